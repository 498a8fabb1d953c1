"""Every place probe meets transformers' attention machinery, each use named. Tested with transformers 5.1.0 (the
declared floor: .ci/compat runs tests/test_classify.py, test_capture.py, test_hook_points.py, test_lse.py,
test_kv_heads.py and test_mask_structure.py with it) and 5.24.0 (the newest, where the whole suite runs).

Public API: `AttentionInterface`, `AttentionMaskInterface` and their `ALL_*` registries, and the arguments
transformers hands a mask function (each function below names what it uses).

No public way: which implementation one config names, and switching it while hooked (`has_implementation`,
`implementation`, `set_implementation`: the config's `_attn_implementation_internal`, the field transformers' own
setters write). `PreTrainedModel.set_attn_implementation` is public but cannot be undone exactly: at 5.1.0 it leaves
`_attn_was_changed` on sub-configs, it checks (and may fall back from) sdpa, it only warns on a model whose layers do
not use the attention interface (Falcon), and it has no form for one config (QK attribution's copy of a layer).
Nor is "eager" in the interface: each modeling file defines its own `eager_attention_forward`, which `own_attention`
finds by that name in the module's modeling file.

The boolean masks transformers makes for `probe_sdpa` are recognised where they are padding, causal and a sliding
window (`noting_sdpa_mask`), from the mask function's arguments, nothing read from the device: a fused kernel then
gets a (b, kv) key mask and an int window instead of a dense additive mask. Any other mask goes to the backend dense.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from probe.hooks.types import Undo

_FIELD = "_attn_implementation_internal"  # transformers 5.1.0 - 5.24.0: a config's attention implementation
NOTE = "probe_mask_structure"  # the attribute a recognised mask tensor carries its MaskStructure in


def has_implementation(config: Any) -> bool:
    """Whether `config` is a transformers config naming an attention implementation (tested at 5.1.0 and 5.24.0)."""
    return config is not None and hasattr(config, _FIELD)


def implementation(config: Any) -> Any:
    """The attention implementation the config names (tested at 5.1.0 and 5.24.0)."""
    return getattr(config, _FIELD)


def set_implementation(config: Any, name: str) -> Undo:
    """Switch this one config (not its sub-configs) to the implementation `name`; the step that switches it back
    exactly (tested at 5.1.0 and 5.24.0)."""
    undo = partial(setattr, config, _FIELD, getattr(config, _FIELD))
    setattr(config, _FIELD, name)
    return undo


def register_attention(name: str, function: Callable[..., Any], masks_of: str | None = None) -> None:
    """Register `function` as the attention implementation `name` (`AttentionInterface.register`); where `masks_of`
    is "sdpa" or "eager", its layers get that implementation's masks (`AttentionMaskInterface.register`), sdpa's with
    their structure noted. Registering again replaces it: the same function each time."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, function)
    if masks_of is not None:
        make_mask = noting_sdpa_mask if masks_of == "sdpa" else ALL_MASK_ATTENTION_FUNCTIONS[masks_of]
        AttentionMaskInterface.register(name, make_mask)


def own_attention(name: str, module: nn.Module) -> Callable[..., tuple[Tensor, Any]] | None:
    """transformers' own implementation `name` for this attention module (`ALL_ATTENTION_FUNCTIONS[name]`); for
    "eager", the module's modeling file's own `eager_attention_forward`, None where it has none."""
    if name == "eager":  # each modeling file has its own eager function (transformers 5.1.0 - 5.24.0)
        return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def noting_sdpa_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers' sdpa mask (`ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]`), its structure noted on it where the
    arguments show it is the padding mask with causality or a sliding window and nothing else."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    make_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    mask = make_mask(*args, **kwargs)
    if isinstance(mask, Tensor):
        arguments = inspect.signature(make_mask).bind(*args, **kwargs).arguments
        form = _form(arguments, arguments.get("kwargs", {}).get("config"))
        if form is not None:
            note_structure(mask, arguments.get("attention_mask"), _query_length(arguments), *form)
    return mask


def _query_length(arguments: dict[str, Any]) -> int | None:
    """The mask's query length: `q_length` (5.24.0), or the length of `cache_position` (5.1.0)."""
    if "q_length" in arguments:
        return arguments["q_length"]
    position = arguments.get("cache_position")
    return int(position.shape[0]) if isinstance(position, Tensor) else None


def _form(arguments: dict[str, Any], config: Any) -> tuple[bool, int | None] | None:
    """(causal, window) of the mask function: transformers' causal or bidirectional function by identity; a sliding
    window where the arguments are those of transformers' sliding-window causal mask with nothing added (its size
    `local_size` is the config's `sliding_window`, the config has no chunked attention, and transformers still allows
    the causal skip, which it turns off when it adds packed sequences or other mask functions); else None."""
    from transformers import masking_utils

    function = arguments.get("mask_function", masking_utils.causal_mask_function)
    # the offsets are tensors under a static cache: only ints are compared (a tensor's comparison is a host read)
    offsets = (arguments.get("q_offset", 0), arguments.get("kv_offset", 0))
    if not all(isinstance(offset, int) and offset == 0 for offset in offsets):
        return None
    if function is masking_utils.causal_mask_function:
        return True, None
    if function is masking_utils.bidirectional_mask_function:
        return False, None
    window = arguments.get("local_size")
    chunked = getattr(config, "attention_chunk_size", None) or "chunked_attention" in (
        getattr(config, "layer_types", None) or ())
    if isinstance(window, int) and window > 0 and window == getattr(config, "sliding_window", None) and \
            not chunked and arguments.get("allow_is_causal_skip", True) is True:
        return True, window
    return None


@dataclass(frozen=True)
class MaskStructure:
    """What a recognised mask hides: keys outside `key_mask` (b, kv) bool, later keys where `causal`, keys
    `window` or more before the query where given."""

    key_mask: Tensor
    causal: bool
    window: int | None


def structure_of(mask: Tensor | None) -> MaskStructure | None:
    """The structure noted on this mask tensor when it was made, or None."""
    return None if mask is None else mask.__dict__.get(NOTE)


def note_structure(mask: Tensor, padding: Tensor | None, q_length: int | None, causal: bool,
                   window: int | None) -> None:
    """Note what a (b, 1, n, kv) boolean mask hides (the 2-D `padding`'s keys, later keys where `causal`, keys
    `window` or more back); nothing for another shape or dtype, or a cache."""
    kv_length = int(mask.shape[-1])
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or q_length != kv_length or \
            int(mask.shape[2]) != q_length:
        return
    if padding is None:
        key_mask = torch.ones(mask.shape[0], kv_length, dtype=torch.bool, device=mask.device)
    elif padding.dim() == 2 and padding.shape[0] == mask.shape[0] and padding.shape[1] >= kv_length:
        key_mask = padding[:, :kv_length].to(torch.bool)  # a view of its own: what the dense bias is kept by
    else:
        return
    mask.__dict__[NOTE] = MaskStructure(key_mask, causal, window)

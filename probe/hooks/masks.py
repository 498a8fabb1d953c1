"""The boolean masks transformers makes for `probe_sdpa`, recognised where they are padding, causal and a sliding
window, so that a fused kernel gets each sequence's key mask (b, kv) and the window as an int instead of the
(b, 1, n, kv) mask made additive.

probe registers `noting_structure(sdpa_mask)` as the mask function of `probe_sdpa`: it makes the mask as
transformers does and notes, keyed by the mask tensor, what it was made from where that is known for sure: the mask
function is transformers' own causal, bidirectional or sliding-window causal one, no query or key offset (no
cache), and the 2-D padding mask (or none). Nothing is read from the device: the structure comes from the
arguments, not the values. Any other mask (packed sequences, chunked attention, image tokens seeing each other, a
cache) is not noted and goes to the backend dense, as before.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary


@dataclass(frozen=True)
class MaskStructure:
    """What a recognised mask hides: keys outside `key_mask` (b, kv) bool, later keys where `causal`, keys
    `window` or more before the query where given."""

    key_mask: Tensor
    causal: bool
    window: int | None


_NOTED: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # mask tensor -> its MaskStructure


def structure_of(mask: Tensor | None) -> MaskStructure | None:
    """The structure noted for this mask tensor when it was made, or None (not made by `noting_structure`, or not one of
    the recognised forms)."""
    return None if mask is None else _NOTED.get(mask)


def noting_structure(make_mask: Callable[..., Tensor | None]) -> Callable[..., Tensor | None]:
    """transformers' `sdpa_mask` that also notes the structure of each boolean mask it makes (`structure_of`)."""
    signature = inspect.signature(make_mask)

    def probe_sdpa_mask(*args: Any, **kwargs: Any) -> Tensor | None:
        mask = make_mask(*args, **kwargs)
        if isinstance(mask, Tensor):
            structure = _recognised(mask, signature.bind(*args, **kwargs).arguments)
            if structure is not None:
                _NOTED[mask] = structure
        return mask

    return probe_sdpa_mask


def _recognised(mask: Tensor, arguments: dict[str, Any]) -> MaskStructure | None:
    """The structure of a (b, 1, n, kv) boolean mask from the arguments it was made with, or None."""
    forms = _mask_forms()
    kind = forms.get(id(arguments.get("mask_function")))
    window = None
    if kind is None:
        window = _sliding_window(arguments.get("mask_function"), forms)
        kind = "causal" if window is not None else None
    q_length, kv_length = arguments.get("q_length"), int(mask.shape[-1])
    # the offsets are tensors under a static cache: only ints are compared (a tensor's comparison is a host read)
    offsets = (arguments.get("q_offset", 0), arguments.get("kv_offset", 0))
    if kind is None or not all(isinstance(offset, int) and offset == 0 for offset in offsets) or \
            mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or \
            tuple(mask.shape[2:]) != (q_length, arguments.get("kv_length")) or q_length != kv_length:
        return None
    padding = arguments.get("attention_mask")
    if padding is None:
        key_mask = torch.ones(mask.shape[0], kv_length, dtype=torch.bool, device=mask.device)
    elif padding.dim() == 2 and padding.shape[0] == mask.shape[0] and padding.shape[1] >= kv_length:
        key_mask = padding[:, :kv_length].to(torch.bool)  # a view of its own: what the dense bias is kept by
    else:
        return None
    return MaskStructure(key_mask, kind == "causal", window)


def _mask_forms() -> dict[int, str]:
    """transformers' own mask functions whose structure is known, by identity."""
    from transformers import masking_utils

    return {id(masking_utils.causal_mask_function): "causal",
            id(masking_utils.bidirectional_mask_function): "bidirectional"}


def _sliding_window(function: Any, forms: dict[int, str]) -> int | None:
    """The window of transformers' `sliding_window_causal_mask_function(window)` (its sliding-window overlay and
    causal function, joined by `and_masks`), else None."""
    if getattr(function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = inspect.getclosurevars(function).nonlocals.get("mask_functions", ())
    if len(parts) != 2 or forms.get(id(parts[1])) != "causal" or \
            getattr(parts[0], "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = inspect.getclosurevars(parts[0]).nonlocals.get("sliding_window")
    return window if isinstance(window, int) and window > 0 else None

"""Hugging Face families whose attention does not go through transformers' attention interface (transformers 5):
BLOOM, MPT and CodeGen compute it inline; GPT-Neo, GPT-J and Falcon choose an attention class when the model is
built. Each family is one `Family` entry: which module is the attention and where it keeps its head count; its
output projection (whose input is the heads, (batch, n, heads * head_dim), head-major) is found by name
(probe.models.parts: `out_proj`, BLOOM's and Falcon's `dense`).

The shared code does the rest: their eager forward returns `(output, weights (b, heads, n, kv))`, so weights are read
from what the module returns, with the model's configs switched to eager while read (Falcon picks sdpa at forward
time otherwise); head outputs are edited by a pre-hook on the output projection, as for hand-written modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from probe.errors import ProbeError
from probe.hooks.custom import edit_projection_input, read_returned_weights
from probe.hooks.points import fires
from probe.hooks.transformers_api import has_implementation, set_implementation
from probe.hooks.types import LayerHooks, Undo


def _bloom_problem(module: nn.Module) -> str:
    if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
        return "BLOOM with pretraining_tp > 1 and slow_but_exact computes its output projection without its `dense` "\
               "module, so probe cannot edit the heads: set config.slow_but_exact = False (the same numbers, fused)"
    return ""


@dataclass(frozen=True)
class Family:
    """How one family's attention module is read: the eager class (by name), the attribute holding the number of
    query heads (and of key/value heads, where fewer), and what can go wrong."""

    attention: str
    heads: str
    kv_heads: str = ""
    problem: Callable[[nn.Module], str] = lambda module: ""


FAMILIES: dict[str, Family] = {
    "gpt_neo": Family("GPTNeoSelfAttention", "num_heads"),
    "gptj": Family("GPTJAttention", "num_attention_heads"),
    "bloom": Family("BloomAttention", "num_heads", problem=_bloom_problem),
    "falcon": Family("FalconAttention", "num_heads", kv_heads="num_kv_heads"),
    "mpt": Family("MptAttention", "n_heads"),
    "codegen": Family("CodeGenAttention", "num_attention_heads"),
}
"""config.model_type -> its Family."""


def family_of(model: nn.Module) -> Family | None:
    """The model's family, where it is one probe reads through a Family adapter."""
    config = getattr(model, "config", None)
    return FAMILIES.get(getattr(config, "model_type", None))  # type: ignore[arg-type]


def _family_of_module(module: nn.Module) -> Family:
    name = type(module).__name__
    return next(family for family in FAMILIES.values() if family.attention == name)


def family_candidates(model: nn.Module, family: Family) -> list[nn.Module]:
    """The family's attention modules; a model built with another attention class (flash) is refused in one line."""
    found = [module for module in model.modules() if type(module).__name__ == family.attention]
    if not found:  # a subclass of the eager class (flash attention) returns no weights
        other = next((type(m).__name__ for m in model.modules()
                      if family.attention in [cls.__name__ for cls in type(m).__mro__[1:]]), None)
        if other is not None:
            raise ProbeError(f"{type(model).__name__} was built with {other}, which returns no attention weights: "
                             "load it with attn_implementation='eager'")
    return found


def family_shape(module: nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of one of a family's attention modules."""
    family = _family_of_module(module)
    heads = int(getattr(module, family.heads))
    kv_heads = int(getattr(module, family.kv_heads, heads)) if family.kv_heads else heads
    head_dim: Any = module.head_dim  # an int the module sets
    return heads, kv_heads, int(head_dim)


def install_family(module: nn.Module, hooks: LayerHooks, undo: list[Undo]) -> None:
    """Weights from what the module returns, edits at its output projection's input; `undo` gets their removal."""
    family = _family_of_module(module)
    problem = family.problem(module)
    if problem and fires(hooks, "heads"):
        raise ProbeError(problem)
    if fires(hooks, "weights"):
        config: Any = getattr(module, "config", None)  # shared with the model
        if has_implementation(config):  # eager's mask, and Falcon's eager branch: the one that returns weights
            undo.append(set_implementation(config, "eager"))
        read_returned_weights(module, hooks, undo)
    if fires(hooks, "heads"):
        edit_projection_input(module, family_shape(module)[0], hooks, undo)

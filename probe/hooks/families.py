"""Hugging Face families whose attention does not go through transformers' attention interface (transformers 5):
BLOOM, MPT and CodeGen compute it inline; GPT-Neo, GPT-J and Falcon choose an attention class when the model is
built. Each is one `Family` entry. Their eager forward returns `(output, weights)`, so they are hooked as
hand-written modules are (probe.hooks.custom), the configs on eager while read (Falcon picks sdpa at forward time
otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from probe.errors import ProbeError
from probe.hooks.custom import install_custom
from probe.hooks.points import fires
from probe.hooks.transformers_api import has_implementation, set_implementation
from probe.hooks.types import LayerHooks, Undo
from probe.models.parts import OUTPUT_PROJECTIONS


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
    """As a hand-written module's (install_custom), with the config on eager while weights are read."""
    problem = _family_of_module(module).problem(module)
    if problem and fires(hooks, "heads"):
        raise ProbeError(problem)
    config: Any = getattr(module, "config", None)  # shared with the model
    if fires(hooks, "weights") and has_implementation(config):  # eager's mask, and Falcon's branch that returns weights
        undo.append(set_implementation(config, "eager"))
    install_custom(module, hooks, undo, family_shape(module)[0], OUTPUT_PROJECTIONS)

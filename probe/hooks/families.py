"""Attention modules whose forward returns `(output, attention_weights)`: weights are read from the returned tuple,
head outputs edited at the input of the output projection.

Hand-written modules in the textbook style have `num_heads` and an output projection `W_o` / `out_proj` / `o_proj`.
Hugging Face families whose attention does not go through transformers' attention interface (transformers 5) are
one `Family` entry each: BLOOM, MPT and CodeGen compute it inline; GPT-Neo, GPT-J and Falcon choose an attention
class when the model is built. Their eager forward returns the weights, so they are hooked as hand-written modules
are, the configs on eager while read (Falcon picks sdpa at forward time otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.points import fire_heads, fire_weights, fires
from probe.hooks.transformers_api import has_implementation, set_implementation
from probe.hooks.types import LayerHooks, Undo
from probe.models.parts import OUTPUT_PROJECTIONS, TEXTBOOK_OUTPUT_PROJECTIONS, named_child


def is_custom_attention(module: nn.Module) -> bool:
    """A candidate textbook attention module (discovery then checks that it returns per-head weights)."""
    return (
        not isinstance(module, nn.MultiheadAttention)
        and isinstance(getattr(module, "num_heads", None), int)
        and any(hasattr(module, name) for name in TEXTBOOK_OUTPUT_PROJECTIONS)
    )


def returns_head_weights(module: nn.Module, output: Any) -> bool:
    """Whether a forward's output is (output, weights (b, num_heads, n, kv))."""
    return (isinstance(output, (tuple, list)) and len(output) >= 2 and isinstance(output[1], Tensor)
            and output[1].dim() == 4 and output[1].shape[1] == module.num_heads)


def install_custom(module: nn.Module, hooks: LayerHooks, undo: list[Undo], heads: int | None = None,
                   names: tuple[str, ...] = TEXTBOOK_OUTPUT_PROJECTIONS) -> None:
    """`pattern` from the weights the forward returns, output[1]; `z` at the input of the output projection (the
    first of `names`), (b, n, heads * head_dim) head-major, handed over as (b, n, heads, head_dim)."""
    if fires(hooks, "weights"):
        def read_weights(_module: nn.Module, _inputs: Any, output: Any) -> None:
            fire_weights(hooks, 0, output[1].float())

        undo.append(module.register_forward_hook(read_weights).remove)
    if not fires(hooks, "heads"):
        return
    given: Any = module.num_heads if heads is None else heads  # an int the module sets
    count = int(given)
    _, projection = named_child(module, names)
    if projection is None:
        raise ProbeError(f"cannot edit the heads of {type(module).__name__}: it has no output projection module "
                         f"({', '.join(names)})")

    def edit_input(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        merged = args[0]  # (b, n, heads * head_dim)
        split = merged.reshape(*merged.shape[:-1], count, merged.shape[-1] // count)  # (b, n, heads, head_dim)
        return (fire_heads(hooks, split).reshape(merged.shape), *args[1:])

    undo.append(projection.register_forward_pre_hook(edit_input).remove)


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

"""Hand-written attention modules in the textbook style: `num_heads`, an output projection `W_o` / `out_proj` /
`o_proj`, and a forward returning `(output, attention_weights)`. Weights are read from the returned tuple; head
outputs are edited at the input of the output projection."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.points import fire_heads, fire_weights, fires
from probe.hooks.types import LayerHooks, Undo
from probe.models.parts import TEXTBOOK_OUTPUT_PROJECTIONS, named_child


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

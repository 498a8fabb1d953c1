"""Hand-written attention modules in the textbook style: `num_heads`, an output projection `W_o` / `out_proj` /
`o_proj`, and a forward returning `(output, attention_weights)`. Weights are read from the returned tuple; head
outputs are edited at the input of the output projection."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.points import fire_heads, fire_weights, fires
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


def read_returned_weights(module: nn.Module, hooks: LayerHooks, undo: list[Undo]) -> None:
    """A forward hook handing the weights the module returns, output[1] (b, heads, n, kv), to the `pattern` point."""
    def read_weights(_module: nn.Module, _inputs: Any, output: Any) -> None:
        fire_weights(hooks, 0, output[1].float())

    undo.append(module.register_forward_hook(read_weights).remove)


def edit_projection_input(module: nn.Module, heads: int, hooks: LayerHooks, undo: list[Undo],
                          names: tuple[str, ...] = OUTPUT_PROJECTIONS) -> None:
    """A pre-hook on the module's output projection (the first of `names`): its input (b, n, heads * head_dim),
    head-major, goes through the `z` point as (b, n, heads, head_dim)."""
    _, projection = named_child(module, names)
    if projection is None:
        raise ProbeError(f"cannot edit the heads of {type(module).__name__}: it has no output projection module "
                         f"({', '.join(names)})")

    def edit_input(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        merged = args[0]  # (b, n, heads * head_dim)
        split = merged.reshape(*merged.shape[:-1], heads, merged.shape[-1] // heads)  # (b, n, heads, head_dim)
        edited = fire_heads(hooks, split)
        return (edited.reshape(merged.shape), *args[1:])

    undo.append(projection.register_forward_pre_hook(edit_input).remove)


def install_custom(module: nn.Module, hooks: LayerHooks, undo: list[Undo]) -> None:
    """PyTorch hooks on the module (weights) and its output projection (edits); `undo` gets their removal."""
    if fires(hooks, "weights"):
        read_returned_weights(module, hooks, undo)
    if fires(hooks, "heads"):
        heads: Any = module.num_heads  # an int the module sets (nn.Module types attributes as tensors or modules)
        edit_projection_input(module, int(heads), hooks, undo, TEXTBOOK_OUTPUT_PROJECTIONS)

"""The model's block list (decoder layers), for reusing the baseline's prefix: keep each block's output and make
blocks return kept outputs; undone on exit (probe.hooks.restore)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any

from torch import Tensor, nn

from probe.hooks.layers import AttentionLayer
from probe.models.parts import output_embeddings
from probe.hooks.run import run_model
from probe.hooks.restore import interrupts_deferred, put_back, restoring


@dataclass
class Blocks:
    """The model's list of blocks (decoder layers) and which block holds each attention layer."""

    container: nn.ModuleList
    of_layer: list[int]
    restart: int | None = None  # the last block a run may start from (later blocks read what it hands on); None: any

    def __len__(self) -> int:
        return len(self.container)

    def start_of(self, layer: int) -> int:
        """The block a run that changes attention layer `layer` starts from: the layer's own block, or `restart`."""
        block = self.of_layer[layer]
        return block if self.restart is None else min(block, self.restart)


WORK_UNITS = 1000  # a full forward of one batch, in the units the sweep's and the estimate's progress count


def forward_costs(model: nn.Module, blocks: Blocks | None) -> Callable[[int], float]:
    """Cost of a run that starts at block `start` and ends with the readout, as a fraction of a full forward, from
    parameter counts (the work per token of a block or of the unembedding is proportional to its weights; a large
    vocabulary's unembedding weighs several blocks: SmolLM2's about 8). 1.0 for every run without a block list."""
    if blocks is None:
        return lambda start: 1.0
    per_block = [sum(p.numel() for p in block.parameters()) for block in blocks.container]
    head = output_embeddings(model)
    unembed = sum(p.numel() for p in head.parameters()) if head is not None else 0
    from_block = [*accumulate(reversed(per_block), initial=unembed)][::-1]  # [start]: blocks start.. and the readout
    return lambda start: from_block[start] / max(from_block[0], 1)


def _parents(model: nn.Module) -> dict[int, nn.Module]:
    parent: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parent.setdefault(id(child), module)
    return parent


def find_blocks(model: nn.Module, layers: list[AttentionLayer]) -> tuple[Blocks | None, str]:
    """The ModuleList whose items hold the attention layers, one after another; None (and why) if there is none."""
    if any(layer.stack for layer in layers):  # reuse would also need the encoder's output kept: not done
        return None, "an encoder-decoder: its encoder and decoder are two lists of blocks, so no prefix is reused"
    parent = _parents(model)
    container: nn.ModuleList | None = None
    of_layer = []
    for layer in layers:
        module: nn.Module = layer.module
        found = None
        while id(module) in parent:
            owner = parent[id(module)]
            if isinstance(owner, nn.ModuleList):
                found = owner
                break
            module = owner
        if found is None:
            return None, f"attention layer {layer.index} is not inside a list of blocks (nn.ModuleList)"
        if container is not None and found is not container:
            return None, "the attention layers are not all in one list of blocks"
        container = found
        of_layer.append(next(i for i, item in enumerate(found) if item is module))
    if any(b < a for a, b in zip(of_layer, of_layer[1:])):
        return None, "the blocks do not run in the order of the attention layers"
    assert container is not None
    return Blocks(container, of_layer, _shared_keys_restart(layers, of_layer)), ""


def _shared_keys_restart(layers: list[AttentionLayer], of_layer: list[int]) -> int | None:
    """The block a run must start at or before where layers reuse another layer's keys and values (Gemma-3n's
    KV-shared layers): a kept block output does not hand them on. None: no layer reuses."""
    if not any(getattr(layer.module, "is_kv_shared_layer", False) is True for layer in layers):
        return None
    stores = [of_layer[layer.index] for layer in layers if getattr(layer.module, "store_full_length_kv", False) is True]
    return min(stores, default=0)  # producers not declared: every earlier block may be one, so reuse nothing


class NoPrefix(Exception):
    """The baseline's prefix cannot be reused for this model (the reason is the message)."""


class _Stop(Exception):
    """Raised by a pre-hook to end a baseline forward once the blocks it needs have run."""


def _stop(_module: nn.Module, _args: Any) -> None:
    raise _Stop


@contextmanager
def keeping_outputs(blocks: Blocks, kept: dict[int, Any], order: list[int] | None = None,
                    stop_at: int | None = None) -> Iterator[None]:
    """Every block's output (detached) into `kept` while the body runs; with `stop_at`, the forward ends there."""
    with restoring() as undo:
        with interrupts_deferred():
            for index, block in enumerate(blocks.container):
                def keep(_module: nn.Module, _args: Any, output: Any, index: int = index) -> None:
                    if order is not None:
                        order.append(index)
                    kept[index] = detach(output)
                undo.append(block.register_forward_hook(keep).remove)
                if index == stop_at:
                    undo.append(block.register_forward_pre_hook(_stop).remove)
        yield


def capture(blocks: Blocks, model: nn.Module, ids: Tensor, mask: Tensor | None, stop_at: int | None = None,
            logits: bool = True) -> tuple[Any, dict[int, Any]]:
    """One unablated forward that keeps every block's output; with `stop_at`, ends before that block runs."""
    kept: dict[int, Any] = {}
    order: list[int] = []
    output = None
    try:
        with keeping_outputs(blocks, kept, order, stop_at):
            output = run_model(model, ids, mask, logits=logits)
    except _Stop:
        pass
    if order != sorted(set(order)):
        raise NoPrefix("the model calls its blocks more than once or out of order")
    return output, kept


def detach(value: Any) -> Any:
    """The value with every tensor in it detached (tuples, lists and dicts kept)."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(detach(item) for item in value) if isinstance(value, tuple) else [detach(v) for v in value]
    if isinstance(value, dict):
        return {key: detach(item) for key, item in value.items()}
    return value


def batch_axis(tensor: Tensor, batch: int, positions: int | None) -> int | None:
    """The axis of a block output's rows (Gemma-3n's AltUp puts predictions first); None: not per row."""
    if positions is not None:
        for axis in range(tensor.dim() - 1):
            if tensor.shape[axis] == batch and tensor.shape[axis + 1] == positions:
                return axis
    return 0 if tensor.dim() >= 1 and tensor.shape[0] == batch else None


def stack(value: Any, copies: int, batch: int, positions: int | None = None) -> Any:
    """`copies` copies of a batch's block output along its batch axis (copy-major, like ids.repeat)."""
    if copies == 1:
        return value
    if isinstance(value, Tensor):
        axis = batch_axis(value, batch, positions)
        if axis is None:
            return value
        return value.repeat(*(copies if dim == axis else 1 for dim in range(value.dim())))  # (.., copies * batch, ..)
    if isinstance(value, tuple):
        return tuple(stack(item, copies, batch, positions) for item in value)
    if isinstance(value, list):
        return [stack(item, copies, batch, positions) for item in value]
    if isinstance(value, dict):
        return {key: stack(item, copies, batch, positions) for key, item in value.items()}
    return value


def _returning(value: Any) -> Callable[..., Any]:
    return lambda *_args, **_kwargs: value


@contextmanager
def skip_blocks(container: nn.ModuleList, outputs: dict[int, Any]) -> Iterator[None]:
    """Blocks in `outputs` return the given value instead of running; their own forward is back on exit."""
    with restoring() as undo:
        with interrupts_deferred():
            for index, value in outputs.items():
                block = container[index]
                undo.append(partial(put_back, block, "forward", block.__dict__.get("forward")))
                block.__dict__["forward"] = _returning(value)
        yield

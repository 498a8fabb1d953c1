"""The model's block list (decoder layers), for reusing the baseline's prefix: keep each block's output and make
blocks return kept outputs; undone on exit (probe.hooks.restore). And how the loss is read off a forward, chosen once
per sweep (`Readout`): the logits as returned; chunked (`Final`: the head runs again a chunk of positions at a time
where the logits would pass LOGITS_BYTES); or direct (the LM head HEAD_ROWS positions at a time, where the first
forward shows that this gives the model's logits)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn

from probe.hooks.hf import is_hf_model
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.models.parts import output_embeddings
from probe.hooks.run import Source, accepts_argument, logits_of, run_model
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


def find_blocks(model: nn.Module, layers: list[AttentionLayer]) -> tuple[Blocks | None, str]:
    """The ModuleList whose items hold the attention layers, one after another; None (and why) if there is none."""
    if any(layer.stack for layer in layers):  # reuse would also need the encoder's output kept: not done
        return None, "an encoder-decoder: its encoder and decoder are two lists of blocks, so no prefix is reused"
    # each module's parent, the first one that holds it (reversed: the first written last)
    parent = {id(child): module for module in reversed(list(model.modules())) for child in module.children()}
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


LOGITS_BYTES = 256 << 20  # logits larger than this (long context) are computed a chunk of positions at a time
LOGITS_CHUNK_BYTES = 128 << 20  # the logits of one such chunk
STACK_BYTES = 1 << 30  # activations (and logits, where whole) of one stacked forward: how many copies to stack
HEAD_ROWS = 128  # positions unembedded at a time by the direct head: 128 x 49k logits stay in cache
CHECK_TOLERANCE = 1e-4  # relative to the outputs' scale: the exact path must reproduce the naive one this closely


def chunkable_blocks(model: nn.Module) -> Blocks | None:
    """The block list where a causal Hugging Face LM's logits can be had a chunk of positions at a time."""
    if not isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
        return None
    if not is_hf_model(model) or not accepts_argument(model, "logits_to_keep"):
        return None
    layers = attention_layers(model)
    if not all(getattr(layer.module, "is_causal", True) for layer in layers):
        return None
    return find_blocks(model, layers)[0]


TokenValues = Callable[[Tensor, Tensor], Tensor]
"""A next-token metric's values from logits (..., vocab) at positions t and the tokens (...) at t + 1 (elementwise
over the leading dimensions): what the chunked readouts compute a chunk at a time (`Metric.token_values`)."""


def head_values(model: nn.Module, normed: Tensor, ids: Tensor, token_values: TokenValues) -> Tensor:
    """(rows, n - 1) next-token values, the LM head HEAD_ROWS positions at a time (their logits stay in cache)."""
    head = output_embeddings(model)
    assert head is not None  # the direct readout is chosen only for a model with an LM head (_direct_head)
    rows, n = ids.shape
    states = normed[:, :-1].reshape(-1, normed.shape[-1])  # (rows * (n - 1), hidden)
    targets = ids[:, 1:].reshape(-1)
    values = []
    for start in range(0, states.shape[0], HEAD_ROWS):
        logits = head(states[start:start + HEAD_ROWS]).float()  # on the head's device, under a device map
        values.append(token_values(logits, targets[start:start + HEAD_ROWS].to(logits.device)))
    return torch.cat(values).view(rows, n - 1)


@dataclass
class Final:
    """A forward's last block output standing in for logits too large to hold (the head reruns a chunk at a time)."""

    model: nn.Module
    blocks: Blocks
    ids: Tensor
    mask: Tensor | None
    hidden: Any  # what the last block returned
    normed: Tensor | None = None  # the decoder's output (final norm applied), where the head is direct

    def logits(self, positions: Tensor) -> Tensor:
        skipped = {index: self.hidden for index in range(len(self.blocks.container))}
        with skip_blocks(self.blocks.container, skipped):
            return logits_of(run_model(self.model, self.ids, self.mask, logits=positions))

    def values(self, token_values: TokenValues) -> Tensor:
        """(rows, n - 1) float32 next-token values at every position, as the full logits would give them."""
        if self.normed is not None:
            return head_values(self.model, self.normed, self.ids, token_values)
        rows, n = self.ids.shape
        config: Any = self.model.config  # (nn.Module types an undeclared attribute as Tensor | Module)
        chunk = max(1, LOGITS_CHUNK_BYTES // (rows * int(config.vocab_size) * 4))
        values = []
        for start in range(0, n - 1, chunk):
            stop = min(start + chunk, n - 1)
            logits = self.logits(torch.arange(start, stop)).float()  # (rows, stop - start, vocab)
            values.append(token_values(logits, self.ids[:, start + 1:stop + 1].to(logits.device)))
        return torch.cat(values, dim=1)

    def first_rows(self, batch: int) -> Tensor:
        """The first rows of the last block's output (Gemma-3n's rows and positions moved to the front)."""
        hidden = self.hidden[0] if isinstance(self.hidden, (tuple, list)) else self.hidden
        axis = batch_axis(hidden, self.ids.shape[0], self.ids.shape[1]) or 0
        return hidden.narrow(axis, 0, batch).movedim((axis, axis + 1), (0, 1))


def decoder(model: nn.Module) -> nn.Module | None:
    """The model's decoder (the part before the LM head, final norm included), if it names one."""
    getter = getattr(model, "get_decoder", None)
    head = output_embeddings(model)
    try:
        found = getter() if callable(getter) else None
    except Exception:  # models without one raise in various ways
        return None
    if not isinstance(found, nn.Module) or found is model or not isinstance(head, nn.Module):
        return None
    return found


@contextmanager
def keeping_decoder_output(model: nn.Module, kept: list[Tensor]) -> Iterator[None]:
    """The decoder's output (detached) appended to `kept` by every forward of the body."""
    found = decoder(model)
    assert found is not None

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        value = output if isinstance(output, Tensor) else getattr(output, "last_hidden_state", None)
        kept.append((value if isinstance(value, Tensor) else output[0]).detach())

    with restoring() as undo:
        with interrupts_deferred():
            undo.append(found.register_forward_hook(keep).remove)
        yield


def _direct_head(model: nn.Module, normed: Tensor, logits: Tensor) -> bool:
    """Whether the logits are the LM head on the decoder's output and nothing else, checked on two positions."""
    positions = min(2, logits.shape[1])
    head = output_embeddings(model)
    if head is None:
        return False
    mine = head(normed[:, :positions]).float()
    theirs = logits[:, :positions].float()
    if mine.shape != theirs.shape:
        return False
    return bool((mine - theirs).abs().max() <= CHECK_TOLERANCE * max(1.0, float(theirs.abs().max())))


def _last_block_output(model: nn.Module, blocks: Blocks, ids: Tensor, mask: Tensor | None,
                       direct: bool = False) -> Final:
    """One forward keeping the last block's output (with `direct`, the decoder's), logits of the last position only."""
    kept: list[Any] = []
    normed: list[Tensor] = []
    last = blocks.container[len(blocks.container) - 1]
    with restoring() as undo:
        with interrupts_deferred():
            undo.append(last.register_forward_hook(lambda _m, _a, output: kept.append(detach(output))).remove)
        with keeping_decoder_output(model, normed) if direct else nullcontext():
            run_model(model, ids, mask, logits=False)
    return Final(model, blocks, ids, mask, kept[-1], normed[-1] if direct else None)


@dataclass
class Readout:
    """How every forward of one sweep gives what the metric reads, chosen once from the model and the metric."""

    model: nn.Module
    chunkable: Blocks | None = None  # where logits can be had a chunk of positions at a time, for this metric
    direct: bool | None = False  # the direct head: None until the first baseline forward shows whether it applies
    _normed: list[Tensor] = field(default_factory=list)

    @classmethod
    def choose(cls, model: nn.Module, chunkable_metric: bool, blocks: Blocks | None) -> Readout:
        """`chunkable_metric`: the metric's `chunkable`; `blocks`: the sweep's block list if it reuses the prefix."""
        chunkable = chunkable_blocks(model) if chunkable_metric else None
        maybe_direct = blocks is not None and chunkable is not None and decoder(model) is not None
        return cls(model, chunkable, None if maybe_direct else False)

    @property
    def chunked(self) -> bool:
        """Whether the metric can be had a chunk of positions at a time (then logits never count whole)."""
        return self.chunkable is not None

    def lean(self, ids: Tensor) -> bool:
        """Whether this batch's logits would pass LOGITS_BYTES: its loss is then read from its last block's output."""
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return self.chunked and isinstance(vocab, int) and ids.numel() * vocab * 4 > LOGITS_BYTES

    def copies(self, inputs: Sequence[Tensor], vocab_size: int) -> int:
        """Copies of a batch to stack: as many as fit in STACK_BYTES, the logits counted unless chunked (and in
        LOGITS_BYTES); long inputs (`lean`) one copy each."""
        chunked = self.chunked
        if chunked and any(self.lean(ids) for ids in inputs):
            return 1
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None) or 1024
        # a copy's activations (about 24 hidden-size vectors a token), and its logits
        per_copy = max(int(ids.numel()) * 4 * (vocab_size * (not chunked) + 24 * hidden) for ids in inputs)
        logits_per_copy = 0 if chunked else max(int(ids.numel()) * 4 * vocab_size for ids in inputs)
        return max(1, min(STACK_BYTES // max(per_copy, 1), LOGITS_BYTES // max(logits_per_copy, 1)))

    def forward(self, ids: Tensor, mask: Tensor | None, lean: bool | None = None,
                source: Source | None = None) -> Tensor | Final:
        """A forward's logits (or last hidden states), or its Final where they would be too large (`lean` None), or
        as told; `source`: an encoder-decoder's own encoder input."""
        if lean is None:
            lean = self.lean(ids)
        if not lean or source is not None:
            return logits_of(run_model(self.model, ids, mask, source=source))
        blocks = self.chunkable or find_blocks(self.model, attention_layers(self.model))[0]
        assert blocks is not None
        return _last_block_output(self.model, blocks, ids, mask)

    def stacked(self, blocks: Blocks, ids: Tensor, mask: Tensor | None) -> Tensor | Final:
        """The forward of stacked ablated copies: through the direct head where it applies."""
        if self.direct:
            return _last_block_output(self.model, blocks, ids, mask, direct=True)
        return self.forward(ids, mask)

    def watching(self) -> Any:
        """While the direct head is undecided, the body's forward keeps the decoder's output for `settle`."""
        self._normed.clear()
        return keeping_decoder_output(self.model, self._normed) if self.direct is None else nullcontext()

    def settle(self, output: Any) -> None:
        """Decide the direct head from the watched forward's `output` (logits, or a Final)."""
        if self._normed:
            reference = output.logits(torch.arange(2)) if isinstance(output, Final) else logits_of(output)
            self.direct = _direct_head(self.model, self._normed[-1], reference)
            self._normed.clear()

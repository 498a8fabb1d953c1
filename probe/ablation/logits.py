"""How the loss is read off a forward, chosen once per sweep (`Readout`): the logits as returned; chunked (`Final`:
the head runs again a chunk of positions at a time where the logits would pass LOGITS_BYTES); or direct (the LM head
HEAD_ROWS positions at a time, where the first forward shows that this gives the model's logits)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.ablation.blocks import Blocks, batch_axis, detach, find_blocks, skip_blocks
from probe.hooks.restore import interrupts_deferred, restoring
from probe.hooks.hf import is_hf_model
from probe.hooks.layers import attention_layers
from probe.hooks.run import Source, accepts_argument, logits_of, run_model
from probe.models.parts import output_embeddings

LOGITS_BYTES = 256 << 20  # logits larger than this (long context) are computed a chunk of positions at a time
LOGITS_CHUNK_BYTES = 128 << 20  # the logits of one such chunk
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

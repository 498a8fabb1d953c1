"""Ablate attention heads and measure what the model loses: zero and mean ablation, exact sweeps, fast estimates.

Ablating head h of layer l replaces that head's output (its slice of the input to the layer's output projection,
before the projection) at every position, through `attention_hooks(edit_heads=...)`:
- zero ablation: by 0 (Michel et al. 2019; Olsson et al. 2022);
- mean ablation: by the head's mean output over every (non-padding) position of a reference set, by default the
  same probe data the loss is measured on; `per_position=True` takes the mean over sequences separately for each
  position instead.

What is measured (`metric`):
- "cross_entropy" (causal LMs): mean next-token cross-entropy over all predicted tokens of the probe set (every
  position but the first predicts the next token; padding excluded), token-weighted. On the repeated set it is also
  reported on the first and on the second copy (the second is where induction heads pay off).
- "cosine_distance" (models without an LM head or not causal, e.g. BERT loaded with AutoModel): mean over
  positions of 1 - cosine similarity between the final output vectors (last hidden states, or the logits of an MLM
  head) with the head ablated and those of the unablated model. The baseline is 0 by definition.

Sweeps (`sweep`) give one result per head (or per group of heads ablated together). Three ways to run one:
- "naive": one full forward pass per ablation; the reference the others are checked against.
- "exact" (default): the unablated baseline runs once and keeps the output of every block (decoder layer) of the
  model's block list; an ablation in layer l then short-circuits blocks 0..l-1 to those kept outputs, so only
  blocks l.. and the unembedding run again; several ablations of the same layer share one forward by stacking
  copies of the batch, each copy with a different head ablated. The same numbers as "naive" (checked on the first
  forward of every sweep; if they differ the sweep falls back to "naive" and says so in `path`).
- "estimate": attribution patching of every head's zero-ablation delta from a handful of forward and backward
  passes (see `estimate`).

Results stream to a JSON-lines file as each head finishes; a sweep given the same file with `resume=True` skips
the heads it already holds, so an interrupted sweep (or a shard of one, run by another process) continues where it
stopped. The model is restored exactly on exit, also after an error or Ctrl-C.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.attention import AttentionLayer, attention_hooks, attention_layers, logits_of, run_model
from probe.data import ProbeSet
from probe.errors import ProbeError
from probe.models import LoadedModel

Head = tuple[int, int]
"""(layer, head)."""
Ablation = tuple[Head, ...]
"""Heads ablated together in one run; a single-head ablation is a 1-tuple."""
Progress = Callable[[int, int], None]
"""(work done, work in all), in block-forwards of one sequence batch; for a progress bar with an ETA."""

METHODS = ("zero", "mean")
MODES = ("exact", "naive", "estimate")
METRICS = {
    "cross_entropy": "mean next-token cross-entropy over all predicted tokens (padding excluded)",
    "cosine_distance": "mean over positions of 1 - cosine similarity of the final outputs (last hidden states, or "
                       "logits) to the unablated model's",
}
RESULTS_FORMAT = 1
STACK_BYTES = 1 << 30  # activations (and logits, where whole) of one stacked forward: how many copies to stack
CACHE_BYTES = 4 << 30  # kept block outputs of the baseline; beyond this they are recomputed per layer
CHECK_TOLERANCE = 1e-4  # relative to the outputs' scale: the exact path must reproduce the naive one this closely
LOGITS_BYTES = 256 << 20  # logits larger than this (long context) are computed a chunk of positions at a time
LOGITS_CHUNK_BYTES = 128 << 20  # the logits of one such chunk
HEAD_ROWS = 128  # positions unembedded at a time by the direct head: 128 x 49k logits stay in cache


# ---------------------------------------------------------------------------------------------------------------
# naming heads


def _layer_shape(layers: list[AttentionLayer]) -> tuple[int, int]:
    return len(layers), max(layer.n_heads for layer in layers)


def _parse_range(text: str, limit: int, what: str, item: str) -> list[int]:
    text = text.strip()
    if text in ("*", ""):
        if text == "":
            raise ProbeError(f"malformed head {item!r} in --heads: use LAYER.HEAD, e.g. 5.1, 5.* or 3-4.0")
        return list(range(limit))
    first, dash, last = text.partition("-")
    try:
        start = int(first)
        stop = int(last) if dash else start
    except ValueError:
        raise ProbeError(f"malformed head {item!r} in --heads: use LAYER.HEAD, e.g. 5.1, 5.* or 3-4.0") from None
    if start > stop:
        raise ProbeError(f"malformed head {item!r} in --heads: the range {text} runs backwards")
    for value in (start, stop):
        if not 0 <= value < limit:
            raise ProbeError(f"{what} {value} in --heads {item!r} is out of range: "
                             f"{'the model has' if what == 'layer' else 'the layer has'} {limit} {what}s "
                             f"(0-{limit - 1})")
    return list(range(start, stop + 1))


def parse_heads(spec: str, layers: list[AttentionLayer]) -> list[Head]:
    """`5.1,18.6` -> [(5, 1), (18, 6)]. Also `5.*` or `5` (every head of layer 5), ranges `3-5.0-2`, and `all`.

    Heads are numbered as query heads, the way every probe report numbers them.
    """
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or any(not item for item in items):
        raise ProbeError(f"malformed --heads {spec!r}: give LAYER.HEAD items separated by commas, e.g. 5.1,18.6")
    heads: list[Head] = []
    for item in items:
        if item.lower() in ("all", "*"):
            chosen = [(layer.index, head) for layer in layers for head in range(layer.n_heads)]
        else:
            layer_part, dot, head_part = item.partition(".")
            if item.count(".") > 1:
                raise ProbeError(f"malformed head {item!r} in --heads: use LAYER.HEAD, e.g. 5.1, 5.* or 3-4.0")
            chosen = []
            for layer in _parse_range(layer_part, len(layers), "layer", item):
                heads_here = layers[layer].n_heads
                for head in _parse_range(head_part if dot else "*", heads_here, "head", item):
                    chosen.append((layer, head))
        heads.extend(head for head in chosen if head not in heads)
    return heads


def all_heads(model: nn.Module) -> list[Head]:
    """Every (layer, query head) of the model, in order."""
    return [(layer.index, head) for layer in attention_layers(model) for head in range(layer.n_heads)]


def _check_heads(layers: list[AttentionLayer], heads: Iterable[Head]) -> None:
    for layer, head in heads:
        if not 0 <= layer < len(layers):
            raise ProbeError(f"layer {layer} is out of range: the model has {len(layers)} layers (0-{len(layers) - 1})")
        if not 0 <= head < layers[layer].n_heads:
            raise ProbeError(f"head {layer}.{head} is out of range: layer {layer} has {layers[layer].n_heads} heads "
                             f"(0-{layers[layer].n_heads - 1})")


def label(ablation: Sequence[Head]) -> str:
    """'5.1' or '5.1+18.6'."""
    return "+".join(f"{layer}.{head}" for layer, head in ablation)


# ---------------------------------------------------------------------------------------------------------------
# mean head outputs and the edit that ablates


@dataclass
class HeadMeans:
    """Mean output of every head of every layer over a reference set: layer -> (heads, head_dim), or with
    `per_position` layer -> (positions, heads, head_dim)."""

    values: dict[int, Tensor]
    per_position: bool
    source: str  # what the mean was taken over, for reports

    def describe(self) -> str:
        kind = "per-position mean" if self.per_position else "mean over all positions"
        return f"{kind} of {self.source}"


def _batches(probe_set: ProbeSet, batch_size: int) -> list[tuple[Tensor, Tensor | None]]:
    """The probe set in batches; right-padded batches lose the columns none of their sequences use."""
    if batch_size < 1:
        raise ProbeError(f"--batch-size must be at least 1, got {batch_size}")
    out = []
    for first in range(0, probe_set.input_ids.shape[0], batch_size):
        ids = probe_set.input_ids[first:first + batch_size]
        mask = None if probe_set.attention_mask is None else probe_set.attention_mask[first:first + batch_size]
        if mask is not None:
            length = int(mask.sum(dim=1).max())
            ids, mask = ids[:, :length], mask[:, :length]
        out.append((ids, mask))
    return out


def head_means(loaded: LoadedModel, reference: ProbeSet, *, per_position: bool = False,
               batch_size: int = 8) -> HeadMeans:
    """Every head's mean output over the reference set (one forward pass over it, nothing changed)."""
    model = loaded.model
    sums: dict[int, Tensor] = {}
    counts: dict[int, Tensor] = {}
    valid_now: list[Tensor] = []

    def record(layer: int, heads: Tensor) -> Tensor:
        valid = valid_now[0].to(heads.device)
        values = heads.detach().double() * valid[:, :, None, None]
        if per_position:
            total, count = values.sum(dim=0), valid.sum(dim=0).double()
        else:
            total, count = values.sum(dim=(0, 1)), valid.sum().double()
        if layer not in sums:
            sums[layer], counts[layer] = torch.zeros_like(total), torch.zeros_like(count)
        if per_position:
            if total.shape[0] > sums[layer].shape[0]:  # a longer batch than the ones before: grow
                grow = total.shape[0] - sums[layer].shape[0]
                sums[layer] = F.pad(sums[layer], (0, 0, 0, 0, 0, grow))
                counts[layer] = F.pad(counts[layer], (0, grow))
            sums[layer][: total.shape[0]] += total
            counts[layer][: total.shape[0]] += count
        else:
            sums[layer] += total
            counts[layer] += count
        return heads

    with torch.no_grad(), attention_hooks(model, edit_heads=record):
        for ids, mask in _batches(reference, batch_size):
            valid_now[:] = [torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()]
            run_model(model, ids, mask)
    values = {}
    for layer, total in sums.items():
        count = counts[layer].clamp(min=1)
        values[layer] = (total / (count[:, None, None] if per_position else count)).float()
    return HeadMeans(values, per_position, reference.description)


def _head_editor(ablations: Sequence[Ablation], batch: int, method: str,
                 means: HeadMeans | None) -> tuple[Callable[[int, Tensor], Tensor], set[int]]:
    """An edit_heads function for `len(ablations)` stacked copies of a batch: copy i has ablations[i] removed."""
    if method == "mean" and means is None:
        raise ProbeError("mean ablation needs the heads' mean outputs (head_means)")
    copies = len(ablations)
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for copy, ablation in enumerate(ablations):
        for layer, head in ablation:
            by_layer.setdefault(layer, []).append((copy, head))
    masks: dict[tuple[int, torch.device], Tensor] = {}

    def edit(layer: int, heads: Tensor) -> Tensor:
        entries = by_layer.get(layer)
        if not entries:
            return heads
        n_heads = heads.shape[2]
        key = (layer, heads.device)
        if key not in masks:
            mask = torch.zeros(copies, 1, 1, n_heads, 1, dtype=torch.bool)
            for copy, head in entries:
                mask[copy, 0, 0, head, 0] = True
            masks[key] = mask.to(heads.device)
        stacked = heads.reshape(copies, heads.shape[0] // copies, *heads.shape[1:])
        if method == "zero":
            replacement = torch.zeros((), dtype=heads.dtype, device=heads.device)
        else:
            mean = means.values[layer]  # type: ignore[union-attr]
            if means.per_position:  # type: ignore[union-attr]
                if mean.shape[0] < heads.shape[1]:
                    raise ProbeError(f"per-position means cover {mean.shape[0]} positions, the input has "
                                     f"{heads.shape[1]}: take the means over sequences at least as long")
                mean = mean[: heads.shape[1]]
            replacement = mean.to(device=heads.device, dtype=heads.dtype)
        return torch.where(masks[key], replacement, stacked).reshape(heads.shape)

    return edit, set(by_layer)


@contextmanager
def ablate(model: nn.Module, heads: Iterable[Head], *, method: str = "zero",
           means: HeadMeans | None = None) -> Iterator[None]:
    """Ablate `heads` together for the body of the `with` (zero, or mean with `means`); restored on exit."""
    if method not in METHODS:
        raise ProbeError(f"unknown ablation method {method!r}: use one of {', '.join(METHODS)}")
    heads = tuple(heads)
    _check_heads(attention_layers(model), heads)
    edit, layers = _head_editor([heads], 1, method, means)
    with attention_hooks(model, edit_heads=edit, layers=layers):
        yield


# ---------------------------------------------------------------------------------------------------------------
# what is measured


def _is_causal_lm(loaded: LoadedModel, output: Any) -> bool:
    """Next-token loss makes sense for a causal model with logits over the vocabulary."""
    from probe.data import is_encoder

    if is_encoder(loaded):
        return False
    if isinstance(output, Tensor):
        return output.shape[-1] == loaded.vocab_size
    return isinstance(getattr(output, "logits", None), Tensor) or (
        isinstance(output, (tuple, list)) and isinstance(output[0], Tensor) and output[0].shape[-1] == loaded.vocab_size)


@dataclass
class _Scorer:
    """Turns a (stacked) forward's outputs into per-copy sums of the metric, whole set and parts."""

    metric: str
    parts: dict[str, tuple[int, int]]  # name -> [start, stop) of the positions predicted / compared

    def masks(self, ids: Tensor, mask: Tensor | None) -> Tensor:
        """(parts + 1, batch, positions) booleans: which positions count, for the whole set and each part."""
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        if self.metric == "cross_entropy":  # position t predicts token t + 1; both must be real tokens
            valid = valid[:, :-1] & valid[:, 1:]
            positions = torch.arange(1, ids.shape[1])  # the predicted token's position
        else:
            positions = torch.arange(ids.shape[1])
        rows = [valid]
        for start, stop in self.parts.values():
            rows.append(valid & ((positions >= start) & (positions < stop))[None, :])
        return torch.stack(rows)

    def sums(self, output: Tensor, ids: Tensor, masks: Tensor, copies: int,
             baseline: Tensor | None = None) -> Tensor:
        """(copies, parts + 1) float64 sums of the metric over the positions that count."""
        batch = ids.shape[0]
        if isinstance(output, _Final):  # long context: the logits never exist in full
            values = output.cross_entropy().view(copies, batch, -1).cpu()
            return (values.double()[:, None] * masks.cpu()[None]).sum(dim=(2, 3))
        out = output.reshape(copies, batch, *output.shape[1:])
        masks = masks.to(output.device)
        result = torch.zeros(copies, masks.shape[0], dtype=torch.float64)
        for copy in range(copies):
            if self.metric == "cross_entropy":
                logits = out[copy, :, :-1].float()
                targets = ids[:, 1:].to(output.device)
                values = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         reduction="none").view(targets.shape)
            else:
                assert baseline is not None
                values = 1.0 - F.cosine_similarity(out[copy].float(), baseline.to(output.device).float(), dim=-1)
            result[copy] = (values.double()[None] * masks).sum(dim=(1, 2)).cpu()
        return result


def _parts(probe_set: ProbeSet) -> dict[str, tuple[int, int]]:
    if probe_set.repeat_len is None:
        return {}
    start, length = probe_set.offset, probe_set.repeat_len
    return {"first_repeat": (start, start + length), "second_repeat": (start + length, start + 2 * length)}


# ---------------------------------------------------------------------------------------------------------------
# the block list, for reusing the baseline's prefix


@dataclass
class _Blocks:
    """The model's list of blocks (decoder layers) and which block holds each attention layer."""

    container: nn.ModuleList
    of_layer: list[int]


def _find_blocks(model: nn.Module, layers: list[AttentionLayer]) -> tuple[_Blocks | None, str]:
    """The ModuleList whose items hold the attention layers, one after another; None (and why) if there is none."""
    parent: dict[int, tuple[nn.Module, nn.Module]] = {}
    for module in model.modules():
        for child in module.children():
            parent.setdefault(id(child), (module, child))
    container: nn.ModuleList | None = None
    of_layer = []
    for layer in layers:
        module: nn.Module = layer.module
        found = None
        while id(module) in parent:
            owner = parent[id(module)][0]
            if isinstance(owner, nn.ModuleList):
                found = owner
                break
            module = owner
        if found is None:
            return None, f"attention layer {layer.index} is not inside a list of blocks (nn.ModuleList)"
        if container is None:
            container = found
        elif found is not container:
            return None, "the attention layers are not all in one list of blocks"
        of_layer.append(next(i for i, item in enumerate(found) if item is module))
    if any(b < a for a, b in zip(of_layer, of_layer[1:])):
        return None, "the blocks do not run in the order of the attention layers"
    assert container is not None
    return _Blocks(container, of_layer), ""


class _Stop(Exception):
    """Raised by a pre-hook to end a baseline forward once the blocks it needs have run."""


def _capture(blocks: _Blocks, model: nn.Module, ids: Tensor, mask: Tensor | None,
             stop_at: int | None = None, logits: bool = True) -> tuple[Any, dict[int, Any]]:
    """One unablated forward that keeps every block's output; with `stop_at`, ends before that block runs."""
    kept: dict[int, Any] = {}
    order: list[int] = []
    handles = []
    for index, block in enumerate(blocks.container):
        def keep(_module: nn.Module, _args: Any, output: Any, index: int = index) -> None:
            order.append(index)
            kept[index] = _detach(output)
        handles.append(block.register_forward_hook(keep))
        if stop_at is not None and index == stop_at:
            def stop(_module: nn.Module, _args: Any) -> None:
                raise _Stop
            handles.append(block.register_forward_pre_hook(stop))
    output = None
    try:
        output = run_model(model, ids, mask, logits=logits)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if order != sorted(set(order)):
        raise _NoPrefix("the model calls its blocks more than once or out of order")
    return output, kept


class _NoPrefix(Exception):
    """The baseline's prefix cannot be reused for this model (the reason is the message)."""


def _detach(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(item) for item in value) if isinstance(value, tuple) else [_detach(v) for v in value]
    if isinstance(value, dict):
        return {key: _detach(item) for key, item in value.items()}
    return value


def _stack(value: Any, copies: int, batch: int) -> Any:
    """`copies` copies of a batch's block output along the batch dimension (copy-major, like ids.repeat)."""
    if copies == 1:
        return value
    if isinstance(value, Tensor):
        if value.dim() >= 1 and value.shape[0] == batch:
            return value.repeat(copies, *([1] * (value.dim() - 1)))
        return value
    if isinstance(value, tuple):
        return tuple(_stack(item, copies, batch) for item in value)
    if isinstance(value, list):
        return [_stack(item, copies, batch) for item in value]
    if isinstance(value, dict):
        return {key: _stack(item, copies, batch) for key, item in value.items()}
    return value


_MISSING = object()


@contextmanager
def _skip_blocks(container: nn.ModuleList, outputs: dict[int, Any]) -> Iterator[None]:
    """Blocks in `outputs` return the given value instead of running; their own forward is back on exit."""
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for index, value in outputs.items():
            module = container[index]
            saved.append((module, module.__dict__.get("forward", _MISSING)))

            def constant(*_args: Any, _value: Any = value, **_kwargs: Any) -> Any:
                return _value

            module.__dict__["forward"] = constant
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous


# ---------------------------------------------------------------------------------------------------------------
# long context: logits computed a chunk of positions at a time


def _chunkable_blocks(model: nn.Module) -> _Blocks | None:
    """The block list, when a forward's logits can be had a chunk of positions at a time instead of whole: a causal
    Hugging Face LM whose forward takes `logits_to_keep`, its attention layers in one block list."""
    from probe.attention import accepts_argument, is_hf_model

    if not isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
        return None
    if not is_hf_model(model) or not accepts_argument(model, "logits_to_keep"):
        return None
    layers = attention_layers(model)
    if not all(getattr(layer.module, "is_causal", True) for layer in layers):
        return None
    return _find_blocks(model, layers)[0]


def _lean_blocks(model: nn.Module, ids: Tensor) -> _Blocks | None:
    """The block list, when a forward's logits on `ids` would pass LOGITS_BYTES and can be had in chunks instead."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or ids.numel() * vocab * 4 <= LOGITS_BYTES:
        return None
    return _chunkable_blocks(model)


@dataclass
class _Final:
    """A forward's last block output, standing in for logits too large to hold (8192 tokens x 49k vocabulary are
    1.6 GB): the model's own head (final norm, unembedding, any soft-capping) runs again on it, every block
    skipped, for a chunk of positions at a time (`logits_to_keep`)."""

    model: nn.Module
    blocks: _Blocks
    ids: Tensor
    mask: Tensor | None
    hidden: Any  # what the last block returned
    normed: Tensor | None = None  # the decoder's output (final norm applied), where the head is direct

    def logits(self, positions: Tensor) -> Tensor:
        skipped = {index: self.hidden for index in range(len(self.blocks.container))}
        with _skip_blocks(self.blocks.container, skipped):
            return logits_of(run_model(self.model, self.ids, self.mask, logits=positions))

    def cross_entropy(self) -> Tensor:
        """(rows, n - 1) float32 next-token cross-entropy at every position, as `_Scorer.sums` computes it."""
        if self.normed is not None:
            return _head_cross_entropy(self.model, self.normed, self.ids)
        rows, n = self.ids.shape
        chunk = max(1, LOGITS_CHUNK_BYTES // (rows * self.model.config.vocab_size * 4))
        values = []
        for start in range(0, n - 1, chunk):
            stop = min(start + chunk, n - 1)
            logits = self.logits(torch.arange(start, stop)).float()
            targets = self.ids[:, start + 1:stop + 1].to(logits.device)
            values.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                          reduction="none").view(rows, stop - start))
        return torch.cat(values, dim=1)

    def first_rows(self, batch: int) -> Tensor:
        hidden = self.hidden[0] if isinstance(self.hidden, (tuple, list)) else self.hidden
        return hidden[:batch]


def _last_block_output(model: nn.Module, blocks: _Blocks, ids: Tensor, mask: Tensor | None,
                       direct: bool = False) -> _Final:
    """One forward that keeps the last block's output (and with `direct`, the decoder's) and computes the logits of
    the last position only."""
    kept: list[Any] = []
    normed: list[Tensor] = []
    last = blocks.container[len(blocks.container) - 1]
    with ExitStack() as stack:
        handle = last.register_forward_hook(lambda _module, _args, output: kept.append(_detach(output)))
        stack.callback(handle.remove)
        if direct:
            stack.enter_context(_keep_decoder_output(model, normed))
        run_model(model, ids, mask, logits=False)
    return _Final(model, blocks, ids, mask, kept[-1], normed[-1] if direct else None)


def _outputs(model: nn.Module, ids: Tensor, mask: Tensor | None, lean: bool | None = None) -> Tensor | _Final:
    """A forward's logits (or last hidden states), or its _Final where the logits would be too large (`lean`
    None), or as told."""
    blocks = _lean_blocks(model, ids) if lean is None else (
        _find_blocks(model, attention_layers(model))[0] if lean else None)
    if blocks is None:
        return logits_of(run_model(model, ids, mask))
    return _last_block_output(model, blocks, ids, mask)


# ---------------------------------------------------------------------------------------------------------------
# the direct head: the loss from the decoder's output, unembedded a cache-sized chunk of positions at a time


def _decoder(model: nn.Module) -> nn.Module | None:
    """The model's decoder (the part before the LM head, final norm included), if it names one."""
    getter = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    try:
        decoder = getter() if callable(getter) else None
    except Exception:  # models without one raise in various ways
        return None
    if not isinstance(decoder, nn.Module) or decoder is model or not isinstance(head, nn.Module):
        return None
    return decoder


@contextmanager
def _keep_decoder_output(model: nn.Module, kept: list[Tensor]) -> Iterator[None]:
    decoder = _decoder(model)
    assert decoder is not None

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        value = output if isinstance(output, Tensor) else getattr(output, "last_hidden_state", None)
        kept.append((value if isinstance(value, Tensor) else output[0]).detach())

    handle = decoder.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def _head_cross_entropy(model: nn.Module, normed: Tensor, ids: Tensor) -> Tensor:
    """(rows, n - 1) next-token cross-entropy, the LM head applied to HEAD_ROWS positions at a time: the logits of a
    chunk are still in cache when the log-softmax reads them (about 12% faster on CPU than all positions at once)."""
    head = model.get_output_embeddings()
    rows, n = ids.shape
    states = normed[:, :-1].reshape(-1, normed.shape[-1])
    targets = ids[:, 1:].reshape(-1)
    values = []
    for start in range(0, states.shape[0], HEAD_ROWS):
        logits = head(states[start:start + HEAD_ROWS]).float()  # on the head's device, under a device map
        values.append(F.cross_entropy(logits, targets[start:start + HEAD_ROWS].to(logits.device), reduction="none"))
    return torch.cat(values).view(rows, n - 1)


def _may_be_direct(model: nn.Module, blocks: _Blocks | None) -> bool:
    """Whether the direct head is worth checking: blocks to reuse, a decoder to hook, logits to chunk."""
    return blocks is not None and _decoder(model) is not None and _chunkable_blocks(model) is not None


def _direct_head(model: nn.Module, normed: Tensor, logits: Tensor) -> bool:
    """Whether the model's logits are its LM head applied to the decoder's output and nothing else (no soft-capping
    or scaling after the head): checked on the first two positions of a forward whose logits are at hand."""
    positions = min(2, logits.shape[1])
    mine = model.get_output_embeddings()(normed[:, :positions]).float()
    theirs = logits[:, :positions].float()
    if mine.shape != theirs.shape:
        return False
    return bool((mine - theirs).abs().max() <= CHECK_TOLERANCE * max(1.0, float(theirs.abs().max())))


# ---------------------------------------------------------------------------------------------------------------
# results


@dataclass
class HeadResult:
    """The metric with one head ablated (or several together: `heads`)."""

    heads: Ablation
    loss: float
    delta: float
    parts: dict[str, float] = field(default_factory=dict)  # e.g. first_repeat / second_repeat losses
    part_deltas: dict[str, float] = field(default_factory=dict)
    exact: bool | None = None  # estimate mode: True for the heads that were ablated exactly

    @property
    def layer(self) -> int:
        return self.heads[0][0]

    @property
    def head(self) -> int:
        return self.heads[0][1]

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        if len(self.heads) == 1:
            entry.update(layer=self.layer, head=self.head)
        else:
            entry.update(heads=[list(head) for head in self.heads], label=label(self.heads))
        entry.update(loss=self.loss, delta=self.delta)
        for name, value in self.parts.items():
            entry[f"{name}_loss"] = value
            entry[f"{name}_delta"] = self.part_deltas.get(name)
        if self.exact is not None:
            entry["exact"] = self.exact
        return entry

    @staticmethod
    def from_dict(entry: dict[str, Any]) -> "HeadResult":
        heads = ((int(entry["layer"]), int(entry["head"])),) if "layer" in entry else tuple(
            (int(a), int(b)) for a, b in entry["heads"])
        parts = {key[:-5]: value for key, value in entry.items() if key.endswith("_loss") and key != "loss"}
        deltas = {key[:-6]: value for key, value in entry.items() if key.endswith("_delta") and key != "delta"}
        return HeadResult(heads, float(entry["loss"]), float(entry["delta"]), parts, deltas, entry.get("exact"))


@dataclass
class AblationResult:
    """Baseline and ablated metric of every ablation of a sweep, plus how it was computed."""

    model: str
    method: str  # "zero" or "mean"
    data: str  # "natural", "repeated" or the text file
    metric: str  # a key of METRICS
    baseline_loss: float
    results: list[HeadResult]
    n_layers: int
    n_heads: int
    mode: str = "exact"  # "exact", "naive" or "estimate"
    path: str = ""  # how the numbers were computed
    baseline_parts: dict[str, float] = field(default_factory=dict)
    probe_set: dict[str, Any] = field(default_factory=dict)
    mean: str | None = None  # mean ablation: what the means were taken over
    seconds: float | None = None
    forwards: float | None = None  # cost in forward-pass equivalents (estimate mode)
    terms: dict[Head, tuple[float, float]] | None = None  # estimate mode: (first-order, second-order) per head

    @property
    def heads(self) -> list[HeadResult]:
        """Single-head results."""
        return [r for r in self.results if len(r.heads) == 1]

    @property
    def groups(self) -> list[HeadResult]:
        """Results of heads ablated together."""
        return [r for r in self.results if len(r.heads) > 1]

    def ranked(self) -> list[HeadResult]:
        """All results, largest delta first."""
        return sorted(self.results, key=lambda r: (-r.delta, r.heads))

    def delta_grid(self) -> Tensor:
        """(n_layers, n_heads) single-head deltas, NaN where a head was not ablated."""
        grid = torch.full((self.n_layers, self.n_heads), float("nan"))
        for r in self.heads:
            grid[r.layer, r.head] = r.delta
        return grid

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "model": self.model,
            "method": self.method,
            "data": self.data,
            "metric": self.metric,
            "metric_description": METRICS.get(self.metric, self.metric),
            "baseline_loss": self.baseline_loss,
            "heads": [self._entry(r) for r in self.heads],
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "mode": self.mode,
            "path": self.path,
        }
        for name, value in self.baseline_parts.items():
            data[f"baseline_{name}_loss"] = value
        if self.groups:
            data["groups"] = [r.to_dict() for r in self.groups]
        if self.mean is not None:
            data["mean"] = self.mean
        if self.probe_set:
            data["probe_set"] = self.probe_set
        if self.seconds is not None:
            data["seconds"] = round(self.seconds, 3)
        if self.forwards is not None:
            data["forward_equivalents"] = round(self.forwards, 3)
        return data

    def _entry(self, result: HeadResult) -> dict[str, Any]:
        entry = result.to_dict()
        if self.terms is not None and result.heads[0] in self.terms:
            entry["first_order"], entry["second_order"] = self.terms[result.heads[0]]
        return entry

    def csv_rows(self) -> list[dict[str, Any]]:
        """One row per ablation, for CSV: label, layer, head, loss, delta, and the parts."""
        rows = []
        for r in self.ranked():
            row: dict[str, Any] = {"heads": label(r.heads), "layer": r.layer if len(r.heads) == 1 else "",
                                   "head": r.head if len(r.heads) == 1 else "", "loss": r.loss, "delta": r.delta}
            for name in self.baseline_parts:
                row[f"{name}_loss"] = r.parts.get(name, "")
                row[f"{name}_delta"] = r.part_deltas.get(name, "")
            rows.append(row)
        return rows

    def _repr_html_(self) -> str:
        from reports.html import ablation_page  # type: ignore[attr-defined]

        return ablation_page(self.to_dict())


def write_csv(path: str | Path, result: AblationResult) -> Path:
    """The ablations as CSV, largest delta first (atomically, like every probe output file)."""
    import csv
    import io

    from reports.files import write_text

    rows = result.csv_rows()
    columns = ["heads", "layer", "head", "loss", "delta"] + [f"{n}_{k}" for n in result.baseline_parts
                                                            for k in ("loss", "delta")]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return write_text(path, buffer.getvalue())


# ---------------------------------------------------------------------------------------------------------------
# the results stream


def _fingerprint(loaded: LoadedModel, probe_set: ProbeSet, method: str, metric: str,
                 means: HeadMeans | None) -> str:
    """What makes two sweeps' numbers comparable: model, data, method, metric, means. Not the heads, not timing."""
    digest = hashlib.sha256()
    digest.update(json.dumps([loaded.name, method, metric, probe_set.offset, probe_set.repeat_len]).encode())
    digest.update(probe_set.input_ids.cpu().contiguous().numpy().tobytes())
    if probe_set.attention_mask is not None:
        digest.update(probe_set.attention_mask.cpu().contiguous().numpy().tobytes())
    if means is not None:
        digest.update(str(means.per_position).encode())
        for layer in sorted(means.values):
            digest.update(means.values[layer].cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:24]


def read_results(path: str | Path) -> tuple[dict[str, Any], list[HeadResult]]:
    """The header and the finished ablations of a results stream; a half-written last line is ignored."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise ProbeError(f"results file not found: {path}") from None
    except UnicodeDecodeError:
        raise ProbeError(f"{path} is not a probe ablation results file") from None
    header: dict[str, Any] | None = None
    results: list[HeadResult] = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number >= len(lines) - 2:  # the last line, cut short by an interruption
                break
            raise ProbeError(f"{path} line {number + 1} is not JSON: not a probe ablation results file") from None
        if header is None:
            if not isinstance(entry, dict) or entry.get("probe_ablation") != RESULTS_FORMAT:
                raise ProbeError(f"{path} is not a probe ablation results file")
            header = entry
        else:
            results.append(HeadResult.from_dict(entry))
    if header is None:
        raise ProbeError(f"{path} is empty: not a probe ablation results file")
    return header, results


def load_results(*paths: str | Path) -> AblationResult:
    """An AblationResult from one or more results streams of the same sweep (e.g. one per process)."""
    if not paths:
        raise ProbeError("no results files given")
    headers, results, seen = [], [], set()
    for path in paths:
        header, entries = read_results(path)
        if headers and header["fingerprint"] != headers[0]["fingerprint"]:
            raise ProbeError(f"{path} comes from a different sweep (model, data or method) than {paths[0]}")
        headers.append(header)
        for entry in entries:
            if entry.heads not in seen:
                seen.add(entry.heads)
                results.append(entry)
    h = headers[0]
    return AblationResult(model=h["model"], method=h["method"], data=h["data"], metric=h["metric"],
                          baseline_loss=h["baseline_loss"], results=results, n_layers=h["n_layers"],
                          n_heads=h["n_heads"], mode=h.get("mode", "exact"), path=h.get("path", ""),
                          baseline_parts=h.get("baseline_parts", {}), probe_set=h.get("probe_set", {}),
                          mean=h.get("mean"))


class _Stream:
    """Appends one JSON line per finished ablation, flushed at once, so an interruption loses nothing finished."""

    def __init__(self, path: Path, header: dict[str, Any], resume: bool) -> None:
        self.path = path
        self.done: dict[Ablation, HeadResult] = {}
        if resume and path.exists() and path.stat().st_size > 0:
            old, entries = read_results(path)
            if old.get("fingerprint") != header["fingerprint"]:
                raise ProbeError(f"cannot resume from {path}: it holds a sweep of a different model, data or method "
                                 "(start over with --force)")
            if not math.isclose(old["baseline_loss"], header["baseline_loss"], rel_tol=1e-5, abs_tol=1e-7):
                raise ProbeError(f"cannot resume from {path}: its baseline loss {old['baseline_loss']:.6f} differs "
                                 f"from this model's {header['baseline_loss']:.6f} (different weights?)")
            self.done = {entry.heads: entry for entry in entries}
            self._rewrite(old, entries)  # drops a half-written last line
        else:
            self._rewrite(header, [])
        self.file = open(path, "a", encoding="utf-8")

    def _rewrite(self, header: dict[str, Any], entries: list[HeadResult]) -> None:
        lines = [json.dumps(header)] + [json.dumps(entry.to_dict()) for entry in entries]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, result: HeadResult) -> None:
        self.file.write(json.dumps(result.to_dict()) + "\n")
        self.file.flush()
        self.done[result.heads] = result

    def close(self) -> None:
        self.file.close()


# ---------------------------------------------------------------------------------------------------------------
# the sweep


@dataclass
class _Baseline:
    """What the unablated model gives on every batch, and what an ablated run reuses."""

    sums: Tensor  # (parts + 1,) metric sums over the probe set
    counts: Tensor  # (parts + 1,) positions that count
    outputs: list[Tensor | None]  # final outputs per batch (cosine metric only)
    kept: list[dict[int, Any] | None]  # block outputs per batch (None: recompute when needed)


def _output_bytes(model: nn.Module, ids: Tensor, loaded: LoadedModel, logits: bool = True) -> int:
    """Memory of one copy in a stacked forward: activations (about 24 hidden-size vectors a token), and logits."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 1024
    return int(ids.numel()) * 4 * (loaded.vocab_size * logits + 24 * hidden)


def _chunks(ablations: Sequence[Ablation], start_of: Callable[[Ablation], int], stack: int) -> list[list[Ablation]]:
    """Ablations that start in the same block, in groups of at most `stack`, split evenly."""
    groups: dict[int, list[Ablation]] = {}
    for ablation in ablations:
        groups.setdefault(start_of(ablation), []).append(ablation)
    out = []
    for start in sorted(groups):
        items = groups[start]
        n = math.ceil(len(items) / stack)
        size = math.ceil(len(items) / n)
        out.extend(items[i:i + size] for i in range(0, len(items), size))
    return out


def _data_name(probe_set: ProbeSet, data: str | Path | None) -> str:
    if probe_set.name == "repeated":
        return "repeated"
    return "natural" if data is None else str(data)


def sweep(
    loaded: LoadedModel,
    probe_set: ProbeSet,
    heads: Sequence[Head] | None = None,
    *,
    groups: Sequence[Sequence[Head]] = (),
    method: str = "zero",
    mode: str = "exact",
    means: HeadMeans | None = None,
    batch_size: int = 8,
    stack: int | None = None,
    results_path: str | Path | None = None,
    resume: bool = False,
    data: str | Path | None = None,
    progress: Progress | None = None,
    on_result: Callable[[HeadResult], None] | None = None,
    shard: tuple[int, int] | None = None,
) -> AblationResult:
    """Ablate each head of `heads` alone (default: every head) and each group of `groups` together; measure the
    metric for each against the unablated baseline.

    `mode` "exact" reuses the baseline's prefix and stacks `stack` ablations per forward (default: as many of one
    layer as fit in STACK_BYTES); "naive" runs one full forward per ablation; "estimate" calls `estimate`.
    `results_path` streams each finished ablation to a JSON-lines file; `resume` skips what that file holds. The
    baseline is computed the same way in every process, so disjoint subsets of heads can run in separate processes
    and be merged with `load_results`; `shard=(rank, world)` runs only this process's share of the sweep's chunks
    (see probe.distributed), so that merged shards equal one process's sweep number for number.
    """
    started = time.perf_counter()
    if method not in METHODS:
        raise ProbeError(f"unknown ablation method {method!r}: use one of {', '.join(METHODS)}")
    if mode not in MODES:
        raise ProbeError(f"unknown sweep mode {mode!r}: use one of {', '.join(MODES)}")
    if probe_set.input_ids.dim() != 2 or probe_set.input_ids.shape[1] < 2 or probe_set.input_ids.shape[0] < 1:
        raise ProbeError("the probe data needs at least one sequence of at least 2 tokens (a next token to predict)")
    if stack is not None and stack < 1:
        raise ProbeError(f"stack must be at least 1, got {stack}")
    model = loaded.model
    layers = attention_layers(model)
    n_layers, n_heads = _layer_shape(layers)
    heads = list(all_heads(model) if heads is None and not groups else heads or [])
    _check_heads(layers, heads)
    for group in groups:
        _check_heads(layers, group)
    ablations: list[Ablation] = [(head,) for head in heads] + [tuple(group) for group in groups]
    ablations = list(dict.fromkeys(ablations))
    if not ablations:
        raise ProbeError("nothing to ablate: give at least one head")
    if mode == "estimate":
        if method != "zero" or groups:
            raise ProbeError("the estimate covers single-head zero ablation: use --method zero without --together")
        return estimate(loaded, probe_set, heads, batch_size=batch_size, data=data, progress=progress)
    if method == "mean" and means is None:
        means = head_means(loaded, probe_set, batch_size=batch_size)
    batches = _batches(probe_set, batch_size)

    with torch.no_grad():
        first_output = run_model(model, batches[0][0][:1, :2], None if batches[0][1] is None else batches[0][1][:1, :2])
    metric = "cross_entropy" if _is_causal_lm(loaded, first_output) else "cosine_distance"
    scorer = _Scorer(metric, _parts(probe_set))
    masks = [scorer.masks(ids, mask) for ids, mask in batches]

    blocks, why_not = (None, "") if mode == "naive" else _find_blocks(model, layers)
    if mode == "exact" and blocks is None:
        mode_path = f"naive: one full forward per ablation ({why_not})"
    elif mode == "naive":
        mode_path = "naive: one full forward per ablation"
    else:
        mode_path = "exact: baseline prefix reused, ablated runs start at the ablated layer's block"

    def start_of(ablation: Ablation) -> int:
        return min(blocks.of_layer[layer] for layer, _ in ablation) if blocks is not None else 0

    n_blocks = len(blocks.container) if blocks is not None else n_layers
    # the baseline, keeping block outputs where they fit
    keep_bytes = 0
    if blocks is not None:
        hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 1024
        keep_bytes = int(probe_set.input_ids.numel()) * 4 * hidden * max(start_of(a) for a in ablations)
    keep_all = blocks is not None and keep_bytes <= CACHE_BYTES
    sums = torch.zeros(len(scorer.parts) + 1, dtype=torch.float64)
    counts = torch.stack([m.sum(dim=(1, 2)) for m in masks]).sum(dim=0).double()
    outputs: list[Tensor | None] = []
    kept: list[dict[int, Any] | None] = []
    total_work = len(batches) * (n_blocks + 1) * (1 + len(ablations))  # upper bound until chunks are known
    work = [0]

    def advance(amount: int) -> None:
        work[0] += amount
        if progress is not None:
            progress(min(work[0], total_work), total_work)

    # the ablated runs' loss straight from the decoder's output, if the first baseline forward shows it is the same
    direct: bool | None = None if metric == "cross_entropy" and _may_be_direct(model, blocks) else False
    with torch.inference_mode():
        for (ids, mask), batch_masks in zip(batches, masks):
            lean = metric == "cross_entropy" and _lean_blocks(model, ids) is not None
            if keep_all:
                try:
                    normed: list[Tensor] = []
                    with ExitStack() as hooks:
                        if direct is None:
                            hooks.enter_context(_keep_decoder_output(model, normed))
                        output, kept_here = _capture(blocks, model, ids, mask, logits=not lean)  # type: ignore[arg-type]
                    if lean:  # long context: the logits a chunk of positions at a time, from the last block's output
                        output = _Final(model, blocks, ids, mask, kept_here[len(blocks.container) - 1])  # type: ignore
                    if normed:
                        reference = output.logits(torch.arange(2)) if isinstance(output, _Final) else logits_of(output)
                        direct = _direct_head(model, normed[-1], reference)
                    last = max(start_of(a) for a in ablations)
                    kept_here = {i: value for i, value in kept_here.items() if i < last}
                except _NoPrefix as error:
                    blocks, keep_all, mode_path = None, False, f"naive: one full forward per ablation ({error})"
                    output, kept_here = _outputs(model, ids, mask), None
            else:
                output, kept_here = _outputs(model, ids, mask), None
            final = output if isinstance(output, _Final) else logits_of(output)
            kept.append(kept_here)
            outputs.append(final.detach() if metric == "cosine_distance" else None)
            if metric == "cross_entropy":  # the cosine distance of the baseline to itself is 0
                sums += scorer.sums(final, ids, batch_masks, 1)[0]
            advance(n_blocks + 1)
    baseline = _Baseline(sums, counts, outputs, kept)
    baseline_loss = float(sums[0] / counts[0].clamp(min=1))
    part_names = list(scorer.parts)
    baseline_parts = {name: float(sums[i + 1] / counts[i + 1].clamp(min=1)) for i, name in enumerate(part_names)}

    data_name = _data_name(probe_set, data)
    header = {"probe_ablation": RESULTS_FORMAT, "model": loaded.name, "method": method, "data": data_name,
              "metric": metric, "fingerprint": _fingerprint(loaded, probe_set, method, metric, means),
              "baseline_loss": baseline_loss, "baseline_parts": baseline_parts, "n_layers": n_layers,
              "n_heads": n_heads, "probe_set": probe_set.to_dict() | {"description": probe_set.description},
              "mean": means.describe() if means is not None and method == "mean" else None}
    stream = _Stream(Path(results_path), header, resume) if results_path is not None else None
    done: dict[Ablation, HeadResult] = dict(stream.done) if stream is not None else {}

    if stack is None:
        # as many copies as fit in STACK_BYTES; where the logits of a stack can be computed a chunk of positions at
        # a time (LOGITS_CHUNK_BYTES), they do not count, else no more copies than keep the logits whole
        # (long inputs, whose single copy's logits are already chunked, gain nothing from stacking: one copy each)
        chunked = metric == "cross_entropy" and _chunkable_blocks(model) is not None
        if chunked and any(_lean_blocks(model, ids) is not None for ids, _ in batches):
            stack = 1
        else:
            per_copy = max(_output_bytes(model, ids, loaded, logits=not chunked) for ids, _ in batches)
            logits_per_copy = 0 if chunked else max(int(ids.numel()) * 4 * loaded.vocab_size for ids, _ in batches)
            stack = max(1, min(STACK_BYTES // max(per_copy, 1), LOGITS_BYTES // max(logits_per_copy, 1)))
    if blocks is None:
        stack = 1
    chunks = _chunks(ablations, start_of, stack)
    if shard is not None:  # (rank, world): this process runs its share of exactly the chunks one process would run
        from probe.distributed import assign_chunks

        owner = assign_chunks([len(chunk) * (n_blocks - start_of(chunk[0]) + 1) for chunk in chunks], shard[1])
        chunks = [chunk for chunk, rank in zip(chunks, owner) if rank == shard[0]]
    todo = [chunk for chunk in chunks if not all(a in done for a in chunk)]
    total_work = work[0] + sum(len(batches) * len(chunk) * (n_blocks - start_of(chunk[0]) + 1) for chunk in todo)
    checked = [blocks is None]

    def result_of(ablation: Ablation, values: Tensor) -> HeadResult:
        loss = float(values[0] / counts[0].clamp(min=1))
        parts = {name: float(values[i + 1] / counts[i + 1].clamp(min=1)) for i, name in enumerate(part_names)}
        return HeadResult(ablation, loss, loss - baseline_loss, parts,
                          {name: parts[name] - baseline_parts[name] for name in part_names})

    with ExitStack() as scope:
        scope.enter_context(torch.inference_mode())  # ~2% quicker than no_grad on CPU: no version counters
        if stream is not None:
            scope.callback(stream.close)
        for chunk in todo:
            chunk_sums = torch.zeros(len(chunk), len(scorer.parts) + 1, dtype=torch.float64)
            start = start_of(chunk[0])
            for index, ((ids, mask), batch_masks) in enumerate(zip(batches, masks)):
                base_out = baseline.outputs[index]
                if blocks is None:
                    for position, ablation in enumerate(chunk):
                        out = _naive_forward(model, ids, mask, ablation, method, means)
                        chunk_sums[position] += scorer.sums(out, ids, batch_masks, 1, base_out)[0]
                else:
                    if checked[0] or start == 0:  # a chunk that starts at block 0 reuses nothing: nothing to check
                        out = _prefix_forward(model, blocks, baseline, index, ids, mask, chunk, start, method, means,
                                              bool(direct))
                    else:
                        try:
                            out = _prefix_forward(model, blocks, baseline, index, ids, mask, chunk, start, method,
                                                  means, bool(direct))
                            reason = _check_prefix(model, ids, mask, chunk[0], method, means, out, len(chunk))
                        except (ProbeError, KeyboardInterrupt):
                            raise
                        except Exception as error:  # the model cannot run from kept block outputs
                            reason = f"{type(error).__name__}: {error}".splitlines()[0]
                        checked[0] = True
                        if reason:  # start over the naive way; nothing of this chunk was counted yet
                            blocks, stack = None, 1
                            mode_path = f"naive: one full forward per ablation (the exact path failed its check: {reason})"
                            for position, ablation in enumerate(chunk):
                                out1 = _naive_forward(model, ids, mask, ablation, method, means)
                                chunk_sums[position] += scorer.sums(out1, ids, batch_masks, 1, base_out)[0]
                            advance(len(chunk) * (n_blocks - start + 1))
                            continue
                    chunk_sums += scorer.sums(out, ids, batch_masks, len(chunk), base_out)
                advance(len(chunk) * (n_blocks - start + 1))
            for position, ablation in enumerate(chunk):
                if ablation in done:
                    continue
                result = result_of(ablation, chunk_sums[position])
                done[ablation] = result
                if stream is not None:
                    stream.write(result)
                if on_result is not None:
                    on_result(result)
    return AblationResult(
        model=loaded.name, method=method, data=data_name, metric=metric, baseline_loss=baseline_loss,
        results=[done[a] for a in ablations if a in done], n_layers=n_layers, n_heads=n_heads,
        mode="naive" if mode_path.startswith("naive") else "exact", path=mode_path, baseline_parts=baseline_parts,
        probe_set=header["probe_set"], mean=header["mean"], seconds=time.perf_counter() - started)


def _naive_forward(model: nn.Module, ids: Tensor, mask: Tensor | None, ablation: Ablation, method: str,
                   means: HeadMeans | None, lean: bool | None = None) -> Tensor | _Final:
    edit, layers = _head_editor([ablation], ids.shape[0], method, means)
    with attention_hooks(model, edit_heads=edit, layers=layers):
        return _outputs(model, ids, mask, lean)


def _prefix_forward(model: nn.Module, blocks: _Blocks, baseline: _Baseline, index: int, ids: Tensor,
                    mask: Tensor | None, chunk: list[Ablation], start: int, method: str,
                    means: HeadMeans | None, direct: bool = False) -> Tensor | _Final:
    """The chunk's ablations stacked along the batch, blocks before `start` replaced by the baseline's outputs;
    `direct`: the loss comes from the decoder's output (`_head_cross_entropy`)."""
    kept = baseline.kept[index]
    if kept is None:  # not kept (too big): run the baseline again, up to the block where this chunk starts
        _, kept = _capture(blocks, model, ids, mask, stop_at=start)
    copies, batch = len(chunk), ids.shape[0]
    # every skipped block returns the last one's output: only that one feeds the first block that runs
    entry = _stack(kept[start - 1], copies, batch) if start > 0 else None
    skipped = {i: entry for i in range(start)}
    edit, layers = _head_editor(chunk, batch, method, means)
    stacked_ids = ids.repeat(copies, 1)
    stacked_mask = None if mask is None else mask.repeat(copies, 1)
    with _skip_blocks(blocks.container, skipped), attention_hooks(model, edit_heads=edit, layers=layers):
        if direct:
            return _last_block_output(model, blocks, stacked_ids, stacked_mask, direct=True)
        return _outputs(model, stacked_ids, stacked_mask)


def _check_prefix(model: nn.Module, ids: Tensor, mask: Tensor | None, ablation: Ablation, method: str,
                  means: HeadMeans | None, stacked: Tensor, copies: int) -> str:
    """'' if the exact path's first copy equals a full forward with the same ablation, else what differs."""
    if isinstance(stacked, _Final):  # long context: compare the last block's outputs, which make the logits
        reference_final = _naive_forward(model, ids, mask, ablation, method, means, lean=True)
        assert isinstance(reference_final, _Final)
        mine, reference = stacked.first_rows(ids.shape[0]), reference_final.first_rows(ids.shape[0])
    else:
        reference = _naive_forward(model, ids, mask, ablation, method, means, lean=False)  # type: ignore[assignment]
        mine = stacked.reshape(copies, ids.shape[0], *stacked.shape[1:])[0]
    if mine.shape != reference.shape:
        return f"output shape {tuple(mine.shape)} != {tuple(reference.shape)}"
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    valid = valid.to(mine.device)
    diff = (mine.float() - reference.float()).abs()[valid].max().item()
    scale = max(1.0, reference.float().abs()[valid].max().item())
    if not diff <= CHECK_TOLERANCE * scale:
        return f"max difference {diff:.3g} on outputs of scale {scale:.3g}"
    return ""


# ---------------------------------------------------------------------------------------------------------------
# estimate mode


GRAD_FORWARD_COST = 1.35  # a forward that keeps the graph, in plain forwards (measured on CPU, SmolLM2)
BACKWARD_COST = 1.4  # a backward to the head outputs only (no weight gradients), in plain forwards (same)
LOSS_COST = 0.1  # an ablated copy's loss beyond its forward (log-softmax over the vocabulary), in plain forwards
ESTIMATE_BUDGET = 10.0  # forward-equivalents: the gradient passes, then exact ablation of the top heads
REFINE_CANDIDATES = 20  # the exact check considers this many of the top estimated heads


def _flop_costs(model: nn.Module, blocks: _Blocks | None, n_layers: int) -> Callable[[int], float]:
    """Cost of an ablated run that starts at block `start`, as a fraction of a full forward, from parameter counts
    (the work per token of a block or of the unembedding is proportional to its weights)."""
    if blocks is None:
        return lambda start: 1.0
    per_block = [sum(p.numel() for p in block.parameters()) for block in blocks.container]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    unembed = sum(p.numel() for p in head.parameters()) if isinstance(head, nn.Module) else 0
    total = sum(per_block) + unembed
    return lambda start: (sum(per_block[start:]) + unembed) / max(total, 1)


def estimate(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head] | None = None, *,
             batch_size: int = 8, samples: int = 1, budget: float = ESTIMATE_BUDGET, refine: int | None = None,
             seed: int = 0, data: str | Path | None = None, progress: Progress | None = None) -> AblationResult:
    """Every head's zero-ablation delta, estimated from a few forward and backward passes instead of a sweep.

    Attribution patching (Syed et al. 2023; Kramar et al. 2024) takes the first-order term -<dL/dz_h, z_h> of each
    head's output z_h from one forward and one backward. Zero-ablating a head is a large step, and on real models
    the loss rises faster than linearly along it (SmolLM2: first order alone explains about a third of a typical
    delta), so two corrections in the spirit of AtP*:
    - the second-order term 1/2 v^T G v with v = -z_h and G the Gauss-Newton matrix of the loss, estimated from
      `samples` extra backward passes with next tokens sampled from the model's own predictions (their squared
      per-position projections onto v are unbiased for the position-diagonal part of v^T G v);
    - of the REFINE_CANDIDATES heads estimated to matter most, those whose estimate rests most on the
      second-order term are ablated exactly (reusing the baseline's prefix, as the exact sweep does) until
      `budget` forward-equivalents are spent (or the top `refine` heads, if given). Those heads are exact.
    The cost is counted in forward-equivalents from measured ratios (GRAD_FORWARD_COST, BACKWARD_COST, LOSS_COST)
    and the weights each ablated run recomputes; `AblationResult.forwards` reports it.
    """
    started = time.perf_counter()
    if samples < 0:
        raise ProbeError(f"samples must be 0 or more, got {samples}")
    if probe_set.input_ids.dim() != 2 or probe_set.input_ids.shape[1] < 2 or probe_set.input_ids.shape[0] < 1:
        raise ProbeError("the probe data needs at least one sequence of at least 2 tokens (a next token to predict)")
    model = loaded.model
    layers = attention_layers(model)
    n_layers, n_heads = _layer_shape(layers)
    heads = list(all_heads(model) if heads is None else heads)
    _check_heads(layers, heads)
    if not heads:
        raise ProbeError("nothing to ablate: give at least one head")
    batches = _batches(probe_set, batch_size)
    with torch.no_grad():
        first_output = run_model(model, batches[0][0][:1, :2], None if batches[0][1] is None else batches[0][1][:1, :2])
    if not _is_causal_lm(loaded, first_output):
        raise ProbeError("the estimate linearises the next-token loss, which this model (no LM head, or not causal) "
                         "does not have: use --method zero (the exact sweep)")
    scorer = _Scorer("cross_entropy", _parts(probe_set))
    masks = [scorer.masks(ids, mask) for ids, mask in batches]
    counts = torch.stack([m.sum(dim=(1, 2)) for m in masks]).sum(dim=0).double()
    n_tokens = float(counts[0].clamp(min=1))
    blocks, why_not = _find_blocks(model, layers)
    direct: bool | None = None if _may_be_direct(model, blocks) else False
    first_order = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    second_order = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    sums = torch.zeros(len(scorer.parts) + 1, dtype=torch.float64)
    kept: list[dict[int, Any] | None] = []
    batch_sums: list[Tensor] = []
    steps_total = len(batches) * (2 + samples)
    steps = [0]

    def step(extra: int = 1) -> None:
        steps[0] += extra
        if progress is not None:
            progress(min(steps[0], steps_total), steps_total)

    for (ids, mask), batch_masks in zip(batches, masks):
        outputs: dict[int, Tensor] = {}

        def capture(layer: int, values: Tensor) -> Tensor:
            if not values.requires_grad:  # frozen weights: the first hooked layer becomes the leaf
                values = values.detach().requires_grad_()
            outputs[layer] = values
            return values

        handles = []
        block_outputs: dict[int, Any] = {}
        if blocks is not None:
            for index, block in enumerate(blocks.container):
                handles.append(block.register_forward_hook(
                    lambda _m, _a, out, index=index: block_outputs.__setitem__(index, _detach(out))))
        normed: list[Tensor] = []
        try:
            with torch.enable_grad():
                with attention_hooks(model, edit_heads=capture), ExitStack() as keep:
                    if direct is None:
                        keep.enter_context(_keep_decoder_output(model, normed))
                    logits = logits_of(run_model(model, ids, mask))
                if normed:
                    direct = _direct_head(model, normed[-1], logits.detach())
                step()
                valid = batch_masks[0].to(logits.device)
                shifted = logits[:, :-1].float()
                targets = ids[:, 1:].to(logits.device)
                vocab = shifted.shape[-1]
                token_loss = F.cross_entropy(shifted.reshape(-1, vocab), targets.reshape(-1),
                                             reduction="none").view(targets.shape)
                order = sorted(outputs)
                inputs = [outputs[layer] for layer in order]
                loss = (token_loss * valid).sum() / n_tokens
                grads = torch.autograd.grad(loss, inputs, retain_graph=samples > 0)
                for layer, grad in zip(order, grads):
                    first_order[layer, :grad.shape[2]] += -(grad * outputs[layer].detach()).double().sum(dim=(0, 1, 3)).cpu()
                step()
                if samples:
                    # the gradient of a sampled label's loss w.r.t. the logits is softmax - onehot(label): no second
                    # log-softmax, and labels drawn by inverse CDF (torch.multinomial is ~0.5 s at 512 x 49k here)
                    probs = shifted.detach().softmax(dim=-1).reshape(-1, vocab)
                    cumulative = probs.cumsum(dim=-1)
                    weight = (valid.reshape(-1, 1) / n_tokens).to(probs.dtype)
                    generator = torch.Generator(device=probs.device).manual_seed(seed + len(kept))
                for sample in range(samples):
                    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
                    drawn = torch.searchsorted(cumulative, uniform * cumulative[:, -1:]).clamp_(max=vocab - 1)
                    grad_logits = probs.clone()
                    grad_logits.scatter_add_(1, drawn, -torch.ones_like(drawn, dtype=probs.dtype))
                    grad_logits.mul_(weight)
                    grads = torch.autograd.grad(shifted, inputs, grad_outputs=grad_logits.view(shifted.shape),
                                                retain_graph=sample < samples - 1)
                    for layer, grad in zip(order, grads):
                        projection = -(grad * outputs[layer].detach()).sum(dim=-1).double()  # (batch, pos, heads)
                        second_order[layer, :grad.shape[2]] += (0.5 * n_tokens / samples
                                                                * projection.pow(2).sum(dim=(0, 1)).cpu())
                    step()
                batch_sums.append(scorer.sums(logits.detach(), ids, batch_masks, 1)[0])
                sums += batch_sums[-1]
        finally:
            for handle in handles:
                handle.remove()
        if blocks is not None:
            last = max(blocks.of_layer[layer] for layer, _ in heads)
            kept.append({i: value for i, value in block_outputs.items() if i < last})
        else:
            kept.append(None)
        del outputs, logits
    baseline_loss = float(sums[0] / counts[0].clamp(min=1))
    part_names = list(scorer.parts)
    baseline_parts = {name: float(sums[i + 1] / counts[i + 1].clamp(min=1)) for i, name in enumerate(part_names)}
    estimated = {head: float(first_order[head] + second_order[head]) for head in heads}

    # exact ablation of the heads estimated to matter most, within the budget
    flop_cost = _flop_costs(model, blocks, n_layers)

    def cost_of(start: int) -> float:
        return flop_cost(start) + LOSS_COST

    start_of = (lambda head: blocks.of_layer[head[0]]) if blocks is not None else (lambda head: 0)
    spent = GRAD_FORWARD_COST + BACKWARD_COST * (1 + samples)
    check_cost = cost_of(len(blocks.container) - 1) if blocks is not None else 0.0
    ranked = sorted(heads, key=lambda head: (-estimated[head], head))
    chosen: list[Head] = []
    if refine is None:
        # among the top estimates, first those whose estimate leans most on the second-order term: there the
        # Taylor model is least trustworthy (on SmolLM2 these are early-layer heads it overrates)
        room = budget - spent - check_cost
        candidates = sorted(ranked[:REFINE_CANDIDATES], key=lambda head: (
            -float(second_order[head]) / max(abs(float(first_order[head])) + float(second_order[head]), 1e-30), head))
        for head in candidates:
            if cost_of(start_of(head)) <= room:
                chosen.append(head)
                room -= cost_of(start_of(head))
    else:
        chosen = ranked[:max(0, refine)]
    exact: dict[Head, Tensor] = {}
    path = ("estimate: attribution patching + Gauss-Newton second order" if samples
            else "estimate: attribution patching (first order)")
    if chosen:
        if blocks is not None:
            reason = _check_skip(model, blocks, kept[0], batches[0][0], batches[0][1], scorer, masks[0],
                                 batch_sums[0])
            spent += check_cost
            if reason:
                blocks, why_not = None, f"the exact path failed its check: {reason}"
        baseline = _Baseline(sums, counts, [None] * len(batches), kept)
        by_start: dict[int, list[Head]] = {}
        for head in chosen:
            by_start.setdefault(start_of(head) if blocks is not None else 0, []).append(head)
        steps_total += sum(len(batches) for _ in by_start)
        with torch.no_grad():
            for start, group in sorted(by_start.items()):
                ablations = [(head,) for head in group]
                totals = torch.zeros(len(group), len(scorer.parts) + 1, dtype=torch.float64)
                for index, ((ids, mask), batch_masks) in enumerate(zip(batches, masks)):
                    if blocks is not None:
                        out = _prefix_forward(model, blocks, baseline, index, ids, mask, ablations, start, "zero", None,
                                              bool(direct))
                        totals += scorer.sums(out, ids, batch_masks, len(group))
                    else:
                        for position, ablation in enumerate(ablations):
                            out = _naive_forward(model, ids, mask, ablation, "zero", None)
                            totals[position] += scorer.sums(out, ids, batch_masks, 1)[0]
                    step()
                for position, head in enumerate(group):
                    exact[head] = totals[position]
                    spent += cost_of(start if blocks is not None else 0)
        path += f", {len(chosen)} top heads ablated exactly ({'prefix reused' if blocks is not None else why_not})"

    results = []
    for head in heads:
        if head in exact:
            values = exact[head]
            loss = float(values[0] / counts[0].clamp(min=1))
            parts = {name: float(values[i + 1] / counts[i + 1].clamp(min=1)) for i, name in enumerate(part_names)}
            results.append(HeadResult((head,), loss, loss - baseline_loss, parts,
                                      {name: parts[name] - baseline_parts[name] for name in part_names}, exact=True))
        else:
            delta = estimated[head]
            results.append(HeadResult((head,), baseline_loss + delta, delta, exact=False))
    return AblationResult(
        model=loaded.name, method="zero", data=_data_name(probe_set, data), metric="cross_entropy",
        baseline_loss=baseline_loss, results=results, n_layers=n_layers, n_heads=n_heads, mode="estimate",
        path=path, baseline_parts=baseline_parts,
        probe_set=probe_set.to_dict() | {"description": probe_set.description},
        seconds=time.perf_counter() - started, forwards=spent,
        terms={head: (float(first_order[head]), float(second_order[head])) for head in heads})


def _check_skip(model: nn.Module, blocks: _Blocks, kept: dict[int, Any] | None, ids: Tensor, mask: Tensor | None,
                scorer: _Scorer, batch_masks: Tensor, expected: Tensor) -> str:
    """'' if short-circuiting the blocks before the last one reproduces the baseline's metric on this batch: a check
    of the prefix reuse that costs one block and the unembedding instead of a full forward."""
    if kept is None:
        return "no block outputs kept"
    last = len(blocks.container) - 1
    skipped = {i: value for i, value in kept.items() if i < last}
    with torch.no_grad(), _skip_blocks(blocks.container, skipped):
        mine = scorer.sums(logits_of(run_model(model, ids, mask)), ids, batch_masks, 1)[0]
    scale = float(expected.abs().max().clamp(min=1.0))
    difference = float((mine - expected).abs().max())
    return "" if difference <= CHECK_TOLERANCE * scale else f"metric differs by {difference:.3g}"

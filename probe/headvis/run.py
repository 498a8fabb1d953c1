"""`head_metrics`: one forward per batch, then a small one of the sampled sequences for the data tree's rows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.headvis.metrics import HeadVisSums, Sequences
from probe.headvis.result import HeadVisMetrics, Sample
from probe.heads.classify import read_batches
from probe.hooks.capture import stream_attention
from probe.hooks.layers import attention_layers
from probe.hooks.types import HookContext
from probe.inputs import ProbeSet, real_tokens
from probe.kernels import DEFAULT_CONFIG, KernelConfig
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, counter, reports
from probe.provenance import model_dtype

PATHS = ("auto", "blocked")
TOP_PER_ROW = 8  # keys kept per query row of a sampled sequence (HeadVis's sparse_topk_per_row)


@reports("headvis metrics")
def head_metrics(loaded: LoadedModel, probe_set: ProbeSet, *, batch_size: int = 8, samples: int = 4,
                 path: str = "auto", progress: ProgressArg = None,
                 config: KernelConfig = DEFAULT_CONFIG) -> HeadVisMetrics:
    """HeadVis's metrics of every head on `probe_set` (right padding). `path` "blocked": eager weights everywhere;
    `samples`: sequences kept for the data tree, spread evenly. Progress in layers of batches."""
    if path not in PATHS:
        raise ProbeError(f"path must be one of {', '.join(PATHS)}, got {path!r}", parameter="path")
    layers = attention_layers(loaded.model)
    if any(layer.stack == "cross" for layer in layers):
        raise ProbeError("headvis reads self-attention: this model has cross-attention layers")
    report = callback(progress)
    batches = probe_set.batches(batch_size)
    sums = HeadVisSums(len(layers), max(layer.n_heads for layer in layers))
    read_batches(loaded, batches, sums, path == "auto", lambda ids, mask: Sequences.of(ids, real_tokens(ids, mask)),
                 counter(report, len(batches) * len(layers)), config=replace(config, moments=True))
    metrics, largest = sums.result()
    counts = sums.counts.long().tolist()
    result = HeadVisMetrics(loaded.name, len(layers), sums.sums.shape[2], model_dtype(loaded), _path_text(sums.paths),
                            probe_set.to_dict() | {"description": probe_set.description},
                            {"sequences": int(largest.shape[0]), "queries": counts[0], "previous": counts[1],
                             "repeated": counts[2]},
                            options={"batch_size": batch_size, "samples": samples, "path": path},
                            metrics={name: value.float() for name, value in metrics.items()},
                            max_activation=largest)
    result.samples = sampled_rows(loaded, probe_set, samples)
    return result


def _path_text(paths: dict[int, str]) -> str:
    """One backend for every layer, or each way with the layers it read."""
    ways: dict[str, list[int]] = {}
    for layer, way in sorted(paths.items()):
        ways.setdefault(way, []).append(layer)
    if len(ways) == 1:
        return next(iter(ways))
    return "; ".join(f"{way}: layers {', '.join(map(str, found))}" for way, found in ways.items())


def sample_indices(probe_set: ProbeSet, count: int) -> list[int]:
    """`count` valid sequences (two tokens at least) spread evenly over the set, first and last included."""
    lengths = real_tokens(probe_set.input_ids, probe_set.attention_mask).sum(dim=1)
    valid = (lengths >= 2).nonzero()[:, 0].tolist()
    if count <= 0 or not valid:
        return []
    picks = np.linspace(0, len(valid) - 1, min(count, len(valid))).round().astype(int)
    return sorted({valid[pick] for pick in picks})


def sampled_rows(loaded: LoadedModel, probe_set: ProbeSet, count: int) -> list[Sample]:
    """The sampled sequences' tokens and top TOP_PER_ROW weights per query row of every head (no whole matrix)."""
    indices = sample_indices(probe_set, count)
    if not indices:
        return []
    ids = probe_set.input_ids[indices]
    mask = None if probe_set.attention_mask is None else probe_set.attention_mask[indices]
    lengths = real_tokens(ids, mask).sum(dim=1).tolist()
    valid_before = (real_tokens(probe_set.input_ids, probe_set.attention_mask).sum(dim=1) >= 2).cumsum(0) - 1
    samples = [Sample(int(valid_before[index]), _token_strings(loaded, ids[row, :lengths[row]].tolist()))
               for row, index in enumerate(indices)]
    parts: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def keep(weights: Tensor, ctx: HookContext) -> None:
        values, keys = weights.topk(min(TOP_PER_ROW, weights.shape[-1]), dim=-1)
        parts.setdefault(ctx.layer, []).append((values.cpu(), keys.cpu()))

    stream_attention(loaded.model, ids, keep, attention_mask=mask)
    for layer, blocks in parts.items():
        values, keys = torch.cat([v for v, _ in blocks], dim=2), torch.cat([k for _, k in blocks], dim=2)
        for row, sample in enumerate(samples):
            length = lengths[row]
            for head in range(values.shape[1]):
                sample.rows[(layer, head)] = (values[row, head, :length].numpy(), keys[row, head, :length].numpy())
    return samples


def _token_strings(loaded: LoadedModel, ids: list[int]) -> list[str]:
    """Each token decoded alone (spaces and punctuation as they render), or its id where there is no tokenizer."""
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        return [str(token) for token in ids]
    return [tokenizer.decode([token]) for token in ids]

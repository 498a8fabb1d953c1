"""Activation patching of every head between a clean and a corrupted run (Vig et al. 2020; Meng et al. 2022; Wang et
al. 2022): denoising patches each head's clean value into the corrupted run, noising the other way. The metric is the
logit difference, each head's effect normalised by `normalised_effect` (1: clean behaviour, 0: corrupted; Heimersheim
& Nanda 2024). A patch is an ablation method the sweep runs (prefix reuse, streaming, resume); a key or value patch
is a key/value group's, reported on each of its query heads."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

import torch
from torch import Tensor

from probe.frames import frame, record_rows
from probe.ablation.heads import Ablation, Head, all_heads, layer_shape
from probe.ablation.methods import PatchAblation, patch_class, patch_method
from probe.ablation.metrics import PATCH_LAYOUTS, Metric
from probe.ablation.results import AblationResult
from probe.ablation.sweep import baseline_metric, sweep, sweep_units
from probe.hooks.layers import attention_layers
from probe.inputs import ProbeSet, normalised_effect
from probe.errors import ProbeError
from probe.hooks.stacks import layer_names
from probe.models import LoadedModel
from probe.progress import Progress, ProgressArg, callback, reports
from probe.provenance import model_dtype
from probe.schemas.base import Field
from probe.schemas.common import (DTYPE, HEAD, HEAD_COLUMNS, LAYER, LAYER_NAMES, MODEL, N_HEADS, N_LAYERS, SECONDS,
                                  SELF_REPAIR)
from probe.schemas.declare import Payload, columns, payload, published, schema_field

Sweep = Callable[..., AblationResult | None]
"""sweep, or probe.distributed.sharded_sweep (same keywords): what runs the patches."""

MAX_TOKENS_PER_POSITION = 3  # distinct tokens a by-position label names before "..."


class PatchEntry(Payload):
    """One head's (or key/value group's) patch: the logit difference with it patched, and its normalised effect."""

    heads: Ablation  # the query heads patched together (a key/value group's, for a key or value patch)

    @payload("the query heads patched together, as [layer, head]", key="heads")
    def head_list(self) -> list[list[int]]:
        return [list(head) for head in self.heads]

    logit_diff: float = schema_field("the logit difference with it patched")
    patch_effect: float = schema_field("1: patching restores the clean behaviour, 0: the corrupt one")
    position: int | None = schema_field("--by-position: the position patched", required=False, omit="none",
                                        default=None)


class PatchHead(Payload, frozen=True):
    """One query head's patch effect (a key or value patch: its group's, with the group's kv_head)."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    patch_effect: float = schema_field("1: patching the head restores the clean behaviour, 0: the corrupt one",
                                       column="the head's patch effect")
    dla: float | None = schema_field("its direct logit attribution on the clean run (null where none)",
                                     column="its DLA on the clean run")
    logit_diff: float = schema_field("the logit difference with it patched", column=True)
    classes: list[str] | None = schema_field("its classes, where they were classified", required=False, omit="none",
                                             column=Field("string", "its classes, comma-separated", required=False),
                                             default=None)
    kv_head: int | None = schema_field("a key or value patch: its key/value group", required=False, column=True,
                                       default=None)


@published("patch", 1, "Activation patching: each head's patch effect between clean and corrupt runs of a contrast set "
           "(probe patch).", rows="one per query head patched", columns=columns(HEAD_COLUMNS, PatchHead),
           sections={"self_repair": SELF_REPAIR})
class PatchResult(Payload):
    """Every head's patch effect, and the logit differences it is normalised by."""

    model: str = schema_field(MODEL)
    component: str = schema_field("what was patched: output, query, key or value")
    direction: str = schema_field("denoising (clean into corrupt) or noising (corrupt into clean)")
    data: str = schema_field("the contrast set")
    clean_logit_diff: float = schema_field("the clean runs' mean logit difference")
    corrupt_logit_diff: float = schema_field("the corrupt runs' mean logit difference")
    n_layers: int = schema_field(N_LAYERS)
    n_heads: int = schema_field(N_HEADS)
    n_kv_heads: int = schema_field("key/value heads per layer")
    entries: list[PatchEntry]

    @payload("one entry per query head patched", items="one head")
    def heads(self) -> list[PatchHead]:
        """One per query head, layer by layer: its (a key or value patch: its group's) effect and logit difference."""
        group, per_group = self.n_heads // max(self.n_kv_heads, 1), patch_class(self.component).per_kv_group
        rows = [PatchHead(layer, head, entry.patch_effect, None if self.dla is None else self.dla[layer][head],
                          entry.logit_diff, self.classes.get((layer, head), []) if self.classes else None,
                          head // group if per_group else None)
                for entry in self.entries for layer, head in entry.heads]
        return sorted(rows, key=lambda row: (row.layer, row.head))

    positions: list[PatchEntry] = schema_field(  # by position: one entry per (unit, position); type= alone: the
        "--by-position: one entry per unit and position", key="by_position", type="array",  # schema names no items
        default_factory=list)
    tokens: list[str] = schema_field("--by-position: each position's tokens",  # over the pairs (by-position axis)
                                     default_factory=list)
    mode: str = schema_field("exact or estimate", default="exact")
    path: str = schema_field("how the numbers were computed", default="")
    seconds: float = schema_field(SECONDS, default=0.0, dump=lambda seconds: round(seconds, 3))
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # docs/precision.md: how far half precision lies
    dla_note: str | None = schema_field("why there is no DLA", required=False, default=None, kw_only=True)
    paths: dict[str, Any] | None = schema_field(  # probe.patching.paths.PathResult.to_dict()
        "--senders/--receivers: the path patching matrix", required=False, default=None, kw_only=True)
    layer_names: list[str] | None = schema_field(LAYER_NAMES, default=None, kw_only=True)
    dla: list[list[float]] | None = field(default=None, kw_only=True)  # (n_layers, n_heads) DLA on the clean run
    classes: dict[Head, list[str]] = field(default_factory=dict, kw_only=True)  # each head's, where classified

    def add_classes(self, labels: Callable[[int, int], list[str]]) -> None:
        """Each head's classes (e.g. `Classification.labels`), shown beside its patch effect."""
        self.classes = {(layer, head): labels(layer, head) for layer in range(self.n_layers)
                        for head in range(self.n_heads)}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per query head patched: the patch schema's columns. Needs pandas."""
        return frame(record_rows(self.heads, self.layer_names))


def patch_units(loaded: LoadedModel, heads: Sequence[Head] | None, component: str) -> list[Ablation]:
    """What is patched one at a time: each query head, or (a key or value) each key/value group's query heads."""
    chosen = list(all_heads(loaded.model) if heads is None else heads)
    if not patch_class(component).per_kv_group:
        return [(head,) for head in chosen]
    layers = attention_layers(loaded.model)
    units: dict[tuple[int, int], list[Head]] = {}
    for layer, head in chosen:
        size = layers[layer].n_heads // max(layers[layer].n_kv_heads, 1)
        group = head // size
        units[(layer, group)] = [(layer, first) for first in range(group * size, (group + 1) * size)]
    return [tuple(unit) for unit in units.values()]


def check_runs(clean: ProbeSet, corrupt: ProbeSet) -> None:
    if any(run.meta.get("layout") not in PATCH_LAYOUTS for run in (clean, corrupt)):
        raise ProbeError("patching compares two runs of prompts, each followed by its answer and distractor: make "
                         "them with probe.patching.contrast_runs", parameter="clean")
    same_scored = torch.equal(torch.as_tensor(clean.scored), torch.as_tensor(corrupt.scored))
    if clean.input_ids.shape != corrupt.input_ids.shape or not same_scored:
        raise ProbeError(f"the clean and corrupted runs need the same rows and token lengths, got "
                         f"{tuple(clean.input_ids.shape)} and {tuple(corrupt.input_ids.shape)}", parameter="corrupt")


def _tokens(loaded: LoadedModel, probe_set: ProbeSet) -> list[str]:
    """The by-position axis: each position's token over the rows (where they differ, the commonest few '/'-joined)."""
    decode = (lambda token: str(token)) if loaded.tokenizer is None else (
        lambda token: loaded.tokenizer.decode([token]))
    mask = probe_set.attention_mask
    labels = []
    for position in range(probe_set.input_ids.shape[1]):
        column = probe_set.input_ids[:, position]
        present = column if mask is None else column[mask[:, position].bool()]
        counts = Counter(decode(token) for token in present.tolist())
        common = [token for token, _ in counts.most_common(MAX_TOKENS_PER_POSITION)]
        labels.append("/".join(common) + ("/..." if len(counts) > MAX_TOKENS_PER_POSITION else ""))
    return labels


def _entries(swept: AblationResult, clean_ld: float, corrupt_ld: float, position: int | None) -> list[PatchEntry]:
    """Each unit's patched logit difference and its normalised effect (refused where the runs' are too close)."""
    return [PatchEntry(result.heads, result.task["margin"],
                       normalised_effect(result.task["margin"], clean_ld, corrupt_ld), position)
            for result in swept.results]


def _in_parts(progress: Progress | None, parts: int) -> Callable[[int], Progress | None]:
    """Part `index`'s `(done, total)` callback for `parts` sweeps of one set of units, run one after the other, as
    one count: the finished parts' work, then this part's, the parts still to come counted as this one's total."""
    finished, latest = [0], [0]

    def part(index: int) -> Progress | None:
        if progress is None or parts == 1:
            return progress
        report = progress
        finished[0] += latest[0]  # the part before this one is done: its last total is its work
        latest[0] = 0

        def tick(done: int, total: int) -> None:
            latest[0] = total
            report(finished[0] + done, finished[0] + total * (parts - index))
        return tick
    return part


def _by_position(loaded: LoadedModel, target: ProbeSet, units: list[Ablation], method: PatchAblation,
                 logit_diffs: tuple[float, float], mode: str, batch_size: int,
                 part: Callable[[int], Progress | None]) -> list[PatchEntry]:
    """Every unit patched at each position alone: one sweep per position, parts 1, 2, ... of the progress."""
    entries = []
    for position in range(target.input_ids.shape[1]):
        swept = sweep_units(loaded, target, units, method=method.at(position), mode=mode, batch_size=batch_size,
                            progress=part(position + 1))
        assert swept is not None  # a plain sweep always reports
        entries += _entries(swept, *logit_diffs, position)
    return entries


@reports("patching heads")
def patch_heads(loaded: LoadedModel, clean: ProbeSet, corrupt: ProbeSet, heads: Sequence[Head] | None = None, *,
                component: str = "output", noising: bool = False, by_position: bool = False, mode: str = "exact",
                batch_size: int = 8, data: str = "", run: Sweep = sweep, progress: ProgressArg = None,
                **options: Any) -> PatchResult | None:
    """Patch each head (a key or value: each key/value group) between the clean and corrupted runs, denoising by
    default, with `by_position` also each position alone. `run` is the sweep (sharded under torchrun), `options` go
    to it; None on a torchrun process that does not report. `progress`: a bar, or a callable of `(done, total)`."""
    started = time.perf_counter()
    check_runs(clean, corrupt)
    target, source = (clean, corrupt) if noising else (corrupt, clean)
    method = patch_method(loaded, source, component, batch_size=batch_size)
    units = patch_units(loaded, heads, component)
    source_ld = mean_logit_diff(baseline_metric(loaded, source, batch_size=batch_size))
    part = _in_parts(callback(progress), 1 + (target.input_ids.shape[1] if by_position else 0))
    swept = sweep_units(loaded, target, units, run, method=method, mode=mode, batch_size=batch_size, data=data,
                        progress=part(0), **options)
    if swept is None:
        return None
    target_ld = mean_logit_diff((swept.baseline_loss, swept.task))
    clean_ld, corrupt_ld = (target_ld, source_ld) if noising else (source_ld, target_ld)
    entries = _entries(swept, clean_ld, corrupt_ld, None)
    positions = _by_position(loaded, target, units, method, (clean_ld, corrupt_ld), mode, batch_size, part) \
        if by_position else []
    layers = attention_layers(loaded.model)
    return PatchResult(loaded.name, component, "noising" if noising else "denoising", data or clean.description,
                       clean_ld, corrupt_ld, *layer_shape(layers), max(layer.n_kv_heads for layer in layers), entries,
                       positions, _tokens(loaded, clean) if by_position else [], swept.mode, swept.path,
                       time.perf_counter() - started, layer_names=layer_names(layers), dtype=model_dtype(loaded))


def row_logit_diffs(metric: Metric, logits: Tensor, ids: Tensor, scored: Tensor | None) -> Tensor:
    """(rows,) each row's logit difference at its scored position: the logit_diff metric's value."""
    assert scored is not None  # a task set's answers: patching's runs mark them
    values = metric.values(logits, ids, None)  # (batch, positions - 1), or a classifier's (batch, 2 x classes)
    return -(values * scored[:, :values.shape[1]].to(values.device)).sum(dim=1)


def mean_logit_diff(measured: tuple[float, dict[str, float] | None]) -> float:
    """The mean logit difference of a measurement (the logit_diff metric's margin)."""
    _, task = measured
    assert task is not None
    return task["margin"]

"""Self-repair per head: what ablating a head costs in total, through its own direct path to the logits, and which
later components make up the difference (McGrath et al. 2023; Rushing and Nanda 2024), read through the final norm
frozen at the clean run.

total: the change of the score (logit difference, or the next token's log-likelihood), minus the sweep's delta;
direct: the head's replaced output minus its clean output through W_O, the frozen norm and the unembedding alone;
self-repair = total - direct (> 0: the rest makes up for the head), split into later heads' compensation
(`by_heads`), the MLPs' (`by_mlps`) and the norm's rescaling (`by_norm`), which sum to it exactly on a contrast set."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.frames import frame, head_name, record_rows
from probe.ablation.blocks import CHECK_TOLERANCE, keeping_outputs, skip_blocks
from probe.ablation.heads import Head
from probe.ablation.methods import AblationMethod, build_method
from probe.ablation.runners import batch_contexts
from probe.errors import ProbeError
from probe.hooks.capture import attention_hooks
from probe.hooks.points import Writer
from probe.hooks.run import logits_of, run_model
from probe.hooks.types import BatchContext, HookContext
from probe.inputs import ContrastSet, ProbeSet
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, reports
from probe.provenance import model_dtype
from probe.residual import (FrozenNorm, Recording, Structure, Targets, check_stream, final_read, head_shares,
                            mlp_shares, model_structure, one_head_count, record_writes)
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, N_HEADS, N_LAYERS
from probe.schemas.declare import Payload, columns, payload, published, schema_field

SELF_REPAIR_METHODS = ("zero", "mean")
LOGIT_DIFF = "logit difference"
LIKELIHOOD = "log-likelihood of the next token"
COMPENSATING = 3  # later heads listed per ablated head
REPAIR_FLOOR = 0.05  # `repaired` (self-repair / -direct) only where |direct| is this share of the largest |direct|:
# a head with almost no direct effect has total - direct = its indirect effect, not a repair of anything


@dataclass
class _Clean:
    """One batch's clean run at its read points: the frozen read vector and every share through it."""

    targets: Targets
    read: Tensor  # (points, d_model) float64: what a write is dotted with
    heads: Tensor  # (points, n_layers, n_heads)
    mlps: Tensor  # (points, n_blocks)
    score: Tensor  # (points,) float64: the model's own score (logit difference, or log-likelihood)
    logit: Tensor  # (points,) float64: the scored logit (difference) the shares sum to
    norm: FrozenNorm
    logits: Tensor | None  # (points, vocab) float32: natural text only, what the direct effect adds to
    recording: Recording  # every write of the clean run at the read points
    kept: dict[int, Any]  # block -> its output (what an ablated run starts from)


@dataclass
class _Sums:
    """Per ablated head, sums over points (divided by the point count at the end)."""

    total: Tensor
    direct: Tensor
    by_norm: Tensor
    by_mlps: Tensor
    compensation: Tensor  # (ablated, n_layers, n_heads)
    points: int = 0

    @classmethod
    def zeros(cls, count: int, n_layers: int, n_heads: int) -> _Sums:
        zero = torch.zeros(count, dtype=torch.float64)
        return cls(zero.clone(), zero.clone(), zero.clone(), zero.clone(),
                   torch.zeros(count, n_layers, n_heads, dtype=torch.float64))


def _likelihood(logits: Tensor, answer: Tensor) -> Tensor:
    """(points,) float64 log P(answer) under (points, vocab) logits."""
    return logits.float().log_softmax(dim=-1).gather(-1, answer.to(logits.device)[:, None])[:, 0].double().cpu()


def _score(targets: Targets, logits: Tensor) -> Tensor:
    """The score of each point: the logit difference, or the next token's log-likelihood (no distractor)."""
    return targets.scored(logits.double().cpu()) if targets.distractor is not None else _likelihood(
        logits, targets.answer)


def _forward(loaded: LoadedModel, structure: Structure, ids: Tensor, mask: Tensor | None, targets: Targets,
             edit: Writer | None, *, keep: dict[int, Any] | None = None,
             skip: dict[int, Any] | None = None) -> tuple[Recording, Tensor]:
    """One forward, `edit` applied to the heads' outputs, every write recorded at the read points; the logits there.
    `keep`: every block's output kept; `skip`: those blocks return the given value instead of running."""
    recording = Recording(targets)
    positions = torch.unique(targets.positions)  # the LM head runs at these alone (the IOI prompts' last ones)

    def heads(z: Tensor, ctx: HookContext) -> Tensor:
        return recording.edit_heads(z if edit is None else edit(z, ctx), ctx)

    with ExitStack() as scope:
        scope.enter_context(torch.no_grad())
        scope.enter_context(record_writes(structure, recording))
        scope.enter_context(attention_hooks(loaded.model, points={"z": heads}))
        if keep is not None:
            scope.enter_context(keeping_outputs(structure.blocks, keep))
        if skip:
            scope.enter_context(skip_blocks(structure.blocks.container, skip))
        output = run_model(loaded.model, ids, mask, logits=positions if len(positions) < ids.shape[1] else True)
    logits = logits_of(output)
    if logits.shape[1] == ids.shape[1]:
        return recording, recording.at(logits)
    at = torch.searchsorted(positions, targets.positions).to(logits.device)  # the kept positions' logits only
    return recording, logits[targets.rows.to(logits.device), at].detach()


def _clean(loaded: LoadedModel, structure: Structure, ids: Tensor, mask: Tensor | None,
           targets: Targets) -> _Clean:
    """The clean run of one batch, decomposed through its own frozen norm (its stream checked as DLA checks it)."""
    kept: dict[int, Any] = {}
    recording, logits = _forward(loaded, structure, ids, mask, targets, None, keep=kept)
    check_stream(structure, recording)
    norm, _, read = final_read(structure, recording)
    heads, _ = head_shares(structure, recording, read)
    return _Clean(targets, read, heads, mlp_shares(structure, recording, read), _score(targets, logits),
                  targets.scored(logits.double().cpu()), norm,
                  None if targets.distractor is not None else logits.float(), recording, kept)


def _ablating(method: AblationMethod, layer: int, head: int, batch: BatchContext) -> Writer:
    """A `z` writer replacing head `head` of `layer` as the method's own writer does, told the batch that runs."""
    write = method.writer([head])

    def edit(z: Tensor, ctx: HookContext) -> Tensor:
        return write(z, dataclasses.replace(ctx, batch=batch)) if ctx.layer == layer else z
    return edit


@dataclass
class _Prefix:
    """Whether ablated runs start at the head's block from the clean run's kept outputs (checked once, as in sweeps)."""

    checked: bool = False
    reason: str | None = None  # why the ablated runs are full forwards (None: they start at the head's block)

    @property
    def path(self) -> str:
        return ("exact: each ablated run starts at its head's block" if self.reason is None else
                f"full forwards ({self.reason})")

    def run(self, loaded: LoadedModel, structure: Structure, ids: Tensor, mask: Tensor | None, clean: _Clean,
            edit: Writer, layer: int) -> tuple[Recording, Tensor]:
        """The ablated forward, its writes before the start block taken from the clean run (they are unchanged)."""
        start = structure.blocks.of_layer[layer]
        if self.reason is not None or start == 0:
            return _forward(loaded, structure, ids, mask, clean.targets, edit)
        recording, logits = _forward(loaded, structure, ids, mask, clean.targets, edit,
                                     skip={index: clean.kept[start - 1] for index in range(start)})
        if not self.checked:
            self.checked = True
            full, expected = _forward(loaded, structure, ids, mask, clean.targets, edit)
            gap = float((logits.float() - expected.float()).abs().max())
            if gap > CHECK_TOLERANCE * max(1.0, float(expected.float().abs().max())):
                self.reason = f"starting at a block differs from a full forward by {gap:.3g}"
                return full, expected
        for block in range(start):
            recording.mlp[block] = clean.recording.mlp[block]
        for position, each in enumerate(structure.layers):
            if structure.blocks.of_layer[position] < start:
                recording.heads[each.index] = clean.recording.heads[each.index]
        return recording, logits


def _add_ablation(sums: _Sums, index: int, structure: Structure, clean: _Clean, ablated: Recording,
                  logits: Tensor, head: Head) -> None:
    """Add one ablated forward's numbers at its batch's points to `sums[index]`."""
    layer, h = head
    shares, _ = head_shares(structure, ablated, clean.read)
    change = shares - clean.heads  # (points, n_layers, n_heads), through the clean run's frozen norm
    mlps = (mlp_shares(structure, ablated, clean.read) - clean.mlps).sum(dim=1)
    logit = clean.targets.scored(logits.double().cpu()) - clean.logit
    direct = change[:, layer, h]
    if clean.logits is not None:  # text: the log-likelihood change of the head's write added to the clean stream
        z_change = (ablated.heads[layer][:, h] - clean.recording.heads[layer][:, h]).double().cpu()
        weight = structure.head.weight.detach()
        normed = clean.norm.apply(z_change @ structure.head_matrix(layer)[h]).to(device=weight.device,
                                                                                  dtype=torch.float32)
        direct = _likelihood(clean.logits + normed @ weight.float().T, clean.targets.answer) - clean.score
    sums.total[index] += float((_score(clean.targets, logits) - clean.score).sum())
    sums.direct[index] += float(direct.sum())
    sums.by_mlps[index] += float(mlps.sum())
    sums.by_norm[index] += float((logit - change.sum(dim=(1, 2)) - mlps).sum())
    sums.compensation[index] += change.sum(dim=0)


def _check(loaded: LoadedModel, method: str, heads: Sequence[Head] | None, top: int) -> tuple[Structure, list[Head]]:
    """The model's structure and the heads to ablate; ProbeError (one line) for what cannot be run."""
    if method not in SELF_REPAIR_METHODS:
        raise ProbeError(f"self-repair ablates a head by {' or '.join(SELF_REPAIR_METHODS)}, not {method!r}: the "
                         "direct effect needs one replacement per head", parameter="method")
    if top < 1:
        raise ProbeError(f"top must be at least 1, got {top}", parameter="top")
    structure = one_head_count(model_structure(loaded.model), "self-repair")
    every = [(layer.index, h) for layer in structure.layers for h in range(layer.n_heads)]
    chosen = every if heads is None else [tuple(head) for head in heads]
    missing = [head for head in chosen if head not in every]
    if missing:
        raise ProbeError(f"no head {missing[0][0]}.{missing[0][1]} in this model", parameter="heads")
    return structure, chosen  # type: ignore[return-value]


def _measure(loaded: LoadedModel, probe_set: ProbeSet, targets: Targets, method: str, heads: Sequence[Head] | None,
             batch_size: int, top: int, progress: ProgressArg) -> tuple[_Sums, list[Head], str, str]:
    """Every chosen head ablated alone on every batch of `probe_set` (the sweep's batches): the sums over points."""
    structure, chosen = _check(loaded, method, heads, top)
    contexts = batch_contexts(probe_set, batch_size)  # the sweep's batches, the method bound to them as it binds
    ablation = build_method(method, loaded, probe_set, batch_size=batch_size).bound_to(contexts)
    batches = probe_set.batches(batch_size)
    n_heads = structure.layers[0].n_heads
    sums = _Sums.zeros(len(chosen), len(structure.layers), n_heads)
    tick, done, prefix = callback(progress), 0, _Prefix()
    for index, (ids, mask) in enumerate(batches):
        rows = slice(index * batch_size, index * batch_size + ids.shape[0])
        part = targets.subset(rows)
        if not len(part.rows):
            continue
        clean = _clean(loaded, structure, ids, mask, part)
        sums.points += len(part.rows)
        for number, (layer, h) in enumerate(chosen):
            edit = _ablating(ablation, layer, h, contexts[index])
            ablated, logits = prefix.run(loaded, structure, ids, mask, clean, edit, layer)
            _add_ablation(sums, number, structure, clean, ablated, logits, (layer, h))
            done += 1
            if tick is not None:
                tick(done, len(batches) * len(chosen))
    if not sums.points:
        raise ProbeError("no position to read the logits at", parameter="targets")
    return sums, chosen, ablation.describe() or "", prefix.path


class RepairedHead(Payload, frozen=True):
    """One ablated head: its total and direct effects, the self-repair between them and its parts."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    total: float = schema_field("the score's change with the head ablated", column=True)
    direct: float = schema_field("its own path to the logits, the final norm frozen at the clean run",
                                 column="its direct effect")
    self_repair: float = schema_field("total - direct", column=True)
    repaired: float | None = schema_field("self_repair / -direct (null below the repair floor)",
                                          column="self_repair / -direct (null below the floor)")
    by_heads: float = schema_field("later heads' DLA change", column=True)
    by_mlps: float = schema_field("the MLPs'", column="the MLPs' change")
    by_norm: float = schema_field("the final norm's rescaling", column=True)
    compensating: list[dict[str, Any]] = schema_field(
        "the other heads whose DLA moved most against the direct effect", items=Field(
            "object", "a head and its DLA change"), column=Field(
            "string", "the compensating heads and their DLA change: 'L1H3 -0.011, ...'"))


@published("self-repair", 1, "Per ablated head: its total effect, its direct effect, and the self-repair between them, "
           "split into later heads', MLPs' and the final norm's share (probe dla / probe patch --self-repair, the "
           "self_repair section).", rows="one per ablated head, largest |direct| first",
           columns=columns(HEAD_COLUMNS, RepairedHead))
class SelfRepair(Payload):
    """Per ablated head, means over the read points (module docstring): total, direct, self_repair and its parts, and
    each later head's compensation (n_layers, n_heads)."""

    model: str = schema_field(MODEL)
    source: str = schema_field("what it was measured on")
    metric: str = schema_field("logit difference, or the next token's log-likelihood on text")  # LIKELIHOOD on text
    method: str = schema_field("zero or mean ablation")
    reference: str = schema_field("what the mean ablation's means were taken over ('' for zero)", default="",
                                  kw_only=True)
    dtype: str = schema_field(DTYPE)
    points: int = schema_field("positions (or pairs) averaged over")

    @payload(N_LAYERS.description)
    def n_layers(self) -> int:
        return int(self.compensation.shape[1])

    @payload(N_HEADS.description)
    def n_heads(self) -> int:
        return int(self.compensation.shape[2])

    unit: str = schema_field("the unit of the compensation columns", key="compensation_unit", default="",
                             kw_only=True)  # what compensation is measured in
    path: str = schema_field("how the ablated runs were computed", default="", kw_only=True)  # _Prefix.path

    @payload("`repaired` is shown where |direct| is at least this share of the largest")
    def repair_floor(self) -> float:
        return REPAIR_FLOOR

    @payload("one entry per ablated head, largest |direct| first", key="heads", items="one head")
    def entries(self) -> list[RepairedHead]:
        """One per ablated head, largest |direct| first (the heads whose own path matters most)."""
        return [self.entry(index) for index in self.direct.abs().argsort(descending=True).tolist()]

    heads: list[Head]
    total: Tensor  # (ablated,)
    direct: Tensor
    by_mlps: Tensor
    by_norm: Tensor
    compensation: Tensor  # (ablated, n_layers, n_heads)
    top: int = field(default=COMPENSATING, kw_only=True)

    @property
    def self_repair(self) -> Tensor:
        return self.total - self.direct

    @property
    def by_heads(self) -> Tensor:
        """(ablated,) every other head's compensation, summed."""
        own = torch.stack([self.compensation[i, layer, h] for i, (layer, h) in enumerate(self.heads)])
        return self.compensation.sum(dim=(1, 2)) - own

    def compensating(self, index: int, count: int | None = None) -> list[tuple[int, int, float]]:
        """The `count` other heads whose DLA moved most against the ablated head's direct effect."""
        sign = -1.0 if float(self.direct[index]) > 0 else 1.0
        toward = self.compensation[index] * sign
        toward[self.heads[index]] = float("-inf")
        order = toward.flatten().argsort(descending=True)[:count or self.top]
        width, values = toward.shape[1], self.compensation[index].flatten()
        return [(*divmod(int(i), width), float(values[i])) for i in order if toward.flatten()[i] > 0]

    def entry(self, index: int) -> RepairedHead:
        """One ablated head's numbers, its compensating heads, and `repaired` = self-repair / -direct."""
        layer, head = self.heads[index]
        direct, repair = float(self.direct[index]), float(self.self_repair[index])
        floor = REPAIR_FLOOR * float(self.direct.abs().max())
        return RepairedHead(layer, head, float(self.total[index]), direct, repair,
                            repair / -direct if abs(direct) > max(floor, 1e-9) else None,
                            float(self.by_heads[index]), float(self.by_mlps[index]), float(self.by_norm[index]),
                            [{"layer": at, "head": h, "value": v} for at, h, v in self.compensating(index)])

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per ablated head, largest |direct| first: the self-repair schema's columns."""
        entries = self.entries
        rows = record_rows(entries)
        for row, entry in zip(rows, entries):
            row["compensating"] = ", ".join(f"{head_name(item['layer'], item['head'])} {item['value']:+.3g}"
                                            for item in entry.compensating)
        return frame(rows)


def _result(loaded: LoadedModel, source: str, metric: str, method: str,
            measured: tuple[_Sums, list[Head], str, str], top: int) -> SelfRepair:
    sums, heads, reference, path = measured
    n = sums.points
    unit = LOGIT_DIFF if metric == LOGIT_DIFF else "logit of the next token"
    return SelfRepair(loaded.name, source, metric, method, model_dtype(loaded), n, heads, sums.total / n,
                      sums.direct / n, sums.by_mlps / n, sums.by_norm / n, sums.compensation / n, reference=reference,
                      top=top, unit=unit, path=path)


@reports("self-repair")
def contrast_self_repair(loaded: LoadedModel, contrast: ContrastSet, heads: Sequence[Head] | None = None, *,
                         method: str = "zero", batch_size: int = 8, top: int = COMPENSATING,
                         progress: ProgressArg = None) -> SelfRepair:
    """Self-repair of the logit difference at each pair's last prompt position, on the clean prompts."""
    from probe.patching.runs import contrast_runs

    if contrast.classes is not None:
        raise ProbeError("self-repair reads a language model's unembedding; a classifier's pooler and head are not "
                         "decomposed", parameter="contrast")
    clean, _ = contrast_runs(loaded, contrast)
    measured = _measure(loaded, clean, Targets.of_contrast(contrast), method, heads, batch_size, top, progress)
    return _result(loaded, contrast.description, LOGIT_DIFF, method, measured, top)


@reports("self-repair")
def text_self_repair(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head] | None = None, *,
                     method: str = "zero", batch_size: int = 8, top: int = COMPENSATING,
                     progress: ProgressArg = None) -> SelfRepair:
    """Self-repair of the next token's log-likelihood at every position of natural text the cross-entropy counts."""
    targets = Targets.next_tokens(probe_set.input_ids, probe_set.attention_mask)
    measured = _measure(loaded, probe_set, targets, method, heads, batch_size, top, progress)
    return _result(loaded, probe_set.description, LIKELIHOOD, method, measured, top)

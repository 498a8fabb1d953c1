"""Every head's dashboard from what the stages measured: plain numbers copied from each stage's own result (nothing
computed twice), the evidence facts, each label judged by its class's rule (probe.heads.evidence), what the head
writes (its OV circuit through the unembedding) and its composition partners (Elhage et al. 2021)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from probe.ablation.results import AblationResult, HeadResult
from probe.atlas.examples import Activity, Example, attended_tokens
from probe.atlas.result import HEADVIS, Atlas, Stage
from probe.circuits.composition import Composition, embedding_matrices, layer_weights
from probe.dla import Attribution
from probe.errors import ProbeError
from probe.heads.classify import Classification
from probe.headvis import HeadVisMetrics
from probe.heads.evidence import RULES, TOP_PARTNERS, HeadFacts, Partner, judge, rule_for
from probe.heads.scores import SCORES
from probe.hooks.layers import attention_layers
from probe.models import LoadedModel
from probe.patterns import Patterns, token_strings
from probe.schemas.common import rounded
from probe.selfrepair import SelfRepair

STATUS_ORDER = ("confirmed", "partial", "unchecked", "pattern_only")
PROMOTED = 6  # tokens listed per attended token


def partners(composition: Composition, layer: int, head: int) -> tuple[list[Partner], list[Partner]]:
    """(feeders, readers): the TOP_PARTNERS strongest heads composing into this head, and those it composes into."""
    feeders: list[Partner] = []
    readers: list[Partner] = []
    for kind in composition.scores:
        table = composition.scores[kind]
        into = table[:layer, :, layer, head].nan_to_num(-1.0).flatten()  # (earlier layers * heads)
        for index in into.argsort(descending=True)[:TOP_PARTNERS].tolist():
            if float(into[index]) > 0:
                earlier, its_head = divmod(index, table.shape[1])
                feeders.append(Partner(earlier, its_head, kind, float(into[index])))
        out = table[layer, head, layer + 1:].nan_to_num(-1.0).flatten()
        for index in out.argsort(descending=True)[:TOP_PARTNERS].tolist():
            if float(out[index]) > 0:
                later, other = divmod(index, table.shape[3])
                readers.append(Partner(layer + 1 + later, other, kind, float(out[index])))
    readers.sort(key=lambda p: -p.score)
    return feeders, readers[:TOP_PARTNERS]


class OVReader:
    """Each layer's OV matrices and the embedding and unembedding, read once."""

    def __init__(self, model: nn.Module, tokens: Any) -> None:
        self.W_E, self.W_U = embedding_matrices(model)
        self.layers = [layer_weights(model, layer) for layer in attention_layers(model)]
        self.tokens = tokens  # ids -> visible strings

    def writes(self, layer: int, head: int, attended: list[int]) -> list[dict[str, Any]]:
        """For each attended id, the tokens whose logits the head's output raises most when it copies that id."""
        weights = self.layers[layer]
        out = []
        for token in attended:
            direction: Tensor = (self.W_E[token].double() @ weights.W_V[head] @ weights.W_O[head]).float()
            logits = direction @ self.W_U
            top = logits.topk(min(PROMOTED, logits.numel()))
            out.append({"token": self.tokens([token])[0], "promotes": [
                {"token": text, "logit": round(float(value), 4)}
                for text, value in zip(self.tokens(top.indices.tolist()), top.values)]})
        return out



@dataclass
class Measured:
    """What the stages returned (None: skipped or not asked for)."""

    classes: Classification
    ablation: AblationResult
    parts: dict[str, AblationResult]
    task: AblationResult | None
    composition: Composition | None
    copying: Tensor | None
    examples: tuple[Activity, dict[tuple[int, int], list[Example]]] | None  # None: W_O unreadable
    dla: Attribution | None
    fast: bool
    self_repair: SelfRepair | None = None  # the self_repair stage, where it ran
    headvis: HeadVisMetrics | None = None  # the headvis stage, where it ran


def _by_head(result: AblationResult | None) -> dict[tuple[int, int], HeadResult]:
    return {} if result is None else {(r.layer, r.head): r for r in result.heads}


def _facts(measured: Measured, layer: int, head: int, found: tuple[list[Partner], list[Partner]],
           flagged: dict[str, set[tuple[int, int]]], ablated: HeadResult | None) -> HeadFacts:
    parts: dict[str, float] = {}
    for result in measured.parts.values():
        entry = _by_head(result).get((layer, head))
        if entry is not None:
            parts.update(entry.part_deltas)
    copying = None if measured.copying is None else rounded(measured.copying[layer, head])
    baseline = None if measured.composition is None else measured.composition.baseline
    return HeadFacts(layer, head, set(measured.classes.labels(layer, head)), None if ablated is None else ablated.delta,
                     parts, copying, found[0], found[1], baseline, flagged,
                     estimated=measured.fast and ablated is not None and not ablated.exact)


def _labels(measured: Measured, facts: HeadFacts) -> list[dict[str, Any]]:
    """The head's classes: score, threshold, the probe set that earned it, and the evidence for it."""
    classes = measured.classes
    out: list[dict[str, Any]] = []
    for name in classes.labels(facts.layer, facts.head):
        probe = SCORES[name].probe if name in SCORES else "natural"
        out.append({"class": name, "score": rounded(classes.scores[name][facts.layer, facts.head]),
                    "threshold": classes.thresholds[name], "probe_set": probe, "evidence": judge(name, facts)})
    out.sort(key=lambda label: (STATUS_ORDER.index(label["evidence"]["status"]),
                                -len(label["evidence"]["supported_by"]), -(label["score"] or 0)))
    return out


def _effects(result: HeadResult | None, estimated: bool) -> dict[str, Any] | None:
    if result is None:
        return None
    return {"delta": rounded(result.delta), "estimated": estimated and not result.exact, **result.effects,
            "parts": {name: rounded(value) for name, value in result.part_deltas.items()}}


def _repair(measured: Measured, layer: int, head: int) -> dict[str, Any] | None:
    result = measured.self_repair
    if result is None or (layer, head) not in result.heads:
        return None
    return result.entry(result.heads.index((layer, head))).to_dict()


def _metrics(measured: Measured, facts: HeadFacts, activity: Activity | None, ablated: HeadResult | None,
             task: HeadResult | None) -> dict[str, float | None]:
    layer, head = facts.layer, facts.head
    repair = _repair(measured, layer, head)
    effects = ablated.effects if ablated is not None else {}
    nonfirst = None if activity is None else activity.nonfirst[:, :, layer, head][activity.valid]
    out = {f"{name}_score": rounded(score[layer, head]) for name, score in measured.classes.scores.items()}
    out.update({
        "delta": facts.delta, "specificity": rounded(effects.get("specificity")),
        "max_token_delta": rounded(effects.get("max_token_delta")),
        "second_repeat_delta": rounded(facts.parts.get("second_repeat")),
        "task_delta": None if task is None else rounded(task.delta), "copying": facts.copying,
        "dla": None if measured.dla is None else rounded(measured.dla.per_head[layer, head]),
        "output_norm": None if activity is None else rounded(activity.mean_norms()[layer, head]),
        "nonfirst_attention": rounded(nonfirst.mean()) if nonfirst is not None and nonfirst.numel() else None,
        "k_in": rounded(max((p.score for p in facts.feeders if p.kind == "k"), default=None)),
        "out": rounded(max((p.score for p in facts.readers), default=None)),
        "self_repair": None if repair is None else rounded(repair["self_repair"]),
    })
    if measured.headvis is not None:
        out.update({HEADVIS + name: rounded(value[layer, head]) for name, value in measured.headvis.metrics.items()})
    return out


def _reader(loaded: LoadedModel) -> OVReader | None:
    try:
        return OVReader(loaded.model, lambda ids: token_strings(loaded, ids))
    except ProbeError:
        return None  # no embeddings or LM head: the copying stage says why


def _head(measured: Measured, reader: OVReader | None, layer: int, head: int,
          flagged: dict[str, set[tuple[int, int]]]) -> dict[str, Any]:
    activity, chosen = measured.examples or (None, {})
    found = partners(measured.composition, layer, head) if measured.composition is not None else ([], [])
    ablated, task = (_by_head(result).get((layer, head)) for result in (measured.ablation, measured.task))
    facts = _facts(measured, layer, head, found, flagged, ablated)
    labels = _labels(measured, facts)
    examples = chosen.get((layer, head), [])
    return {
        "layer": layer, "head": head, "classes": labels,
        "status": labels[0]["evidence"]["status"] if labels else "none",  # the best-supported label's
        "pattern": labels[0]["probe_set"] if labels else "natural",
        "metrics": _metrics(measured, facts, activity, ablated, task),
        "examples": [example.to_dict() for example in examples],
        "writes": None if reader is None else reader.writes(layer, head, attended_tokens(examples)),
        "partners": {"feeders": [p.to_dict() for p in found[0]], "readers": [p.to_dict() for p in found[1]]},
        "effects": _effects(ablated, measured.fast),
        "task": None if task is None else {"delta": rounded(task.delta),
                                           **{k: rounded(v) for k, v in task.task.items()}},
        "self_repair": _repair(measured, layer, head),
    }


def assemble(loaded: LoadedModel, measured: Measured, settings: dict[str, Any], stages: list[Stage],
             patterns: dict[str, Patterns]) -> Atlas:
    """The Atlas of every head (see the module docstring)."""
    classes = measured.classes
    flagged = {name: {(layer, h) for layer, h, _ in classes.flagged(name)} for name in classes.scores}
    reader = _reader(loaded) if measured.copying is not None else None
    heads = [_head(measured, reader, layer, head, flagged)
             for layer in range(classes.n_layers) for head in range(classes.n_heads)]
    described = {name: {**info, "threshold": classes.thresholds[name], "rule": rule_for(name).describe()}
                 for name, info in classes.to_dict()["classes"].items()}
    settings = {**settings, "baseline_loss": measured.ablation.baseline_loss, "sweep_path": measured.ablation.path,
                "task_baseline": None if measured.task is None else measured.task.task,
                "composition_baseline": None if measured.composition is None else measured.composition.baseline,
                "dla_residual": None if measured.dla is None else measured.dla.residual, "dtype": classes.dtype,
                "self_repair": None if measured.self_repair is None else {
                    "metric": measured.self_repair.metric, "method": measured.self_repair.method,
                    "compensation_unit": measured.self_repair.unit, "path": measured.self_repair.path},
                "rules": sorted(RULES)}
    return Atlas(loaded.name, classes.n_layers, classes.n_heads, heads, described, settings, stages, patterns,
                 layer_names=classes.layer_names)

"""`circuits`: induction heads and the earlier heads that feed their keys (Elhage et al. 2021; Olsson et al. 2022),
ranked by K-composition, then checked on the repeated set: if the earlier head feeds the induction head, ablating it
alone already hurts induction, and ablating both costs less than the two costs added (interaction < 0)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from probe.frames import frame, head_columns, head_name
from probe.ablation.heads import Head
from probe.ablation.sweep import sweep
from probe.circuits.composition import UNIT, Composition, composition_scores
from probe.inputs import DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, ProbeOptions, ProbeSet, build_probe_set
from probe.heads.classify import Classification, classify
from probe.models import LoadedModel
from probe.provenance import model_dtype
from probe.progress import Progress, StageProgressArg, reports, callback, stage_tick
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, SECONDS
from probe.schemas.declare import Payload, payload, published, schema_field

CLASSES = ("previous_token", "induction")
STAGE_UNITS = {"K-composition": UNIT}  # the stages whose units mean something to a user
_rounded = partial(round, ndigits=6)


class Feeder(Payload):
    """An earlier head and its K-composition into one induction head."""

    head: Head

    @payload(LAYER, key="layer")
    def layer_index(self) -> int:
        return self.head[0]

    @payload(HEAD, key="head")
    def head_index(self) -> int:
        return self.head[1]

    score: float = schema_field("its K-composition into the induction head", key="k_composition", dump=_rounded)
    rank_in_layer: int = schema_field("1: the strongest of its layer")
    previous_token: bool = schema_field("whether it is a previous-token head")


class Pair(Payload):
    """An induction head, its strongest feeders, and the causal check with its strongest feeder."""

    induction: Head

    @payload(LAYER)
    def layer(self) -> int:
        return self.induction[0]

    @payload(HEAD)
    def head(self) -> int:
        return self.induction[1]

    induction_score: float = schema_field("its induction score", dump=_rounded)
    feeders: list[Feeder] = schema_field(  # type= alone: the schema declares no items here (Feeder's fields)
        "its strongest K-composing feeders", type="array")
    checked: Head | None = None  # the feeder ablated with it (the strongest previous-token feeder, else the top one)

    @payload("the feeder ablated with it", key="checked")
    def checked_head(self) -> dict[str, int] | None:
        return None if self.checked is None else {"layer": self.checked[0], "head": self.checked[1]}

    deltas: dict[str, float] = schema_field(  # "feeder", "induction", "together": second-copy deltas
        "feeder, induction, together: second-copy loss deltas", key="second_copy_deltas", default_factory=dict,
        dump=lambda deltas: {key: _rounded(value) for key, value in deltas.items()})

    @payload("together - feeder - induction", type="number",
             dump=lambda interaction: None if interaction is None else _rounded(interaction))
    def interaction(self) -> float | None:
        if not self.deltas:
            return None
        return self.deltas["together"] - self.deltas["feeder"] - self.deltas["induction"]


@published("circuits", 1, "Induction heads, their K-composing feeders against the random baseline, and the ablation "
           "check (probe circuits --json).", rows="one per induction head and feeder",
           columns={**HEAD_COLUMNS, "induction_score": Field("number", "the induction head's score"),
                    "feeder_layer": Field("integer", "the feeder's layer"), "feeder_head": Field("integer", "its head"),
                    "feeder_name": Field("string", "its name (L5H1)"),
                    "k_composition": Field("number", "its K-composition into the induction head"),
                    "rank_in_layer": Field("integer", "1: the strongest of its layer"),
                    "previous_token": Field("boolean", "whether the feeder is a previous-token head")})
class Circuits(Payload):
    """What `circuits` found: each induction head's strongest K-composing feeders against the random baseline, the
    previous-token heads' ranks among them, and the ablation check (`probe circuits --json`)."""

    model: str = schema_field(MODEL)
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)  # docs/precision.md: how far half precision lies
    baseline: float = schema_field("K-composition of random matrices of the same shapes", key="random_baseline",
                                   dump=_rounded)
    pairs: list[Pair]
    previous_token_ranks: list[tuple[Head, Head, float, int]]  # (previous-token head, induction head, K, rank)
    folded: str

    @payload("the norm whose gains were folded into the weights")
    def folded_norm(self) -> str | None:
        return self.folded or None

    @payload("whether rotary embeddings are left out of the scores")
    def rotary_ignored(self) -> bool:
        return True

    seconds: float = schema_field(SECONDS, dump=lambda seconds: round(seconds, 3))
    baseline_second_copy: float | None = schema_field("the second copy's loss, unablated",
                                                      key="baseline_second_copy_loss", default=None)

    @payload("each induction head", items="an induction head")
    def induction_heads(self) -> list[Pair]:
        return self.pairs

    @payload("the previous-token heads' ranks among the feeders")
    def previous_token_pairs(self) -> dict[str, Any]:
        ranks = self.previous_token_ranks
        return {"pairs": len(ranks), "ranked_first_in_layer": sum(rank == 1 for *_, rank in ranks),
                "above_baseline": sum(score > self.baseline for _, _, score, _ in ranks),
                "entries": [{"previous_token": f"{p[0]}.{p[1]}", "induction": f"{i[0]}.{i[1]}",
                             "k_composition": round(score, 6), "rank_in_layer": rank}
                            for p, i, score, rank in ranks]}

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per induction head and feeder: the circuits schema's columns. Needs pandas."""
        return frame([{**head_columns(*pair.induction), "induction_score": pair.induction_score,
                       "feeder_layer": feeder.head[0], "feeder_head": feeder.head[1],
                       "feeder_name": head_name(*feeder.head), "k_composition": feeder.score,
                       "rank_in_layer": feeder.rank_in_layer, "previous_token": feeder.previous_token}
                      for pair in self.pairs for feeder in pair.feeders])


def _pairs(composition: Composition, classes: Classification, top: int) -> tuple[list[Pair], list[Any]]:
    previous = {(layer, head) for layer, head, _ in classes.flagged("previous_token")}
    pairs, ranks = [], []
    for layer, head, score in classes.flagged("induction"):
        table = composition.scores["k"][:layer, :, layer, head]  # (earlier layers, heads)
        order = table.nan_to_num(-1.0).flatten().argsort(descending=True)[:top].tolist()
        feeders = []
        for index in order:
            source = divmod(index, table.shape[1])
            feeders.append(Feeder(source, float(table[source]), composition.rank_in_layer("k", source, (layer, head)),
                                  source in previous))
        checked = [feeder.head for feeder in feeders if feeder.previous_token] or [feeder.head for feeder in feeders]
        pairs.append(Pair((layer, head), score, feeders, checked=checked[0] if checked else None))
        for source in sorted(p for p in previous if p[0] < layer):
            ranks.append((source, (layer, head), composition.score("k", source, (layer, head)),
                          composition.rank_in_layer("k", source, (layer, head))))
    return pairs, ranks


@reports("circuits", stages=True)
def circuits(loaded: LoadedModel, *, top: int = 3, check: bool = True, seq_len: int = 128,
             num_seqs: int = DEFAULT_NUM_SEQS, repeat_len: int = DEFAULT_REPEAT_LEN, seed: int = DEFAULT_SEED,
             batch_size: int = 8, method: str = "zero", progress: StageProgressArg = None) -> Circuits:
    """Induction heads, their strongest K-composing earlier heads and, with `check`, each ablated with its strongest
    previous-token feeder (else its top feeder), together and alone. Stages: STAGE_UNITS."""
    started = time.perf_counter()
    report = callback(progress)
    composition = composition_scores(loaded.model, loaded.name, kinds=("k",),
                                     progress=stage_tick(report, "K-composition"))
    classes = classify(loaded, scores=list(CLASSES), seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len,
                       seed=seed, batch_size=batch_size, progress=stage_tick(report, "classifying heads"))
    pairs, ranks = _pairs(composition, classes, top)
    result = Circuits(loaded.name, composition.baseline, pairs, ranks, composition.folded, 0.0,
                      dtype=model_dtype(loaded))
    checked = [pair for pair in pairs if pair.checked is not None]
    if check and checked:
        probe_set = build_probe_set("repeated", loaded, ProbeOptions(num_seqs=num_seqs, repeat_len=repeat_len,
                                                                     seed=seed))
        result.baseline_second_copy = _check(loaded, checked, probe_set, method, batch_size,
                                             stage_tick(report, "ablation check"))
    result.seconds = time.perf_counter() - started
    return result


def _check(loaded: LoadedModel, checked: list[Pair], probe_set: ProbeSet, method: str, batch_size: int,
           tick: Progress | None) -> float:
    """Each pair's heads ablated alone and together (second-copy deltas into `pair.deltas`); the unablated loss."""
    groups = [(pair.checked, pair.induction) for pair in checked if pair.checked is not None]
    ablated = sweep(loaded, probe_set, sorted({head for group in groups for head in group}), groups=groups,
                    method=method, batch_size=batch_size, progress=tick)
    by_heads = {entry.heads: entry.part_deltas["second_repeat"] for entry in ablated.results}
    for pair, (feeder, induction) in zip(checked, groups):
        pair.deltas = {"feeder": by_heads[(feeder,)], "induction": by_heads[(induction,)],
                       "together": by_heads[(feeder, induction)]}
    return ablated.baseline_parts["second_repeat"]

"""`kv_heads`: check, score, order, label from a budget and check the order, each stage on its own inputs."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

from probe.ablation.window import WindowAblation
from probe.hooks.layers import attention_layers
from probe.inputs import DEFAULT_DEPTHS, NeedleOptions, ProbeSet, natural_set, needle_set
from probe.errors import ProbeError
from probe.heads.scores import DEFAULT_RECENT
from probe.hooks.stacks import is_encoder_decoder
from probe.models import LoadedModel
from probe.progress import Progress, StageProgressArg, reports, callback, stage_tick
from probe.provenance import model_dtype
from probe.headmaps.kvpress import check_kvpress_ratio
from probe.kv.budget import (DEFAULT_MAX_LOSS_INCREASE, Budget, CurveInputs, calibrate_budget, curve_steps,
                             fixed_budget, kvpress_budget, stream_curve)
from probe.kv.order import ORDERS, aggregate, kv_groups, loss_order, stream_order
from probe.kv.result import KVHeads
from probe.kv.scoring import accuracy_table, score_needles

CURVE_SEED_OFFSET = 1000  # the curve's needle prompts: another seed than the scored ones
BUDGET_SEED_OFFSET = 2000  # the budget's needle prompts: another seed than the scored ones and the curve's


STAGE_UNITS = {"scoring heads": "needle prompts", "ordering by loss": "KV heads", "calibrating the budget": "points",
               "checking the order": "points"}  # each stage its own bar: a budget point costs far more than a prompt
KV_SINK = 64  # sink keys of a streaming head: DuoAttention's deployed cache (64 sink + 256 recent keys)


def _check(loaded: LoadedModel, lengths: tuple[int, ...], sink: int, recent: int, seeds: list[int],
           order_by: str, kvpress_ratio: float | None, fixed: tuple[float | None, ...]) -> bool:
    """The arguments checked against the model; whether a fixed budget is asked for (check_budget_choice)."""
    if order_by not in ORDERS:
        raise ProbeError(f"order_by {order_by!r}: use one of {', '.join(ORDERS)}", parameter="order_by")
    if is_encoder_decoder(loaded.model):  # every layer would be windowed, and only decoder self-attention can be
        raise ProbeError("kv-heads sorts a decoder-only model's KV heads for a decoding cache; an encoder-decoder's "
                         "encoder and cross-attention keep no such cache: it is not supported")
    if sink < 0 or recent < 1:
        raise ProbeError(f"sink must be >= 0 and recent >= 1, got sink {sink}, recent {recent}", parameter="recent")
    if not lengths or max(lengths) <= sink + recent + 16:
        raise ProbeError(f"the streaming score reads queries past sink + recent = {sink + recent}: give lengths "
                         f"longer than {sink + recent + 16} or a smaller recent", parameter="lengths")
    if len(set(seeds)) != len(seeds):
        raise ProbeError("random_seeds must differ from each other", parameter="random_seeds")
    return check_budget_choice(kvpress_ratio, fixed, lengths, sink, recent)


def check_budget_choice(kvpress_ratio: float | None, fixed: tuple[float | None, ...], lengths: tuple[int, ...],
                        sink: int, recent: int) -> bool:
    """Whether a fixed budget is asked for (`fixed`: the full fraction and thresholds), before any model loads."""
    asked = any(value is not None for value in fixed)
    if kvpress_ratio is None:
        return asked
    if asked:
        raise ProbeError("kvpress_ratio is a budget of its own: give no full fraction or thresholds beside it",
                         parameter="kvpress_ratio")
    if lengths:
        check_kvpress_ratio(kvpress_ratio, sink, recent, max(lengths))
    return False


def _held_out(loaded: LoadedModel, options: NeedleOptions, data: str | None, texts: int, first_text: int,
              seed_offset: int, window: WindowAblation) -> CurveInputs:
    """Inputs the scores never read: natural texts of the longest length and needle prompts of another seed."""
    needles = needle_set(loaded, replace(options, seed=options.seed + seed_offset))
    n_heads, n_kv = kv_groups(loaded)
    return CurveInputs(_texts(loaded, options, data, texts, first_text).input_ids, needles, n_heads // n_kv, window)


def _texts(loaded: LoadedModel, options: NeedleOptions, data: str | None, texts: int, first_text: int) -> ProbeSet:
    """Natural texts `first_text` .. `first_text + texts` of the longest length, each stage reading its own."""
    natural = natural_set(loaded, data=data, seq_len=max(options.lengths) - 1, num_seqs=first_text + texts,
                          seed=options.seed)
    if natural.input_ids.shape[0] < first_text + texts:
        raise ProbeError(f"the text has {natural.input_ids.shape[0]} sequences of {max(options.lengths)} tokens; the "
                         f"curve, the budget and the order need {first_text + texts} different ones: give a longer "
                         "--data or fewer curve texts", parameter="curve_texts")
    return ProbeSet(natural.name, f"{natural.description}, sequences {first_text}..{first_text + texts - 1}",
                    natural.input_ids[first_text:first_text + texts], natural.offset)


@reports("kv-heads", stages=True)
def kv_heads(
    loaded: LoadedModel, *, lengths: tuple[int, ...] = (1024,), depths: tuple[float, ...] = DEFAULT_DEPTHS,
    prompts: int = 1, needle: str | None = None, sink: int = KV_SINK, recent: int = DEFAULT_RECENT,
    full_fraction: float | None = None, retrieval_threshold: float | None = None,
    streaming_threshold: float | None = None, max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE,
    curve: bool = True, steps: int = 5, random_seeds: tuple[int, ...] = (0, 1), curve_texts: int = 2,
    data: str | None = None, seed: int = 0, order_by: str = "retrieval", stop_random: bool = True,
    kvpress_ratio: float | None = None, progress: StageProgressArg = None,
) -> KVHeads:
    """Score every head for retrieval and streaming, aggregate per KV head, order them, label them from a budget
    and, with `curve`, check the order against random ones (stream_curve). Stages: STAGE_UNITS."""
    fixed = _check(loaded, tuple(lengths), sink, recent, list(random_seeds), order_by, kvpress_ratio,
                   (full_fraction, retrieval_threshold, streaming_threshold))
    options = NeedleOptions(seed=seed, lengths=tuple(lengths), depths=tuple(depths), prompts=prompts,
                            **({"needle": needle} if needle else {}))  # type: ignore[arg-type]
    calibrated, why_fixed = _budget_kind(loaded, not fixed)
    scored = needle_set(loaded, options)
    n_heads, n_kv = kv_groups(loaded)
    stage, clock = partial(stage_tick, callback(progress)), _Clock()
    retrieval, streaming, run = score_needles(loaded, scored, sink=sink, recent=recent,
                                              progress=stage("scoring heads"))
    clock.lap("scores")
    kv_retrieval, kv_streaming = aggregate(retrieval, n_kv, "max"), aggregate(streaming, n_kv, "min")
    window = WindowAblation(sink=sink, recent=recent)
    order = stream_order(kv_retrieval, kv_streaming) if order_by == "retrieval" else loss_order(
        loaded, kv_retrieval, _texts(loaded, options, data, curve_texts, 2 * curve_texts), window,
        progress=stage("ordering by loss"))[0]
    clock.lap("order")
    if calibrated or kvpress_ratio is not None:
        held_out = _held_out(loaded, options, data, curve_texts, curve_texts, BUDGET_SEED_OFFSET, window) \
            if calibrated else None
        budget, full = _measured_budget(loaded, order, held_out, kvpress_ratio, (sink, recent, max(lengths)),
                                        max_loss_increase, why_fixed,
                                        stage("calibrating the budget"))
    else:
        budget, full = fixed_budget(order, kv_retrieval, kv_streaming, full_fraction,
                                     (retrieval_threshold, streaming_threshold), model_dtype(loaded), why_fixed)
    clock.lap("budget")
    result = KVHeads(loaded.name, retrieval.shape[0], n_heads, n_kv, sink, recent, retrieval.float(),
                     streaming.float(), kv_retrieval.float(), kv_streaming.float(), order, full,
                     accuracy_table(scored, run), budget=budget, dtype=model_dtype(loaded))
    result.options = {"lengths": list(lengths), "depths": list(depths), "prompts": prompts, "seed": seed,
                      "needle": options.needle, "full_fraction": full_fraction,
                      "retrieval_threshold": retrieval_threshold, "streaming_threshold": streaming_threshold,
                      "max_loss_increase": max_loss_increase, "order_by": order_by, "stop_random": stop_random,
                      "scored_on": scored.description}
    if curve:
        inputs = _held_out(loaded, options, data, curve_texts, 0, CURVE_SEED_OFFSET, window)
        ks = sorted(set(curve_steps(len(order), steps)) | {budget.streamed})  # the map's own k, checked too
        result.curve = stream_curve(loaded, order, inputs, ks, list(random_seeds), progress=stage("checking the order"),
                                    stop_below=max_loss_increase if stop_random else None)
        result.curve["needle_seed"] = seed + CURVE_SEED_OFFSET
        clock.lap("curve")
    result.seconds = clock.laps
    return result


def _measured_budget(loaded: LoadedModel, order: list[tuple[int, int]], held_out: CurveInputs | None,
                     kvpress_ratio: float | None, cache: tuple[int, int, int], max_loss_increase: float,
                     why: str | None, progress: Progress | None) -> tuple[Budget, set[tuple[int, int]]]:
    """The budget measured on `held_out` (kvpress's for `kvpress_ratio`, else calibrated) and its full KV heads."""
    if kvpress_ratio is None:
        assert held_out is not None
        budget = calibrate_budget(loaded, order, held_out, max_loss_increase=max_loss_increase, progress=progress)
    else:
        sink, recent, length = cache
        budget = kvpress_budget(loaded, order, held_out, kvpress_ratio, sink=sink, recent=recent, length=length,
                                max_loss_increase=max_loss_increase, why=why)
        if progress is not None:
            progress(1, 1)
    if held_out is not None:
        budget.measured_on["needle_seed"] = held_out.needles.meta["seed"]
    return budget, set(order[budget.streamed:])


class _Clock:
    """Wall seconds per stage, in the order the stages ran."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = round(now - self.last, 3)
        self.last = now


def _budget_kind(loaded: LoadedModel, wanted: bool) -> tuple[bool, str | None]:
    """(whether the budget is calibrated, why not where it was wanted but cannot be)."""
    if not wanted or all(layer.kind == "hf" for layer in attention_layers(loaded.model)):
        return wanted, None
    return False, ("a calibrated budget measures window ablation, which needs transformers attention; this model's "
                   "is its own")

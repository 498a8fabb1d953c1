"""`probe steer`: the metric against an intervention's values per head, and (`--find`) every head ranked through the
sweep."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from probe.ablation import parse_heads
from probe.ablation.heads import Head
from probe.ablation.methods import METHODS
from probe.ablation.metrics import Metric as MetricObject
from probe.ablation.metrics import choose_metric, read_target_words
from probe.ablation.metrics import target_words as target_words_metric  # `target_words` is an option of steer
from probe.cli.options import (BatchSize, Data, Device, DeviceMap, Dtype, Force, Heads, HtmlFile, JsonFile, Labels,
                               Metric, Model, NumSeqs, OffloadFolder, Pairs, Results, Resume, Seed, SeqLen, Stack, Task,
                               Top, TrustRemoteCode, load_for)
from probe.cli.outputs import check_sweep_outputs, save_results, warn_non_finite
from probe.cli.progress import console, heads_done, progress_bar, saved_on_interrupt, status
from probe.distributed import current, sharded_sweep
from probe.errors import ProbeError
from probe.hooks.layers import attention_layers
from probe.inputs import (DEFAULT_NUM_SEQS, DEFAULT_SEED, DEFAULT_SEQ_LEN, ProbeOptions, ProbeSet,
                          ContrastSet, build_probe_set)
from probe.inputs.choice import GENERATED, data_file, probe_set_name
from probe.ablation.stream import cached_results_path, finished_count
from probe.models import DEFAULT_MODEL, LoadedModel
from probe.patching.runs import contrast_runs
from probe.reports.steer import steer_page, steer_report
from probe.steering import (SteerResult, check_values, find_result, generations, intervention_named, steer_curves,
                            steerable)

DEFAULT_VALUES = "0,0.5,2,3"
Intervention = Annotated[str, typer.Option(
    "--intervention", help="What is done to each head: "
    + "; ".join(f"{name} ({METHODS[name].parameter}): {METHODS[name].summary}" for name in steerable()) + ".")]
VALUES_HELP = (f"The intervention's values, comma-separated (default {DEFAULT_VALUES}); the model as it is (scale's "
               "alpha 1) is always measured. With --find: one value.")
ALPHA_HELP = ("Scale's alphas, comma-separated, e.g. 0,0.5,2,3 (0: zero ablation; above 1: amplified): --values under "
              "its name, for an intervention whose value is an alpha.")
Values = Annotated[Optional[str], typer.Option("--values", help=VALUES_HELP)]
Alpha = Annotated[Optional[str], typer.Option("--alpha", help=ALPHA_HELP)]
Find = Annotated[bool, typer.Option(
    "--find", help="Apply the intervention at the one value to every head (or each of --heads) alone and rank "
    "them by how far it moves the metric (an exact sweep: streamed to --results, --resume, split under torchrun).")]
TargetWords = Annotated[Optional[Path], typer.Option(
    "--target-words", help="Measure a behaviour on text: a UTF-8 file of one word or phrase per line (# comments); "
    "the metric is the mean next-token probability of each line's first token after a space (' time'), higher = "
    "more of the behaviour.")]
Generate = Annotated[Optional[str], typer.Option(
    "--generate", help="Also continue this prompt greedily for each head and value, side by side with the model as "
    "it is (with --find: the top head).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Tokens generated per continuation.")]


@dataclass(frozen=True)
class Request:
    """What to steer and measure: everything of a run but the model and the output files."""

    heads: str | None
    intervention: str
    values: list[float]
    find: bool
    data: str
    task: str | None
    pairs: Path | None
    labels: Path | None
    metric: str | None
    words: Path | None
    prompt: str | None
    max_new_tokens: int


def parse_values(text: str, flag: str = "--values") -> list[float]:
    """--values (or --alpha): comma-separated finite numbers, each once."""
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ProbeError(f"{flag} {text!r}: give numbers separated by commas, e.g. 0,0.5,2,3") from None
    if not values or not all(math.isfinite(value) for value in values):
        raise ProbeError(f"{flag} {text!r}: give finite numbers separated by commas, e.g. 0,0.5,2,3")
    return check_values(values)


def chosen_values(intervention: str, values: str | None, alpha: str | None) -> list[float]:
    """The values of --values, or of --alpha where the intervention's value is an alpha, each checked."""
    if alpha is None:
        chosen = parse_values(DEFAULT_VALUES if values is None else values)
    elif values is not None:
        raise ProbeError("--alpha and --values give the same values: give one of them")
    elif METHODS[intervention].parameter != "alpha":
        raise ProbeError(f"--alpha sets an alpha; {intervention}'s value is its {METHODS[intervention].parameter}: "
                         "give --values")
    else:
        chosen = parse_values(alpha, "--alpha")
    for value in chosen:
        intervention_named(intervention, value)  # refuses a value the intervention cannot take, in one line
    return chosen


def check_request(request: Request, distributed: bool) -> None:
    """Every option that can be judged without the model, before it is loaded."""
    sources = {"--task": request.task, "--pairs": request.pairs, "--labels": request.labels,
               "--target-words": request.words}
    given = [flag for flag, value in sources.items() if value is not None]
    if len(given) > 1:
        raise ProbeError(f"{' and '.join(given)} each choose the input: give one of them")
    if given and given[0] != "--target-words" and request.data != "natural":
        raise ProbeError(f"{given[0]} replaces --data: give one of them")
    if request.words is not None:
        if request.metric is not None:
            raise ProbeError("--target-words is the metric: drop --metric")
        read_target_words(request.words)
    if request.find and len(request.values) != 1:
        raise ProbeError("--find ranks every head at one value: give one --values value, e.g. --values 3")
    if not request.find and request.heads is None:
        raise ProbeError("give --heads (the heads to steer, e.g. 23.3) or --find (rank every head)")
    if distributed and not request.find:
        raise ProbeError("torchrun splits --find's sweep over the processes: run curves without torchrun")


def probe_input(loaded: LoadedModel, request: Request, options: ProbeOptions) -> ProbeSet:
    """The input measured: clean prompts of contrast pairs (logit difference), a task file, labelled texts, or text."""
    name = probe_set_name(request.data, labels=request.labels, task=request.task, pairs=request.pairs, contrast=True)
    chosen = build_probe_set(name, loaded, replace(options, task=request.task, pairs=request.pairs,
                                                   labels=request.labels))
    return contrast_runs(loaded, chosen)[0] if isinstance(chosen, ContrastSet) else chosen


def run_find(loaded: LoadedModel, probe_set: ProbeSet, heads: list[Head] | None, metric: MetricObject,
             request: Request, stream: Path, *, resume: bool, batch_size: int, stack: int | None,
             show: bool) -> SteerResult | None:
    """Every head under the intervention at the one value, through the sharded sweep."""
    stream.parent.mkdir(parents=True, exist_ok=True)
    value, method = request.values[0], intervention_named(request.intervention, request.values[0])
    with saved_on_interrupt(stream, lambda: f"{finished_count(stream)} finished head(s)", show), \
            progress_bar(f"{request.intervention} at {value:g} per head", show=show) as update:
        swept = sharded_sweep(loaded, probe_set, heads, method=method, metric=metric,
                              batch_size=batch_size, stack=stack, results_path=stream, resume=resume,
                              data=_data_file(request), progress=update, on_result=heads_done(update))
    return None if swept is None else find_result(loaded, swept, value, metric, request.intervention)


def _data_file(request: Request) -> Path | None:
    """The text file measured, for the result's `data` (None: the set names itself)."""
    if any(value is not None for value in (request.task, request.pairs, request.labels)):
        return None
    return data_file(request.data)


def add_generations(loaded: LoadedModel, result: SteerResult, heads: list[Head], request: Request, seed: int) -> None:
    if request.prompt is None:
        return
    if request.find:
        ranking = result.find["ranking"] if result.find else []
        heads = [(ranking[0]["layer"], ranking[0]["head"])] if ranking else []
    with status(f"generating {request.max_new_tokens} tokens per head and value ..."):
        result.generations = generations(loaded, request.prompt, heads, request.values,
                                         intervention=request.intervention, max_new_tokens=request.max_new_tokens,
                                         seed=seed)


def cache_key(model: str, dtype: str, device: str | None, request: Request, options: ProbeOptions,
              batch_size: int) -> dict[str, Any]:
    """Everything that shapes --find's numbers, as given (names the default results file)."""
    return {"command": "steer", "model": model, "dtype": dtype, "device": device,
            "options": str(options), "request": str(request), "batch_size": batch_size}


def steer(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, heads: Heads = None,
    intervention: Intervention = "scale", values: Values = None, alpha: Alpha = None, find: Find = False,
    target_words: TargetWords = None, task: Task = None,
    pairs: Pairs = None, labels: Labels = None, metric: Metric = None, data: Data = "natural",
    seq_len: SeqLen = DEFAULT_SEQ_LEN, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, seed: Seed = DEFAULT_SEED,
    generate: Generate = None, max_new_tokens: MaxNewTokens = 20, batch_size: BatchSize = 8, stack: Stack = None,
    results: Results = None, resume: Resume = False, top: Top = 15, json_path: JsonFile = None,
    html_path: HtmlFile = None, force: Force = False, device: Device = None, dtype: Dtype = "float32",
    device_map: DeviceMap = None, offload_folder: OffloadFolder = None,
) -> None:
    """Turn single heads up or down (scale, or any registered intervention that takes a value): the metric against
    its value, the text generated, and which head moves a behaviour most (--find)."""
    request = Request(heads, intervention, chosen_values(intervention, values, alpha), find, data, task, pairs,
                      labels, metric, target_words, generate, max_new_tokens)
    outputs, rank = {"--json": json_path, "--html": html_path}, current()
    main_process = rank is None or rank.is_main
    check_request(request, rank is not None)
    check_sweep_outputs(outputs, results, resume=resume, force=force, writes=main_process)
    options = ProbeOptions(None if data in GENERATED else data, seq_len, num_seqs, seed=seed)
    loaded = load_for(rank, model, device, dtype, device_map, offload_folder, trust_remote_code)
    probe_set = probe_input(loaded, request, options)
    words = None if target_words is None else target_words_metric(loaded, target_words)
    measured = choose_metric(loaded, probe_set, metric if words is None else words)
    chosen = parse_heads(heads, attention_layers(loaded.model)) if heads is not None else None
    if find:
        stream = results or cached_results_path(cache_key(model, dtype, device, request, options, batch_size))
        result = run_find(loaded, probe_set, chosen, measured, request, stream, resume=resume,
                          batch_size=batch_size, stack=stack, show=main_process)
        if result is not None and results is None:
            stream.unlink(missing_ok=True)  # the cache stream only serves --resume
    else:
        with status(f"measuring {len(chosen or [])} head(s) at {len(request.values)} value(s) ..."):
            result = steer_curves(loaded, probe_set, chosen or [], request.values,
                                  intervention=request.intervention, metric=measured,
                                  batch_size=batch_size, stack=stack,
                                  data=None if _data_file(request) is None else str(_data_file(request)))
    if not main_process or result is None:
        return
    add_generations(loaded, result, chosen or [], request, seed)
    payload = result.to_dict()
    save_results(payload, "steer", json_path, html_path=html_path, page=steer_page)
    warn_non_finite(payload)
    steer_report(payload, console, top=top, flag="--values" if alpha is None else "--alpha")

"""`probe ablate`: how much the loss changes with each head ablated. The sweep streams to a results file (`--resume`
continues it) and splits over torchrun's processes; rank 0 reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from probe.cli.options import (ESTIMATE, BatchSize, CsvFile, Data, Device, DeviceMap, Dtype, Force, Heads, HtmlFile,
                               JsonFile, Labels, Method, Metric, Model, Naive, NumSeqs, OffloadFolder, RepeatLen,
                               Results, Resume, Seed, SeqLen, Stack, Task, Top, TrustRemoteCode, load_for)
from probe.cli.outputs import check_sweep_outputs, save_results, warn_non_finite
from probe.cli.progress import console, heads_done, note, progress_bar, saved_on_interrupt, status
from probe.ablation import METHODS, AblationResult, Head, estimate, parse_heads
from probe.ablation.methods import AblationMethod, build_method
from probe.ablation.stream import cached_results_path, finished_count
from probe.hooks.layers import attention_layers
from probe.inputs import (DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN, ProbeOptions, ProbeSet,
                          TASKS, build_probe_set, read_labelled, read_task_file)
from probe.inputs.choice import data_file, probe_set_name
from probe.distributed import current, sharded_sweep
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL, LoadedModel
from probe.reports.html import ablation_page
from probe.reports.terminal import ablation_report


Together = Annotated[bool, typer.Option(
    "--together", help="Ablate the --heads together, in one run, instead of one at a time.")]
Seq2seq = Annotated[Optional[Path], typer.Option(
    "--seq2seq", help="Encoder-decoders (t5, bart): a JSON-lines file of {\"source\", \"target\"} texts; the encoder "
    "reads the source, the loss is the decoder's on the target (--method " + " or ".join(
        name for name, method in METHODS.items() if not method.across_sequences) + ").")]
PerPosition = Annotated[bool, typer.Option(
    "--per-position", help="Methods that read statistics of the heads' outputs (" + ", ".join(
        name for name, method in METHODS.items() if method.statistics) + "): one value per position (over the "
    "sequences) instead of one over all positions.")]
Budget = Annotated[float, typer.Option("--budget", help="--method estimate: forward-pass equivalents to spend.")]


@dataclass(frozen=True)
class Request:
    """What to ablate and how: everything of a run but the model, the probe set's sizes and the output files."""

    heads: str | None
    together: bool
    method: str
    per_position: bool
    data: str  # natural, repeated, or a text file
    batch_size: int
    stack: int | None
    naive: bool
    budget: float
    task: str | None = None  # sva, ioi or a JSON-lines file
    seq2seq: Path | None = None  # encoder-decoders: a JSON-lines file of source/target texts (probe.inputs.pairs)
    metric: str | None = None  # a name of METRICS; None: the one for this input
    seed: int = 0  # of the probe set, and of methods that draw at random
    labels: Path | None = None  # sequence classifiers: a JSON-lines file of labelled texts (probe.inputs.labels)


def check_request(request: Request, *, html: bool, distributed: bool) -> None:
    """Every option that can be judged without the model, before it is loaded."""
    choices = (*METHODS, ESTIMATE)  # every registered ablation method, and the estimate
    if request.method not in choices:
        raise ProbeError(f"--method {request.method!r}: use one of {', '.join(choices)}")
    if request.per_position and (request.method == ESTIMATE or not METHODS[request.method].statistics):
        with_statistics = [name for name, method in METHODS.items() if method.statistics]
        raise ProbeError(f"--per-position applies to --method {' or '.join(with_statistics)}: the methods that read "
                         "statistics of the heads' outputs")
    if request.method == ESTIMATE and (request.together or request.naive):
        raise ProbeError("--method estimate covers every head alone: drop --together / --naive")
    if request.together and request.heads is None:
        raise ProbeError("--together needs --heads: the heads to ablate together, e.g. --heads 5.1,18.6")
    if html and request.together:
        raise ProbeError("--html shows one result per head: drop --together, or use --json / --csv")
    if distributed and request.method == ESTIMATE:
        raise ProbeError("--method estimate is a few forward and backward passes, not a sweep to split: run it "
                         "without torchrun")
    if request.method == ESTIMATE and (request.task is not None or request.labels is not None):
        flag, what = ("--task", "a task's margin") if request.task is not None else ("--labels", "a classifier's")
        raise ProbeError(f"--method estimate linearises the next-token loss of text, not {what}: use another --method "
                         f"({', '.join(METHODS)}) with {flag}")  # the exact sweep's methods serve it
    if request.task is not None and request.data != "natural":
        raise ProbeError("--task replaces --data: give one of them")
    if request.seq2seq is not None and (request.task is not None or request.data != "natural"):
        raise ProbeError("--seq2seq replaces --data and --task: give one of them")
    if request.labels is not None and (request.task is not None or request.seq2seq is not None or
                                       request.data != "natural"):
        raise ProbeError("--labels replaces --data, --task and --seq2seq: give one of them")
    if request.task is not None and request.task not in TASKS:  # a task file's rows now, their tokens once it loads
        read_task_file(request.task)
    if request.labels is not None:  # a labels file's rows now, their classes once the model loads
        read_labelled(request.labels)


def cache_key(model: str, dtype: str, device: str | None, request: Request, options: ProbeOptions) -> dict[str, Any]:
    """Everything that shapes a sweep's numbers, as the command line gave it (names the default results file)."""
    return {"model": model, "data": request.data, "seq_len": options.seq_len, "num_seqs": options.num_seqs,
            "repeat_len": options.repeat_len, "seed": options.seed, "method": request.method,
            "per_position": request.per_position, "heads": request.heads, "together": request.together,
            "batch_size": request.batch_size, "stack": request.stack, "naive": request.naive,
            "dtype": dtype, "device": device, "task": request.task, "metric": request.metric,
            **({"seq2seq": str(request.seq2seq)} if request.seq2seq is not None else {}),
            **({"labels": str(request.labels)} if request.labels is not None else {})}


def run_estimate(loaded: LoadedModel, probe_set: ProbeSet, heads: list[Head] | None, request: Request,
                 show: bool) -> AblationResult:
    with progress_bar("estimating", show=show) as update:
        return estimate(loaded, probe_set, heads, metric=request.metric, batch_size=request.batch_size,
                        data=data_file(request.data), progress=update, budget=request.budget)


def chosen_method(loaded: LoadedModel, probe_set: ProbeSet, request: Request, show: bool) -> AblationMethod:
    """The method, built with what it declares: the statistics it reads (taken now, over the probe set), the seed."""
    needs = METHODS[request.method].statistics
    with status(f"taking the heads' {' and '.join(needs)} ...", show and bool(needs)):
        return build_method(request.method, loaded, probe_set, per_position=request.per_position, seed=request.seed,
                            batch_size=request.batch_size)


def run_sweep(loaded: LoadedModel, probe_set: ProbeSet, heads: list[Head] | None, request: Request, stream: Path, *,
              resume: bool, show: bool) -> AblationResult | None:
    """The sweep, streamed to `stream`; on Ctrl-C, say what is saved and how to continue (then exit 130)."""
    method = chosen_method(loaded, probe_set, request, show)
    stream.parent.mkdir(parents=True, exist_ok=True)
    done_before = finished_count(stream) if resume else 0
    groups = [heads] if request.together and heads else []
    with saved_on_interrupt(stream, lambda: f"{finished_count(stream)} finished ablation(s)", show), \
            progress_bar("ablating heads", show=show) as update:
        result = sharded_sweep(loaded, probe_set, None if request.together else heads, groups=groups,
                               method=method, metric=request.metric, mode="naive" if request.naive else "exact",
                               batch_size=request.batch_size, stack=request.stack, results_path=stream,
                               resume=resume, data=data_file(request.data), progress=update,
                               on_result=heads_done(update))
    if show and done_before:
        note(f"resumed: {done_before} ablation(s) read from {stream}")
    return result


def ablate(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False,
    heads: Heads = None, together: Together = False, method: Method = "zero", per_position: PerPosition = False,
    data: Data = "natural", seq_len: SeqLen = DEFAULT_SEQ_LEN, num_seqs: NumSeqs = DEFAULT_NUM_SEQS,
    repeat_len: RepeatLen = DEFAULT_REPEAT_LEN, seed: Seed = DEFAULT_SEED, batch_size: BatchSize = 8,
    stack: Stack = None, naive: Naive = False, budget: Budget = 10.0, task: Task = None, seq2seq: Seq2seq = None,
    labels: Labels = None, metric: Metric = None,
    json_path: JsonFile = None, csv_path: CsvFile = None, html_path: HtmlFile = None,
    results: Results = None, resume: Resume = False, top: Top = 15, force: Force = False,
    device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None, offload_folder: OffloadFolder = None,
) -> None:
    """Ablate heads and measure the loss change: which heads can the model not do without?"""
    request = Request(heads, together, method, per_position, data, batch_size, stack, naive, budget, task, seq2seq,
                      metric, seed, labels)
    rank = current()
    main_process = rank is None or rank.is_main
    check_request(request, html=html_path is not None, distributed=rank is not None)
    check_sweep_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, results, resume=resume,
                        force=force, writes=main_process)
    options = ProbeOptions(data_file(data), seq_len, num_seqs, repeat_len, seed, task=task, seq2seq=seq2seq,
                           labels=labels)
    loaded = load_for(rank, model, device, dtype, device_map, offload_folder, trust_remote_code)
    probe_set = build_probe_set(probe_set_name(data, labels=labels, task=task, seq2seq=seq2seq), loaded, options)
    chosen = parse_heads(heads, attention_layers(loaded.model)) if heads is not None else None
    stream = None
    result: AblationResult | None
    if method == ESTIMATE:
        result = run_estimate(loaded, probe_set, chosen, request, main_process)
    else:
        stream = results or cached_results_path(cache_key(model, dtype, device, request, options))
        result = run_sweep(loaded, probe_set, chosen, request, stream, resume=resume, show=main_process)
    if not main_process or result is None:
        return
    payload = result.to_dict()
    save_results(payload, "ablate", json_path, csv_path, html_path, rows=lambda _: result.csv_rows(),
                 page=ablation_page)
    warn_non_finite(payload)
    ablation_report(payload, console, top=top)
    if stream is not None and results is None:
        stream.unlink(missing_ok=True)  # the cache stream only serves --resume

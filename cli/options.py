"""Every option more than one command takes, declared once (one command's own flags are in its module:
`tests/test_cli_options.py` holds both)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from probe.ablation.methods import METHODS
from probe.ablation.metrics import KINDS, METRICS
from probe.cli.checks import check_hub_reachable
from probe.cli.outputs import record_provenance
from probe.cli.progress import status, timed_status, warn
from probe.distributed import Rank, rank_device, rank_placement
from probe.errors import ProbeError
from probe.inputs import CONTRAST_TASKS, TASKS
from probe.models import LoadedModel, load_model
from probe.models.load import loading_words
from probe.selfrepair import SELF_REPAIR_METHODS
from probe.threads import ENV as THREADS_ENV


def method_help(*more: str) -> str:
    """--method's help: one clause per registered method and the `more` given."""
    return "; ".join([*(f"{name}: {method.summary or name}" for name, method in METHODS.items()), *more]) + "."


def metric_help() -> str:
    """--metric's help: one clause per registered metric (METRICS), with what it reads and where it is the default."""
    def clause(name: str) -> str:
        metric = METRICS[name]
        default = f", the default for {' and '.join(KINDS[kind] for kind in metric.default_for)}" \
            if metric.default_for else ""
        return f"{name} ({metric.reads}{default})"
    return "What is measured: " + "; ".join(clause(name) for name in METRICS) + "."


ESTIMATE = "estimate"  # not a method: attribution patching of every head's zero ablation (probe.ablation.estimate)

GLOBAL_PANEL = "Global flags (before or after the command)"  # --help's panel of the flags every command takes
Threads = Annotated[Optional[int], typer.Option(
    "--threads", min=1, rich_help_panel=GLOBAL_PANEL, help="Threads torch computes on (default: the CPUs not busy "
    f"when the run starts; {THREADS_ENV} sets it too).")]
Debug = Annotated[bool, typer.Option(
    "--debug", rich_help_panel=GLOBAL_PANEL, help="Show tracebacks instead of one-line errors.")]
Quiet = Annotated[bool, typer.Option(
    "--quiet", "-q", rich_help_panel=GLOBAL_PANEL, help="No progress and no notes; warnings and errors only.")]
Verbose = Annotated[bool, typer.Option(
    "--verbose", "-v", rich_help_panel=GLOBAL_PANEL, help="Also the library's log messages (INFO) on stderr.")]
Model = Annotated[str, typer.Option(
    "--model", "-m", help="Alias, model folder, .gguf file, hub id, or FILE.py:FUNCTION (imports and runs that Python "
    "file). A folder's or hub model's own code never runs without --trust-remote-code.")]
TrackedModel = Annotated[Optional[str], typer.Option(  # --model where checkpoints of a run are loaded (probe track)
    "--model", "-m", help="A hub id whose --revisions are the checkpoints, or FILE.py:FUNCTION (imports and runs that "
    "file) whose model the --checkpoints state dicts load into; none for a glob of model folders.")]
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Let a model folder or hub id run the Python code it ships (transformers' "
    "trust_remote_code). Only for models whose code you trust.")]
Device = Annotated[Optional[str], typer.Option(
    "--device", help="torch device, e.g. cpu or cuda (default: where the model loads).")]
Dtype = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16.")]
DeviceMap = Annotated[Optional[str], typer.Option(
    "--device-map", help="Spread a model too big for one device: auto, balanced, sequential, or JSON (inline or a "
    ".json file) of module -> GPU index/cpu/disk.")]
OffloadFolder = Annotated[Optional[Path], typer.Option(
    "--offload-folder", help="Folder for the weights a device map puts on disk.")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per natural-text sequence (BOS not counted).")]
NumSeqs = Annotated[int, typer.Option("--num-seqs", help="Number of sequences in each probe set.")]
Seed = Annotated[int, typer.Option(
    "--seed", help="Seed of the random tokens, and of the ablation methods that draw at random.")]
Metric = Annotated[Optional[str], typer.Option("--metric", help=metric_help())]
Labels = Annotated[Optional[Path], typer.Option(
    "--labels", help="Sequence classifiers: a JSON-lines file of {\"text\", \"label\"} rows ({\"text\", "
    "\"text_pair\", \"label\"} for sentence pairs; a label is a class index or a name of the config's id2label); "
    "measured by the gold class's cross-entropy, or --metric accuracy. probe patch reads clean/corrupt texts of one "
    "token length instead, {\"clean\", \"corrupt\", \"answer\", \"distractor\"} rows with two classes: their logit "
    "difference.")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Sequences per forward pass.")]
Force = Annotated[bool, typer.Option("--force", help="Overwrite output files that exist.")]
JsonFile = Annotated[Optional[Path], typer.Option(
    "--json", help="Write the results as JSON (strict: a NaN or infinity is written as null).")]
HtmlFile = Annotated[Optional[Path], typer.Option("--html", help="Write an interactive HTML report.")]
Heads = Annotated[Optional[str], typer.Option(
    "--heads", help="The heads worked on (ablated, steered, patched, tracked: see the command): LAYER.HEAD items, "
    "e.g. 5.1,18.6; 5.* for a whole layer; ranges 3-4.0-2; encoder-decoders name the stack: enc5.1, dec5.1, x5.1 "
    "(cross-attention).")]
Data = Annotated[str, typer.Option(
    "--data", help="natural (embedded English text), repeated (BOS + random tokens repeated twice: losses on each "
    "copy too), or a UTF-8 text file.")]
TextData = Annotated[Optional[Path], typer.Option(  # --data where the command makes its repeated set itself
    "--data", help="A UTF-8 text file to use instead of the embedded English text.")]
Stack = Annotated[Optional[int], typer.Option(
    "--stack", help="Ablations of one layer stacked into one forward (default: as many as fit in 1 GiB; one at long "
    "context).")]
Naive = Annotated[bool, typer.Option(
    "--naive", help="One full forward per ablation, no reuse of the baseline (the reference the exact mode is "
    "checked against).")]
Results = Annotated[Optional[Path], typer.Option(
    "--results", help="Stream each finished unit of work (a head's ablation; a checkpoint with probe track) to this "
    "JSON-lines file, kept (probe atlas: a folder of its sweeps' files); default: probe's cache, removed when done.")]
Resume = Annotated[bool, typer.Option(
    "--resume", help="Continue an interrupted run: skip what its --results already holds.")]
RepeatLen = Annotated[int, typer.Option("--repeat-len", help="Random tokens per copy in the repeated set.")]
Top = Annotated[int, typer.Option(
    "--top", help="How many of the largest are kept: rows of each table, largest first (probe compare: the size of "
    "each map's top set whose overlap is measured).")]
CsvFile = Annotated[Optional[Path], typer.Option(
    "--csv", help="Write the results as CSV: one row per line of the command's table (a head, pair, step or "
    "checkpoint).")]
Task = Annotated[Optional[str], typer.Option(
    "--task", help=f"A task: generated by name, {', '.join(TASKS)} (sva: subject-verb agreement, after Marvin & "
    "Linzen 2018; ioi: indirect object identification, Wang et al. 2022), or a JSON-lines task file of "
    "{\"prompt\", \"answer\", \"distractor\"} or {\"sentence_good\", \"sentence_bad\"} rows; measured by the answer's "
    "margin over the distractor. Commands that patch or attribute need corrupt prompts: a generated task's, or "
    "--pairs.")]
Pairs = Annotated[Optional[Path], typer.Option(
    "--pairs", help="Clean/corrupt pairs: a JSON-lines file of {\"clean\", \"corrupt\", \"answer\", \"distractor\"} "
    "rows; clean and corrupt of one token length, answer and distractor single tokens (mind the leading space); "
    "measured by the logit difference of answer and distractor.")]
Count = Annotated[int, typer.Option("--count", help="Items generated by --task (those the model cannot use dropped).")]
SelfRepair = Annotated[bool, typer.Option(
    "--self-repair", help="Also ablate each head alone: its total and direct effect (through the frozen final norm), "
    "self-repair = total - direct, and the later heads whose direct logit attribution rises to cover for it.")]
RepairMethod = Annotated[str, typer.Option(
    "--repair-method", help=f"How --self-repair ablates a head: {' or '.join(SELF_REPAIR_METHODS)} (mean: its mean "
    "output over every position of the clean prompts).")]
Method = Annotated[str, typer.Option("--method", help="How a head is ablated: " + method_help(
    f"{ESTIMATE} (probe ablate): attribution-patching estimate of every zero-ablation delta from a few "
    "forward/backward passes (the top heads checked exactly)"))]
Thresholds = Annotated[Optional[list[str]], typer.Option(
    "--threshold", help="Override a class threshold: NAME=VALUE (repeatable).")]
MapThresholds = Annotated[Optional[list[float]], typer.Option(  # --threshold where head maps are read (compare)
    "--threshold", help="Label the heads above this value (instead of the files' own labels). Once: both maps; "
    "twice: A's, then B's.")]
Text = Annotated[Optional[str], typer.Option("--text", help="The text to look at.")]
MaxTokens = Annotated[int, typer.Option(
    "--max-tokens", help="Tokens read: probe heatmap's positions shown (at most 1024; a longer input is shown as a "
    "window), probe serve's longest text.")]
TextFile = Annotated[Optional[Path], typer.Option(
    "--file", help="A UTF-8 text file to read: the text looked at (instead of --text), or parsed with spaCy (probe "
    "syntax; default: the embedded English text).")]
Conllu = Annotated[Optional[Path], typer.Option(
    "--conllu", help="Gold parses as a CoNLL-U file (Universal Dependencies labels): the syntactic class (probe "
    "syntax).")]


def parse_thresholds(items: list[str]) -> dict[str, float]:
    """--threshold NAME=VALUE items, each class once (a second value would silently replace the first)."""
    thresholds: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ProbeError(f"--threshold takes NAME=VALUE, e.g. induction=0.3; got {item!r}")
        if not math.isfinite(number):
            raise ProbeError(f"--threshold {item!r}: the value must be a finite number, e.g. induction=0.3")
        if name.strip() in thresholds:
            raise ProbeError(f"--threshold {name.strip()} is given twice: give each class one value")
        thresholds[name.strip()] = number
    return thresholds


def check_contrast_task(task: str | None) -> None:
    """--task where clean and corrupt runs are compared: a generated task (a task file has no corrupt prompts)."""
    if task is not None and task not in CONTRAST_TASKS:
        raise ProbeError(f"--task {task!r}: this command compares clean and corrupt prompts, which probe generates "
                         f"for {', '.join(CONTRAST_TASKS)}; give a file of clean/corrupt rows with --pairs")


def load(spec: str, device: str | None = None, dtype: str = "float32", device_map: str | None = None,
         offload_folder: Path | None = None, trust_remote_code: bool = False) -> LoadedModel:
    """Load the model saying so on stderr, and how long it took (transformers' own progress bars off)."""
    from transformers.utils import logging as hf_logging  # a transformers submodule: loaded only to load a model

    hf_logging.disable_progress_bar()
    check_hub_reachable(spec)  # one line now, not the hub client's half minute of retries
    with timed_status(loading_words(spec), f"loaded {spec}"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        loaded = load_model(spec, dtype=dtype, device=device, device_map=device_map, offload_folder=offload_folder,
                            trust_remote_code=trust_remote_code)
    for warning in caught:  # e.g. a tokenizer that cannot encode text: one line each, not Python's two
        if str(warning.message).startswith("the tokenizer of"):
            warn(f"warning: {warning.message}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    with status(f"hashing {spec} for the provenance of the files written ..."):  # seconds for a big model
        record_provenance(loaded)
    return loaded


def load_for(rank: Rank | None, spec: str, device: str | None, dtype: str, device_map: str | None,
             offload_folder: Path | None, trust_remote_code: bool) -> LoadedModel:
    """The model, for this process: under torchrun on its own GPU (or share of a device map)."""
    if rank is None:
        return load(spec, device, dtype, device_map, offload_folder, trust_remote_code)
    placement, folder, memory = rank_placement(rank, device_map, offload_folder)
    share: dict[str, Any] = {"device_map": placement, "offload_folder": folder, "max_memory": memory}
    loaded = load_model(spec, dtype=dtype, device=rank_device(rank, device), trust_remote_code=trust_remote_code,
                        **share)
    record_provenance(loaded)
    return loaded

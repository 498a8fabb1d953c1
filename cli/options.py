"""Options shared by the commands, and what they mean: which model to load and where, which files to write."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from probe.ablation.methods import METHODS
from probe.ablation.metrics import KINDS, METRICS
from probe.cli.checks import check_hub_reachable
from probe.cli.outputs import record_provenance
from probe.cli.progress import status, timed_status, warn
from probe.distributed import Rank, rank_device, rank_placement
from probe.models import ALIASES, LoadedModel, load_model


def method_help(*more: str) -> str:
    """--method's help: one clause per registered method (METHODS) and the `more` given; a new method documents
    itself."""
    return "; ".join([*(f"{name}: {method.summary or name}" for name, method in METHODS.items()), *more]) + "."


def metric_help() -> str:
    """--metric's help: one clause per registered metric (METRICS), with what it reads and where it is the default."""
    def clause(name: str) -> str:
        metric = METRICS[name]
        default = f", the default for {' and '.join(KINDS[kind] for kind in metric.default_for)}" \
            if metric.default_for else ""
        return f"{name} ({metric.reads}{default})"
    return "What is measured: " + "; ".join(clause(name) for name in METRICS) + "."

Model = Annotated[str, typer.Option(
    "--model", "-m", help="Alias, model folder, .gguf file, hub id, or FILE.py:FUNCTION (imports and runs that Python "
    "file). A folder's or hub model's own code never runs without --trust-remote-code.")]
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
    "measured by the gold class's cross-entropy, or --metric accuracy.")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Sequences per forward pass.")]
Force = Annotated[bool, typer.Option("--force", help="Overwrite output files that exist.")]
JsonFile = Annotated[Optional[Path], typer.Option(
    "--json", help="Write the results as JSON (strict: a NaN or infinity is written as null).")]
HtmlFile = Annotated[Optional[Path], typer.Option("--html", help="Write an interactive HTML report.")]
Heads = Annotated[Optional[str], typer.Option(
    "--heads", help="Heads to ablate: LAYER.HEAD items, e.g. 5.1,18.6; 5.* for a whole layer; ranges 3-4.0-2; "
    "encoder-decoders name the stack: enc5.1, dec5.1, x5.1 (cross-attention); default: every head, one at a time.")]
Data = Annotated[str, typer.Option(
    "--data", help="natural (embedded English text), repeated (BOS + random tokens repeated twice: losses on each "
    "copy too), or a UTF-8 text file.")]
Stack = Annotated[Optional[int], typer.Option(
    "--stack", help="Ablations of one layer stacked into one forward (default: as many as fit in 1 GiB; one at long "
    "context).")]
Naive = Annotated[bool, typer.Option(
    "--naive", help="One full forward per ablation, no reuse of the baseline (the reference the exact mode is "
    "checked against).")]
Results = Annotated[Optional[Path], typer.Option(
    "--results", help="Stream each finished head to this JSON-lines file (kept); default: a file in probe's cache, "
    "removed when done.")]
Resume = Annotated[bool, typer.Option(
    "--resume", help="Continue an interrupted sweep: skip the heads its results file already holds.")]


@dataclass(frozen=True)
class ModelChoice:
    """Which model to load, and where: the options every command that loads a model takes."""

    spec: str
    device: str | None = None
    dtype: str = "float32"
    device_map: str | None = None
    offload_folder: Path | None = None
    trust_remote_code: bool = False

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of `load_model`."""
        return {"dtype": self.dtype, "device": self.device, "device_map": self.device_map,
                "offload_folder": self.offload_folder, "trust_remote_code": self.trust_remote_code}


def load(choice: ModelChoice) -> LoadedModel:
    """Load the model saying so on stderr, on a terminal or off it (a spinner, or a line once it has taken a while),
    and how long it took (transformers' own progress bars off)."""
    from transformers.utils import logging as hf_logging  # a transformers submodule: loaded only to load a model

    hf_logging.disable_progress_bar()
    check_hub_reachable(choice.spec)  # one line now, not the hub client's half minute of retries
    gguf = choice.spec in ALIASES or choice.spec.endswith(".gguf")
    first_run = " (GGUF: dequantised on the first run, then cached)" if gguf else ""
    with timed_status(f"loading {choice.spec}{first_run}", f"loaded {choice.spec}"), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        loaded = load_model(choice.spec, **choice.arguments())
    for warning in caught:  # e.g. a tokenizer that cannot encode text: one line each, not Python's two
        if str(warning.message).startswith("the tokenizer of"):
            warn(f"warning: {warning.message}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    with status(f"hashing {choice.spec} for the provenance of the files written ..."):  # seconds for a big model
        record_provenance(loaded)
    return loaded


def load_for(choice: ModelChoice, rank: Rank | None) -> LoadedModel:
    """The model, for this process: under torchrun on its own GPU (or share of a device map)."""
    if rank is None:
        return load(choice)
    placement, folder, memory = rank_placement(rank, choice.device_map, choice.offload_folder)
    loaded = load_model(choice.spec, **{**choice.arguments(), "device": rank_device(rank, choice.device),
                                        "device_map": placement, "offload_folder": folder, "max_memory": memory})
    record_provenance(loaded)
    return loaded

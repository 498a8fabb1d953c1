"""`probe patch`: activation patching of every head between clean and corrupted prompts, with its DLA and classes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Optional

import typer

from probe.ablation import parse_heads
from probe.ablation.methods import PATCHES
from probe.hooks.layers import attention_layers
from probe.heads.classify import classify
from probe.ablation.stream import cached_results_path
from probe.cli.dla import self_repair_section
from probe.cli.options import (BatchSize, Count, CsvFile, Device, DeviceMap, Dtype, Force, Heads, HtmlFile, JsonFile,
                               Labels, Model, Naive, OffloadFolder, Pairs, RepairMethod, Results, Resume, Seed,
                               SelfRepair, Stack, Task, Top, TrustRemoteCode, check_contrast_task, load_for)
from probe.cli.outputs import check_sweep_outputs, save_results, warn_non_finite
from probe.cli.progress import console, heads_done, progress_bar, status
from probe.inputs import ContrastSet, ProbeOptions, build_probe_set
from probe.inputs.choice import probe_set_name
from probe.distributed import current, sharded_sweep
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL, LoadedModel
from probe.patching import PatchResult, patch_contrast
from probe.patching.paths import LOGITS, path_contrast
from probe.reports.patching import patch_page, patch_report, patch_rows

Component = Annotated[str, typer.Option(
    "--component", help=f"What of each head is patched: {', '.join(PATCHES)} (a key or value: its key/value "
    "group's, on a grouped-query model).")]
Noising = Annotated[bool, typer.Option(
    "--noising", help="Patch the corrupted run's values into the clean run (default: denoising, the clean values "
    "into the corrupted run).")]
ByPosition = Annotated[bool, typer.Option(
    "--by-position", help="Also patch each head at each position alone (one sweep per position).")]
Senders = Annotated[Optional[str], typer.Option(
    "--senders", help="Path patching: heads whose effect through the --receivers is measured (LAYER.HEAD items).")]
Receivers = Annotated[Optional[str], typer.Option(
    "--receivers", help="Path patching: heads of later layers whose --path-component input the senders reach, or "
    "logits: each sender's direct path into the logits (nothing downstream recomputed).")]
PathComponent = Annotated[str, typer.Option(
    "--path-component", help="Path patching: the receivers' query, key or value.")]
Estimate = Annotated[bool, typer.Option(
    "--estimate", help="Estimate every head's patch of --component by attribution patching (one forward and "
    "backward; a query or key with AtP*'s QK fix; each value marked estimated) instead of patching each head.")]
NoClasses = Annotated[bool, typer.Option("--no-classes", help="Do not classify the heads (saves a few forwards).")]


@dataclass(frozen=True)
class Request:
    """What to patch and how: everything of a run but the model, the pairs and the output files."""

    component: str
    noising: bool
    by_position: bool
    heads: str | None
    naive: bool
    estimate: bool
    batch_size: int
    stack: int | None


def check_request(inputs: dict[str, object], request: Request, distributed: bool) -> None:
    """Every option that can be judged without the model; `inputs`: --task, --pairs and --labels as given."""
    if sum(value is not None for value in inputs.values()) != 1:
        raise ProbeError("give --task or --pairs (or a classifier's --labels): one of them")
    if request.by_position and distributed:
        raise ProbeError("--by-position runs one sweep per position in one process: run it without torchrun")
    if request.estimate and (request.by_position or request.naive or distributed):
        raise ProbeError("--estimate covers each head at every position, in one process: drop --by-position, --naive "
                         "(and torchrun)")


def run_patches(loaded: LoadedModel, contrast: ContrastSet, request: Request, stream: Path, resume: bool,
                show: bool) -> PatchResult | None:
    """The patches (or their estimate), streamed to `stream`; None on a process of torchrun's that does not report."""
    chosen = parse_heads(request.heads, attention_layers(loaded.model)) if request.heads is not None else None
    if request.estimate:
        with status("estimating every head's patch ...", show):
            return patch_contrast(loaded, contrast, chosen, estimate=True, component=request.component,
                                  noising=request.noising, batch_size=request.batch_size)
    with progress_bar("patching heads", show=show) as update:
        return patch_contrast(loaded, contrast, chosen, component=request.component, noising=request.noising,
                              by_position=request.by_position, mode="naive" if request.naive else "exact",
                              batch_size=request.batch_size, stack=request.stack, progress=update,
                              on_result=heads_done(update),
                              run=partial(sharded_sweep, results_path=stream, resume=resume))


def add_paths(loaded: LoadedModel, contrast: ContrastSet, result: PatchResult, senders: str, receivers: str,
              component: str, batch_size: int) -> None:
    layers = attention_layers(loaded.model)
    with status("path patching ..."):
        to = receivers if receivers == LOGITS else parse_heads(receivers, layers)
        result.paths = path_contrast(loaded, contrast, parse_heads(senders, layers), to, component=component,
                                     batch_size=batch_size).to_dict()


def patch(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, task: Task = None, pairs: Pairs = None,
    labels: Labels = None, count: Count = 32, seed: Seed = 0, component: Component = "output",
    noising: Noising = False,
    by_position: ByPosition = False, heads: Heads = None, senders: Senders = None, receivers: Receivers = None,
    path_component: PathComponent = "value", naive: Naive = False, estimate: Estimate = False,
    no_classes: NoClasses = False, self_repair: SelfRepair = False, repair_method: RepairMethod = "zero",
    top: Top = 15, json_path: JsonFile = None, csv_path: CsvFile = None,
    html_path: HtmlFile = None, results: Results = None, resume: Resume = False, batch_size: BatchSize = 8,
    stack: Stack = None, device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None,
    offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Which heads carry a behaviour: each head's clean value patched into the corrupted run (or the other way),
    as the share of the clean logit difference it restores."""
    request = Request(component, noising, by_position, heads, naive, estimate, batch_size, stack)
    rank = current()
    main_process = rank is None or rank.is_main
    check_request({"--task": task, "--pairs": pairs, "--labels": labels}, request, rank is not None)
    check_contrast_task(task)
    if (senders is None) != (receivers is None):
        raise ProbeError("path patching takes --senders and --receivers together")
    if self_repair and labels is not None:
        raise ProbeError("--self-repair reads a language model's unembedding: not a classifier's --labels")
    check_sweep_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, results, resume=resume,
                        force=force, writes=main_process)
    loaded = load_for(rank, model, device, dtype, device_map, offload_folder, trust_remote_code)
    contrast = build_probe_set(probe_set_name("natural", labels=labels, task=task, pairs=pairs, contrast=True,
                                              compared=True), loaded,
                               ProbeOptions(task=task, pairs=pairs, labels=labels, num_seqs=count, seed=seed))
    stream = results or cached_results_path({"command": "patch", "model": model, "task": task, "pairs": str(pairs),
                                              "labels": str(labels),
                                              "count": count, "seed": seed, "dtype": dtype} | asdict(request))
    stream.parent.mkdir(parents=True, exist_ok=True)
    result = run_patches(loaded, contrast, request, stream, resume, main_process)
    if result is None:  # another process's share under torchrun: rank 0 reports
        return
    if senders is not None and receivers is not None:
        add_paths(loaded, contrast, result, senders, receivers, path_component, batch_size)
    if not no_classes:
        with status("classifying the heads ..."):
            result.add_classes(classify(loaded, batch_size=batch_size).labels)
    payload = result.to_dict()
    if self_repair:
        chosen = parse_heads(heads, attention_layers(loaded.model)) if heads is not None else None
        payload["self_repair"] = self_repair_section(loaded, contrast, repair_method, chosen, batch_size)
    warn_non_finite(payload)
    save_results(payload, "patch", json_path, csv_path, html_path, rows=patch_rows,
                 page=lambda p: patch_page(p, top=top))
    patch_report(payload, console, top=top)
    if results is None:
        stream.unlink(missing_ok=True)  # the cache stream only serves --resume

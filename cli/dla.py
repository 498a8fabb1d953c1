"""`probe dla`: direct logit attribution per head on clean/corrupt pairs, and `--self-repair` (also probe patch's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from probe.ablation import parse_heads
from probe.ablation.heads import Head
from probe.cli.options import (BatchSize, Count, CsvFile, Device, DeviceMap, Dtype, Force, Heads, HtmlFile, JsonFile,
                               Model, OffloadFolder, Pairs, RepairMethod, Seed, SelfRepair, Task, Top, TrustRemoteCode,
                               check_contrast_task, load)
from probe.cli.outputs import check_outputs, save_results, warn_non_finite
from probe.cli.progress import console, progress_bar, status
from probe.inputs import ContrastSet, ProbeOptions, build_probe_set
from probe.dla import logit_attribution
from probe.errors import ProbeError
from probe.hooks.layers import attention_layers
from probe.models import DEFAULT_MODEL, LoadedModel
from probe.reports.dla import dla_page, dla_report, dla_rows
from probe.selfrepair import contrast_self_repair


def self_repair_section(loaded: LoadedModel, contrast: ContrastSet, method: str, heads: Sequence[Head] | None,
                        batch_size: int, show: bool = True) -> dict[str, Any]:
    """`SelfRepair.to_dict()` of the chosen heads (every head by default), with a progress bar."""
    with progress_bar("self-repair", show=show) as update:
        return contrast_self_repair(loaded, contrast, heads, method=method, batch_size=batch_size,
                                    progress=update).to_dict()


def dla(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, task: Task = None, pairs: Pairs = None,
    count: Count = 32, seed: Seed = 0, top: Top = 15, json_path: JsonFile = None, csv_path: CsvFile = None,
    html_path: HtmlFile = None, self_repair: SelfRepair = False, heads: Heads = None,
    repair_method: RepairMethod = "zero", batch_size: BatchSize = 8, device: Device = None, dtype: Dtype = "float32",
    device_map: DeviceMap = None, offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Direct logit attribution: each head's share of logit(answer) - logit(distractor) at the last prompt position
    of the clean prompts, through the final norm frozen; the shares of every component sum to the model's own."""
    if (task is None) == (pairs is None):
        raise ProbeError("give --task or --pairs (one of them)")
    check_contrast_task(task)
    if heads is not None and not self_repair:
        raise ProbeError("--heads chooses the heads --self-repair ablates: add --self-repair (DLA covers every head)")
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    chosen = None if heads is None else parse_heads(heads, attention_layers(loaded.model))  # before any work
    contrast = build_probe_set("contrast", loaded, ProbeOptions(task=task, pairs=pairs, num_seqs=count, seed=seed))
    with status(f"attributing {len(contrast)} pairs ..."):
        payload = logit_attribution(loaded, contrast, batch_size=batch_size).to_dict()
    if self_repair:
        payload["self_repair"] = self_repair_section(loaded, contrast, repair_method, chosen, batch_size)
    warn_non_finite(payload)
    save_results(payload, "dla", json_path, csv_path, html_path, rows=dla_rows, page=lambda p: dla_page(p, top=top))
    dla_report(payload, console, top=top)

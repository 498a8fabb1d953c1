"""`probe circuits`: induction heads, the earlier heads whose output feeds their keys (K-composition), which of
those are previous-token heads, and an ablation check of each pair."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import typer

from probe.cli.options import (BatchSize, CsvFile, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model,
                               ModelChoice, NumSeqs, OffloadFolder, RepeatLen, Seed, SeqLen, Top, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs, save, save_json
from probe.ablation.sweep import sweep_forwards
from probe.cli.plans import (SWEEP_FORWARDS, Work, classify_works, composition_work, counted_sweep_work, estimated,
                             planned_first, say)
from probe.cli.progress import console, stage_progress
from probe.circuits.pairs import CLASSES, STAGE_UNITS, Check
from probe.circuits.pairs import circuits as find_circuits
from probe.inputs import DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, ProbeOptions, build_probe_set
from probe.errors import ProbeError
from probe.hooks.layers import attention_layers
from probe.models import DEFAULT_MODEL, LoadedModel
from probe.reports.circuits import circuit_rows, circuits_page, circuits_report
from probe.reports.files import write_csv, write_text

def circuits_work(loaded: LoadedModel, options: ProbeOptions, check: bool) -> list[Work]:
    """K-composition in layer pairs and the classification's passes; with `check`, the ablation check, which the
    classification sizes (each induction head it finds with its feeder, alone and together): planned in a line of
    its own once sized (`check_work`), here named and bounded by every head alone and every head past the first
    layer with its feeder, and the one forward its plan times."""
    works = [composition_work(loaded, "k"), *classify_works(loaded, options, list(CLASSES))]
    if check:
        layers = attention_layers(loaded.model)
        bound = 2 * sum(layer.n_heads for layer in layers) - layers[0].n_heads
        batch = build_probe_set("repeated", loaded, options).input_ids
        works += [Work("", batch, (0.0, 1.0)),
                  Work(f"the ablation check (each induction head found and its feeder, alone and together: up to "
                       f"{bound} ablations)", batch, (0.0, SWEEP_FORWARDS[1] * bound), later=True)]
    return works


def check_work(loaded: LoadedModel, chosen: Check) -> Work:
    """The ablation check the classification chose, in forwards of its repeated set as the sweep counts them."""
    heads = f"{len(chosen.heads)} heads, {len(chosen.groups)} of them induction heads, alone and in pairs"
    return counted_sweep_work("the ablation check", heads, len(chosen.heads) + len(chosen.groups),
                              sweep_forwards(loaded, chosen.heads, chosen.groups), chosen.probe_set.input_ids)


@dataclass
class _Plans:
    """The command's two plan lines: the first before its work, the check's once the classification has sized it
    (said wherever the first was said: that line leaves the check to it)."""

    loaded: LoadedModel
    options: ProbeOptions
    batch_size: int
    end_stage: Callable[[], None]  # the classification's last line comes before the check's plan times a forward
    said: bool = False

    def first(self, check: bool) -> None:
        estimate = estimated(self.loaded, circuits_work(self.loaded, self.options, check), self.batch_size)
        self.said = estimate is not None and say(estimate)

    def check(self, chosen: Check) -> None:
        self.end_stage()
        estimate = estimated(self.loaded, [check_work(self.loaded, chosen)], self.batch_size, warm=True)
        if estimate is not None:
            say(estimate, 0.0 if self.said else None)


NoCheck = Annotated[bool, typer.Option("--no-check", help="Skip the ablation check (weights and classification only).")]


def circuits(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, top: Top = 3, no_check: NoCheck = False,
    seq_len: SeqLen = 128, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, repeat_len: RepeatLen = DEFAULT_REPEAT_LEN,
    seed: Seed = DEFAULT_SEED, json_path: JsonFile = None, csv_path: CsvFile = None, html_path: HtmlFile = None,
    batch_size: BatchSize = 8,
    device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None,
    offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Induction heads and the earlier heads that feed their keys (K-composition, Elhage et al. 2021), marked when
    they are previous-token heads, each pair ablated together vs alone on the repeated set."""
    if top < 1:
        raise ProbeError(f"--top must be at least 1, got {top}")
    check_outputs({"--json": json_path, "--csv": csv_path, "--html": html_path}, force=force)
    loaded = load(ModelChoice(model, device, dtype, device_map, offload_folder, trust_remote_code))
    options = ProbeOptions(seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len, seed=seed)
    with stage_progress("circuits: ", STAGE_UNITS) as stages:
        plans = _Plans(loaded, options, batch_size, stages.end)
        update = planned_first(lambda: plans.first(not no_check), stages)
        result = find_circuits(loaded, top=top, check=not no_check, seq_len=seq_len, num_seqs=num_seqs,
                               repeat_len=repeat_len, seed=seed, batch_size=batch_size, progress=update,
                               on_check=plans.check)
    payload = result.to_dict()
    save_json(json_path, payload, "circuits")
    save(csv_path, lambda path: write_csv(path, circuit_rows(payload)))
    save(html_path, lambda path: write_text(path, circuits_page(payload)))
    circuits_report(payload, console)

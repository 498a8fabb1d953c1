"""`probe atlas`: one page where every head's evidence meets (pattern, weights, cause), with a head finder and one
dashboard per head."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from probe.ablation.estimate import ESTIMATE_BUDGET
from probe.atlas import atlas as build_atlas
from probe.atlas.run import DEFAULT_NUM_SEQS, STAGE_UNITS, bounded_stages
from probe.cli.options import (BatchSize, Count, Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, Model,
                               ModelChoice, NumSeqs, OffloadFolder, RepeatLen, Results, Resume, Seed, SelfRepair,
                               SeqLen, Task, TextData, Thresholds, TrustRemoteCode, load, parse_thresholds)
from probe.cli.outputs import check_outputs, save, save_json, warn_non_finite
from probe.cli.plans import (SWEEP_FORWARDS, Work, classify_works, composition_work, plan, planned_first,
                             sweep_work)
from probe.cli.progress import console, stage_progress
from probe.heads.evidence import RULES
from probe.hooks.layers import attention_layers
from probe.inputs import DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN, ProbeOptions, build_probe_set
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL, LoadedModel
from probe.reports.atlas import atlas_page, atlas_report
from probe.reports.files import write_text

PLAN_STAGES = (6.0, 22.0)  # copying, examples, patterns and DLA (each position's heads to the next token's logit),
# in forwards of the natural set (bench/NOTES.md: about 13 on SmolLM2)
SELF_REPAIR = (0.5, 1.5)  # one head zero-ablated on the natural set, its total and direct effects, in its forwards


def atlas_work(loaded: LoadedModel, options: ProbeOptions, fast: bool, task: ProbeOptions | None,
               self_repair: bool) -> list[Work]:
    """The atlas' stages in forwards of their sets: classify's passes, the weights' K/Q/V composition in layer
    pairs, every head ablated on natural text (the exact sweep, or the estimate's budget of forward-equivalents),
    the heads of classes checked on a part of a set (up to every head; which, classify decides), the task's sweep,
    the examples, patterns and DLA, and self-repair."""
    natural = build_probe_set("natural", loaded, options).input_ids
    heads = sum(layer.n_heads for layer in attention_layers(loaded.model))
    works = [*classify_works(loaded, options), composition_work(loaded, "kqv")]
    works.append(Work(f"estimating every head's ablation (about {ESTIMATE_BUDGET:g} forwards)", natural,
                      (0.6 * ESTIMATE_BUDGET, 1.5 * ESTIMATE_BUDGET)) if fast else
                 sweep_work("ablating every head", heads, natural))
    for name in sorted({rule.probe for rule in RULES.values() if rule.probe is not None}):
        batch = build_probe_set(name, loaded, options).input_ids
        works.append(Work(f"ablating the heads classified by their part of the {name} set (up to {heads})", batch,
                          (0.0, SWEEP_FORWARDS[1] * heads)))
    if task is not None:
        works.append(sweep_work("ablating every head on the task", heads, build_probe_set("task", loaded,
                                                                                           task).input_ids))
    works.append(Work("copying scores, examples, patterns and DLA", natural, PLAN_STAGES))
    if self_repair:
        works.append(Work(f"self-repair ({heads} heads, one forward each)", natural,
                          (SELF_REPAIR[0] * heads, SELF_REPAIR[1] * heads)))
    return works


Fast = Annotated[bool, typer.Option(
    "--fast", help="Estimate the ablation deltas on natural text (attribution patching, ~10 forward-equivalents) "
    "instead of the exact sweep; the page marks them estimated. A --task sweep stays exact.")]


def atlas(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, data: TextData = None,
    seq_len: SeqLen = DEFAULT_SEQ_LEN, num_seqs: NumSeqs = DEFAULT_NUM_SEQS, repeat_len: RepeatLen = DEFAULT_REPEAT_LEN,
    seed: Seed = DEFAULT_SEED, threshold: Thresholds = None, task: Task = None, count: Count = 32, fast: Fast = False,
    results: Results = None, resume: Resume = False, self_repair: SelfRepair = False, json_path: JsonFile = None,
    html_path: HtmlFile = None,
    batch_size: BatchSize = 8, device: Device = None, dtype: Dtype = "float32", device_map: DeviceMap = None,
    offload_folder: OffloadFolder = None, force: Force = False,
) -> None:
    """Every head's classes, each label checked against its weights and its causal effect, examples over the data,
    what it writes, its composition partners and its ablation effects: one offline page (--html) and JSON."""
    thresholds = parse_thresholds(threshold or [])
    if resume and results is None:
        raise ProbeError("--resume continues the sweeps kept in a --results folder: give --results")
    check_outputs({"--json": json_path, "--html": html_path}, force=force)
    loaded = load(ModelChoice(model, device, dtype, device_map, offload_folder, trust_remote_code))
    options = ProbeOptions(data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len, seed=seed)
    tasks = None if task is None else replace(options, task=task, num_seqs=count)
    with stage_progress("atlas: ", STAGE_UNITS, bounded_stages(fast=fast)) as stages:
        update = planned_first(lambda: None if resume else plan(
            loaded, atlas_work(loaded, options, fast, tasks, self_repair), batch_size), stages)
        result = build_atlas(loaded, data=data, seq_len=seq_len, num_seqs=num_seqs, repeat_len=repeat_len, seed=seed,
                             thresholds=thresholds, task=task, task_count=count, fast=fast, batch_size=batch_size,
                             results_dir=results, resume=resume, progress=update, self_repair=self_repair)
    payload = result.to_dict()
    save_json(json_path, payload, "atlas")
    save(html_path, lambda path: write_text(path, atlas_page(payload, {name: block.page_payload() for name, block
                                                                       in result.patterns.items()})))
    warn_non_finite(payload)
    atlas_report(payload, console)

"""Attribution patching (Nanda 2023; Kramar et al. 2024, "AtP*"): every head's output patch estimated at once from
one forward and backward of the patched-into run, as the first-order change of the logit difference,

    LD_patched(h) ~ LD_target + sum over rows, positions and dimensions of dLD/dz_h * (z_h,source - z_h,target)

with z_h the head's output (its slice of the output projection's input). AtP* adds two refinements for the inputs of
attention (the QK fix, for patches that move a saturated softmax) and against cancellation (GradDrop); a head's
output patch moves no softmax of its own layer, and neither refinement is applied here. Cost: the source run's
outputs, one forward and backward, and the source's baseline (about 4 forward-equivalents). Every value is marked
estimated; `bench/patching.py` prints its Spearman against the exact result.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from probe.ablation.heads import Head, all_heads
from probe.ablation.metrics import choose_metric
from probe.ablation.statistics import HeadOutputs, head_outputs
from probe.ablation.sweep import baseline_metric
from probe.attention import attention_hooks, attention_layers, logits_of, run_model
from probe.data import ProbeSet
from probe.hooks.stacks import layer_names
from probe.models import LoadedModel
from probe.patching.heads import PatchEntry, PatchResult, check_runs, mean_logit_diff, row_logit_diffs
from probe.contrast import normalised_effect


def _first_order(loaded: LoadedModel, target: ProbeSet, source: HeadOutputs, batch_size: int) -> tuple[Tensor, float]:
    """(n_layers, n_heads) summed first-order changes of the mean logit difference, and the target's mean."""
    metric = choose_metric(loaded, target)
    layers = attention_layers(loaded.model)
    change = torch.zeros(len(layers), max(layer.n_heads for layer in layers), dtype=torch.float64)
    total, rows = 0.0, target.input_ids.shape[0]
    for batch, (ids, mask) in enumerate(target.batches(batch_size)):
        captured: dict[int, Tensor] = {}

        def capture(layer: int, heads: Tensor) -> Tensor:  # heads: (batch, positions, n_heads, head_dim)
            heads = heads if heads.requires_grad else heads.detach().requires_grad_()
            captured[layer] = heads
            return heads

        with torch.enable_grad():
            with attention_hooks(loaded.model, edit_heads=capture):
                logits = logits_of(run_model(loaded.model, ids, mask))
            scored = target.scored[batch * batch_size:batch * batch_size + ids.shape[0]]
            diffs = row_logit_diffs(metric, logits, ids, scored)  # (batch,)
            order = sorted(captured)
            grads = torch.autograd.grad(diffs.sum() / rows, [captured[layer] for layer in order])
        total += float(diffs.detach().double().sum()) / rows
        for layer, grad in zip(order, grads):
            delta = source.at(layer, captured[layer], batch) - captured[layer].detach()
            change[layer, :grad.shape[2]] += (grad * delta).double().sum(dim=(0, 1, 3)).cpu()
    return change, total


def estimate_patches(loaded: LoadedModel, clean: ProbeSet, corrupt: ProbeSet, heads: Sequence[Head] | None = None, *,
                     noising: bool = False, batch_size: int = 8, data: str = "") -> PatchResult:
    """Every head's output patch between the clean and corrupted runs (probe.patching.contrast_runs), estimated by
    attribution patching (see the module docstring); a PatchResult whose `mode` is "estimate"."""
    started = time.perf_counter()
    check_runs(clean, corrupt)
    target, source = (clean, corrupt) if noising else (corrupt, clean)
    change, target_ld = _first_order(loaded, target, head_outputs(loaded, source, batch_size=batch_size), batch_size)
    source_ld = mean_logit_diff(baseline_metric(loaded, source, batch_size=batch_size))
    clean_ld, corrupt_ld = (target_ld, source_ld) if noising else (source_ld, target_ld)
    entries = [PatchEntry(((layer, head),), target_ld + float(change[layer, head]),
                          normalised_effect(target_ld + float(change[layer, head]), clean_ld, corrupt_ld))
               for layer, head in (all_heads(loaded.model) if heads is None else heads)]
    layers = attention_layers(loaded.model)
    return PatchResult(loaded.name, "output", "noising" if noising else "denoising", data or clean.description,
                       clean_ld, corrupt_ld, len(layers), max(layer.n_heads for layer in layers),
                       max(layer.n_kv_heads for layer in layers), entries, mode="estimate",
                       path="estimate: attribution patching, first order (no QK fix, no GradDrop)",
                       seconds=time.perf_counter() - started, layer_names=layer_names(layers))

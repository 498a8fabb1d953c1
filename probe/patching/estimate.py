"""Attribution patching (Nanda 2023; Kramar et al. 2024, AtP*; docs/patching.md): every head's patch from one
forward and backward, LD_target + dLD/dz_h . (z_h,patched - z_h,target); a query, key or value through AtP*'s QK fix
(the head's attention recomputed with the patched input). No GradDrop; every value is marked estimated."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from probe.ablation.estimate import keeping_graph, scaled_gradients
from probe.ablation.heads import Ablation, Head
from probe.ablation.metrics import Metric, choose_metric
from probe.ablation.statistics import HeadOutputs
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.errors import ProbeError
from probe.hooks.blocked import blocked_attention
from probe.hooks.stacks import layer_names
from probe.hooks.types import AttentionInputs, HookContext
from probe.inputs import ProbeSet, normalised_effect
from probe.models import LoadedModel
from probe.provenance import model_dtype
from probe.patching.heads import PatchEntry, PatchResult, check_runs, patch_units, row_logit_diffs

RECOMPUTE_TOLERANCE = 1e-4  # the QK fix's recomputation of an unpatched head against the model's own output
# in float32; a half-precision model rounds its output to its dtype (bfloat16: by up to 2^-9 of values near 1, which
# refused every query, key and value estimate), so there the tolerance is 2 eps of the dtype (2^-6 in bfloat16)


@dataclass
class _Pass:
    """One batch of the target run: its head outputs z, dLD/dz, and (QK fix) each layer's attention inputs."""

    heads: dict[int, Tensor]
    grads: dict[int, Tensor]  # times `scale`: float16's gradients of a mean over rows kept in range (scaled_gradients)
    inputs: dict[int, AttentionInputs]
    scale: float = 1.0


def _target_pass(loaded: LoadedModel, metric: Metric, ids: Tensor, mask: Tensor | None, scored: Tensor | None,
                 rows: int, keep_inputs: bool) -> tuple[_Pass, float]:
    """A forward and backward of one target batch; the batch's summed logit differences / `rows`."""
    captured: dict[int, Tensor] = {}
    inputs: dict[int, AttentionInputs] = {}

    def record(seen: AttentionInputs, ctx: HookContext) -> None:
        inputs[ctx.layer] = replace(seen, query=seen.query.detach(), key=seen.key.detach(), value=seen.value.detach())

    with torch.enable_grad():
        with attention_hooks(loaded.model, points={"z": keeping_graph(captured),
                                                   **({"inputs": record} if keep_inputs else {})}):
            logits = logits_of(run_model(loaded.model, ids, mask))
        diffs = row_logit_diffs(metric, logits, ids, scored)  # (batch,)
        order = sorted(captured)
        grads, scale = scaled_gradients(diffs.sum() / rows, rows, [captured[layer] for layer in order])
    heads = {layer: captured[layer].detach() for layer in order}
    kept = {layer: grad for layer, grad in zip(order, grads) if grad is not None}  # every head feeds the logits
    return _Pass(heads, kept, inputs, scale), float(diffs.detach().double().sum()) / rows


def _head_slice(value: Tensor | None, heads: list[int]) -> Tensor | None:
    """A mask or position bias cut to `heads` where it has a head axis (dim 1) of more than one."""
    if value is None or value.dim() < 4 or value.shape[1] == 1:
        return value
    return value[:, heads]


def _recomputed(inputs: AttentionInputs, heads: list[int], group: int) -> Tensor:
    """The outputs of `heads` (all of KV head `group`) recomputed from `inputs` by eager attention."""
    out = blocked_attention(inputs.query[:, heads], inputs.key[:, group:group + 1], inputs.value[:, group:group + 1],
                            scaling=inputs.scaling, mask=_head_slice(inputs.mask, heads), causal=inputs.mask is None,
                            on_block=None, softcap=inputs.softcap,
                            sinks=None if inputs.sinks is None else inputs.sinks[heads],
                            position_bias=_head_slice(inputs.position_bias, heads))
    return out.transpose(1, 2)


def _local_change(one: _Pass, layer: int, unit: Ablation, component: str, source: Tensor) -> float:
    """The QK fix's first-order change of a unit: outputs recomputed with the source's `component`, dot dLD/dz."""
    inputs = one.inputs[layer]
    heads = [head for _, head in unit]
    group = heads[0] // (inputs.query.shape[1] // inputs.key.shape[1])
    index = heads[0] if component == "query" else group
    patched_tensor = getattr(inputs, component).clone()
    patched_tensor[:, index] = source[:, index].to(patched_tensor.dtype)
    before = _recomputed(inputs, heads, group)
    gap = float((before - one.heads[layer][:, :, heads]).abs().max())
    if gap > max(RECOMPUTE_TOLERANCE, 2 * torch.finfo(before.dtype).eps) * max(1.0, float(before.abs().max())):
        raise ProbeError(f"the QK fix cannot rebuild layer {layer}'s attention from its inputs (off by {gap:.3g}): "
                         "estimate the output component, or patch exactly", parameter="component")
    after = _recomputed(replace(inputs, **{component: patched_tensor}), heads, group)
    return float((one.grads[layer][:, :, heads] * (after - before)).double().sum()) / one.scale


def _first_order(loaded: LoadedModel, target: ProbeSet, source: HeadOutputs, units: list[Ablation], component: str,
                 batch_size: int) -> tuple[list[float], float]:
    """Each unit's summed first-order change of the mean logit difference, and the target's mean."""
    metric = choose_metric(loaded, target)
    changes, total, rows = [0.0] * len(units), 0.0, target.input_ids.shape[0]
    for batch, ((ids, mask), scored) in enumerate(zip(target.batches(batch_size), target.scored_batches(batch_size))):
        one, batch_total = _target_pass(loaded, metric, ids, mask, scored, rows, component != "output")
        total += batch_total
        for index, unit in enumerate(units):
            layer = unit[0][0]
            if component == "output":
                heads = [head for _, head in unit]
                delta = source.at(layer, one.heads[layer], batch)[:, :, heads] - one.heads[layer][:, :, heads]
                changes[index] += float((one.grads[layer][:, :, heads] * delta).double().sum()) / one.scale
            else:
                changes[index] += _local_change(one, layer, unit, component, source.values[batch][layer])
    return changes, total


def _source_pass(loaded: LoadedModel, source: ProbeSet, component: str, batch_size: int) -> tuple[HeadOutputs, float]:
    """The source run's head outputs (or inputs `component`) per batch and its mean logit difference."""
    metric = choose_metric(loaded, source)
    values: list[dict[int, Tensor]] = []
    total = 0.0

    def record(seen: Any, ctx: HookContext) -> None:
        values[-1][ctx.layer] = (seen if component == "output" else getattr(seen, component)).detach().clone()

    with torch.no_grad(), attention_hooks(loaded.model, {"z" if component == "output" else "inputs": record}):
        for (ids, mask), scored in zip(source.batches(batch_size), source.scored_batches(batch_size)):
            values.append({})
            logits = logits_of(run_model(loaded.model, ids, mask))
            total += float(row_logit_diffs(metric, logits, ids, scored).double().sum())
    return HeadOutputs(values, source.description), total / source.input_ids.shape[0]


def estimate_patches(loaded: LoadedModel, clean: ProbeSet, corrupt: ProbeSet, heads: Sequence[Head] | None = None, *,
                     component: str = "output", noising: bool = False, batch_size: int = 8,
                     data: str = "") -> PatchResult:
    """Every head's patch of `component`, estimated by attribution patching with the QK fix (`mode` "estimate")."""
    started = time.perf_counter()
    check_runs(clean, corrupt)
    target, source = (clean, corrupt) if noising else (corrupt, clean)
    units = patch_units(loaded, heads, component)
    values, source_ld = _source_pass(loaded, source, component, batch_size)
    changes, target_ld = _first_order(loaded, target, values, units, component, batch_size)
    clean_ld, corrupt_ld = (target_ld, source_ld) if noising else (source_ld, target_ld)
    entries = [PatchEntry(unit, target_ld + change, normalised_effect(target_ld + change, clean_ld, corrupt_ld))
               for unit, change in zip(units, changes)]
    layers = attention_layers(loaded.model)
    how = "first order" if component == "output" else "the QK fix: each head's attention recomputed, then first order"
    return PatchResult(loaded.name, component, "noising" if noising else "denoising", data or clean.description,
                       clean_ld, corrupt_ld, len(layers), max(layer.n_heads for layer in layers),
                       max(layer.n_kv_heads for layer in layers), entries, mode="estimate",
                       path=f"estimate: attribution patching, {how} (no GradDrop)",
                       seconds=time.perf_counter() - started, layer_names=layer_names(layers),
                       dtype=model_dtype(loaded))

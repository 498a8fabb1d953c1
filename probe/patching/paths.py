"""Path patching (Wang et al. 2022; Goldowsky-Dill et al. 2023; docs/patching.md): a sender head's effect through one
path only, into receivers' query, key or value (S + S x R forwards), or into the logits through W_O (`direct_path`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.ablation.heads import Head, check_heads
from probe.ablation.methods import PATCHES, InputPatch, ablated
from probe.ablation.metrics import choose_metric
from probe.ablation.runners import batch_contexts
from probe.ablation.statistics import HeadOutputs, head_outputs
from probe.ablation.sweep import baseline_metric
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.residual import model_structure
from probe.hooks.restore import restoring
from probe.inputs import ContrastSet, ProbeSet, normalised_effect
from probe.errors import ProbeError
from probe.hooks.points import Writer
from probe.hooks.types import AttentionInputs, HookContext
from probe.models import LoadedModel
from probe.patching.heads import check_runs, mean_logit_diff, row_logit_diffs
from probe.patching.runs import contrast_runs


LOGITS = "logits"
"""The receiver that is the logits themselves: the sender's direct path (`direct_path`)."""


@dataclass
class PathResult:
    """The effect of each sender through each receiver's `component` (the direct path: receiver LOGITS, "logits")."""

    model: str
    component: str
    senders: list[Head]
    receivers: list[Head | str]
    logit_diff: list[list[float]]
    patch_effect: list[list[float]]
    clean_logit_diff: float
    corrupt_logit_diff: float

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "component": self.component, "senders": [list(h) for h in self.senders],
                "receivers": [h if isinstance(h, str) else list(h) for h in self.receivers],
                "logit_diff": self.logit_diff,
                "patch_effect": self.patch_effect, "clean_logit_diff": self.clean_logit_diff,
                "corrupt_logit_diff": self.corrupt_logit_diff}


def _frozen_but(sender: Head, clean: HeadOutputs, corrupt: HeadOutputs,
                batch: int) -> Writer:
    """A `z` writer: every head at its corrupted output but `sender`, at its clean one."""
    def edit(heads: Tensor, ctx: HookContext) -> Tensor:  # heads: (batch, positions, n_heads, head_dim)
        layer = ctx.layer
        frozen = corrupt.at(layer, heads, batch).clone()
        if layer == sender[0]:
            frozen[:, :, sender[1]] = clean.at(layer, heads, batch)[:, :, sender[1]]
        return frozen
    return edit


def _recorded(loaded: LoadedModel, ids: Tensor, mask: Tensor | None, edit: Writer,
              component: str, layers: set[int]) -> dict[int, Tensor]:
    """Pass 1: the receivers' layers' `component` inputs with the heads edited by `edit`."""
    seen: dict[int, Tensor] = {}

    def record(inputs: AttentionInputs, ctx: HookContext) -> None:
        if ctx.layer in layers:
            seen[ctx.layer] = getattr(inputs, component).detach().clone()

    with torch.no_grad(), attention_hooks(loaded.model, points={"z": edit, "inputs": record}):
        run_model(loaded.model, ids, mask, logits=False)
    return seen


def path_patch(loaded: LoadedModel, clean: ProbeSet, corrupt: ProbeSet, senders: Sequence[Head],
               receivers: Sequence[Head], *, component: str = "value", batch_size: int = 8) -> PathResult:
    """Each sender's effect through each receiver's `component` (query, key or value; see the module docstring)."""
    check_runs(clean, corrupt)
    if component not in PATCHES or not issubclass(PATCHES[component], InputPatch):
        raise ProbeError(f"path patching reaches a receiver through its query, key or value, not {component!r}",
                         parameter="component")
    layers = attention_layers(loaded.model)
    check_heads(layers, list(senders) + list(receivers))
    later = [(s, r) for s in senders for r in receivers if s[0] >= r[0]]
    if later:
        raise ProbeError(f"a receiver reads a sender's output only in a later layer: {later[0][1]} does not come after "
                         f"{later[0][0]}", parameter="receivers")
    clean_ld, corrupt_ld = (mean_logit_diff(baseline_metric(loaded, run, batch_size=batch_size))
                            for run in (clean, corrupt))
    clean_out, corrupt_out = (head_outputs(loaded, run, batch_size=batch_size) for run in (clean, corrupt))
    metric = choose_metric(loaded, corrupt)
    sums = torch.zeros(len(senders), len(receivers), dtype=torch.float64)
    contexts = batch_contexts(corrupt, batch_size)
    for batch, ((ids, mask), scored) in enumerate(zip(corrupt.batches(batch_size), corrupt.scored_batches(batch_size))):
        for i, sender in enumerate(senders):
            edit = _frozen_but(sender, clean_out, corrupt_out, batch)
            seen = _recorded(loaded, ids, mask, edit, component, {layer for layer, _ in receivers})
            method = PATCHES[component](HeadOutputs([{}] * batch + [seen], "path patching's first pass")).bound_to(
                contexts)
            for j, receiver in enumerate(receivers):
                with torch.no_grad(), ablated(loaded.model, [(receiver,)], method, contexts[batch]):
                    logits = logits_of(run_model(loaded.model, ids, mask))
                sums[i, j] += float(row_logit_diffs(metric, logits, ids, scored).double().sum())
    means = (sums / corrupt.input_ids.shape[0]).tolist()
    return PathResult(loaded.name, component, list(senders), list(receivers), means,
                      [[normalised_effect(value, clean_ld, corrupt_ld) for value in row] for row in means],
                      clean_ld, corrupt_ld)


def _final_stream(loaded: LoadedModel, norm: torch.nn.Module, ids: Tensor, mask: Tensor | None) -> Tensor:
    """(batch, positions, d_model): the residual stream the final norm reads on one unchanged forward."""
    seen: dict[str, Tensor] = {}

    def keep(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["stream"] = (args[0] if args else kwargs["hidden_states"]).detach()

    with restoring() as undo:
        undo.append(norm.register_forward_pre_hook(keep, with_kwargs=True).remove)
        with torch.no_grad():
            run_model(loaded.model, ids, mask, logits=False)
    return seen["stream"]


def _check_readout(found: float, expected: float) -> None:
    """The final norm and unembedding applied to the recorded stream must give the model's own logit difference."""
    if abs(found - expected) > 1e-3 * max(1.0, abs(expected)):
        raise ProbeError(f"the final norm and unembedding give a corrupted logit difference of {found:.5f}, the model "
                         f"{expected:.5f}: its logits are not the unembedded final stream (a scale or cap after the "
                         "LM head), so the direct path cannot be read", parameter="receivers")


def direct_path(loaded: LoadedModel, clean: ProbeSet, corrupt: ProbeSet, senders: Sequence[Head], *,
                batch_size: int = 8) -> PathResult:
    """Each sender's effect straight into the logits, every other path frozen at the corrupted run (Wang et al.)."""
    check_runs(clean, corrupt)
    check_heads(attention_layers(loaded.model), list(senders))
    structure = model_structure(loaded.model)  # refuses a model without an LM head or a final norm it can find
    clean_ld, corrupt_ld = (mean_logit_diff(baseline_metric(loaded, run, batch_size=batch_size))
                            for run in (clean, corrupt))
    clean_out, corrupt_out = (head_outputs(loaded, run, batch_size=batch_size) for run in (clean, corrupt))
    metric = choose_metric(loaded, corrupt)
    sums, unpatched = torch.zeros(len(senders), 1, dtype=torch.float64), 0.0
    for batch, ((ids, mask), scored) in enumerate(zip(corrupt.batches(batch_size), corrupt.scored_batches(batch_size))):
        stream = _final_stream(loaded, structure.norm, ids, mask)
        read = lambda delta: row_logit_diffs(metric, structure.head(structure.norm(stream + delta)), ids,  # noqa: E731
                                             scored).double().sum()
        with torch.no_grad():
            unpatched += float(read(torch.zeros_like(stream)))
            for i, (layer, head) in enumerate(senders):
                values = corrupt_out.values[batch][layer]  # (rows, positions, n_heads, head_dim)
                change = (clean_out.at(layer, values, batch) - values)[:, :, head]
                rows = structure.head_matrix(layer)[head].to(change.device)  # (value_dim, d_model)
                sums[i, 0] += float(read((change.double() @ rows).to(stream.dtype)))
    rows_total = corrupt.input_ids.shape[0]
    _check_readout(unpatched / rows_total, corrupt_ld)
    means = (sums / rows_total).tolist()
    return PathResult(loaded.name, LOGITS, list(senders), [LOGITS], means,
                      [[normalised_effect(row[0], clean_ld, corrupt_ld)] for row in means], clean_ld, corrupt_ld)


def path_contrast(loaded: LoadedModel, contrast: ContrastSet, senders: Sequence[Head],
                  receivers: Sequence[Head] | str, *, component: str = "value", batch_size: int = 8) -> PathResult:
    """`path_patch` between the contrast set's clean and corrupt prompts; `receivers="logits"`: `direct_path`."""
    clean, corrupt = contrast_runs(loaded, contrast)
    if isinstance(receivers, str):
        if receivers != LOGITS:
            raise ProbeError(f"receivers {receivers!r}: give heads, or {LOGITS!r} for the direct path",
                             parameter="receivers")
        return direct_path(loaded, clean, corrupt, senders, batch_size=batch_size)
    return path_patch(loaded, clean, corrupt, senders, receivers, component=component, batch_size=batch_size)

"""`estimate`: every head's zero-ablation delta from a few forward and backward passes instead of a sweep.

Attribution patching (Syed et al. 2023; Kramar et al. 2024) gives the first-order term -<dL/dz_h, z_h>; zero ablation
is a large step (on SmolLM2 first order explains about a third of a typical delta), so, as AtP*, a Gauss-Newton
second-order term from `samples` sampled-label backward passes, and the heads whose estimate rests most on it ablated
exactly until the budget is spent."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from probe.ablation.blocks import WORK_UNITS, Blocks, Readout, find_blocks, forward_costs, keeping_outputs
from probe.ablation.heads import Head, ablation_list, layer_shape
from probe.ablation.methods import ZeroAblation
from probe.ablation.metrics import Metric, Scorer, choose_metric, losses, parts_of
from probe.ablation.results import AblationResult, HeadResult
from probe.ablation.runners import Batch, Runner, Work, batches_of, check_probe_set, chunks, data_name
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.inputs import LABELS_LAYOUT, ProbeSet
from probe.errors import ProbeError
from probe.hooks.stacks import layer_names
from probe.hooks.types import Handler, HookContext
from probe.models import LoadedModel
from probe.progress import ProgressArg, callback, reports
from probe.provenance import model_dtype

GRAD_FORWARD_COST = 1.35  # a forward that keeps the graph, in plain forwards (measured on CPU, SmolLM2)
BACKWARD_COST = 1.4  # a backward to the head outputs only (no weight gradients), in plain forwards (same)
LOSS_COST = 0.1  # an ablated copy's loss beyond its forward (log-softmax over the vocabulary), in plain forwards
ESTIMATE_BUDGET = 10.0  # forward-equivalents: the gradient passes, then exact ablation of the top heads
REFINE_CANDIDATES = 20  # the exact check considers this many of the top estimated heads


@dataclass
class _Terms:
    """What the gradient passes accumulate over the probe set."""

    first: Tensor  # (n_layers, n_heads) float64 first-order terms
    second: Tensor  # (n_layers, n_heads) float64 second-order terms
    sums: Tensor  # (parts + 1,) unablated metric sums
    batch_sums: list[Tensor] = field(default_factory=list)  # (parts + 1,) per batch


def gradient_scale(count: float) -> float:
    """The power of two at or above `count` that a mean over `count` tokens is scaled by before its backward: a
    mean's gradient falls under float16's smallest normal (on SmolLM2 61% of them did); a power of two changes no
    float32 or bfloat16 rounding."""
    return 2.0 ** math.ceil(math.log2(max(count, 1.0)))


def scaled_gradients(mean: Tensor, count: float, inputs: Sequence[Tensor], *, retain_graph: bool = False
                     ) -> tuple[tuple[Tensor | None, ...], float]:
    """The gradients of `mean` w.r.t. `inputs` times the scale returned (1 where a scaled float16 one is not finite)."""
    scale = gradient_scale(count)
    checked = scale > 1.0 and any(tensor.dtype == torch.float16 for tensor in inputs)
    grads = torch.autograd.grad(mean * scale, inputs, retain_graph=retain_graph or checked, allow_unused=True)
    found = [grad for grad in grads if grad is not None]
    if not checked or not found or bool(torch.stack([torch.isfinite(grad).all() for grad in found]).all()):
        return grads, scale
    return torch.autograd.grad(mean, inputs, retain_graph=retain_graph, allow_unused=True), 1.0


GUMBEL_CHUNK = 1 << 26  # noise elements made at once: 256 MB of float32 (at 128k vocab, 512 rows)


def gumbel_draws(logits: Tensor, generator: torch.Generator) -> Tensor:
    """(rows, 1): one label per row drawn from softmax(logits) by Gumbel-max, which changes a label only where two
    noisy logits nearly tie, so that the one-sample second order compares across dtypes (inverse CDF does not)."""
    rows, vocab = logits.shape
    step = max(1, GUMBEL_CHUNK // max(vocab, 1))
    drawn = []
    for start in range(0, rows, step):
        part = logits[start:start + step]
        uniform = torch.rand(part.shape, generator=generator, device=part.device, dtype=torch.float32)
        drawn.append((part - uniform.clamp_(min=1e-20).log_().neg_().log_()).argmax(dim=-1, keepdim=True))
    return torch.cat(drawn)


def _second_order(terms: _Terms, shifted: Tensor, inputs: list[Tensor], order: list[int], valid: Tensor,
                  n_tokens: float, samples: int, seed: int, step: Callable[[float], None], scale: float = 1.0) -> None:
    """Gauss-Newton term from `samples` backwards, next tokens drawn from the model's predictions (`gumbel_draws`)."""
    vocab = shifted.shape[-1]
    logits = shifted.detach().reshape(-1, vocab)  # (batch * (positions - 1), vocab) float32
    probs = logits.softmax(dim=-1)
    weight = (valid.reshape(-1, 1) * (scale / n_tokens)).to(probs.dtype)  # the first order's scale: scaled_gradients
    generator = torch.Generator(device=probs.device).manual_seed(seed)
    for sample in range(samples):
        drawn = gumbel_draws(logits, generator)
        grad_logits = probs.clone()
        grad_logits.scatter_add_(1, drawn, -torch.ones_like(drawn, dtype=probs.dtype))
        grad_logits.mul_(weight)
        grads = torch.autograd.grad(shifted, inputs, grad_outputs=grad_logits.view(shifted.shape),
                                    retain_graph=sample < samples - 1)
        for layer, value, grad in zip(order, inputs, grads):
            projection = -(grad * value.detach()).sum(dim=-1).double() / scale  # (batch, positions, heads)
            terms.second[layer, :grad.shape[2]] += 0.5 * n_tokens / samples * projection.pow(2).sum(dim=(0, 1)).cpu()
        step(BACKWARD_COST)


def keeping_graph(outputs: dict[int, Tensor]) -> Handler:
    """A `z` handler keeping each layer's head outputs in `outputs` as tensors a backward reaches."""
    def capture(values: Tensor, ctx: HookContext) -> Tensor:  # values: (batch, positions, n_heads, head_dim)
        if not values.requires_grad:  # frozen weights: the first hooked layer becomes the leaf
            values = values.detach().requires_grad_()
        outputs[ctx.layer] = values
        return values

    return capture


def _gradient_pass(model: nn.Module, readout: Readout, scorer: Scorer, batch: Batch, terms: _Terms, n_tokens: float,
                   samples: int, seed: int, step: Callable[[float], None], blocks: Blocks | None) -> dict[int, Any]:
    """One forward keeping the graph from every head's output and its backwards; returns the blocks' outputs."""
    outputs: dict[int, Tensor] = {}

    kept: dict[int, Any] = {}
    with torch.enable_grad():
        with keeping_outputs(blocks, kept) if blocks is not None else nullcontext(), \
                attention_hooks(model, {"z": keeping_graph(outputs)}), readout.watching():
            logits = logits_of(run_model(model, batch.ids, batch.mask))  # (batch, positions, vocab)
        readout.settle(logits.detach())
        step(GRAD_FORWARD_COST)
        valid = batch.counted[0].to(logits.device)
        shifted = logits[:, :-1].float()
        token_loss = scorer.metric.values(logits, batch.ids, None)  # (batch, positions - 1)
        order = sorted(outputs)
        inputs = [outputs[layer] for layer in order]
        loss = (token_loss * valid).sum() / n_tokens
        grads, scale = scaled_gradients(loss, n_tokens, inputs, retain_graph=samples > 0)  # float16's kept in range
        for layer, grad in zip(order, grads):
            assert grad is not None  # every head output feeds the logits
            first = -(grad * outputs[layer].detach()).double().sum(dim=(0, 1, 3)).cpu()
            terms.first[layer, :grad.shape[2]] += first / scale
        step(BACKWARD_COST)
        if samples:
            _second_order(terms, shifted, inputs, order, valid, n_tokens, samples, seed, step, scale)
        terms.batch_sums.append(scorer.sums(logits.detach(), batch.ids, batch.counted, 1)[0])
        terms.sums += terms.batch_sums[-1]
    return kept


def _choose(heads: list[Head], terms: _Terms, estimated: dict[Head, float], room: float, refine: int | None,
            cost: Callable[[Head], float]) -> list[Head]:
    """The top `refine` estimates, or of the top REFINE_CANDIDATES those leaning most on the second order, in `room`."""
    ranked = sorted(heads, key=lambda head: (-estimated[head], head))
    if refine is not None:
        return ranked[:max(0, refine)]
    first, second = terms.first, terms.second
    candidates = sorted(ranked[:REFINE_CANDIDATES], key=lambda head: (
        -float(second[head]) / max(abs(float(first[head])) + float(second[head]), 1e-30), head))
    chosen = []
    for head in candidates:
        if cost(head) <= room:
            chosen.append(head)
            room -= cost(head)
    return chosen


def _refine(runner: Runner, chosen: list[Head], cost: Callable[[Head], float],
            step: Callable[[float], None]) -> dict[Head, Tensor]:
    """(parts + 1,) exact metric sums of each chosen head's zero ablation: one stacked chunk per start block."""
    exact: dict[Head, Tensor] = {}
    with torch.no_grad():
        for chunk in chunks([(head,) for head in chosen], runner.start_of, len(chosen)):
            group = [head for head, in chunk]
            totals = torch.zeros(len(group), len(runner.scorer.parts) + 1, dtype=torch.float64)
            for index in range(len(runner.batches)):
                totals += runner.sums(chunk, index)
                step(sum(cost(head) for head in group))
            exact.update(zip(group, totals))
    return exact


def _setup(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head] | None, metric: str | Metric | None,
           batch_size: int, samples: int) -> tuple[list[Head], Scorer, list[Batch]]:
    if samples < 0:
        raise ProbeError(f"samples must be 0 or more, got {samples}", parameter="samples")
    check_probe_set(probe_set, refuse="the estimate")
    if probe_set.scored is not None:
        what = "a classifier's labelled texts" if probe_set.meta.get("layout") == LABELS_LAYOUT else "a task's margin"
        raise ProbeError(f"the estimate linearises the next-token loss of text, not {what}: run the exact sweep",
                         parameter="method")
    chosen = [ablation[0] for ablation in ablation_list(loaded.model, heads, ())]
    chosen_metric = choose_metric(loaded, probe_set, metric)
    if not chosen_metric.estimable:
        raise ProbeError(f"the estimate linearises a causal LM's next-token loss, the cross-entropy (its second order "
                         f"is the softmax's), not {chosen_metric.name}, which reads {chosen_metric.reads}: run the "
                         "exact sweep",
                         parameter="method")
    scorer = Scorer(chosen_metric, parts_of(probe_set))
    return chosen, scorer, batches_of(probe_set, scorer, batch_size)


def _exact_runner(loaded: LoadedModel, readout: Readout, scorer: Scorer, batches_: list[Batch], blocks: Blocks | None,
                  why_not: str, expected: Tensor, heads: list[Head]) -> tuple[Runner, str]:
    """Prefix reuse where a check on the first batch reproduces its baseline, else one forward each; and which."""
    runner = Runner(loaded.model, ZeroAblation(), scorer, readout, batches_, blocks, why_not, [(h,) for h in heads],
                    checked=True)
    reason = "" if runner.reason is not None else runner.reproduces(0, expected)
    if reason:  # every head then runs from block 0, the naive way
        runner.reason = f"the exact path failed its check: {reason}"
    return runner, runner.reason or "prefix reused"


@reports("estimating")
def estimate(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head] | None = None, *,
             metric: str | Metric | None = None, batch_size: int = 8, samples: int = 1, budget: float = ESTIMATE_BUDGET,
             refine: int | None = None, seed: int = 0, data: str | Path | None = None,
             progress: ProgressArg = None) -> AblationResult:
    """Every head's zero-ablation delta estimated (see the module's docstring), then the heads estimated to matter
    most ablated exactly until `budget` forward-equivalents are spent (or the top `refine`);
    `AblationResult.forwards` reports the cost. `progress`: True draws a bar, a callable gets `(done, total)`."""
    started = time.perf_counter()
    heads, scorer, batches_ = _setup(loaded, probe_set, heads, metric, batch_size, samples)
    model = loaded.model
    n_layers, n_heads = layer_shape(attention_layers(model))
    blocks, why_not = find_blocks(model, attention_layers(model))
    readout = Readout.choose(model, scorer.metric.chunkable, blocks)
    terms = _Terms(torch.zeros(n_layers, n_heads, dtype=torch.float64),
                   torch.zeros(n_layers, n_heads, dtype=torch.float64),
                   torch.zeros(len(scorer.parts) + 1, dtype=torch.float64))
    counts = torch.stack([batch.counted.sum(dim=(1, 2)) for batch in batches_]).sum(dim=0).double()
    n_tokens = float(counts[0].clamp(min=1))
    flop_cost = forward_costs(model, blocks)
    start_of = (lambda head: blocks.start_of(head[0])) if blocks is not None else (lambda head: 0)
    spent = GRAD_FORWARD_COST + BACKWARD_COST * (1 + samples)  # forward-equivalents, of every batch
    check_cost = flop_cost(len(blocks) - 1) + LOSS_COST if blocks is not None else 0.0
    room = budget - spent - check_cost
    exact_room = max(room, 0.0) if refine is None else max(refine, 0) * (1 + LOSS_COST)  # a full forward each at most
    work = Work(len(batches_) * (spent + exact_room) + check_cost, callback(progress), WORK_UNITS)  # the whole plan
    last = max(blocks.of_layer[layer] for layer, _ in heads) if blocks is not None else 0  # the exact runs' starts
    for index, batch in enumerate(batches_):
        kept = _gradient_pass(model, readout, scorer, batch, terms, n_tokens, samples, seed + index, work.advance,
                                blocks)
        batch.kept = {i: value for i, value in kept.items() if i < last} if blocks is not None else None
    baseline_loss, baseline_parts = losses(terms.sums, counts, list(scorer.parts))
    estimated = {head: float(terms.first[head] + terms.second[head]) for head in heads}
    chosen = _choose(heads, terms, estimated, room, refine, lambda head: flop_cost(start_of(head)) + LOSS_COST)
    path = ("estimate: attribution patching + Gauss-Newton second order" if samples
            else "estimate: attribution patching (first order)")
    exact: dict[Head, Tensor] = {}
    work.total = work.done  # the plan, now that the heads to refine are known
    if chosen:
        runner, how = _exact_runner(loaded, readout, scorer, batches_, blocks, why_not, terms.batch_sums[0], heads)
        cost = lambda head: flop_cost(runner.start_of((head,))) + LOSS_COST  # noqa: E731
        refined = sum(cost(head) for head in chosen)  # the exact runs of one batch
        work.total += check_cost + len(batches_) * refined
        work.advance(check_cost)
        exact = _refine(runner, chosen, cost, work.advance)
        spent += check_cost + refined
        path += f", {len(chosen)} top heads ablated exactly ({how})"
    else:
        work.report()  # the plan is done: its end reported at its lowered total
    results = [HeadResult.of_sums((head,), exact[head], counts, baseline_loss, baseline_parts, exact=True)
               if head in exact else HeadResult((head,), baseline_loss + estimated[head], estimated[head], exact=False)
               for head in heads]
    return AblationResult(
        model=loaded.name, method="zero", data=data_name(probe_set, data), metric=scorer.metric.name,
        baseline_loss=baseline_loss, results=results, n_layers=n_layers, n_heads=n_heads, mode="estimate",
        path=path, baseline_parts=baseline_parts,
        probe_set=probe_set.to_dict() | {"description": probe_set.description},
        seconds=time.perf_counter() - started, forwards=spent,
        terms={head: (float(terms.first[head]), float(terms.second[head])) for head in heads},
        layer_names=layer_names(attention_layers(loaded.model)), dtype=model_dtype(loaded))

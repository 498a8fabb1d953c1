"""Benchmark 2b: how far a Taylor expansion can take estimate mode on SmolLM2, measured rather than argued.

For a head h let f_h(a) be the change of the mean next-token loss when h's output is scaled by 1 - a: f_h(1) is
the zero-ablation delta that the exact sweep measures, f_h'(0) is attribution patching's first-order term. This
benchmark measures, on the batch of benchmark 2 (4 x 128 tokens of natural text):
- f_h(1) for all 270 heads (probe's exact sweep), and estimate mode's own first- and Gauss-Newton second-order terms;
- the exact second derivative f_h''(0) for all 270 heads, by central differences
  (f_h(0.1) + f_h(-0.1) - 2 f_h(0)) / 0.01, and f_h'(0) = (f_h(0.1) - f_h(-0.1)) / 0.2 as a check of the gradients;
- f_h along a = 0.25, 0.5, 0.75 for the heads where the exact second-order Taylor value and the exact delta disagree
  about the top 10.
If f'(0) + f''(0) / 2 with the exact f'' still misses the top 10, no better estimate of the curvature can reach it,
and only exact ablations (about one forward each for an early head) can.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import load_average, machine, now, spearman
from probe.ablation import estimate, sweep
from probe.hooks.capture import attention_hooks
from probe.hooks.run import logits_of, run_model
from probe.inputs import natural_set
from probe.models import load_model

STEP = 0.1  # the finite-difference step in a: heads scaled by 0.9 and 1.1
PATH = (0.25, 0.5, 0.75)


def _losses(model: torch.nn.Module, ids: torch.Tensor, layer: int, head: int, scales: list[float]) -> list[float]:
    """Mean next-token loss with head `head` of `layer` scaled by each of `scales` (one stacked forward). Unlike
    bench.ablation.mean_loss the mean is taken in float64: the second differences divide by STEP^2 = 0.01."""

    batch = ids.shape[0]

    def scale(values: torch.Tensor, _ctx: Any) -> torch.Tensor:
        values = values.clone()
        for copy, factor in enumerate(scales):
            values[copy * batch:(copy + 1) * batch, :, head] *= factor
        return values

    with torch.inference_mode(), attention_hooks(model, {"z": scale}, layers={layer}):
        logits = logits_of(run_model(model, ids.repeat(len(scales), 1), None))[:, :-1].float()
    targets = ids[:, 1:].repeat(len(scales), 1)
    token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return [float(x) for x in token_loss.view(len(scales), -1).double().mean(dim=1)]


def run(log: Any = print) -> dict[str, Any]:
    loaded = load_model("smollm2")
    model = loaded.model
    probe_set = natural_set(loaded, seq_len=127, num_seqs=4)
    ids = probe_set.input_ids
    started = time.perf_counter()
    log("bench 2b: exact sweep of all heads")
    exact_result = sweep(loaded, probe_set, None, mode="exact")
    exact = {r.heads[0]: r.delta for r in exact_result.heads}
    heads = sorted(exact)
    terms = estimate(loaded, probe_set, samples=1, refine=0).terms
    base = _losses(model, ids, 0, 0, [1.0])[0]  # scaled by 1: the same computation as the scaled runs
    log(f"bench 2b: second derivatives of {len(heads)} heads by central differences")
    first_fd: dict[tuple[int, int], float] = {}
    second: dict[tuple[int, int], float] = {}
    for layer, head in heads:
        down, up = _losses(model, ids, layer, head, [1 - STEP, 1 + STEP])
        first_fd[(layer, head)] = (down - up) / (2 * STEP)
        second[(layer, head)] = (down + up - 2 * base) / STEP**2

    def top(values: dict[tuple[int, int], float]) -> set[tuple[int, int]]:
        return set(sorted(heads, key=lambda h: -values[h])[:10])

    exact_top = top(exact)
    taylor = {h: terms[h][0] + second[h] / 2 for h in heads}
    estimates = {
        "first order (attribution patching)": {h: terms[h][0] for h in heads},
        "first + Gauss-Newton second order (estimate mode's terms, 1 sample)": {h: terms[h][0] + terms[h][1]
                                                                                for h in heads},
        "first + exact second order f'(0) + f''(0)/2": taylor,
    }
    rows = [{"estimate": name, "spearman": spearman([exact[h] for h in heads], [values[h] for h in heads]),
             "top10_overlap": len(exact_top & top(values))} for name, values in estimates.items()]
    disputed = sorted(exact_top ^ top(taylor), key=lambda h: -max(exact[h], taylor[h]))
    log(f"bench 2b: loss along the ablation of {len(disputed)} heads")
    paths = []
    for layer, head in disputed:
        values = [loss - base for loss in _losses(model, ids, layer, head, [1 - a for a in PATH])]
        paths.append({"head": f"{layer}.{head}", "first_order": terms[(layer, head)][0],
                      "gauss_newton": terms[(layer, head)][1], "half_second_derivative": second[(layer, head)] / 2,
                      "taylor": taylor[(layer, head)], "path": dict(zip(map(str, PATH), values)),
                      "exact": exact[(layer, head)], "in_exact_top10": (layer, head) in exact_top})
    return {
        "date": now(), "machine": machine(), "load_average": load_average(), "seconds": time.perf_counter() - started,
        "heads": len(heads), "baseline_loss": base, "sweep_baseline_loss": exact_result.baseline_loss,
        # f'(0) from the gradient against the central difference (which carries an O(STEP^2) third-order term)
        "first_order_difference_median": statistics.median(abs(first_fd[h] - terms[h][0]) for h in heads),
        "first_order_difference_max": max(abs(first_fd[h] - terms[h][0]) for h in heads),
        "first_order_scale": max(abs(terms[h][0]) for h in heads),
        "rows": rows, "paths": paths,
    }

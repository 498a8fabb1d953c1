"""Benchmark 2: zero-ablate each SmolLM2 head alone on 4 x 128 tokens of natural text, measure the loss of each.

Variants, each over the same heads and the same (4, 128) batch (BOS + 127 tokens of probe's embedded English text),
timed interleaved in one loop:
- naive: the baseline. Plain PyTorch: for each head a forward pre-hook on that layer's `o_proj` zeroes the head's
  slice of its input, then one full forward and the mean next-token cross-entropy.
- tl: TransformerLens, `run_with_hooks(tokens, return_type="loss", fwd_hooks=[("blocks.L.attn.hook_z", zero)])`
  per head.
- probe_exact: `probe.ablation.sweep(loaded, probe_set, heads, mode="exact")`.

By default the timed sweep is the full one, all 270 heads; `--ablation-layers 2,7,12,17,22,27` times a
representative subset instead (the middle layer of each sixth of the model, so that the work per head, which for
probe's exact mode shrinks with the layer, averages as over all 30 layers; the fixed cost of probe's baseline and
check forwards then weighs 5x more per head).

Estimate mode: its cost in forward-equivalents and how well it ranks the heads against the exact sweep of all 270
heads (Spearman rank correlation and overlap of the top 10 by loss increase); the same for plain attribution
patching (first order only, no exact refinement).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import (have_transformer_lens, interleaved, load_average, machine, now, spearman,
                          transformer_lens_bridge)
from probe.ablation import estimate, sweep
from probe.inputs import natural_set
from probe.models import load_model


def mean_loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)))


def run(repeats: int = 3, layers: list[int] | None = None, log: Any = print, with_tl: bool = True,
        with_estimate: bool = True) -> dict[str, Any]:
    loaded = load_model("smollm2")
    model = loaded.model
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    head_dim = model.config.hidden_size // n_heads
    layers = list(range(n_layers)) if layers is None else layers
    heads = [(layer, head) for layer in layers for head in range(n_heads)]
    probe_set = natural_set(loaded, seq_len=127, num_seqs=4)
    ids = probe_set.input_ids
    log(f"bench 2: batch {tuple(ids.shape)}, {len(heads)} heads (layers {layers})")
    losses: dict[str, dict[tuple[int, int], float]] = {}
    deltas: dict[str, dict[tuple[int, int], float]] = {}

    with torch.no_grad():
        baseline_loss = mean_loss(model(input_ids=ids, use_cache=False).logits, ids)

    def naive() -> None:
        out = {}
        with torch.no_grad():
            for layer, head in heads:
                def zero(_module: Any, args: tuple, head: int = head) -> tuple:
                    x = args[0].clone()
                    x[..., head * head_dim:(head + 1) * head_dim] = 0
                    return (x, *args[1:])

                handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero)
                try:
                    out[(layer, head)] = mean_loss(model(input_ids=ids, use_cache=False).logits, ids)
                finally:
                    handle.remove()
        losses["naive"] = out

    def probe_exact() -> None:
        result = sweep(loaded, probe_set, heads, mode="exact", batch_size=8)
        losses["probe_exact"] = {r.heads[0]: r.loss for r in result.heads}
        deltas["probe_exact"] = {r.heads[0]: r.delta for r in result.heads}
        losses["probe_exact_path"] = result.path  # type: ignore[assignment]

    variants = {"naive": naive, "probe_exact": probe_exact}
    if with_tl and have_transformer_lens():
        bridge = transformer_lens_bridge(loaded)

        def tl() -> None:
            out = {}
            with torch.no_grad():
                for layer, head in heads:
                    def zero_z(z: torch.Tensor, hook: Any, head: int = head) -> torch.Tensor:
                        z[:, :, head, :] = 0.0
                        return z

                    loss = bridge.run_with_hooks(ids, return_type="loss",
                                                 fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_z)])
                    out[(layer, head)] = float(loss)
            losses["tl"] = out

        variants["tl"] = tl
    started, load_before = now(), load_average()
    timings = interleaved(variants, "naive", repeats, warmup=0, log=log)
    agreement = {}
    for name in ("probe_exact", "tl"):
        if name in losses:
            agreement[name] = max(abs(losses[name][h] - losses["naive"][h]) for h in heads)
    naive_deltas = {h: losses["naive"][h] - baseline_loss for h in heads}
    result: dict[str, Any] = {
        "benchmark": "ablation",
        "date": started,
        "machine": machine(),
        "load_before": load_before,
        "batch": list(ids.shape),
        "layers": layers,
        "n_heads_timed": len(heads),
        "n_heads_total": n_layers * n_heads,
        "repeats": repeats,
        "timings": timings.to_dict(),
        "probe_path": losses.get("probe_exact_path"),
        "max_abs_loss_difference_vs_naive": agreement,
        "baseline_loss": baseline_loss,
        "largest_deltas_naive": sorted(((f"{l}.{h}", d) for (l, h), d in naive_deltas.items()),
                                       key=lambda x: -x[1])[:10],
    }
    if with_estimate:  # the timed exact sweep is the reference when it covered every head
        reference = deltas.get("probe_exact") if len(heads) == n_layers * n_heads else None
        result["estimate"] = estimate_quality(loaded, probe_set, log, reference)
    result["load_after"] = load_average()
    return result


def estimate_quality(loaded: Any, probe_set: Any, log: Any = print,
                     reference: dict[tuple[int, int], float] | None = None) -> dict[str, Any]:
    """Estimate mode's cost and agreement with an exact sweep of every head (`reference` deltas, or one run here),
    and the same for plain attribution patching (first order, no exact refinement)."""

    out: dict[str, Any] = {}
    if reference is None:
        log("bench 2: exact sweep of all heads (reference for estimate mode)")
        start = time.perf_counter()
        exact = sweep(loaded, probe_set, None, mode="exact", batch_size=8)
        out.update(exact_all_heads_seconds=time.perf_counter() - start, exact_path=exact.path)
        reference = {r.heads[0]: r.delta for r in exact.heads}
    else:
        out["reference"] = "the timed exact sweep of all heads"
    log("bench 2: estimate mode, and attribution patching alone")
    start = time.perf_counter()
    estimated = sweep(loaded, probe_set, None, mode="estimate", batch_size=8)
    out["estimate_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    plain = estimate(loaded, probe_set, samples=0, refine=0, batch_size=8)
    out["atp_seconds"] = time.perf_counter() - start
    # the cost of one plain forward of the same batch, for forward-equivalents measured here
    model, ids = loaded.model, probe_set.input_ids
    times = []
    for _ in range(5):
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        times.append(time.perf_counter() - start)
    forward = statistics.median(times)
    heads = sorted(reference)

    def agreement(result: Any) -> tuple[float, int]:
        delta = {r.heads[0]: r.delta for r in result.heads}
        top = lambda d: set(sorted(heads, key=lambda h: -d[h])[:10])  # noqa: E731
        return spearman([reference[h] for h in heads], [delta[h] for h in heads]), len(top(reference) & top(delta))

    out["spearman"], out["top10_overlap"] = agreement(estimated)
    out["atp_spearman"], out["atp_top10_overlap"] = agreement(plain)
    out.update({
        "forward_seconds": forward,
        "estimate_forward_equivalents_measured": out["estimate_seconds"] / forward,
        "estimate_forward_equivalents_reported": estimated.forwards,
        "estimate_path": estimated.path,
        "exact_heads": sum(r.exact for r in estimated.heads),
        "atp_forward_equivalents_measured": out["atp_seconds"] / forward,
    })
    return out

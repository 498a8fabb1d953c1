"""Exact-mode sweep vs the naive loop on SmolLM2, side by side in one run; and estimate mode against the exact sweep.

    python -m bench.bench_sweep_exact [--heads-per-layer 3 | --all-heads] [--rounds 2] [--estimate]

Speed. Both variants are `probe.ablate.sweep` over the same heads and the same 4 x 128 tokens of natural text
(BOS + 128 tokens of probe's embedded English text, one batch): `mode="naive"` runs one full forward per head,
`mode="exact"` reuses the baseline's prefix and stacks the heads of a layer into one forward. Each timed run is a
whole sweep, baseline and check included, as a user runs it. The runs alternate naive, exact, exact, naive, ...
(`--rounds` pairs), so that load from other processes on the machine falls on both alike; the ratio is total
exact time over total naive time, in wall-clock seconds and in this process's CPU seconds. The saving depends on
the ablated layer's depth, so the default subset takes `--heads-per-layer` heads of every layer (rotating which
heads), i.e. the same mix of depths as the full sweep. The floor from arithmetic alone (weights each ablated run
recomputes, the unembedding included) is reported next to the measurement.

Estimate (`--estimate`): one exact sweep of all 270 heads is the reference (or `--reference FILE`, a results
stream of one); then plain attribution patching (first order only, no exact check) and probe's estimate mode at its
default budget. Cost in forward-equivalents is measured against plain forwards timed right before and after, in
wall-clock and in CPU seconds of this process (steadier when other processes load the machine); the agreement is the Spearman rank correlation of the deltas over all heads and the overlap of the top 10.

Writes bench/sweep_results.json (sections "exact" and "estimate", each kept when the other is rerun).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "sweep_results.json"


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> torch.Tensor:
        order = torch.tensor(values, dtype=torch.float64).argsort()
        out = torch.empty(len(values), dtype=torch.float64)
        out[order] = torch.arange(len(values), dtype=torch.float64)
        return out

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def top_overlap(a: dict, b: dict, k: int = 10) -> int:
    top = lambda d: set(sorted(d, key=lambda h: -d[h])[:k])  # noqa: E731
    return len(top(a) & top(b))


def spread_heads(n_layers: int, n_heads: int, per_layer: int) -> list[tuple[int, int]]:
    """`per_layer` heads of every layer, evenly spaced and rotated from layer to layer."""
    step = n_heads / per_layer
    return [(layer, (layer + round(j * step)) % n_heads) for layer in range(n_layers) for j in range(per_layer)]


def flop_floor(model: torch.nn.Module, heads: list[tuple[int, int]]) -> float:
    """Work of the exact sweep over the naive loop if only the recomputed weights counted (per token)."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.model.layers]
    unembed = model.lm_head.weight.numel()
    full = sum(blocks) + unembed
    return sum(sum(blocks[layer:]) + unembed for layer, _ in heads) / (len(heads) * full)


def machine() -> dict[str, Any]:
    try:
        load = [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:
        load = None
    return {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average": load}


def timed(function: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    value = function()
    return value, time.perf_counter() - wall, time.process_time() - cpu


def bench_exact(loaded: Any, probe_set: Any, heads: list[tuple[int, int]], rounds: int, log: Any,
                stack: int | None = None) -> dict[str, Any]:
    from probe.ablate import sweep

    times: dict[str, list[tuple[float, float]]] = {"naive": [], "exact": []}
    results: dict[str, Any] = {}
    order = []
    for r in range(rounds):
        order += ["naive", "exact"] if r % 2 == 0 else ["exact", "naive"]
    for name in order:
        options = {"stack": stack} if name == "exact" and stack is not None else {}
        result, wall, cpu = timed(lambda: sweep(loaded, probe_set, heads, mode=name, batch_size=4, **options))
        times[name].append((wall, cpu))
        results[name] = result
        log(f"  {name:5s}: {wall:7.1f} s wall, {cpu:7.1f} s cpu ({result.path})")
    naive, exact = results["naive"], results["exact"]
    difference = max(abs(a.loss - b.loss) for a, b in zip(exact.heads, naive.heads))
    wall_ratio = sum(w for w, _ in times["exact"]) / sum(w for w, _ in times["naive"])
    cpu_ratio = sum(c for _, c in times["exact"]) / sum(c for _, c in times["naive"])
    return {
        "heads": len(heads), "layers": sorted({layer for layer, _ in heads}), "batch": list(probe_set.input_ids.shape),
        "rounds": rounds, "order": order, "stack": stack if stack is not None else "default (as fit in 1 GiB)",
        "naive_seconds": [round(w, 2) for w, _ in times["naive"]],
        "exact_seconds": [round(w, 2) for w, _ in times["exact"]],
        "naive_cpu_seconds": [round(c, 2) for _, c in times["naive"]],
        "exact_cpu_seconds": [round(c, 2) for _, c in times["exact"]],
        "ratio_wall": round(wall_ratio, 4), "ratio_cpu": round(cpu_ratio, 4),
        "floor_from_weights": round(flop_floor(loaded.model, heads), 4),
        "target": 0.65, "meets_target": wall_ratio <= 0.65,
        "max_abs_loss_difference_vs_naive": difference, "exact_path": exact.path,
        "baseline_loss": exact.baseline_loss,
    }


def plain_forward_seconds(loaded: Any, probe_set: Any, repeats: int = 3) -> tuple[float, float]:
    """Median (wall, cpu) seconds of one plain forward over the probe data."""
    from probe.attention import run_model

    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            run_model(loaded.model, probe_set.input_ids)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def bench_estimate(loaded: Any, probe_set: Any, reference: Path | None, log: Any) -> dict[str, Any]:
    from probe.ablate import estimate, load_results, sweep

    if reference is not None and reference.is_file():
        exact = load_results(reference)
        exact_seconds = None
        log(f"  reference: {reference} ({len(exact.heads)} heads)")
    else:
        exact, exact_seconds, _ = timed(lambda: sweep(loaded, probe_set, None, mode="exact", batch_size=4,
                                                      results_path=reference))
        log(f"  exact sweep of all heads: {exact_seconds:.1f} s")
    truth = {r.heads[0]: r.delta for r in exact.heads}
    heads = sorted(truth)
    out: dict[str, Any] = {"reference_heads": len(heads), "exact_all_heads_seconds": exact_seconds,
                           "reference_file": str(reference) if exact_seconds is None else None,
                           "reference_top10": [f"{l}.{h}" for l, h in sorted(truth, key=lambda k: -truth[k])[:10]],
                           "target": {"spearman": 0.9, "top10": 8, "forward_equivalents": 10}}
    variants = {"attribution_patching": dict(samples=0, refine=0), "estimate_default": {}}
    for name, options in variants.items():
        before = plain_forward_seconds(loaded, probe_set)
        result, wall, cpu = timed(lambda: estimate(loaded, probe_set, batch_size=4, **options))
        after = plain_forward_seconds(loaded, probe_set)
        forward, forward_cpu = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        est = {r.heads[0]: r.delta for r in result.heads}
        entry = {
            "options": options, "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
            "forward_seconds": round(forward, 3), "forward_cpu_seconds": round(forward_cpu, 3),
            "forward_equivalents_measured": round(wall / forward, 2),
            "forward_equivalents_measured_cpu": round(cpu / forward_cpu, 2),
            "forward_equivalents_counted": round(result.forwards or 0.0, 2),
            "spearman": round(spearman([est[h] for h in heads], [truth[h] for h in heads]), 4),
            "top10_overlap": top_overlap(est, truth), "exact_heads": sum(1 for r in result.heads if r.exact),
            "path": result.path,
        }
        out[name] = entry
        log(f"  {name}: {entry}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads-per-layer", type=int, default=3)
    parser.add_argument("--all-heads", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="naive/exact pairs, alternating order")
    parser.add_argument("--stack", type=int, default=None, help="exact mode: ablations per forward (default: auto); "
                        "results go to section exact_stack<N>")
    parser.add_argument("--estimate", action="store_true", help="also measure estimate mode")
    parser.add_argument("--skip-exact", action="store_true", help="only the estimate section")
    parser.add_argument("--reference", type=Path, default=None, help="results stream of an exact sweep of all heads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from probe.data import natural_set
    from probe.models import load_model

    loaded = load_model("smollm2")
    probe_set = natural_set(loaded, seq_len=128, num_seqs=4)
    config = loaded.model.config
    n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
    existing = json.loads(args.out.read_text()) if args.out.is_file() else {}
    existing.update({"benchmark": "probe ablate sweep: exact mode vs naive loop, estimate mode",
                     "model": "smollm2 (SmolLM2-135M-Instruct, 30 layers x 9 heads)",
                     "data": probe_set.description})
    if not args.skip_exact:
        heads = ([(l, h) for l in range(n_layers) for h in range(n_heads)] if args.all_heads
                 else spread_heads(n_layers, n_heads, args.heads_per_layer))
        print(f"exact vs naive: {len(heads)} heads over {n_layers} layers, batch {tuple(probe_set.input_ids.shape)}")
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        section = {"date": started, "machine": machine()} | bench_exact(loaded, probe_set, heads, args.rounds, print,
                                                                         args.stack)
        section["machine_after"] = machine()
        existing["exact" if args.stack is None else f"exact_stack{args.stack}"] = section
        print(f"ratio exact/naive: {section['ratio_wall']} wall, {section['ratio_cpu']} cpu "
              f"(floor {section['floor_from_weights']}, target 0.65); max |loss difference| "
              f"{section['max_abs_loss_difference_vs_naive']:.2e}")
    if args.estimate:
        print("estimate vs exact sweep of all heads")
        section = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine()}
        section |= bench_estimate(loaded, probe_set, args.reference, print)
        existing["estimate"] = section
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Benchmark and numbers of `probe kv-heads` on SmolLM2: the scoring pass and a curve forward against a plain
forward of the same input (ratios within one run, variants interleaved), then the full map with its curve, and the
retrieval heads next to the induction heads `classify` flags.

    python -m bench.kv_heads --length 512 --recent 64 --steps 6 --seeds 0 1 --repeats 2 [--timing-lengths 512 2048]

Writes bench/results/kv_heads.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe import load_model  # noqa: E402
from probe.ablation.methods import ablated  # noqa: E402
from probe.ablation.window import WindowAblation  # noqa: E402
from probe.hooks.run import run_model
from probe.heads.classify import classify
from probe.kv import kv_heads, score_needles  # noqa: E402
from probe.inputs import NeedleOptions, needle_set  # noqa: E402
from bench.common import save_result  # noqa: E402

HALF = tuple((layer, head) for layer in range(30) for head in range(0, 9, 2))  # about half of SmolLM2's heads
EVERY = tuple((layer, head) for layer in range(30) for head in range(9))  # the curve's last point


def timings(loaded, length: int, recent: int, repeats: int) -> dict:
    """Median over repeats of (variant / plain forward of the same prompt), variants interleaved."""
    needles = needle_set(loaded, NeedleOptions(lengths=(length,), depths=(0.5,), seed=7))
    ids = needles.input_ids

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None)

    def scoring() -> None:
        score_needles(loaded, needles, recent=recent)

    def curve_forward() -> None:
        with torch.no_grad(), ablated(loaded.model, [HALF], WindowAblation(recent=recent)):
            run_model(loaded.model, ids, None)

    def curve_forward_all() -> None:
        with torch.no_grad(), ablated(loaded.model, [EVERY], WindowAblation(recent=recent)):
            run_model(loaded.model, ids, None)

    variants = {"plain": plain, "scoring": scoring, "curve_forward": curve_forward,
                "curve_forward_all": curve_forward_all}
    times: dict[str, list[float]] = {name: [] for name in variants}
    plain()
    for repeat in range(repeats):
        names = list(variants)[repeat % len(variants):] + list(variants)[:repeat % len(variants)]
        for name in names:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    ratios = {name: statistics.median(t / p for t, p in zip(times[name], times["plain"])) for name in variants}
    return {"length": length, "repeats": repeats, "seconds": {k: statistics.median(v) for k, v in times.items()},
            "ratio_vs_plain": ratios}


def earlier_run(path: Path, marker: str, keys: tuple[str, ...]) -> dict:
    """`keys` of an earlier run's results, and under `marker` which run that was (its command and date)."""
    earlier = json.loads(path.read_text())
    return {key: earlier[key] for key in keys} | {marker: {"command": earlier["command"], "date": earlier["date"]}}


def map_and_curve(loaded, args: argparse.Namespace) -> dict:
    """The map with its curve at --length, and the heads classify flags as induction and duplicate-token heads."""
    started = time.perf_counter()
    kv = kv_heads(loaded, lengths=(args.length,), depths=(0.25, 0.75), prompts=args.prompts,
                  recent=args.recent, steps=args.steps, random_seeds=tuple(args.seeds), curve_texts=args.curve_texts,
                  progress=lambda d, t: print(f"{d}/{t} {time.perf_counter() - started:.0f}s", flush=True))
    classes = classify(loaded, scores=["induction", "duplicate_token"])
    return {"kv_heads": kv.to_dict(), "kv_heads_seconds": time.perf_counter() - started,
            "induction": [[layer, head, round(score, 3)] for layer, head, score in classes.flagged("induction")],
            "duplicate_token": [[layer, head, round(score, 3)]
                                for layer, head, score in classes.flagged("duplicate_token")]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=1, help="Needle prompts per depth that the scores are made on.")
    parser.add_argument("--curve-texts", type=int, default=1, help="Natural texts the curve's loss is measured on.")
    parser.add_argument("--timing-lengths", type=int, nargs="*", help="Lengths to time at (default: --length).")
    parser.add_argument("--timing-from", type=Path,
                        help="A kv_heads.json whose timing to keep instead of timing again.")
    parser.add_argument("--curve-from", type=Path, help="A kv_heads.json whose map and curve to keep instead of "
                        "computing them again.")
    args = parser.parse_args()
    loaded = load_model("smollm2")
    result: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.timing_from is not None:
        result.update(earlier_run(args.timing_from, "timing_from", ("timings",)))
    else:
        result["timings"] = []
        for length in args.timing_lengths or [args.length]:
            result["timings"].append(timings(loaded, length, args.recent, args.repeats))
            print(json.dumps(result["timings"][-1]), flush=True)
    save_result("kv_heads", result)
    if args.curve_from is not None:
        result.update(earlier_run(args.curve_from, "curve_from",
                                  ("kv_heads", "kv_heads_seconds", "induction", "duplicate_token")))
    else:
        result.update(map_and_curve(loaded, args))
    print("wrote", save_result("kv_heads", result))


if __name__ == "__main__":
    main()

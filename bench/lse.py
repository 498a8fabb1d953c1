"""Head scores from the attention's log-sum-exp, against a plain sdpa forward, in one run.

    python -m bench.lse [--lengths 512 4096 8192 32768] [--kv-lengths 2048 4096] [--threads 1] [--repeats-32k 1]

SmolLM2, one sequence of BOS + R random tokens repeated twice per length (R = (N - 1) // 2). The target ratio comes
from two variants alone, timed in alternation (order swapped every repeat, median of per-repeat ratios):
- plain: `run_model(model, ids, logits=False)`, the sdpa forward `classify` runs, its logits at one position (the
  baseline: what scoring adds to the forward it needs);
- probe: `score_heads` with all six default scores (path "auto": the log-sum-exp).
Then, for reference, in their own interleaved loop against plain (REFERENCE_REPEATS; a heavy variant between the two
of the target would change what the next one finds in the allocator and the caches):
- plain_logits: `model(input_ids=ids)`, logits at every position (the baseline of earlier sections), up to 8192;
- probe_blocked: the same scores on the blocked eager path, up to BLOCKED_UP_TO tokens.
kv-heads: `score_needles` (kv-heads' default cache: 64 sink + 256 recent keys) on one needle prompt of each length,
fast and blocked, against `run_model(ids)` (logits at
every position, bench/kv_heads.py's baseline) and the forward without them.
Memory: fresh processes (bench.long_context_point plain / classify / classify_blocked at 32768 tokens, a random llama
with SmolLM2's layer sizes). Writes bench/results/lse.json after each part, so a run cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

import torch
from probe.threads import use_threads

from bench.common import SIX, interleaved, last_json, load_average, machine, now, run_measured, save_result

REPEATS = {512: 15, 2048: 3, 4096: 7, 8192: 5, 32768: 1}
REFERENCE_REPEATS = 2
BLOCKED_UP_TO = 4096
LOGITS_UP_TO = 8192


def repeated_ids(loaded: Any, length: int) -> Any:
    """A repeated probe set of one sequence of `length` tokens (BOS + R random tokens twice, R = (length - 1) // 2),
    built directly: the probe set's builder refuses lengths past the model's context (8192 for SmolLM2)."""
    from probe.inputs import ProbeSet

    torch.manual_seed(0)
    half = torch.randint(100, loaded.vocab_size, (1, (length - 1) // 2))
    bos = torch.tensor([[loaded.tokenizer.bos_token_id]])
    return ProbeSet("repeated", "random tokens, repeated", torch.cat([bos, half, half], dim=1), 1,
                    repeat_len=half.shape[1])


def classify_speed(loaded: Any, length: int, repeats: int, log: Any) -> dict[str, Any]:
    from probe.hooks.run import run_model
    from probe.heads.classify import score_heads

    probe_set = repeated_ids(loaded, length)
    ids = probe_set.input_ids
    scores: dict[str, Any] = {}

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None, logits=False)

    def plain_logits() -> None:
        with torch.no_grad():
            loaded.model(input_ids=ids, use_cache=False)

    def probe() -> None:
        scores["lse"] = score_heads(loaded, probe_set, SIX, batch_size=1)

    def probe_blocked() -> None:
        scores["blocked"] = score_heads(loaded, probe_set, SIX, batch_size=1, path="blocked")

    warmup = 1 if length <= 1024 else 0
    log(f"classify {tuple(ids.shape)}: {repeats} repeats, plain and probe")
    timings = interleaved({"plain": plain, "probe": probe}, "plain", repeats, warmup=warmup, log=log)
    out: dict[str, Any] = {"tokens": int(ids.shape[1]), "scores": SIX, "timings": timings.to_dict(),
                           "path": scores["lse"].path}
    references = {"plain": plain}
    if length <= LOGITS_UP_TO:
        references["plain_logits"] = plain_logits
    if length <= BLOCKED_UP_TO:
        references["probe_blocked"] = probe_blocked
    if len(references) > 1:
        log(f"  references: {REFERENCE_REPEATS} repeats, {', '.join(references)}")
        out["reference_timings"] = interleaved(references, "plain", REFERENCE_REPEATS, warmup=warmup,
                                               log=log).to_dict()
    if "blocked" in scores:
        out["largest_difference_lse_blocked"] = {
            name: float((scores["lse"][name] - scores["blocked"][name]).abs().max()) for name in SIX}
    return out


def kv_speed(loaded: Any, length: int, repeats: int, log: Any) -> dict[str, Any]:
    from probe.hooks.run import run_model
    from probe.kv import KV_SINK, score_needles
    from probe.inputs import NeedleOptions, needle_set

    needles = needle_set(loaded, NeedleOptions(lengths=(length,), depths=(0.5,), seed=7))
    ids = needles.input_ids
    results: dict[str, Any] = {}

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None)

    def plain_no_logits() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None, logits=False)

    def scoring() -> None:
        results["lse"] = score_needles(loaded, needles, sink=KV_SINK)  # as kv-heads runs it

    def scoring_blocked() -> None:
        results["blocked"] = score_needles(loaded, needles, sink=KV_SINK, fast=False)

    variants = {"plain": plain, "plain_no_logits": plain_no_logits, "scoring": scoring,
                "scoring_blocked": scoring_blocked}
    log(f"kv-heads scoring {tuple(ids.shape)}: {repeats} repeats")
    timings = interleaved(variants, "plain", repeats, warmup=1 if length <= 2048 else 0, log=log)
    return {"tokens": int(ids.shape[1]), "timings": timings.to_dict(),
            "largest_difference_lse_blocked": {
                "retrieval": float((results["lse"][0] - results["blocked"][0]).abs().max()),
                "streaming": float((results["lse"][1] - results["blocked"][1]).abs().max())}}


def memory(log: Any, length: int = 32768) -> dict[str, Any]:
    points = {}
    for tool in ("load_only", "plain", "classify", "classify_blocked"):
        result = run_measured([sys.executable, "-m", "bench.long_context_point", tool, str(length)])
        point: dict[str, Any] = {"length": length, "peak_rss": result.peak_rss, "seconds": result.seconds,
                                 "returncode": result.returncode, "killed": result.killed}
        if result.returncode == 0:
            point.update(last_json(result.stdout))
        else:
            point["error"] = result.stderr[-1500:]
        log(f"  memory {tool} {length}: peak {result.peak_rss / 2**30:.2f} GiB, {result.seconds:.0f} s")
        points[tool] = point
    return points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="*", default=[512, 4096, 8192, 32768])
    parser.add_argument("--kv-lengths", type=int, nargs="*", default=[2048, 4096])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--repeats-32k", type=int, default=REPEATS[32768], help="repeats at 32768 tokens")
    parser.add_argument("--allocator", choices=["cli", "default"], default="cli",
                        help="cli: freed buffers kept in the C heap, as the probe command sets (cli/allocator.py); "
                             "default: glibc's own thresholds")
    args = parser.parse_args()
    if args.allocator == "cli":
        from probe.cli.allocator import keep_freed_buffers

        keep_freed_buffers()
    REPEATS[32768] = args.repeats_32k
    use_threads(args.threads)
    from probe.models import load_model

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    out: dict[str, Any] = {"benchmark": "lse", "date": now(), "machine": machine(), "load_before": load_average(),
                           "command": "python -m bench.lse " + shlex.join(sys.argv[1:]), "threads": args.threads,
                           "allocator": args.allocator,
                           "memory": {}, "kv": {}, "classify": {}}
    if not args.no_memory:  # first, in fresh processes: a child's peak RSS counts its parent's memory at fork
        out["memory"] = memory(log)
        save_result("lse", out)
    loaded = load_model("smollm2")
    for length in args.kv_lengths:
        out["kv"][str(length)] = kv_speed(loaded, length, REPEATS.get(length, 2), log)
        save_result("lse", out)
    for length in args.lengths:
        out["classify"][str(length)] = classify_speed(loaded, length, REPEATS.get(length, 1), log)
        out["load_after"] = load_average()
        save_result("lse", out)
    log("wrote bench/results/lse.json")


if __name__ == "__main__":
    main()

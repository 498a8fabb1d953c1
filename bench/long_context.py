"""Long context: `probe classify`'s scoring against a plain forward at 128, 4096 and 8192 tokens, and peak
memory at 32,768 tokens.

Speed: SmolLM2, one sequence of BOS + R random tokens repeated twice (the repeated probe set, R = (N - 1) // 2),
variants timed interleaved in one process, the order rotated every repeat:
- plain: one ordinary sdpa forward, logits included, `model(input_ids)` (the baseline, as in benchmark 1);
- probe: `score_heads` with all six scores on that sequence (what `probe classify` runs per probe set);
- probe_before: the same with blocked attention and the score functions of commit BEFORE (the code before the
  long-context rewrite) swapped in, so that before and after are timed in the same run.
Memory: fresh processes (bench.long_context_point) on a random llama with SmolLM2's layer sizes and a 32k context;
peak RSS from the kernel, 8 GiB watchdog; and the scores in query blocks against the unblocked computation.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.common import ROOT, SIX, interleaved, last_json, load_average, machine, now, run_measured

BEFORE = "a197f6a"  # the commit before the long-context rewrite of blocked attention and the scores
REPEATS = {128: 7, 4096: 3, 8192: 1}
BEFORE_UP_TO = 4096  # probe_before is timed up to this length (it is the slowest variant)
MEMORY_POINTS = [("load_only", 32768), ("classify", 32768), ("heatmap", 32768), ("equal", 2048)]


def _module_at(commit: str, path: str, name: str) -> Any:
    """The module at `path` as it was at `commit` (imported under another name, from a temporary file)."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="probe-before-"))
    file = folder / f"{name}.py"
    file.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@contextmanager
def code_before(commit: str = BEFORE) -> Iterator[None]:
    """For the body, probe runs the blocked attention and the score functions of `commit`."""
    import probe.hooks.hf as hf
    from probe.heads.scores import SCORES

    old_blocked = _module_at(commit, "probe/hooks/blocked.py", "probe_before_blocked")
    old_scores = _module_at(commit, "probe/heads/scores.py", "probe_before_scores")
    saved_attention, saved_scores = hf.blocked_attention, dict(SCORES)
    hf.blocked_attention = old_blocked.blocked_attention
    SCORES.update({name: score for name, score in old_scores.SCORES.items() if name in SCORES})
    try:
        yield
    finally:
        hf.blocked_attention = saved_attention
        SCORES.update(saved_scores)


def _speed(loaded: Any, length: int, repeats: int, with_before: bool, log: Any) -> dict[str, Any]:
    from probe.inputs import repeated_set
    from probe.heads.classify import score_heads
    from probe.heads.scores import SCORES

    probe_set = repeated_set(loaded, repeat_len=(length - 1) // 2, num_seqs=1, seed=0)
    ids = probe_set.input_ids
    results: dict[str, Any] = {}

    def plain() -> None:
        with torch.no_grad():
            loaded.model(input_ids=ids, use_cache=False)

    def probe() -> None:
        results["after"] = score_heads(loaded, probe_set, SIX, batch_size=1)

    def probe_before() -> None:
        with code_before():
            results["before"] = score_heads(loaded, probe_set, SIX, batch_size=1)

    variants = {"plain": plain, "probe": probe}
    if with_before:
        variants["probe_before"] = probe_before
    log(f"long context: {tuple(ids.shape)}, {repeats} repeats, variants {', '.join(variants)}")
    timings = interleaved(variants, "plain", repeats, warmup=1 if length <= 1024 else 0, log=log)
    out: dict[str, Any] = {"tokens": int(ids.shape[1]), "scores": SIX, "timings": timings.to_dict()}
    if "before" in results:
        out["largest_difference_before_after"] = {
            name: float((results["after"][name] - results["before"][name]).abs().max()) for name in SCORES
            if name in results["before"]}
    return out


def _ops(fn: Any, rows: int = 8) -> dict[str, Any]:
    """torch.profiler: total self time and the ops that take the most of it (all shapes together)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]
    return {"self_seconds": total / 1e6, "ops": [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
                                                  "share": e.self_cpu_time_total / total} for e in ranked]}


def layer_profile(length: int = 4096, log: Any = print) -> dict[str, Any]:
    """One attention layer of SmolLM2's sizes (9 query / 3 key-value heads of 64) on random q, k, v of `length`
    positions: blocked attention with the six scores reduced from its blocks, before and after, profiled; and the
    plain sdpa attention of the same tensors timed (min of 3)."""
    import time

    import torch.nn.functional as F

    import probe.hooks.hf as hf
    from probe.heads.accumulate import ScoreAccumulator
    from probe.heads.scores import SCORES, Batch

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, length, 64), torch.randn(1, 3, length, 64), torch.randn(1, 3, length, 64)
    out: dict[str, Any] = {"length": length}

    def best(fn: Any) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.no_grad():
        out["sdpa_seconds"] = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        for label, context in (("before", code_before), ("after", _nothing)):
            with context():
                accumulator = ScoreAccumulator(list(SCORES), 1, 9)
                accumulator.batch = Batch(torch.ones(1, length, dtype=torch.bool), 1, (length - 1) // 2)

                def layer() -> None:
                    hf.blocked_attention(q, k, v, scaling=None, mask=None, causal=True,
                                         on_block=lambda start, w: accumulator.update(0, start, w))

                out[label] = {"seconds": best(layer), **_ops(layer)}
            log(f"  layer profile {label}: {out[label]['seconds']:.3f} s (sdpa {out['sdpa_seconds']:.3f} s)")
    return out


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _memory(log: Any) -> dict[str, Any]:
    points = {}
    for tool, length in MEMORY_POINTS:
        result = run_measured([sys.executable, "-m", "bench.long_context_point", tool, str(length)])
        point: dict[str, Any] = {"length": length, "peak_rss": result.peak_rss, "seconds": result.seconds,
                                 "killed": result.killed, "returncode": result.returncode}
        if result.returncode == 0:
            point.update(last_json(result.stdout))
        else:
            point["error"] = result.stderr[-1500:]
        log(f"  {tool} {length}: peak {result.peak_rss / 2**30:.2f} GiB, {result.seconds:.0f} s, "
            f"rc {result.returncode}")
        points[f"{tool}:{length}"] = point
    return points


def run(lengths: list[int] | None = None, repeats: dict[int, int] | None = None, memory: bool = True,
        profile_layer: bool = True, with_before: bool = True, log: Any = print) -> dict[str, Any]:
    from probe.models import load_model

    started, load_before = now(), load_average()
    out: dict[str, Any] = {"benchmark": "long_context", "date": started, "machine": machine(),
                           "load_before": load_before, "before_commit": BEFORE, "speed": {}}
    if memory:  # first, in fresh processes: a child's peak RSS counts its parent's memory at fork
        out["memory"] = _memory(log)
    if profile_layer:
        out["layer_profile"] = layer_profile(4096, log)
    loaded = load_model("smollm2")
    for length in list(REPEATS) if lengths is None else lengths:
        count = (repeats or {}).get(length, REPEATS.get(length, 1))
        out["speed"][str(length)] = _speed(loaded, length, count, with_before and length <= BEFORE_UP_TO, log)
    out["load_after"] = load_average()
    return out

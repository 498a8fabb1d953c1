"""Where the time goes: torch.profiler op tables of probe's classification, short batch and one long sequence.

Two workloads:
- short: benchmark 1's batch, 8 x 101 tokens, previous-token + duplicate-token + induction;
- long: one sequence of LENGTH tokens (default 2048) of natural text, the four natural-text scores (what
  `probe classify --num-seqs 1` runs on it).
For each: the plain sdpa forward's time, probe's, and the ops that take the most self time inside probe's run,
with their input shapes. pyinstrument adds the share of Python-side time outside torch ops (hooks, reductions).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _top_ops(fn: Any, rows: int = 12) -> tuple[list[dict[str, Any]], float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]
    out = [{"op": e.key, "shapes": str(e.input_shapes)[:90], "calls": e.count,
            "self_ms": e.self_cpu_time_total / 1000, "share": e.self_cpu_time_total / total} for e in ranked]
    return out, total / 1e6


def _python_share(fn: Any) -> dict[str, Any]:
    """pyinstrument: time in frames of probe's own Python code vs all, for the Python-side overhead."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return {"note": "pyinstrument not installed"}
    profiler = Profiler(interval=0.001)
    profiler.start()
    fn()
    session = profiler.stop()
    root = session.root_frame()
    total = root.time if root is not None else 0.0
    probe_self = 0.0

    def walk(frame: Any) -> None:
        nonlocal probe_self
        path = frame.file_path or ""
        if "/probe/" in path and "site-packages" not in path:
            probe_self += frame.total_self_time
        for child in frame.children:
            walk(child)

    if root is not None:
        walk(root)
    return {"total_seconds": total, "probe_python_self_seconds": probe_self,
            "text": profiler.output_text(unicode=False, color=False, show_all=False)[:6000]}


def run(length: int = 2048, log: Any = print) -> dict[str, Any]:
    from bench.common import load_average, machine, now
    from probe.classify import score_heads
    from probe.data import natural_set, repeated_set
    from probe.models import load_model
    from probe.scores import SCORES

    loaded = load_model("smollm2")
    model = loaded.model
    started, load_before = now(), load_average()
    workloads = {
        "short": (repeated_set(loaded, repeat_len=50, num_seqs=8, seed=0),
                  ["previous_token", "duplicate_token", "induction"], 8),
        "long": (natural_set(loaded, seq_len=length - 1, num_seqs=1),
                 [name for name, score in SCORES.items() if score.probe == "natural"], 1),
    }
    out: dict[str, Any] = {"benchmark": "profile", "date": started, "machine": machine(), "load_before": load_before}
    for name, (probe_set, names, batch) in workloads.items():
        ids = probe_set.input_ids

        def plain() -> None:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)

        def probe() -> None:
            score_heads(loaded, probe_set, names, batch_size=batch)

        plain(), probe()  # warm up
        times = {}
        for label, fn in (("plain", plain), ("probe", probe), ("plain_again", plain)):
            start = time.perf_counter()
            fn()
            times[label] = time.perf_counter() - start
        log(f"profile {name}: plain {times['plain']:.2f}s, probe {times['probe']:.2f}s")
        ops, profiled_seconds = _top_ops(probe)
        plain_ops, _ = _top_ops(plain, rows=6)
        out[name] = {"shape": list(ids.shape), "scores": names, "seconds": times, "probe_ops": ops,
                     "plain_ops": plain_ops, "profiled_self_seconds": profiled_seconds,
                     "python": _python_share(probe)}
    out["load_after"] = load_average()
    return out

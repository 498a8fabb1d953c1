"""Where the time goes: torch.profiler op tables of probe's classification, short batch and one long sequence.

Two workloads:
- short: benchmark 1's batch, 8 x 101 tokens, previous-token + duplicate-token + induction;
- long: one sequence of LENGTH tokens (default 2048) of natural text, the four natural-text scores (what
  `probe classify --num-seqs 1` runs on it).
For each: the plain sdpa forward's time, probe's, and the ops that take the most self time inside probe's run,
with their input shapes, and pyinstrument's wall time by source file (score reductions, attention, the model).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _top_ops(fn: Any, rows: int = 12) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """(ops by self time, with input shapes), (ops by self time, all shapes together), total self seconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]
    shaped = [{"op": e.key, "shapes": str(e.input_shapes)[:90], "calls": e.count,
               "self_ms": e.self_cpu_time_total / 1000, "share": e.self_cpu_time_total / total} for e in ranked]
    by_name: dict[str, list[float]] = {}
    for e in events:
        entry = by_name.setdefault(e.key, [0.0, 0])
        entry[0] += e.self_cpu_time_total
        entry[1] += e.count
    named = [{"op": key, "calls": int(count), "self_ms": self_us / 1000, "share": self_us / total}
             for key, (self_us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:rows]]
    return shaped, named, total / 1e6


def _by_source(fn: Any) -> dict[str, Any]:
    """pyinstrument: wall time by the source file of the Python frame that was running (a torch op counts for the
    frame that called it), so: score reductions (probe/scores.py), probe's attention (probe/attention.py), the
    rest of the model (transformers, torch.nn)."""
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
    by_file: dict[str, float] = {}

    def name_of(path: str) -> str:
        for marker in ("/probe/", "/transformers/", "/torch/", "/bench/"):
            if marker in path:
                return marker.strip("/") + "/" + path.split(marker, 1)[1]
        return path.rsplit("/", 1)[-1] or "?"

    def walk(frame: Any, owner: str) -> None:
        path = frame.file_path or ""
        if path and not path.startswith("<"):  # a Python source file; built-ins (torch ops) count for their caller
            owner = name_of(path)
        by_file[owner] = by_file.get(owner, 0.0) + frame.total_self_time
        for child in frame.children:
            walk(child, owner)

    if root is not None:
        walk(root, "(outside any Python file)")
    top = sorted(by_file.items(), key=lambda kv: -kv[1])[:10]
    return {"total_seconds": total, "by_file": [{"file": k, "seconds": v, "share": v / total if total else 0.0}
                                                for k, v in top]}


def run(length: int = 2048, log: Any = print) -> dict[str, Any]:
    from bench.common import load_average, machine, now
    from probe.inputs import natural_set, repeated_set
    from probe.heads.classify import score_heads
    from probe.heads.scores import SCORES
    from probe.models import load_model

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
        ops, named, profiled_seconds = _top_ops(probe)
        _, plain_named, plain_seconds = _top_ops(plain, rows=6)
        out[name] = {"shape": list(ids.shape), "scores": names, "seconds": times, "probe_ops": ops,
                     "probe_ops_by_name": named, "plain_ops_by_name": plain_named,
                     "profiled_self_seconds": profiled_seconds, "plain_profiled_self_seconds": plain_seconds,
                     "python": _by_source(probe)}
    out["load_after"] = load_average()
    return out

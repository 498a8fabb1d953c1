"""Benchmark 3: peak memory (RSS) against sequence length, one fresh process per point, a single sequence.

- probe: the command line, `probe classify --seq-len N-1 --num-seqs 1 --batch-size 1` (BOS makes N), which scores
  every head for all six classes (it also runs the repeated set, 1 x 101 tokens);
- probe_ablate: `probe ablate --heads 0.0,0.1,29.8 --seq-len N-1 --num-seqs 1 --batch-size 1`: the exact sweep's
  machinery at its largest (the baseline keeps block outputs up to the last layer; the two heads of layer 0 share
  one stacked forward, as many copies as a full sweep stacks at 8192 tokens, and the first ablated forward is
  checked against a full forward); a full 270-head sweep holds no more, it only takes longer;
- hf: Hugging Face `output_attentions=True` (eager), the attentions of all layers held (bench.memory_point);
- tl: TransformerLens `run_with_cache` (every hook, as documented); tl_patterns: filtered to the pattern hooks.

A point that would pass MEMORY_CAP (8 GiB: the machine is shared) is not run: its peak is estimated from the
points measured for the same tool, by a least-squares fit of a + b*N + c*N^2 (attention of all layers held grows
as N^2), and reported as an estimate. A running point whose RSS passes the cap is stopped and reported as such.
"""

from __future__ import annotations

import sys
from typing import Any

from bench.common import GIB, MEMORY_CAP, last_json, load_average, machine, now, run_measured

LENGTHS = [512, 1024, 2048, 4096, 8192]
FIT_EXTRA = {"hf": [768, 1536], "tl": [768, 1280], "tl_patterns": [768, 1536]}  # more points below the cap, to fit
TOOLS = ["load_only", "probe", "probe_ablate", "hf", "tl", "tl_patterns"]
ABLATE_LENGTHS = [1024, 2048, 4096, 8192]  # probe ablate: fewer points


def fit(points: list[tuple[int, int]]) -> tuple[float, float, float] | None:
    """Least squares a + b*n + c*n^2 through (n, bytes); None with fewer than 3 points."""
    if len(points) < 3:
        return None
    import numpy as np

    n = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    design = np.stack([np.ones_like(n), n, n * n], axis=1)
    coefficients, *_ = np.linalg.lstsq(design, y, rcond=None)
    return tuple(float(c) for c in coefficients)  # type: ignore[return-value]


def predict(points: list[tuple[int, int]], length: int) -> float | None:
    if len(points) >= 3:
        a, b, c = fit(points)  # type: ignore[misc]
        return a + b * length + c * length * length
    if len(points) == 2:  # floor + quadratic growth through the two points
        (n1, y1), (n2, y2) = sorted(points)
        c = (y2 - y1) / (n2 * n2 - n1 * n1)
        return y1 + c * (length * length - n1 * n1)
    return None


def command(tool: str, length: int) -> list[str]:
    if tool == "probe":
        return [sys.executable, "-m", "probe.cli", "classify", "--seq-len", str(length - 1), "--num-seqs", "1",
                "--batch-size", "1"]
    if tool == "probe_ablate":
        return [sys.executable, "-m", "probe.cli", "ablate", "--heads", "0.0,0.1,29.8", "--seq-len", str(length - 1),
                "--num-seqs", "1", "--batch-size", "1"]
    return [sys.executable, "-m", "bench.memory_point", tool, str(length)]


def run(lengths: list[int] | None = None, tools: list[str] | None = None, log: Any = print) -> dict[str, Any]:
    from bench.common import have_transformer_lens

    lengths = lengths or LENGTHS
    tools = tools or [t for t in TOOLS if have_transformer_lens() or not t.startswith("tl")]
    started, load_before = now(), load_average()
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for tool in tools:
        if tool == "load_only":
            grid = [lengths[0]]
        elif tool == "probe_ablate":
            grid = [n for n in lengths if n in ABLATE_LENGTHS] or [max(lengths)]
        else:
            grid = sorted(set(lengths) | set(FIT_EXTRA.get(tool, [])))
        measured: list[tuple[int, int]] = []
        rows: dict[int, dict[str, Any]] = {}
        for length in grid:
            guess = predict(measured, length)
            if guess is not None and guess > 0.9 * MEMORY_CAP:
                rows[length] = {"status": "skipped", "predicted_before": guess}
                log(f"  {tool} {length}: skipped, predicted {guess / GIB:.1f} GiB > 0.9 x cap")
                continue
            result = run_measured(command(tool, length))
            row: dict[str, Any] = {"peak_rss": result.peak_rss, "wall_seconds": result.seconds}
            if result.killed:
                row["status"] = "stopped at cap"
            elif result.returncode != 0:
                row["status"] = "failed"
                row["error"] = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
            else:
                row["status"] = "measured"
                measured.append((length, result.peak_rss))
                if not tool.startswith("probe"):
                    row.update(last_json(result.stdout))
            rows[length] = row
            log(f"  {tool} {length}: {row['status']}, peak {result.peak_rss / GIB:.2f} GiB, {result.seconds:.0f} s")
        coefficients = fit(measured)
        for length, row in rows.items():
            if row["status"] != "measured" and coefficients is not None:
                a, b, c = coefficients
                row["estimate"] = a + b * length + c * length * length
        table[tool] = rows
    return {
        "benchmark": "memory",
        "date": started,
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "cap_bytes": MEMORY_CAP,
        "lengths": lengths,
        "points": {tool: {str(k): v for k, v in rows.items()} for tool, rows in table.items()},
    }

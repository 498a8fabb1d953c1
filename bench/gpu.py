"""`python -m bench gpu`: which fused-attention backend probe should ask first on a GPU, settled in one run.

On a GPU (bfloat16; random-init llama models with the layer sizes of SmolLM2-135M, Llama-3.2-1B and Llama-3-8B; one
sequence of BOS + random tokens repeated), every registered backend that serves the point's attention call (asked,
never named: probe.kernels.BACKENDS, `problem(call)`) against the plain sdpa forward:
- classify's scoring pass (six default scores) and kv-heads' (`score_needles`, needle prompts of token ids: no
  tokenizer travels), interleaved timings, peak memory (torch.cuda.max_memory_allocated) against the plain forward's;
- one layer's attention per backend against torch's sdpa, both checked against a float32 reference of the last
  rows (never n x n);
- the six scores per backend against the blocked path (float32 and bfloat16) at a short length;
- whether the scoring passes wait for the GPU inside a forward.
It prints which backend the registry should put first for which sizes, and writes bench/results/gpu.json after every
row (RESULTS.md's section: bench/gpu_report.py).

Time: the whole run fits `BUDGET_SECONDS` (one 10-minute device command with room). Each group of points (a layout,
its model built once) runs in a child process (bench/gpu_points.py) that checks each point's deadline between layers
and repeats; this process kills a child whose point is past its deadline and `GRACE_SECONDS` (a kernel or compilation
no check reaches) and starts a fresh one for the points left. A point that raises or runs over is recorded with its
outcome; nothing escapes `run()`. Points run in plan order and a point not started by the budget's end is skipped,
so time running short drops, in this order: 1B, then 135M from its longest length, then the 8B layout's 65536 point,
then kv-heads at 16384 (`GPU_PLAN`).

Without a GPU (`--dry-run`, or no CUDA) the same structure runs tiny layouts on the CPU (the Triton kernel through its
interpreter): what CI checks (tests/test_bench_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, now

Log = Callable[[str], None]
BUDGET_SECONDS = 420.0  # all points; bench/device.sh gives the rest of one command to the wheels and gpu_commands
GRACE_SECONDS = 20.0  # past a point's deadline before its child is killed
REPEATS = {2048: 5, 4096: 5, 8192: 3, 16384: 3, 32768: 2, 65536: 2}
CAPS = {512: 120, 1024: 60, 2048: 40, 4096: 60, 8192: 40, 16384: 75, 32768: 60, 65536: 130}  # seconds per point:
# the first point of a backend in a process pays its compilation (Triton's autotuning, torch.compile's)


def _point(kind: str, layout: str, tokens: int, cap: float | None = None, repeats: int | None = None) -> dict[str, Any]:
    return {"id": f"{kind} {layout} {tokens}", "kind": kind, "layout": layout, "tokens": tokens,
            "cap": cap if cap is not None else CAPS.get(tokens, 60), "repeats": repeats or REPEATS.get(tokens, 1)}


GPU_PLAN: list[list[dict[str, Any]]] = [  # groups in the order they run; one child (one model) per group
    [_point("agreement", "135M", 512)],
    [_point("classify", "8B", 4096), _point("classify", "8B", 16384), _point("kv", "8B", 4096),
     _point("kv", "8B", 16384), _point("classify", "8B", 65536)],
    [_point("sync", "135M", 1024), _point("classify", "135M", 2048), _point("classify", "135M", 8192),
     _point("classify", "135M", 32768)],
    [_point("classify", "1B", 4096), _point("classify", "1B", 16384)],
]
DRY_PLAN: list[list[dict[str, Any]]] = [  # one child: the same structure on the CPU, in seconds
    [_point("agreement", "tiny", 24, cap=120), _point("sync", "tiny", 24, cap=60),
     _point("classify", "tiny", 48, cap=120, repeats=1), _point("kv", "tiny", 64, cap=60, repeats=1)],
]
TARGETS = {"135M": 1.25, "8B": 1.10}  # classify / plain forward, the bound each layout is held to
KV_TARGET = 1.10


def versions() -> dict[str, str]:
    """torch, triton and transformers as this process imports them (the child imports the same)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "triton", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


class Results:
    """gpu.json as it grows: every row saved at once (written whole through a temporary file and a rename)."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data
        self.save()

    def add(self, point: dict[str, Any], row: dict[str, Any]) -> None:
        self.data["rows"].append({"point": point["id"], **row})
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(temporary, self.path)


def run(dry: bool, log: Log, name: str = "gpu", plan: list[list[dict[str, Any]]] | None = None,
        budget: float | None = None, grace: float = GRACE_SECONDS) -> dict[str, Any]:
    """Every group of the plan in a child process, rows saved to bench/results/NAME.json as they come; the backend
    choice last. Never raises for a point: its row says what happened."""
    import torch

    from bench import common

    device = "cpu" if dry or not torch.cuda.is_available() else "cuda"
    plan = plan if plan is not None else (GPU_PLAN if device == "cuda" else DRY_PLAN)
    budget = budget if budget is not None else BUDGET_SECONDS
    started = time.time()
    results = Results(common.RESULTS_DIR / f"{name}.json", {
        "benchmark": "gpu", "date": now(), "machine": machine(("transformers",)), "versions": versions(),
        "device": device, "dtype": "bfloat16" if device == "cuda" else "float32", "dry_run": device == "cpu",
        "budget_seconds": budget, "grace_seconds": grace,
        "plan": [point["id"] for group in plan for point in group], "rows": []})
    log(f"gpu: {device}, {results.data['dtype']}, budget {budget:.0f} s, {len(results.data['plan'])} points")
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as folder:
        for number, group in enumerate(plan):
            Group(group, device, started + budget, grace, Path(folder) / f"group-{number}", results, log).run()
    results.data["seconds"] = round(time.time() - started, 1)
    results.data["choice"] = choose(results.data["rows"])
    results.save()
    for line in choice_lines(results.data["choice"]):
        log(line)
    return results.data


class Group:
    """One group's points run by child processes: a fresh child for the points left whenever one dies or is
    killed; the point it was in is recorded (crashed, killed) and not tried again."""

    def __init__(self, points: list[dict[str, Any]], device: str, budget_end: float, grace: float, folder: Path,
                 results: Results, log: Log) -> None:
        positions = max(point["tokens"] for point in points) + 64  # the model's context, one for the group
        self.points = [{"positions": positions, **point} for point in points]  # copies: the plan stays as it is
        self.device, self.budget_end, self.grace = device, budget_end, grace
        self.folder, self.results, self.log = folder, results, log
        self.finished: set[str] = set()

    def left(self) -> list[dict[str, Any]]:
        return [point for point in self.points if point["id"] not in self.finished]

    def run(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        attempt = 0
        while self.left():
            if time.time() >= self.budget_end:
                for point in self.left():
                    self._record(point, {"kind": point["kind"], "layout": point["layout"], "tokens": point["tokens"],
                                         "outcome": "skipped", "why": "past the run's time budget"})
                return
            attempt += 1
            self._child(attempt)

    def _record(self, point: dict[str, Any], row: dict[str, Any], final: bool = True) -> None:
        self.results.add(point, row)
        self.log(f"    {_row_line(row)}")
        if final:
            self.finished.add(point["id"])

    def _setup_deadline(self, points: dict[str, dict[str, Any]]) -> float:
        """How long a child may take outside a point (its imports, the step to the next point)."""
        return min(time.time() + max(point["cap"] for point in points.values()), self.budget_end)

    def _child(self, attempt: int) -> None:  # long: starts, watches and reads one child to its end
        """One child for the points left: its events read as they come, the child killed where its point is past
        the deadline and the grace; a point in progress when it ended is recorded as killed or crashed."""
        points = {point["id"]: point for point in self.left()}
        spec: dict[str, Any] = {"device": self.device, "dtype": "bfloat16" if self.device == "cuda" else "float32",
                "budget_end": self.budget_end, "rows": str(self.folder / f"rows-{attempt}.jsonl"),
                "points": list(points.values())}
        spec_path = self.folder / f"spec-{attempt}.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        Path(spec["rows"]).touch()
        log_path = self.folder / f"child-{attempt}.log"
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                 os.environ.get("PYTHONPATH")]))}
        if self.device == "cpu":
            environment["TRITON_INTERPRET"] = "1"
        with log_path.open("w") as child_log:
            child = subprocess.Popen([sys.executable, "-m", "bench.gpu_points", str(spec_path)], cwd=ROOT,
                                     env=environment, stdout=child_log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        current: dict[str, Any] | None = None
        deadline = self._setup_deadline(points)
        offset, killed = 0, ""
        while True:
            returncode = child.poll()
            offset, events = _read_events(Path(spec["rows"]), offset)
            for event in events:
                point = points[event["id"]]
                if event["event"] == "start":
                    current, deadline = point, event["deadline"]
                    self.log(f"  {point['id']}: started (deadline in {deadline - time.time():.0f} s)")
                elif event["event"] == "row":
                    self._record(point, event["row"], final=False)
                else:
                    self.finished.add(point["id"])
                    current, deadline = None, self._setup_deadline(points)
                    self.log(f"  {point['id']}: done in {event['seconds']:.1f} s")
            if returncode is not None:
                break
            if time.time() > deadline + (current or {}).get("grace", self.grace) and not killed:
                killed = f"killed: still running {(current or {}).get('grace', self.grace):.0f} s past its deadline"
                _kill(child)
            time.sleep(0.2)
        if current is not None and current["id"] not in self.finished:
            why = killed or f"crashed: the child exited with {returncode}: {_tail(log_path)}"
            self._record(current, {"kind": current["kind"], "layout": current["layout"],
                                   "tokens": current["tokens"], "outcome": "killed" if killed else "crashed",
                                   "why": why})
        elif returncode != 3:  # ended outside a point (imports, between points): the rest is not tried again
            for point in self.left():
                self._record(point, {"kind": point["kind"], "layout": point["layout"], "tokens": point["tokens"],
                                     "outcome": "killed" if killed else "crashed",
                                     "why": (killed or f"exited with {returncode}") + " before the point started: "
                                     + _tail(log_path)})


def _read_events(path: Path, offset: int) -> tuple[int, list[dict[str, Any]]]:
    """The complete lines appended to the rows file since `offset` (a half-written last line waits)."""
    with path.open("rb") as handle:
        handle.seek(offset)
        data = handle.read()
    end = data.rfind(b"\n") + 1
    return offset + end, [json.loads(line) for line in data[:end].decode("utf-8").splitlines() if line.strip()]


def _kill(child: subprocess.Popen[bytes]) -> None:
    """The child and what it started (its own process group), then wait for it."""
    import contextlib
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-600:]


def _row_line(row: dict[str, Any]) -> str:
    """One row as a log line."""
    what = f"{row.get('kind')} {row.get('layout')} {row.get('tokens')} {row.get('backend', '')}".rstrip()
    if row.get("outcome") != "ok":
        return f"{what}: {row.get('outcome')}: {row.get('where') or row.get('error') or row.get('why', '')}"
    if "ratio" in row:
        return f"{what}: {row['ratio']:.3f}x" + (f", path {row['path']}" if "path" in row else "")
    if "largest_difference" in row:
        return f"{what} {row['dtype']}: path {row['path']}, agrees {row['agrees']}"
    return f"{what}: {row.get('pass')} {row.get('result')}"


def choose(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layout and length, the fastest backend among those whose classify row finished and served every layer
    (path = its name), leaving out any whose scores disagreed with the blocked path (one the agreement point did not
    reach is ranked, marked unchecked); and which to put first (fastest at most points, ties to the lower median)."""
    checked = [row for row in rows if row.get("kind") == "agreement" and row.get("outcome") == "ok"]
    failed = {row["backend"] for row in checked if not row["agrees"]}
    agreed = {row["backend"] for row in checked} - failed
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("kind") != "classify" or row.get("outcome") != "ok" or not row.get("served") or \
                row["backend"] in failed:
            continue
        key = f"{row['layout']} {row['tokens']}"
        if key not in best or row["ratio"] < best[key]["ratio"]:
            best[key] = {"layout": row["layout"], "tokens": row["tokens"], "backend": row["backend"],
                         "ratio": row["ratio"], "checked": row["backend"] in agreed}
    wins: dict[str, list[float]] = {}
    for entry in best.values():
        wins.setdefault(entry["backend"], []).append(entry["ratio"])
    first = min(wins, key=lambda name: (-len(wins[name]), sorted(wins[name])[len(wins[name]) // 2]), default=None)
    return {"first": first, "points": list(best.values()), "agreed": sorted(agreed), "disagreed": sorted(failed),
            "wins": {name: len(ratios) for name, ratios in wins.items()}}


def choice_lines(choice: dict[str, Any]) -> list[str]:
    """The printout: per layout the sizes each backend is fastest at, and which the registry should put first."""
    lines = ["backend choice (fastest classify pass per point, among backends that served every layer and whose "
             "scores did not disagree with the blocked path):"]
    by_layout: dict[str, list[dict[str, Any]]] = {}
    for entry in choice["points"]:
        by_layout.setdefault(entry["layout"], []).append(entry)
    for layout, entries in by_layout.items():
        lines += [f"  {layout} at {entry['tokens']} tokens: {entry['backend']} ({entry['ratio']:.3f}x the plain forward"
                  + ("" if entry["checked"] else "; scores not checked against the blocked path") + ")"
                  for entry in sorted(entries, key=lambda entry: entry["tokens"])]
    lines.append(f"registry: put {choice['first']} first (fastest at {choice['wins'].get(choice['first'], 0)} of "
                 f"{len(choice['points'])} points)" if choice["first"] else
                 "registry: no backend finished a classify point with agreeing scores: no choice")
    return lines

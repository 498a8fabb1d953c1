"""Shared pieces of the benchmarks: the machine, interleaved timing, fresh-process memory points, TransformerLens.

Every figure a benchmark reports is measured in the run that reports it: ratios are taken against a baseline timed
in the same loop (variants interleaved, their order rotated every repeat), and each figure is the median over the
repeats of the per-repeat ratio, so that a load spike from another process hits baseline and variant alike.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCH = Path(__file__).parent
ROOT = BENCH.parent
RESULTS_DIR = BENCH / "results"  # one JSON per benchmark, rendered together into RESULTS.md
RESULTS_MD = BENCH / "RESULTS.md"
GIB = 2**30
MEMORY_CAP = 8 * GIB  # no benchmark process may grow past this: other work shares the machine
TL_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SIX = ["previous_token", "sink", "induction", "duplicate_token", "next_token", "positional"]  # every score
TOUR_DOCS = ("docs/getting-started.md",)  # the documents whose `probe` lines `python -m bench.tour --doc` runs


def tour_result(doc: str | None) -> str:
    """bench.tour's result name: `tour` for the README's tour, `tour-STEM` for a document's lines."""
    return "tour" if doc is None else f"tour-{Path(doc).stem}"


def machine(packages: tuple[str, ...] = ("transformers", "transformer_lens")) -> dict[str, Any]:
    """What the numbers were measured on (with the versions of `packages`: importing TransformerLens takes seconds,
    a benchmark that does not use it leaves it out)."""
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in packages:
        try:
            module = __import__(package)
            versions[package] = getattr(module, "__version__", "?")
        except Exception:  # transformer_lens is optional (the bench extra)
            versions[package] = "not installed"
    try:
        from importlib.metadata import version

        if "transformer_lens" in packages:
            versions["transformer_lens"] = version("transformer-lens")
    except Exception:
        pass
    gpu = "none"
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(memory / GIB, 1),
        "gpu": gpu,
        "os": platform.platform(),
        "versions": versions,
    }


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


# ---------------------------------------------------------------------------------------------------------------
# timing


@dataclass
class Timings:
    """Seconds per repeat of each variant; `baseline` names the variant the ratios are taken against."""

    baseline: str
    seconds: dict[str, list[float]] = field(default_factory=dict)
    load: list[tuple[float, float, float]] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratios(self, name: str) -> list[float]:
        return [t / b for t, b in zip(self.seconds[name], self.seconds[self.baseline])]

    def ratio(self, name: str) -> float:
        """Median over repeats of (variant / baseline of the same repeat)."""
        return statistics.median(self.ratios(name))

    def paired(self, name: str, other: str) -> float:
        """Median over repeats of (name / other in the same repeat)."""
        return statistics.median(t / o for t, o in zip(self.seconds[name], self.seconds[other]))

    def spread(self, name: str) -> tuple[float, float]:
        ratios = self.ratios(name)
        return min(ratios), max(ratios)

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "seconds": self.seconds,
            "median_seconds": {name: self.median(name) for name in self.seconds},
            "ratio_vs_baseline": {name: self.ratio(name) for name in self.seconds},
            "ratio_range": {name: self.spread(name) for name in self.seconds},
            "paired_ratios": {f"{a}/{b}": self.paired(a, b) for a in self.seconds for b in self.seconds if a != b},
            "load_average_1min": [load[0] for load in self.load],
        }


def interleaved(variants: dict[str, Callable[[], Any]], baseline: str, repeats: int, warmup: int = 1,
                log: Callable[[str], None] = print) -> Timings:
    """Time each variant `repeats` times, interleaved, rotating the order each repeat; warm each up first."""
    import gc

    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    timings = Timings(baseline, {name: [] for name in names})
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        timings.load.append(load_average())
        for name in order:
            gc.collect()
            start = time.perf_counter()
            variants[name]()
            timings.seconds[name].append(time.perf_counter() - start)
        log(f"  repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{name} {timings.seconds[name][-1]:.3f}s" for name in names) + f" (load {timings.load[-1][0]:.2f})")
    return timings


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of `a` and `b` (ties take their mean rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


# ---------------------------------------------------------------------------------------------------------------
# fresh processes with a memory watchdog


@dataclass
class ProcessResult:
    returncode: int
    peak_rss: int  # bytes, as the kernel counted it (ru_maxrss of the child), or the watchdog's last reading
    seconds: float
    stdout: str
    stderr: str
    killed: bool  # the watchdog stopped it at MEMORY_CAP


def run_measured(args: list[str], cap: int = MEMORY_CAP, timeout: float = 3600, env: dict[str, str] | None = None
                 ) -> ProcessResult:
    """Run `args` in a fresh process; peak RSS from the kernel (wait4's rusage of that child), stopped if its RSS
    (with its children's) passes `cap` at one of the 50 ms samples."""
    import psutil

    start = time.perf_counter()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, **(env or {})})
    stdout_chunks: list[str] = []
    stderr_chunks: list[str] = []
    readers = [threading.Thread(target=lambda s=s, out=out: out.append(s.read()), daemon=True)
               for s, out in ((process.stdout, stdout_chunks), (process.stderr, stderr_chunks))]
    for reader in readers:
        reader.start()
    handle = psutil.Process(process.pid)
    killed = False
    watched = 0
    while True:  # only this loop reaps the child, so that wait4 gets its rusage
        pid, status, rusage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        try:
            rss = sum(p.memory_info().rss for p in [handle, *handle.children(recursive=True)])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            rss = 0
        watched = max(watched, rss)
        if not killed and (rss > cap or time.perf_counter() - start > timeout):
            killed = rss > cap
            process.kill()
        time.sleep(0.05)
    process.returncode = os.waitstatus_to_exitcode(status)
    for reader in readers:
        reader.join()
    peak = max(rusage.ru_maxrss * 1024, watched)
    return ProcessResult(process.returncode, peak, time.perf_counter() - start, "".join(stdout_chunks),
                         "".join(stderr_chunks), killed)


def last_json(text: str) -> dict[str, Any]:
    """The last line of `text` that is a JSON object (what a child process reports)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in the output:\n{text[-2000:]}")


# ---------------------------------------------------------------------------------------------------------------
# TransformerLens


def transformer_lens_bridge(loaded: Any) -> Any:
    """TransformerLens 4.x on SmolLM2, offline: wrap a copy of the HF model (the bridge switches it to eager)."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    hf = copy.deepcopy(loaded.model)
    hf.config.architectures = ["LlamaForCausalLM"]  # GGUF configs leave it empty
    bridge = TransformerBridge.boot_transformers(TL_MODEL_ID, hf_model=hf, tokenizer=loaded.tokenizer,
                                                 device="cpu")
    original = bridge.to_tokens

    def to_tokens(value: Any, *args: Any, **kwargs: Any) -> Any:
        """Token ids pass through: the benchmark's inputs are random token ids, which do not survive a round trip
        through text; tokenizing is no part of what is compared."""
        if isinstance(value, torch.Tensor):
            return value if value.dim() == 2 else value[None]
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return torch.cat([v if v.dim() == 2 else v[None] for v in value])
        return original(value, *args, **kwargs)

    bridge.to_tokens = to_tokens
    return bridge


def have_transformer_lens() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_lens") is not None


def save_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def load_result(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{name}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))

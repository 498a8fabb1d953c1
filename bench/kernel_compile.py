"""`python -m bench kernel_compile`: every autotune configuration of the CUDA backend's Triton kernel
(probe/kernels/cuda.py `TILES`) compiled by Triton's own compiler for sm_90 (H100 / H200) and sm_80 (A100), without a
GPU: registers per thread, shared memory per program and spilled bytes, as ptxas reports them. Each head size
(64 / 128 / 256) and dtype (float32 / bfloat16 / float16), the output pass and the statistics-only pass, with the
masks that cost the most registers (a key mask, a sliding window and causal: every branch of the key loop).
tests/test_kernel_compile.py runs the same compiles and fails on a spill or on more shared memory than the target
gives one program.

The compiles run in fresh processes (Triton compiles only where it was imported without TRITON_INTERPRET), each with
a cache of its own (a cached kernel skips ptxas, whose report is what is read): one by default, the test's two side by
side (each compile keeps one core busy).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine

ARCHS = (90, 80)
SHARED_LIMIT = {90: 232448, 80: 166912}  # bytes of shared memory one program may use (227 KiB, 163 KiB)
HEADS = (64, 128, 256)
DTYPES = ("bf16", "fp32", "fp16")  # compiled in this order: float16 shares bfloat16's tiles and instructions

COMPILE = r"""
import contextlib, io, json, re, sys, time
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import probe.kernels.cuda as cuda

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
kernel = cuda._kernels(False).jitted
for arch, head, dtype, with_output in json.loads(sys.argv[1]):
    value_head = head if with_output else 16
    for tile in cuda.tiles_for(head, value_head, DTYPE[dtype], with_output):
        constants = dict(D=head, DV=value_head, HEAD=head, VALUE_HEAD=value_head, NONE=cuda.NO_NAN, HAS_BIAS=False,
                         HAS_KEY_MASK=True, WINDOWED=True, CAUSAL=True, WITH_OUTPUT=with_output, MOMENTS=False,
                         PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False, BLOCK_M=tile.rows,
                         BLOCK_N=tile.keys)
        types = dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, Bias="*" + dtype, KeyMask="*i1",
                     Out="*" + dtype, Lse="*fp32", Top="*i32", Moments="*fp32", qk_scale="fp32")
        signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
        source = ASTSource(kernel, signature,
                           {(kernel.arg_names.index(name),): value for name, value in constants.items()})
        log = io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": tile.warps, "num_stages": tile.stages})
        used = re.search(r"Used (\d+) registers", log.getvalue())
        spills = [int(found) for found in re.findall(r"(\d+) bytes spill (?:stores|loads)", log.getvalue())]
        row = dict(arch=arch, head=head, dtype=dtype, output=with_output, rows=tile.rows, keys=tile.keys,
                   warps=tile.warps, stages=tile.stages, registers=int(used.group(1)) if used else None,
                   spill_bytes=sum(spills) if spills else None, shared=compiled.metadata.shared,
                   seconds=round(time.perf_counter() - started, 2))
        print("ROW " + json.dumps(row), flush=True)
"""


def compile_configurations(archs: tuple[int, ...] = ARCHS, heads: tuple[int, ...] = HEADS,
                           dtypes: tuple[str, ...] = DTYPES, timeout: float = 600,
                           processes: int = 1) -> list[dict[str, Any]]:
    """One row per compiled configuration (arch, head, dtype, output pass or statistics alone, tile, warps, stages):
    registers per thread, spilled bytes (stores + loads) and shared memory, compiled in fresh processes, dtype by
    dtype in the order given. `processes` processes compile side by side (ptxas and LLVM use one core each), the
    configuration sets dealt out in turn, each process with a cache of its own; rows come back in `expected`'s order.
    Past `timeout` seconds the processes are stopped and the rows compiled so far returned."""
    wanted = expected(archs, heads, dtypes)
    by_target = [(arch, head, dtype, output) for dtype in dtypes for head in heads for output in (True, False)
                 for arch in archs]  # neighbours differ in the target alone
    count = max(1, min(processes, len(by_target)))
    with tempfile.TemporaryDirectory() as folder:
        started = [_start(by_target[share::count], Path(folder) / str(share)) for share in range(count)]
        try:
            deadline = time.monotonic() + timeout
            stdout = "".join(_finished(process, deadline, Path(folder) / str(share))
                             for share, process in enumerate(started))
        finally:
            for process in started:
                if process.poll() is None:
                    process.kill()
                process.wait()
    rows = [json.loads(row) for row in re.findall(r"^ROW (.*)$", stdout, re.MULTILINE)]
    order = {key: index for index, key in enumerate(wanted)}
    return sorted(rows, key=lambda row: order[row["arch"], row["head"], row["dtype"], row["output"]])


def _start(sets: list[tuple[int, int, str, bool]], folder: Path) -> subprocess.Popen[bytes]:
    """A fresh process compiling `sets`, with a Triton cache of its own in `folder` and its output in files there
    (a pipe nobody reads while another process is waited for could fill)."""
    folder.mkdir()
    environment = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(folder / "cache"),
                   "TRITON_DUMP_PTXAS_LOG": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    with open(folder / "stdout", "wb") as stdout, open(folder / "stderr", "wb") as stderr:
        return subprocess.Popen([sys.executable, "-c", COMPILE, json.dumps(sets)], env=environment, cwd=ROOT,
                                stdout=stdout, stderr=stderr)


def _finished(process: subprocess.Popen[bytes], deadline: float, folder: Path) -> str:
    """A compiling process' output once it exits, or what it printed before `deadline` (it is then stopped)."""
    try:
        process.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    else:
        if process.returncode != 0:
            stderr = (folder / "stderr").read_text(errors="replace")
            raise RuntimeError(f"compiling the kernel failed:\n{stderr[-4000:]}")
    return (folder / "stdout").read_text(errors="replace")


def expected(archs: tuple[int, ...] = ARCHS, heads: tuple[int, ...] = HEADS,
             dtypes: tuple[str, ...] = DTYPES) -> list[tuple[int, int, str, bool]]:
    """(arch, head, dtype, output pass) of every configuration set a run is asked to compile."""
    return [(arch, head, dtype, output) for dtype in dtypes for arch in archs for head in heads
            for output in (True, False)]


def problems(rows: list[dict[str, Any]]) -> list[str]:
    """What disqualifies a configuration: spilled registers, or more shared memory than the target gives."""
    found = []
    for row in rows:
        name = (f"sm_{row['arch']} head {row['head']} {row['dtype']} {'output' if row['output'] else 'statistics'} "
                f"{row['rows']}x{row['keys']} w{row['warps']} s{row['stages']}")
        if row["registers"] is None or row["spill_bytes"] is None:
            found.append(f"{name}: no ptxas report read")
        elif row["spill_bytes"]:
            found.append(f"{name}: {row['spill_bytes']} bytes spilled")
        if row["shared"] > SHARED_LIMIT[row["arch"]]:
            found.append(f"{name}: {row['shared']} bytes of shared memory, over {SHARED_LIMIT[row['arch']]}")
    return found


def run(log: Callable[[str], None], budget: float = 1500) -> dict[str, Any]:
    """Every configuration compiled within `budget` seconds, its resources, what (if anything) disqualifies one,
    and the configuration sets left uncompiled when the budget ran out."""
    started = time.perf_counter()
    rows = compile_configurations(timeout=budget)
    done = {(row["arch"], row["head"], row["dtype"], row["output"]) for row in rows}
    log(f"   {len(rows)} configurations compiled in {time.perf_counter() - started:.0f} s")
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows,
            "problems": problems(rows), "triton": _triton_version(), "budget_seconds": budget,
            "not_compiled": [list(key) for key in expected() if key not in done]}


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def section(data: dict[str, Any]) -> str:
    """RESULTS.md's table of the compiled configurations."""
    lines = ["## The Triton kernel compiled for sm_90 and sm_80 (no GPU): registers, shared memory, spills", "",
             f"`{data.get('command', 'python -m bench kernel_compile')}`, Triton {data['triton']}, {data['date']}. "
             "Every autotune configuration of probe/kernels/cuda.py (`TILES`), compiled with a key mask, a sliding "
             "window and causal masking (every branch of the key loop); registers per thread, spilled bytes (stores "
             "+ loads) and shared memory per program as ptxas reports them. Shared memory limits: "
             f"{SHARED_LIMIT[90]} bytes on sm_90, {SHARED_LIMIT[80]} on sm_80.", "",
             "| arch | head | dtype | pass | rows x keys | warps | stages | registers | spilled bytes "
             "| shared (bytes) |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for row in data["rows"]:
        lines.append(f"| sm_{row['arch']} | {row['head']} | {row['dtype']} | "
                     f"{'output' if row['output'] else 'statistics'} | {row['rows']} x {row['keys']} | "
                     f"{row['warps']} | {row['stages']} | {row['registers']} | {row['spill_bytes']} | "
                     f"{row['shared']} |")
    verdict = "none" if not data["problems"] else "; ".join(data["problems"])
    left = data.get("not_compiled") or []
    rest = "" if not left else (
        f" Not compiled in this run (its {data['budget_seconds']:.0f} s budget ran out on a loaded machine): "
        + ", ".join(f"sm_{arch} head {head} {dtype} {'output' if output else 'statistics'}"
                    for arch, head, dtype, output in left) + ".")
    return "\n".join(lines) + f"\n\nConfigurations that spill or overflow shared memory: {verdict}.{rest}\n"

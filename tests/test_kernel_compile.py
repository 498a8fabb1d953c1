"""The CUDA backend's Triton kernel compiled by Triton's compiler (not its interpreter) for sm_90 and sm_80 without a
GPU (ptxas ships with triton): its autotune configurations must not spill registers nor ask for more shared memory
than the target gives a program. In two fresh processes side by side, one target's compiles each (Triton compiles
only where it was imported without TRITON_INTERPRET; a compile keeps one core busy), through bench/kernel_compile.py,
which `python -m bench kernel_compile` runs over every head size, dtype and pass to write the table in
bench/RESULTS.md.

The compiles here are the half-precision configurations (bfloat16; float16 compiles to the same instructions on
other types) of the head sizes models use most, both passes, for both targets: 14 compiles. The bench entry compiles
the rest (float32, float16, head size 64) and its table says what each one uses."""

from __future__ import annotations

import importlib.util

import pytest

from bench.kernel_compile import compile_configurations, problems

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                                reason="no CUDA compiler in triton")


@pytest.mark.slow  # over 10 s on 2 cores
def test_the_kernel_compiles_for_sm90_and_sm80_without_spills() -> None:
    rows = compile_configurations(archs=(90, 80), heads=(128, 256), dtypes=("bf16",), processes=2)
    assert {(row["arch"], row["head"], row["output"]) for row in rows} == {
        (arch, head, output) for arch in (90, 80) for head in (128, 256) for output in (True, False)}
    assert all(row["registers"] and row["shared"] for row in rows)
    assert not problems(rows), problems(rows)

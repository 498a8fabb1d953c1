"""`python -m bench gpu` (bench/gpu.py, issue 44) without a GPU: the tiny dry run goes through every part (classify
against the plain forward, the Triton kernel against sdpa through Triton's interpreter, the scores with the CUDA
backend forced against the blocked path) and renders its section; on a GPU the same code measures the real layouts."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import bench.common as common
from bench import gpu

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None,  # not imported here: Triton fixes
                                 # whether it interprets when first imported, and the dry run sets TRITON_INTERPRET
                                 reason="triton is not installed: the dry run's kernel parts cannot run"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),  # the interpreter's padding rows
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]


def test_the_dry_run_measures_every_part_and_renders(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logged: list[str] = []
    data = gpu.run(True, logged.append, name="gpu-dry")
    assert json.loads((tmp_path / "gpu-dry.json").read_text())["dry_run"] is True
    assert data["device"] == "cpu" and data["sync"]["result"].startswith("not run")
    (point,) = data["classify"]
    assert point["layout"] == "tiny" and point["tokens"] == 48 and point["path"] == "cpu" and point["ratio"] > 0
    assert point["path_b"] == "cuda" and point["ratio_b"] > 0  # design (b) forced: the kernel's statistics
    (kernel,) = data["kernel"]
    assert kernel["largest_error_kernel"] <= 1e-5  # float32: the kernel's output is attention's
    assert kernel["ratio"] > 0 and kernel["ratio_sdpa_and_statistics"] > 0
    for dtype, bound in (("float32", 1e-5), ("bfloat16", 1e-4)):
        entry = data["agreement"][dtype]
        assert entry["path"] == "cuda", entry["path"]  # every layer served by the kernel
        diagonal_and_column = [value for name, value in entry["largest_difference"].items() if name != "positional"]
        assert max(diagonal_and_column) <= bound, (dtype, entry)
    assert data["agreement"]["float32"]["largest_difference"]["positional"] <= 1e-5
    text = gpu.section(data)
    assert "| tiny | 48 |" in text and "dry run" in text and "not run: no CUDA device" in text


def test_the_gpu_plan_fits_the_issue() -> None:
    """The layouts and lengths the issue names: 135M at 2048-32768, 1B, 8B at 4096-65536, kv-heads at 4096 and
    16384, each point's repeats named; the layouts are llama's sizes (grouped-query heads of 64 or 128)."""
    assert gpu.GPU_PLAN["135M"] == [2048, 8192, 32768] and gpu.GPU_PLAN["8B"] == [4096, 16384, 65536]
    assert all(length in gpu.REPEATS for lengths in gpu.GPU_PLAN.values() for length in lengths)
    assert gpu.KV_LENGTHS == [4096, 16384]
    for name in ("135M", "1B", "8B"):
        sizes = gpu.LAYOUTS[name]
        assert sizes["hidden_size"] // sizes["num_attention_heads"] in (64, 128)
        assert sizes["num_attention_heads"] % sizes["num_key_value_heads"] == 0
    assert torch.cuda.is_available() or gpu.BUDGET_SECONDS < 8 * 60

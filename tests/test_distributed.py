"""Sharded sweeps: torchrun with 2 processes (gloo, CPU) gives the single-process sweep number for number, and a
sweep that loses a process completes with --resume without redoing what was finished."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from probe.distributed import Rank, assign_chunks, current, rank_placement, shard_path, shard_paths, sharded_sweep
from probe.errors import ProbeError

ROOT = Path(__file__).parent.parent
TESTS = Path(__file__).parent
MODEL = f"{TESTS / 'mortal.py'}:planted_mortal"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
# a small sweep: 2 layers x 4 heads, 3 repeated sequences; --stack 1 makes 8 chunks, 4 per process
SWEEP = ["--model", MODEL, "--data", "repeated", "--num-seqs", "3", "--repeat-len", "12"]


def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def torchrun(args: list[str], tmp_path: Path, nproc: int = 2, command_name: str = "ablate",
             **extra: str) -> subprocess.CompletedProcess:
    assert TORCHRUN is not None, "torchrun is not installed next to this Python"
    command = [TORCHRUN, "--nproc-per-node", str(nproc), "--standalone", "-m", "probe.cli", command_name, *args]
    return subprocess.run(command, cwd=ROOT, env=environment(tmp_path, **extra), capture_output=True, text=True,
                          timeout=300)


def alone(args: list[str], tmp_path: Path, command_name: str = "ablate", **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "probe.cli", command_name, *args], cwd=ROOT,
                          env=environment(tmp_path, **extra), capture_output=True, text=True, timeout=300)


def comparable(path: Path, command_name: str = "ablate") -> dict:
    data = json.loads(path.read_text())
    data.pop("seconds", None)  # wall time differs, everything else must not
    assert data.pop("provenance")["command"].startswith(f"probe {command_name}")  # the run's own: its line, its time
    return data


def entries(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:] if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# through torchrun


@pytest.mark.slow  # over 10 s on 2 cores
def test_torchrun_two_processes_equal_one_process(tmp_path: Path) -> None:
    single = alone([*SWEEP, "--json", str(tmp_path / "one.json"), "--results", str(tmp_path / "one.jsonl")],
                   tmp_path)
    assert single.returncode == 0, single.stderr
    run = torchrun([*SWEEP, "--json", str(tmp_path / "two.json"), "--csv", str(tmp_path / "two.csv"),
                    "--results", str(tmp_path / "two.jsonl")], tmp_path)
    assert run.returncode == 0, run.stderr
    one, two = comparable(tmp_path / "one.json"), comparable(tmp_path / "two.json")
    assert two["baseline_loss"] == one["baseline_loss"]
    assert two["heads"] == one["heads"]  # every head, every number, the same order: exact equality
    assert two == one
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert (tmp_path / "two.csv").is_file()
    assert not shard_paths(tmp_path / "two.jsonl")  # merged, then removed
    assert run.stdout.count("Head ablation of") == 1  # only rank 0 reports
    assert run.stdout.count("Heads whose removal hurts most") == single.stdout.count("Heads whose removal hurts most")
    assert run.stderr.count(f"wrote {tmp_path / 'two.json'}") == 1


@pytest.mark.slow
def test_torchrun_patching_equals_one_process(tmp_path: Path) -> None:
    """`probe patch` under torchrun: each process patches its share of the heads (the sweep's chunks), rank 0
    merges, adds the DLA and reports; the numbers equal one process's."""
    args = ["--task", "ioi", "--count", "4", "--heads", "0-1.*", "--stack", "1", "--no-classes"]
    single = alone([*args, "--json", str(tmp_path / "one.json")], tmp_path, "patch")
    assert single.returncode == 0, single.stderr
    run = torchrun([*args, "--json", str(tmp_path / "two.json"), "--results", str(tmp_path / "two.jsonl")],
                   tmp_path, command_name="patch")
    assert run.returncode == 0, run.stderr
    one, two = comparable(tmp_path / "one.json", "patch"), comparable(tmp_path / "two.json", "patch")
    assert len(two["heads"]) == 18 and two == one
    assert not shard_paths(tmp_path / "two.jsonl") and run.stdout.count("Activation patching of") == 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's uninterrupted sweep with --stack 1 (ref.json, ref.jsonl, and ref.log counting its forwards),
    run once: both sweeps that lose a process are compared with it."""
    folder = tmp_path_factory.mktemp("reference")
    full = alone([*SWEEP, "--stack", "1", "--results", str(folder / "ref.jsonl"), "--json", str(folder / "ref.json")],
                 folder, PROBE_TEST_FORWARD_LOG=str(folder / "ref.log"))
    assert full.returncode == 0, full.stderr
    return folder


@pytest.fixture(scope="module")
def died(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a torchrun sweep (--stack 1, results sweep.jsonl) whose rank 1 died when its 7th forward
    started, run once: each test resumes its own copy."""
    folder = tmp_path_factory.mktemp("died")
    run = torchrun([*SWEEP, "--stack", "1", "--results", str(folder / "sweep.jsonl")], folder,
                   PROBE_TEST_DIE_RANK="1", PROBE_TEST_DIE_AT="7")
    assert run.returncode != 0 and shard_paths(folder / "sweep.jsonl")
    return folder


def copy_of(died: Path, tmp_path: Path) -> Path:
    """The dead sweep's files (results file and shards) copied into `tmp_path`; the results file's path there."""
    for path in died.iterdir():
        shutil.copy(path, tmp_path / path.name)
    return tmp_path / "sweep.jsonl"


@pytest.mark.slow
def test_dead_process_loses_only_unfinished_heads_and_resume_completes(tmp_path: Path, reference: Path,
                                                                       died: Path) -> None:
    # rank 1 died when its 7th forward started: discovery, first output, baseline, 2 chunks (+ the exact path's
    # check) are done by then, 2 of its 4 chunks are not
    results = copy_of(died, tmp_path)
    args = [*SWEEP, "--stack", "1", "--results", str(results)]
    shards = {int(path.name.rpartition("-")[2]): path for path in shard_paths(results)}
    assert 1 in shards
    finished = entries(shards[1])
    assert 1 <= len(finished) < 4
    kept = {(e["layer"], e["head"]) for path in shards.values() for e in entries(path)}
    expected = {(e["layer"], e["head"]): e for e in entries(reference / "ref.jsonl")}
    for entry in finished:  # what the dead process finished is already the final number
        assert entry == expected[(entry["layer"], entry["head"])]
    # the rerun completes the rest, and does less work than the whole sweep (one process, uninterrupted)
    log = tmp_path / "resume.log"
    resumed = torchrun([*args, "--resume", "--json", str(tmp_path / "resumed.json")], tmp_path,
                       PROBE_TEST_FORWARD_LOG=str(log))
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(tmp_path / "resumed.json")["heads"] == comparable(reference / "ref.json")["heads"]
    assert comparable(tmp_path / "resumed.json") == comparable(reference / "ref.json")
    assert not shard_paths(results)
    full_forwards = len((reference / "ref.log").read_text().splitlines())
    setup = 3  # discovery, first output, baseline: every process pays these
    resumed_work = len(log.read_text().splitlines()) - 2 * setup
    assert resumed_work < full_forwards - setup
    assert len(kept) > 0


@pytest.mark.slow
def test_resume_alone_completes_a_torchrun_sweep(tmp_path: Path, reference: Path, died: Path) -> None:
    results = copy_of(died, tmp_path)
    finished = alone([*SWEEP, "--stack", "1", "--results", str(results), "--resume", "--json",
                      str(tmp_path / "done.json")], tmp_path)
    assert finished.returncode == 0, finished.stderr
    assert comparable(tmp_path / "done.json") == comparable(reference / "ref.json")
    assert not shard_paths(results)


@pytest.mark.slow  # over 10 s on 2 cores
def test_torchrun_with_layers_offloaded_to_disk_equals_one_process(tmp_path: Path) -> None:
    """Each process loads a tiny Llama with half its layers on disk (its own offload folder); the merged sweep
    equals one process's sweep of the model in memory."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    folder = tmp_path / "tiny-llama"
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    args = ["--model", str(folder), "--data", "repeated", "--num-seqs", "3", "--repeat-len", "10", "--stack", "2"]
    single = alone([*args, "--json", str(tmp_path / "one.json")], tmp_path)
    assert single.returncode == 0, single.stderr
    run = torchrun([*args, "--json", str(tmp_path / "two.json"), "--device-map", json.dumps(device_map),
                    "--offload-folder", str(tmp_path / "offload")], tmp_path)
    assert run.returncode == 0, run.stderr
    assert comparable(tmp_path / "two.json") == comparable(tmp_path / "one.json")
    assert sorted(path.name for path in (tmp_path / "offload").iterdir()) == ["rank-0", "rank-1"]


# ---------------------------------------------------------------------------------------------------------------
# the pieces, in process


def test_assign_chunks_is_balanced_and_deterministic() -> None:
    # 30 layers x 3 chunks, a chunk of layer l costing 31 - l blocks (an exact sweep of a 30-block model)
    costs = [31 - layer for layer in range(30) for _ in range(3)]
    for world in (1, 2, 3, 4, 7):
        owner = assign_chunks(costs, world)
        assert owner == assign_chunks(costs, world)
        loads = [sum(c for c, o in zip(costs, owner) if o == rank) for rank in range(world)]
        assert max(loads) - min(loads) <= max(costs)
        for rank in range(world):  # every rank has work in early and late layers
            layers = [i // 3 for i, o in enumerate(owner) if o == rank]
            assert min(layers) < 10 and max(layers) >= 20
    assert assign_chunks([5.0], 3) == [0]


def test_current_reads_torchrun_environment(monkeypatch) -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert current() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert current() is None  # one process: nothing to split
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert current() == Rank(3, 4, 1, 2)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ProbeError, match="must be integers"):
        current()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only placement")
def test_rank_placement_on_cpu(tmp_path: Path) -> None:
    rank = Rank(1, 2, 1, 2)
    device_map, folder, memory = rank_placement(rank, "auto", tmp_path)
    assert device_map == "auto" and folder == tmp_path / "rank-1"
    assert set(memory) == {"cpu"} and memory["cpu"] > 0  # half this machine's free memory
    device_map, folder, memory = rank_placement(rank, '{"": "cpu"}', None)
    assert device_map == {"": "cpu"} and folder is None and memory is None
    with pytest.raises(ProbeError, match="on GPU 0, but this machine has no GPU"):
        rank_placement(rank, {"model.layers.0": 0, "lm_head": "cpu"}, None)
    assert rank_placement(None, "auto", tmp_path) == ("auto", tmp_path, None)


def test_gpu_groups_per_process(monkeypatch) -> None:
    """With GPUs (faked: counts only), each process of a machine gets its own equal group of them."""
    from probe.distributed import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    second = Rank(rank=3, world_size=4, local_rank=1, local_world_size=2)  # 2 machines x 2 processes
    assert rank_device(second, None) == "cuda:1" and rank_device(second, "cuda") == "cuda:1"
    assert rank_device(second, "cuda:6") == "cuda:6"
    device_map, _, _ = rank_placement(second, {"model.layers.0": 0, "model.layers.1": "cuda:3", "lm_head": "cpu"},
                                      None)
    assert device_map == {"model.layers.0": 4, "model.layers.1": 7, "lm_head": "cpu"}  # GPUs 4-7 are its group
    with pytest.raises(ProbeError, match="GPU 4, but under torchrun each of the 2 processes"):
        rank_placement(second, {"": 4}, None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    crowded = Rank(rank=2, world_size=4, local_rank=2, local_world_size=4)
    with pytest.raises(ProbeError, match="4 processes on this machine, which has 2 GPUs"):
        rank_placement(crowded, "auto", None)


def test_estimate_is_not_split(monkeypatch) -> None:
    from conftest import tiny_loaded

    from probe.inputs import repeated_set

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    loaded = tiny_loaded("llama_gqa")
    with pytest.raises(ProbeError, match="without torchrun"):
        sharded_sweep(loaded, repeated_set(loaded, repeat_len=5, num_seqs=1), results_path="x.jsonl",
                      mode="estimate")


def test_shard_paths(tmp_path: Path) -> None:
    results = tmp_path / "sweep.jsonl"
    for rank in (10, 2, 0):
        shard_path(results, rank).write_text("")
    (tmp_path / "sweep.jsonl.shard-x").write_text("")
    assert shard_paths(results) == [shard_path(results, r) for r in (0, 2, 10)]


def test_resume_refuses_shards_of_another_sweep(tmp_path: Path, monkeypatch) -> None:
    from conftest import tiny_loaded

    from probe.ablation import sweep
    from probe.inputs import repeated_set

    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    loaded = tiny_loaded("llama_gqa")
    probe_set = repeated_set(loaded, repeat_len=5, num_seqs=1)
    results = tmp_path / "sweep.jsonl"
    sweep(loaded, probe_set, [(0, 0)], results_path=results)
    sweep(loaded, probe_set, [(0, 1)], method="mean", results_path=shard_path(results, 1))  # another sweep
    with pytest.raises(ProbeError, match="holds a different sweep"):
        sharded_sweep(loaded, probe_set, [(0, 0), (0, 1)], results_path=results, resume=True)
    shard_path(results, 1).unlink()
    sweep(loaded, probe_set, [(1, 2)], results_path=shard_path(results, 3))  # the same sweep, another process
    merged = sharded_sweep(loaded, probe_set, [(0, 0), (1, 2), (1, 3)], results_path=results, resume=True)
    reference = sweep(loaded, probe_set, [(0, 0), (1, 2), (1, 3)])
    assert [(r.heads, r.delta) for r in merged.results] == [(r.heads, r.delta) for r in reference.results]
    assert not shard_paths(results)

"""`probe track`: trajectories equal classify on each checkpoint alone, the in-context learning score equals the
per-token losses computed by hand, a planted jump is found and a flat run has none, resume after an interruption
gives the same result, state dicts load with weights_only=True, checkpoints order by step number, bad input is one
line and exit 2, and torchrun's split equals one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli
from probe.heads.classify import classify
from probe.inputs import natural_set
from probe.errors import ProbeError
from probe.models import load_model
from probe.track import (CheckpointResult, TrackOptions, find_run, icl_score, phase_changes, read_track, step_of,
                         track)
from probe.track.checkpoints import Checkpoint, ordered
from test_distributed import alone, comparable, torchrun
from track_models import planted_state, tiny, wider

TESTS = Path(__file__).parent
TINY = f"{TESTS / 'track_models.py'}:tiny"
PLANTED = f"{TESTS / 'track_models.py'}:planted"
SMALL = TrackOptions(seq_len=24, num_seqs=2, repeat_len=8, early=4, late=40, icl_seqs=3)


class Opaque:
    """Not a tensor: a pickle holding one needs more than weights_only=True allows."""


def tiny_checkpoints(folder: Path, steps: tuple[int, ...] = (0, 5, 10)) -> list[dict[str, torch.Tensor]]:
    """State dicts of the tiny model at different random weights, saved as step-N.pt."""
    folder.mkdir(exist_ok=True)
    states = []
    for step in steps:
        torch.manual_seed(step + 1)
        model, _ = tiny()
        for parameter in model.parameters():
            parameter.data.normal_(0, 0.3)
        states.append(model.state_dict())
        torch.save(model.state_dict(), folder / f"step-{step}.pt")
    return states


def test_steps_order_by_number() -> None:
    names = ["step-10", "step-9", "step-100.pt", "ckpt_2"]
    assert [step_of(name) for name in names] == [10, 9, 100, 2]
    assert [c.name for c in ordered([Checkpoint(n, step_of(n), n) for n in names])] == [
        "ckpt_2", "step-9", "step-10", "step-100.pt"]
    with pytest.raises(ProbeError, match="no number"):
        step_of("final")


def test_trajectories_equal_classify_alone(tmp_path: Path) -> None:
    states = tiny_checkpoints(tmp_path / "ckpt")
    result = track(find_run(TINY, checkpoints=str(tmp_path / "ckpt" / "step-*.pt")), SMALL,
                   results_path=tmp_path / "run.jsonl")
    assert [c.step for c in result.checkpoints] == [0, 5, 10]
    for checkpoint, state in zip(result.checkpoints, states):
        model, tokenizer = tiny()
        model.load_state_dict(state)
        alone_ = classify(load_model(model, tokenizer=tokenizer), seq_len=24, num_seqs=2, repeat_len=8).to_dict()
        assert checkpoint.heads == [{k: e[k] for k in ("layer", "head", "scores")} for e in alone_["heads"]]
        assert checkpoint.icl_score is not None and checkpoint.loss is not None
    payload = result.to_dict()
    assert set(payload) >= {"checkpoints", "phase_changes"}
    assert set(payload["checkpoints"][0]) >= {"name", "step", "loss", "icl_score", "heads"}


@pytest.mark.parametrize("kind", ["custom", "gpt2"])
def test_icl_score_is_late_minus_early_token_loss(kind: str) -> None:
    if kind == "gpt2":  # a Hugging Face model: only the two positions' logits are computed (logits_to_keep)
        import transformers as tf

        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=257, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                 bos_token_id=256, eos_token_id=256)).eval()
        tokenizer = tiny()[1]
    else:
        model, tokenizer = tiny()
    loaded = load_model(model, tokenizer=tokenizer)
    score = icl_score(loaded, early=5, late=40, num_seqs=3)
    ids = natural_set(loaded, seq_len=40, num_seqs=3).input_ids  # BOS + 40 bytes
    with torch.no_grad():
        logits = model(ids)
        logits = getattr(logits, "logits", logits)
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    # token i (counted from 1 after BOS) is at position i, predicted at position i - 1
    assert score.value == pytest.approx(float(losses[:, 39].mean() - losses[:, 4].mean()), abs=1e-5)
    short = icl_score(loaded, early=50, late=500)
    assert short.value is None and "context (64 tokens) is shorter than token 500" in str(short.note)


def test_planted_jump_found_and_flat_run_has_none(tmp_path: Path) -> None:
    (tmp_path / "jump").mkdir()
    (tmp_path / "flat").mkdir()
    for step, on in ((100, False), (200, False), (300, True), (400, True)):
        torch.save(planted_state(on), tmp_path / "jump" / f"step-{step}.pt")
        torch.save(planted_state(True), tmp_path / "flat" / f"step-{step}.pt")
    options = TrackOptions(seq_len=40, num_seqs=2, repeat_len=16, scores=("previous_token", "induction"))
    jump = track(find_run(PLANTED, checkpoints=str(tmp_path / "jump" / "*.pt")), options,
                 results_path=tmp_path / "jump.jsonl")
    changes = jump.to_dict()["phase_changes"]
    assert [(c["class"], c["from_step"], c["to_step"], c["heads"]) for c in changes] == [
        ("induction", 200, 300, ["1.1"])]
    assert changes[0]["best_after"] > 0.9 and changes[0]["share_of_range"] == pytest.approx(1.0)
    assert jump.checkpoints[0].icl_score is None and "no tokenizer" in jump.checkpoints[0].notes[0]
    flat = track(find_run(PLANTED, checkpoints=str(tmp_path / "flat" / "*.pt")), options,
                 results_path=tmp_path / "flat.jsonl")
    assert flat.to_dict()["phase_changes"] == []


def test_phase_changes_and_icl_change_on_hand_made_results() -> None:
    def checkpoint(step: int, score: float, icl: float) -> CheckpointResult:
        heads = [{"layer": 0, "head": 0, "scores": {"induction": 0.05}},
                 {"layer": 0, "head": 1, "scores": {"induction": score}}]
        return CheckpointResult(f"step-{step}", step, 3.0, icl, heads)

    run = [checkpoint(1, 0.1, -0.05), checkpoint(2, 0.15, -0.1), checkpoint(3, 0.7, -0.6), checkpoint(4, 0.72, -0.6)]
    found = phase_changes(run, {"induction": 0.4})
    assert found[0]["heads"] == ["0.1"] and (found[0]["from_step"], found[0]["to_step"]) == (2, 3)
    assert found[0]["coincides_with_icl"] and found[0]["icl_change"] == pytest.approx(-0.5)
    assert phase_changes(run, {"induction": 0.4}, min_rise=0.6) == []


def test_resume_after_interruption_gives_the_same_result(tmp_path: Path) -> None:
    tiny_checkpoints(tmp_path / "ckpt", (1, 2, 3, 4))
    run = find_run(TINY, checkpoints=str(tmp_path / "ckpt" / "*.pt"))
    whole = track(run, SMALL, results_path=tmp_path / "whole.jsonl").to_dict()
    finished = []

    def interrupt(result: CheckpointResult) -> None:
        finished.append(result.name)
        if len(finished) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        track(run, SMALL, results_path=tmp_path / "cut.jsonl", on_result=interrupt)
    assert [c.name for c in read_track(tmp_path / "cut.jsonl")[1]] == ["step-1.pt", "step-2.pt"]
    resumed = track(run, SMALL, results_path=tmp_path / "cut.jsonl", resume=True,
                    on_result=lambda result: finished.append(result.name))
    assert finished == ["step-1.pt", "step-2.pt", "step-3.pt", "step-4.pt"]  # only the rest ran
    assert resumed.to_dict() == whole
    with pytest.raises(ProbeError, match="another run"):
        track(run, TrackOptions(seq_len=16, num_seqs=2, early=4, late=40), results_path=tmp_path / "cut.jsonl",
              resume=True)


def test_state_dicts_load_weights_only(tmp_path: Path) -> None:
    tiny_checkpoints(tmp_path / "ckpt", (1,))
    torch.save({**tiny()[0].state_dict(), "extra": Opaque()}, tmp_path / "ckpt" / "step-2.pt")
    with pytest.raises(ProbeError, match=r"step-2.pt is not a plain state dict: .*weights_only=True refuses") as error:
        track(find_run(TINY, checkpoints=str(tmp_path / "ckpt" / "*.pt")), SMALL, results_path=tmp_path / "r.jsonl")
    assert "\n" not in str(error.value)
    torch.save(wider()[0].state_dict(), tmp_path / "ckpt" / "step-2.pt")
    with pytest.raises(ProbeError, match="step-2.pt does not fit the model .*a different architecture"):
        track(find_run(TINY, checkpoints=str(tmp_path / "ckpt" / "*.pt")), SMALL, results_path=tmp_path / "r.jsonl")


def test_cli_writes_outputs_and_refuses_bad_input(tmp_path: Path, capsys, monkeypatch) -> None:
    tiny_checkpoints(tmp_path / "ckpt", (9, 10))
    small = ["--seq-len", "24", "--num-seqs", "2", "--repeat-len", "8", "--icl-seqs", "2"]
    code, _out, err = run_cli(["track", "--model", TINY, "--checkpoints", str(tmp_path / "ckpt" / "step-*.pt"),
                              *small, "--json", str(tmp_path / "t.json"), "--csv", str(tmp_path / "t.csv")],
                             capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads((tmp_path / "t.json").read_text())
    assert [c["step"] for c in payload["checkpoints"]] == [9, 10] and "provenance" in payload
    assert "context (64 tokens) is shorter than token 500" in err  # the ICL score's null, said once
    rows = (tmp_path / "t.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 8 and rows[0].startswith("checkpoint,step,loss,icl_score,layer,head,previous_token")
    bad = {"no checkpoint matches": ["--model", TINY, "--checkpoints", str(tmp_path / "none-*.pt")],
           "differ": ["--checkpoints", str(tmp_path / "hf-*")],
           "cannot resolve revision 'step99999999' of EleutherAI/pythia-70m": [
               "--model", "EleutherAI/pythia-70m", "--revisions", "step99999999"]}
    for folder, hidden in (("hf-1", 32), ("hf-2", 48)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": hidden}))
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: no revision resolves unless cached (the hub is not asked)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read when imported, so set it too
    for message, args in bad.items():
        code, _, err = run_cli(["track", *args], capsys, monkeypatch)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_torchrun_splits_checkpoints_and_equals_one_process(tmp_path: Path) -> None:
    tiny_checkpoints(tmp_path / "ckpt", (1, 2, 3))
    args = ["--model", TINY, "--checkpoints", str(tmp_path / "ckpt" / "*.pt"), "--seq-len", "24", "--num-seqs", "2",
            "--repeat-len", "8", "--icl-positions", "4,40", "--icl-seqs", "2"]
    two = torchrun([*args, "--json", str(tmp_path / "two.json"), "--results", str(tmp_path / "two.jsonl")],
                   tmp_path, command_name="track")
    assert two.returncode == 0, two.stderr
    one = alone([*args, "--json", str(tmp_path / "one.json")], tmp_path, command_name="track")
    assert one.returncode == 0, one.stderr
    assert comparable(tmp_path / "two.json", "track") == comparable(tmp_path / "one.json", "track")
    assert not list(tmp_path.glob("two.jsonl.shard-*"))
    assert len(read_track(tmp_path / "two.jsonl")[1]) == 3


def test_model_folders_load_one_at_a_time(tmp_path: Path) -> None:
    from conftest import tiny_hf

    for step in (10, 9):
        torch.manual_seed(step)
        model = tiny_hf("gpt2")
        for parameter in model.parameters():
            parameter.data.normal_(0, 0.2)
        model.save_pretrained(tmp_path / f"step-{step}")
    result = track(find_run(checkpoints=str(tmp_path / "step-*")), SMALL, results_path=tmp_path / "r.jsonl")
    assert [c.step for c in result.checkpoints] == [9, 10]
    alone_ = classify(load_model(str(tmp_path / "step-10")), seq_len=24, num_seqs=2, repeat_len=8).to_dict()
    assert result.checkpoints[1].heads == [{k: e[k] for k in ("layer", "head", "scores")} for e in alone_["heads"]]
    assert result.checkpoints[0].icl_score is None and "no tokenizer" in result.checkpoints[0].notes[0]

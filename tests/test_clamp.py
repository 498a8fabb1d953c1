"""The clamp intervention: every element of a head's output limited to [-bound, bound], checked against clamping the
head's slice of the output projection's input by hand, and reached from `probe steer --intervention clamp`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.hooks import RemovableHandle

from conftest import run_cli, tiny_loaded
from probe.ablation import ablate
from probe.ablation.methods import METHODS
from probe.hooks.run import logits_of, run_model
from probe.hooks.trace import Trace
from probe.inputs import contrast_task, logit_diffs
from probe.models import load_model
from probe.patching.runs import contrast_runs
from probe.steering import steer_curves
from test_cli import strict_json

WORDS = "tests/words.py:tiny_with_words"
HEAD_DIM = 16  # the tiny llamas: hidden 64, 4 heads


def clamped_projection(model: torch.nn.Module, layer: int, head: int, bound: float) -> RemovableHandle:
    """By hand: the head's slice of the output projection's input clamped to [-bound, bound] (the handle's `with`
    removes the hook)."""
    columns = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        z = args[0].clone()
        z[..., columns] = z[..., columns].clamp(-bound, bound)
        return (z,)

    return model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(hook)


def test_clamp_equals_clamping_the_projection_by_hand_and_zero_is_zero_ablation() -> None:
    loaded = tiny_loaded("llama_gqa")
    ids = torch.randint(3, 120, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = logits_of(run_model(loaded.model, ids))
        for bound in (0.01, 0.05):
            with Trace(loaded, {"z": {1: METHODS["clamp"](bound).writer(2)}}):
                clamped = logits_of(run_model(loaded.model, ids))
            with clamped_projection(loaded.model, 1, 2, bound):
                hand = logits_of(run_model(loaded.model, ids))
            assert torch.allclose(clamped, hand, atol=1e-6) and not torch.allclose(clamped, own, atol=1e-4)
        with Trace(loaded, {"z": {0: METHODS["clamp"](0.0).writer(3)}}):
            clamped = logits_of(run_model(loaded.model, ids))
        with ablate(loaded.model, [(0, 3)]):
            zeroed = logits_of(run_model(loaded.model, ids))
    assert torch.equal(clamped, zeroed)


def test_probe_steer_clamps_heads_against_the_bound(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "clamp.json"
    code, stdout, stderr = run_cli(["steer", "--model", WORDS, "--intervention", "clamp", "--values", "0.02,1",
                                    "--heads", "1.2,0.1", "--task", "ioi", "--num-seqs", "6", "--generate",
                                    "the keys to the", "--max-new-tokens", "3", "--json", str(out)],
                                   capsys, monkeypatch)
    assert code == 0, stderr
    payload = strict_json(out)
    assert (payload["intervention"], payload["parameter"], payload["values"]) == ("clamp", "bound", [0.02, 1.0])
    loaded = load_model(WORDS)
    ioi = contrast_task(loaded, "ioi", count=6, seed=0)
    library = steer_curves(loaded, contrast_runs(loaded, ioi)[0], [(1, 2), (0, 1)], [0.02, 1.0],
                           intervention="clamp").to_dict()
    for ours, theirs in zip(payload["curves"], library["curves"]):
        assert [p["setting"] for p in ours["points"]] == [0.02, 1.0]  # no value of clamp leaves the model as it is
        assert [p["value"] for p in ours["points"]] == pytest.approx([p["value"] for p in theirs["points"]],
                                                                     abs=1e-6)
        for point in ours["points"]:
            with clamped_projection(loaded.model, ours["layer"], ours["head"], point["setting"]):
                hand = float(logit_diffs(loaded, ioi, ioi.clean).mean())
            assert point["value"] == pytest.approx(hand, abs=1e-5)  # read forwards: the logit difference
    rows = payload["generations"]["rows"]
    assert [(row["layer"], row["head"], row["setting"]) for row in rows] == [
        (1, 2, 0.02), (1, 2, 1.0), (0, 1, 0.02), (0, 1, 1.0)]
    assert "value 0.02" in stdout and "(clamp's bound)" in stdout


@pytest.mark.parametrize(("extra", "message"), [
    (["--values", "0,-1"], "bound must be a finite number >= 0"), (["--alpha", "1"], "give --values"),
])
def test_a_bad_bound_is_one_line_before_the_model_loads(extra: list[str], message: str, capsys,
                                                        monkeypatch) -> None:
    code, _, stderr = run_cli(["steer", "--model", "no/such-model", "--heads", "1.2", "--intervention", "clamp",
                               *extra], capsys, monkeypatch)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1

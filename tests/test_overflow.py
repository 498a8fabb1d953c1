"""A model whose own float16 forward overflows (issue 45: "float16 overflow ... detected and reported, never a silent
inf/NaN"): each command refuses in one line naming the module where the forward first went non-finite and what to
load instead, where it used to print tables of NaN; the same models in float32 run (tests/overflowing.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from overflowing import attention_overflow, mlp_overflow
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.overflow import NotFiniteError, first_non_finite, not_finite
from probe.track.icl import probe_loss

MLP = "tests/overflowing.py:mlp_overflow"
ATTENTION = "tests/overflowing.py:attention_overflow"
PLANTED = "tests/overflowing.py:planted_overflow"
ADVICE = "float16 ends at 65504"


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(module._forward_hooks) for module in model.modules())


def test_the_first_module_whose_output_is_not_finite_is_named() -> None:
    """The MLP's down projection; for attention logits past 65504, the attention module (its o_proj only reads the
    NaN the softmax made); nothing in float32; every hook gone afterwards, also when the forward raises."""
    ids = torch.randint(1, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model = mlp_overflow()[0]
    assert first_non_finite(model, lambda: model(ids)) is None
    model.half()
    assert first_non_finite(model, lambda: model(ids)) == "model.layers.0.mlp.down_proj"
    attention = attention_overflow()[0].half()
    assert first_non_finite(attention, lambda: attention(ids)) == "model.layers.0.self_attn"
    with pytest.raises(RuntimeError, match="stop"):
        first_non_finite(model, lambda: (model(ids), (_ for _ in ()).throw(RuntimeError("stop"))))
    assert _hooks(model) == 0 and _hooks(attention) == 0


@pytest.mark.parametrize(("dtype", "advice"), [
    (torch.float16, "load it with dtype bfloat16"), (torch.bfloat16, "try dtype float32"),
    (torch.float32, "its weights or inputs are broken")])
def test_the_refusal_says_what_to_do_for_the_dtype(dtype: torch.dtype, advice: str) -> None:
    model = torch.nn.Linear(2, 2).to(dtype)
    error = not_finite("the loss", model, site="layers.3.mlp")
    assert isinstance(error, ProbeError) and error.parameter == "dtype"
    assert str(error).startswith("the loss came out NaN or infinite") and "(first in layers.3.mlp)" in str(error)
    assert advice in str(error) and str(dtype).removeprefix("torch.") in str(error)


COMMANDS = {
    "ablate": ["--data", "repeated", "--num-seqs", "2", "--repeat-len", "8"],
    "prune": ["--data", "repeated", "--num-seqs", "2", "--seq-len", "24"],
    "dla": ["--task", "ioi", "--count", "4"],
    "patch": ["--task", "ioi", "--count", "4"],
    "steer": ["--heads", "0.1", "--alpha", "0,2", "--data", "natural", "--num-seqs", "2", "--seq-len", "24"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_refuses_a_model_whose_float16_forward_overflows(name: str, tmp_path, capsys,
                                                                       monkeypatch) -> None:
    """One line, exit 2, no traceback, no file written: the baseline came out NaN, where block 0's MLP overflowed,
    and --dtype bfloat16 is the way out."""
    out = tmp_path / "out.json"
    code, _, err = run_cli([name, "--model", MLP, *COMMANDS[name], "--dtype", "float16", "--json", str(out)],
                           capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "came out NaN or infinite" in line, line
    assert "(first in model.layers.0.mlp.down_proj)" in line and ADVICE in line and "--dtype bfloat16" in line
    assert not out.exists()


def test_classify_keeps_the_heads_before_the_overflow_and_says_which_are_not(tmp_path, capsys, monkeypatch) -> None:
    """Scores need no baseline: layer 0's heads (before block 0's MLP overflowed) are scored, layer 1's are null, and
    one warning names them with float16's advice."""
    out = tmp_path / "heads.json"
    code, _, err = run_cli(["classify", "--model", MLP, "--dtype", "float16", "--json", str(out)], capsys,
                           monkeypatch)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if line.startswith("warning:"))
    assert "for 1.0, 1.1, 1.2, 1.3;" in warning and ADVICE in warning and "--dtype bfloat16" in warning
    heads = json.loads(out.read_text())["heads"]
    assert all(head["scores"]["induction"] is None for head in heads if head["layer"] == 1)
    assert all(head["scores"]["induction"] is not None for head in heads if head["layer"] == 0)


def test_the_same_model_in_float32_runs(tmp_path, capsys, monkeypatch) -> None:
    code, _, err = run_cli(["ablate", "--model", MLP, *COMMANDS["ablate"], "--json", str(tmp_path / "a.json")],
                           capsys, monkeypatch)
    assert code == 0, err


def test_attention_logits_past_65504_in_the_models_own_attention(capsys, monkeypatch) -> None:
    """Eager float16 attention overflowing: the sweep's baseline names the attention module. classify runs: its
    scores come from probe's own attention, whose logits are float32 (docs/precision.md), so they are finite."""
    code, _, err = run_cli(["ablate", "--model", ATTENTION, *COMMANDS["ablate"], "--dtype", "float16"], capsys,
                           monkeypatch)
    assert code == 2 and "(first in model.layers.0.self_attn)" in err, err
    code, out, err = run_cli(["classify", "--model", ATTENTION, "--dtype", "float16"], capsys, monkeypatch)
    assert code == 0 and "computed in float16" in out.lower(), err


def test_kv_heads_refuses_needle_scores_of_an_overflowing_forward(capsys, monkeypatch) -> None:
    code, _, err = run_cli(["kv-heads", "--model", PLANTED, "--lengths", "120", "--depths", "0.5", "--sink", "1",
                            "--recent", "4", "--no-curve", "--dtype", "float16"], capsys, monkeypatch)
    assert code == 2 and "(first in layers.1.W_q)" in err and ADVICE in err, err


def test_track_refuses_a_checkpoint_whose_loss_overflows_instead_of_having_none() -> None:
    """probe_loss returns None for a model without next-token logits; an overflowing one is refused."""
    model, tokenizer = mlp_overflow()
    loaded = LoadedModel(model=model.half(), tokenizer=tokenizer, name="mlp_overflow", vocab_size=model.vocab_size)
    with pytest.raises(NotFiniteError, match="first in model.layers.0.mlp.down_proj"):
        probe_loss(loaded, seq_len=24, num_seqs=2)

"""Pruning curves: each step's loss is the loss with the same heads ablated together by hand; Michel importance is
the gate gradient computed by hand; orderings, limits and key/value groups behave as documented."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_loaded
from probe.ablation import ablate
from probe.ablation.prune import _Evaluator, importance, prune, prune_units
from probe.ablation.methods import ZeroAblation
from probe.ablation.metrics import METRICS
from probe.inputs import ProbeSet
from probe.errors import ProbeError


def _probe_set() -> ProbeSet:
    ids = torch.randint(1, 120, (4, 12), generator=torch.Generator().manual_seed(1))
    return ProbeSet("natural", "random tokens", ids, 0)


def _loss_by_hand(model, ids: torch.Tensor, heads) -> float:
    with torch.no_grad(), ablate(model, heads):
        logits = model(ids).logits[:, :-1]
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def test_step_losses_equal_ablating_the_same_heads_together_by_hand():
    loaded = tiny_loaded("llama_gqa")
    probe_set = _probe_set()
    result = prune(loaded, probe_set, step=0.25, seeds=(0, 1), batch_size=3)
    assert [curve.ordering for curve in result.curves] == ["michel", "sweep", "random", "random"]
    for curve in result.curves:
        assert curve.steps[-1].share == 1.0 and curve.steps[-1].heads_removed == 8
        pruned = []
        for step in curve.steps:
            pruned += [tuple(int(x) for x in name.split(".")) for name in step.removed]
            assert step.loss == pytest.approx(_loss_by_hand(loaded.model, probe_set.input_ids, pruned), rel=1e-5)
    assert result.curves[0].steps[0].loss == pytest.approx(result.baseline_loss)


def _importance_by_hand(model, ids: torch.Tensor) -> torch.Tensor:
    """A gate per head on the input of each o_proj; per-sequence gradients, |.|, mean, l2-normalised per layer."""
    gates = torch.ones(2, 4, requires_grad=True)
    handles = []
    for index, block in enumerate(model.model.layers):
        def scale(module, args, index=index):
            x = args[0].view(*args[0].shape[:-1], 4, -1) * gates[index][:, None]
            return (x.flatten(-2),)
        handles.append(block.self_attn.o_proj.register_forward_pre_hook(scale))
    per_sequence = []
    try:
        for row in ids:
            logits = model(row[None]).logits[0, :-1]
            loss = F.cross_entropy(logits, row[1:])
            per_sequence.append(torch.autograd.grad(loss, gates)[0].abs())
    finally:
        for handle in handles:
            handle.remove()
    raw = torch.stack(per_sequence).mean(dim=0).double()
    return raw / raw.norm(dim=1, keepdim=True)


def test_michel_importance_is_the_gate_gradient_by_hand():
    loaded = tiny_loaded("llama_gqa")
    probe_set = _probe_set()
    evaluator = _Evaluator(loaded, probe_set, ZeroAblation(), METRICS["cross_entropy"], batch_size=3)
    evaluator.baseline()
    units = prune_units(loaded)
    scores = importance(evaluator, units, [], (2, 4))
    expected = _importance_by_hand(loaded.model, probe_set.input_ids)
    for (head,) in units:
        assert scores[(head,)] == pytest.approx(float(expected[head]), rel=1e-4)


def test_kv_groups_limit_and_mask():
    loaded = tiny_loaded("llama_gqa")  # 4 query heads, 2 key/value groups per layer
    probe_set = _probe_set()
    assert prune_units(loaded, kv_groups=True)[0] == ((0, 0), (0, 1))
    result = prune(loaded, probe_set, orderings=("sweep",), step=0.25, kv_groups=True, max_increase=0.0, relative=False)
    (curve,) = result.curves
    assert result.units == "kv_groups" and result.to_dict()["note"] is None
    assert all(step.heads_removed == 2 * step.units_removed for step in curve.steps)
    if curve.steps[-1].loss > result.baseline_loss:  # stopped at the first step that raised the loss
        assert "passed the limit" in curve.stopped and len(curve.steps) >= 2
        kept = sum(map(sum, curve.kept))
        assert kept == 8 - curve.steps[-2].heads_removed
    rows = result.rows()
    assert rows[0]["ordering"] == "sweep" and rows[0]["share_pruned"] == 0.0


def test_bad_pruning_input_is_refused():
    loaded = tiny_loaded("llama_gqa")
    with pytest.raises(ProbeError, match="step"):
        prune(loaded, _probe_set(), step=0)
    with pytest.raises(ProbeError, match="unknown ordering"):
        prune(loaded, _probe_set(), orderings=("best",))


def test_prune_command_writes_json_csv_and_html(tmp_path, capsys, monkeypatch):
    import json
    from pathlib import Path

    from conftest import run_cli

    spec = f"{Path(__file__).parent / 'planted.py'}:planted_textbook"
    outputs = {flag: tmp_path / f"p.{flag[2:]}" for flag in ("--json", "--csv", "--html")}
    code, out, err = run_cli(["prune", "--model", spec, "--seq-len", "24", "--num-seqs", "2", "--data", "repeated",
                              "--step", "0.25", "--seeds", "2", "--max-increase", "50%",
                              *[part for flag, path in outputs.items() for part in (flag, str(path))]],
                             capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads(outputs["--json"].read_text())
    assert [curve["ordering"] for curve in payload["curves"]] == ["michel", "sweep", "random", "random"]
    michel = payload["curves"][0]
    assert michel["kept_mask"][1][1] == 1 and michel["kept_mask"][0][0] == 1  # the induction circuit is kept
    assert "michel" in out and "forward-equivalents" in out
    assert "of the heads can be pruned within +50% (loss at most" in out
    lines = outputs["--csv"].read_text().splitlines()
    assert lines[0].startswith("ordering,seed,step,")  # the header first; the provenance beside the file
    assert json.loads((tmp_path / "p.provenance.json").read_text())["describes"] == "p.csv"
    assert "probe-prune-plot" in outputs["--html"].read_text()
    for bad, message in ((["--max-increase", "lots"], "--max-increase"), (["--step", "2"], "--step"),
                         (["--orderings", "best"], "--orderings")):
        code, _, err = run_cli(["prune", "--model", spec, "--seq-len", "24", "--num-seqs", "2", *bad],
                               capsys, monkeypatch)
        assert code == 2 and message in err, err


def test_losses_measured_on_a_held_out_set_while_the_order_is_chosen_on_the_probe_set():
    loaded = tiny_loaded("llama_gqa")
    chosen_on = _probe_set()
    held_out = ProbeSet("natural", "other random tokens", torch.randint(1, 120, (3, 10), generator=torch.Generator()
                                                                        .manual_seed(7)), 0)
    result = prune(loaded, chosen_on, orderings=("michel",), step=0.25, eval_set=held_out, eval_data="held")
    assert result.to_dict()["measured_on"] == "held"
    assert result.baseline_loss == pytest.approx(_loss_by_hand(loaded.model, held_out.input_ids, []), rel=1e-5)
    (curve,) = result.curves
    evaluator = _Evaluator(loaded, chosen_on, ZeroAblation(), METRICS["cross_entropy"], batch_size=8)
    scores = importance(evaluator, prune_units(loaded), [], (2, 4))
    first = min(prune_units(loaded), key=lambda unit: (scores[unit], unit))
    assert curve.steps[1].removed[0] == f"{first[0][0]}.{first[0][1]}"  # chosen on the probe set
    pruned = []
    for step in curve.steps[1:]:
        pruned += [tuple(int(x) for x in name.split(".")) for name in step.removed]
        assert step.loss == pytest.approx(_loss_by_hand(loaded.model, held_out.input_ids, pruned), rel=1e-5)
    assert result.costs["loss_passes"] == 4 and result.costs["gradient_passes"] == 4


def test_the_verdict_says_in_words_how_much_can_be_pruned_within_the_limit_as_given():
    from probe.reports.prune import prune_verdict

    def curve(ordering, losses):
        return {"ordering": ordering, "steps": [{"share_pruned": index / 4, "loss": loss}
                                                for index, loss in enumerate(losses)]}

    payload = {"baseline_loss": 3.0, "max_loss": 3.15, "units": "heads",
               "curves": [curve("michel", [3.0, 3.4]), curve("random", [3.0, 3.2])]}
    assert prune_verdict(payload, "5%") == ("No fraction of heads can be pruned within +5% (loss at most 3.1500): "
                                            "every ordering's first step passes it.")
    payload["curves"].append(curve("sweep", [3.0, 3.05, 3.1, 3.3]))
    assert prune_verdict(payload | {"units": "kv_groups"}, "0.15") == (
        "Up to 50% of the key/value groups can be pruned within +0.15 (loss at most 3.1500): the sweep ordering, "
        "loss 3.1000.")
    assert prune_verdict(payload | {"max_loss": None}, "5%") is None  # no limit: pruned to 100%

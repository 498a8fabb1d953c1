"""Self-repair per head (probe.selfrepair): the direct effect is minus the head's DLA under zero ablation, the total is
minus the sweep's delta of the same ablation, a later head's compensation is its DLA with and without the ablation
computed by hand, the parts sum to the total, the model is restored; the CLI's table, JSON, CSV and page."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, tiny_loaded
from test_browser import browser, open_page  # noqa: F401 (fixtures)
from probe.ablation.sweep import sweep
from probe.dla import logit_attribution, next_token_attribution
from probe.errors import ProbeError
from probe.inputs import ContrastSet, ProbeSet, contrast_task
from probe.patching import contrast_runs
from probe.selfrepair import contrast_self_repair, text_self_repair
from test_dla import random_contrast

CLOSE = 1e-5


def hand_run(model: torch.nn.Module, contrast: ContrastSet, ablate: tuple[int, int] | None = None) -> dict:
    """A Llama's clean prompts by plain module hooks: every layer's o_proj input (the heads' outputs side by side)
    and the final norm's input at each pair's last position, and the logit differences there; `ablate=(layer,
    head)` zeroes that head's slice of its layer's o_proj input first."""
    rows, last = torch.arange(len(contrast)), contrast.last
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    seen: dict = {}

    def hook(index: int):
        def pre(_module, args):
            x = args[0].clone()
            if ablate is not None and ablate[0] == index:
                x[..., ablate[1] * head_dim:(ablate[1] + 1) * head_dim] = 0
            seen[index] = x[rows, last].double()
            return (x,)
        return pre

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(hook(index))
               for index, layer in enumerate(model.model.layers)]
    handles.append(model.model.norm.register_forward_pre_hook(
        lambda _module, args: seen.__setitem__("stream", args[0][rows, last].double())))
    try:
        with torch.no_grad():
            logits = model(contrast.clean, attention_mask=contrast.mask).logits[rows, last].double()
    finally:
        for handle in handles:
            handle.remove()
    seen["diff"] = logits[rows, contrast.answer] - logits[rows, contrast.distractor]
    return seen


def hand_dla(model: torch.nn.Module, contrast: ContrastSet, run: dict, stream: torch.Tensor, layer: int,
             head: int) -> torch.Tensor:
    """(pairs,) head layer.head's share of the logit difference in `run`, through the final norm frozen at `stream`
    (the clean run's): its slice of z times its columns of W_O, times 1/rms, the gain and W_U[answer] - W_U[dist]."""
    dim = model.config.hidden_size // model.config.num_attention_heads
    w_o = model.model.layers[layer].self_attn.o_proj.weight.detach().double()[:, head * dim:(head + 1) * dim]
    write = run[layer][:, head * dim:(head + 1) * dim] @ w_o.T
    norm = model.model.norm
    scale = (stream.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon).rsqrt()
    unembed = model.lm_head.weight.detach().double()
    direction = unembed[contrast.answer] - unembed[contrast.distractor]
    return (write * scale * norm.weight.detach().double() * direction).sum(-1)


def test_direct_total_and_compensation_equal_hand_computations() -> None:
    loaded = tiny_loaded("llama_gqa")
    model = loaded.model
    contrast = random_contrast([6, 8, 7, 5, 9])
    result = contrast_self_repair(loaded, contrast, batch_size=2)
    dla = logit_attribution(loaded, contrast, per_position=False)
    assert torch.allclose(result.direct, -dla.per_head.flatten(), atol=CLOSE)  # zero ablation: minus the DLA
    swept = sweep(loaded, contrast_runs(loaded, contrast)[0], batch_size=2)  # metric: minus the logit difference
    assert torch.allclose(result.total, -torch.tensor([entry.delta for entry in swept.heads], dtype=torch.float64),
                          atol=CLOSE)
    clean = hand_run(model, contrast)
    for ablated in ((0, 1), (0, 3)):
        index = result.heads.index(ablated)
        run = hand_run(model, contrast, ablated)
        assert float(result.total[index]) == pytest.approx(float((run["diff"] - clean["diff"]).mean()), abs=CLOSE)
        for later in range(4):  # each head of layer 1: its DLA under the ablation minus its clean DLA, both frozen
            expected = hand_dla(model, contrast, run, clean["stream"], 1, later) - hand_dla(
                model, contrast, clean, clean["stream"], 1, later)
            assert float(result.compensation[index, 1, later]) == pytest.approx(float(expected.mean()), abs=CLOSE)
        assert result.compensation[index, 0].abs().sum() == pytest.approx(abs(float(result.direct[index])), abs=CLOSE)
    parts = result.direct + result.by_heads + result.by_mlps + result.by_norm
    assert torch.allclose(parts, result.total, atol=CLOSE)
    assert torch.allclose(result.self_repair, result.total - result.direct)
    for index, ablated in enumerate(result.heads):  # who covers: moved against the direct effect, largest first
        toward = 1.0 if float(result.direct[index]) < 0 else -1.0
        listed = result.compensating(index)
        assert all(value * toward > 0 and value == float(result.compensation[index, at, h]) and (at, h) != ablated
                   for at, h, value in listed)
        assert [value * toward for _, _, value in listed] == sorted((value * toward for _, _, value in listed),
                                                                    reverse=True)


def test_mean_ablation_total_is_the_sweeps_and_the_model_is_restored() -> None:
    loaded = tiny_loaded("llama_gqa")
    contrast = random_contrast([6, 8, 7])
    before = loaded.model(contrast.clean, attention_mask=contrast.mask).logits.detach()
    result = contrast_self_repair(loaded, contrast, [(0, 2), (1, 1)], method="mean", batch_size=2)
    swept = sweep(loaded, contrast_runs(loaded, contrast)[0], [(0, 2), (1, 1)], method="mean", batch_size=2)
    assert torch.allclose(result.total, -torch.tensor([entry.delta for entry in swept.heads], dtype=torch.float64),
                          atol=CLOSE)
    # the mean is not zero: a direct effect of its own
    assert not torch.allclose(result.direct, torch.zeros(2, dtype=torch.float64))
    after = loaded.model(contrast.clean, attention_mask=contrast.mask).logits.detach()
    assert torch.equal(before, after)
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in loaded.model.modules())
    payload = result.to_dict()
    assert payload["method"] == "mean" and payload["dtype"] == "float32" and "mean" in payload["reference"]
    directs = [abs(row["direct"]) for row in payload["heads"]]
    assert directs == sorted(directs, reverse=True)


def test_on_natural_text_the_total_is_minus_the_loss_delta_and_direct_reads_the_frozen_logits() -> None:
    loaded = tiny_loaded("llama_gqa")
    ids = torch.randint(3, 120, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    text = ProbeSet("natural", "random ids", ids, 0, attention_mask=mask)
    result = text_self_repair(loaded, text, batch_size=2)
    swept = sweep(loaded, text, batch_size=2)  # cross-entropy: the total is minus its delta
    assert result.points == 9 + 6 + 9
    assert torch.allclose(result.total, -torch.tensor([entry.delta for entry in swept.heads], dtype=torch.float64),
                          atol=CLOSE)
    own = torch.stack([result.compensation[i, layer, head] for i, (layer, head) in enumerate(result.heads)])
    assert torch.allclose(own, -next_token_attribution(loaded, ids, mask).per_head.flatten(), atol=CLOSE)
    # by hand for head 0.0: its write removed from the final norm's input, the norm's scale kept, then the loss
    model, rows, positions = loaded.model, *(mask[:, 1:].bool() & mask[:, :-1].bool()).nonzero(as_tuple=True)
    seen = {}
    handles = [model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda _m, args: seen.__setitem__("z", args[0])),
        model.model.norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.double()[rows, positions]
    for handle in handles:
        handle.remove()
    x, dim = seen["x"][rows, positions].double(), model.config.hidden_size // model.config.num_attention_heads
    w_o = model.model.layers[0].self_attn.o_proj.weight.detach().double()[:, :dim]
    write = seen["z"][rows, positions, :dim].double() @ w_o.T
    scale = (x.pow(2).mean(-1, keepdim=True) + model.model.norm.variance_epsilon).rsqrt()
    gain, unembed = model.model.norm.weight.detach().double(), model.lm_head.weight.detach().double()
    changed = logits - (write * scale * gain) @ unembed.T
    answer = ids[rows, positions + 1]
    picked = torch.arange(len(rows))
    expected = changed.log_softmax(-1)[picked, answer] - logits.log_softmax(-1)[picked, answer]
    assert float(result.direct[result.heads.index((0, 0))]) == pytest.approx(float(expected.mean()), abs=1e-4)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "resample"}, "self-repair ablates a head by zero or mean, not 'resample'"),
    ({"heads": [(2, 0)]}, "no head 2.0 in this model"),
    ({"top": 0}, "top must be at least 1"),
])
def test_what_it_cannot_run_is_refused_in_one_line(kwargs, message) -> None:
    with pytest.raises(ProbeError, match=message) as error:
        contrast_self_repair(tiny_loaded("llama_gqa"), random_contrast([5, 6]), **kwargs)
    assert "\n" not in str(error.value)


def test_the_dla_and_patch_commands_show_self_repair(tmp_path, capsys, monkeypatch) -> None:
    import probe.inputs.contrast as contrast

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    words = "tests/words.py:tiny_with_words"
    out, csv, page = tmp_path / "d.json", tmp_path / "d.csv", tmp_path / "d.html"
    code, stdout, stderr = run_cli(["dla", "--model", words, "--task", "ioi", "--count", "6", "--self-repair",
                                    "--json", str(out), "--csv", str(csv), "--html", str(page)], capsys, monkeypatch)
    assert code == 0, stderr
    section = json.loads(out.read_text())["self_repair"]
    assert section["metric"] == "logit difference" and len(section["heads"]) == 8 and section["points"] == 6
    first = section["heads"][0]
    assert first["self_repair"] == pytest.approx(first["total"] - first["direct"])
    assert "Self-repair of" in stdout and "covered by" in stdout and ",self_repair,covered_by" in csv.read_text()
    html = page.read_text()
    assert "window.probeReports.start(\"dla\"" in html and "probe-self-repair" in html and "probe-dla-repair" in html
    assert "<script src" not in html and "probeExtraPages.dla" in html
    code, stdout, stderr = run_cli(["patch", "--model", words, "--task", "ioi", "--count", "6", "--heads", "0.1,1.2",
                                    "--no-classes", "--self-repair", "--repair-method", "mean", "--json", str(out),
                                    "--html", str(page), "--force"], capsys, monkeypatch)
    assert code == 0, stderr
    section = json.loads(out.read_text())["self_repair"]
    assert section["method"] == "mean" and {(row["layer"], row["head"]) for row in section["heads"]} == {(0, 1),
                                                                                                     (1, 2)}
    assert "Self-repair of" in stdout and "probe-self-repair" in page.read_text()
    code, _, stderr = run_cli(["dla", "--model", words, "--task", "ioi", "--self-repair", "--repair-method", "noise"],
                              capsys, monkeypatch)
    assert code == 2 and "--repair-method 'noise': use one of zero, mean" in stderr
    code, _, stderr = run_cli(["dla", "--model", words, "--task", "ioi", "--count", "6", "--self-repair", "--heads",
                               "1.2,0.1", "--json", str(out), "--force"], capsys, monkeypatch)
    assert code == 0, stderr
    chosen = json.loads(out.read_text())
    assert {(row["layer"], row["head"]) for row in chosen["self_repair"]["heads"]} == {(1, 2), (0, 1)}
    assert len(chosen["heads"]) == 8  # DLA itself still covers every head
    code, _, stderr = run_cli(["dla", "--model", words, "--task", "ioi", "--heads", "0.1"], capsys, monkeypatch)
    assert code == 2 and "add --self-repair" in stderr and len(stderr.strip().splitlines()) == 1
    code, _, stderr = run_cli(["dla", "--model", words, "--task", "ioi", "--self-repair", "--heads", "7.0"], capsys,
                              monkeypatch)
    assert code == 2 and "7" in stderr and len(stderr.strip().splitlines()) == 1  # past the model's layers


def test_smollm2_ioi_self_repair_equals_the_sweep_dla_and_a_hand_computation(smollm2) -> None:
    contrast = contrast_task(smollm2, "ioi", count=8)
    heads = [(20, 3), (22, 1), (23, 3)]
    result = contrast_self_repair(smollm2, contrast, heads, batch_size=8)
    dla = logit_attribution(smollm2, contrast, per_position=False).per_head
    assert torch.allclose(result.direct, -torch.stack([dla[layer, head] for layer, head in heads]), atol=1e-4)
    swept = sweep(smollm2, contrast_runs(smollm2, contrast)[0], heads, batch_size=8)
    assert torch.allclose(result.total, -torch.tensor([entry.delta for entry in swept.heads], dtype=torch.float64),
                          atol=1e-4)
    clean, run = hand_run(smollm2.model, contrast), hand_run(smollm2.model, contrast, (23, 3))
    for later in ((24, 0), (25, 4), (27, 2)):
        expected = hand_dla(smollm2.model, contrast, run, clean["stream"], *later) - hand_dla(
            smollm2.model, contrast, clean, clean["stream"], *later)
        assert float(result.compensation[2, later[0], later[1]]) == pytest.approx(float(expected.mean()), abs=1e-4)
    assert torch.allclose(result.direct + result.by_heads + result.by_mlps + result.by_norm, result.total, atol=1e-4)


def test_the_atlas_shows_self_repair_where_the_stage_ran(tmp_path, capsys, monkeypatch) -> None:
    from probe.atlas import atlas

    options = {"seq_len": 24, "num_seqs": 2, "repeat_len": 8}
    built = atlas(tiny_loaded("llama_gqa"), self_repair=True, **options).to_dict()
    for entry in built["heads"]:  # the sweep on the same text: the total is minus its loss delta
        assert entry["self_repair"]["total"] == pytest.approx(-entry["effects"]["delta"], abs=1e-5)
        assert entry["metrics"]["self_repair"] == pytest.approx(entry["self_repair"]["self_repair"], abs=1e-5)
    assert "self_repair" in built["metrics"] and built["settings"]["self_repair"]["method"] == "zero"
    skipped = atlas(tiny_loaded("llama_gqa"), **options).to_dict()  # not asked for: no stage, nothing shown
    assert all(entry["self_repair"] is None for entry in skipped["heads"]) and "self_repair" not in skipped["metrics"]
    assert "self_repair" not in [stage["name"] for stage in skipped["stages"]]
    page, data = tmp_path / "atlas.html", tmp_path / "atlas.json"
    code, _, err = run_cli(["atlas", "--model", "tests/planted.py:planted_lm", "--seq-len", "24", "--num-seqs", "2",
                            "--repeat-len", "8", "--fast", "--self-repair", "--json", str(data), "--html", str(page)],
                           capsys, monkeypatch)
    assert code == 0, err  # a model DLA cannot decompose: the stage is skipped with its reason, the atlas made
    stage = next(stage for stage in json.loads(data.read_text())["stages"] if stage["name"] == "self_repair")
    assert stage["note"].startswith("skipped: ") and "cannot decompose" in stage["note"]


@pytest.mark.slow
@pytest.mark.browser
def test_the_dla_page_and_an_atlas_dashboard_draw_self_repair(tmp_path, capsys, monkeypatch, open_page) -> None:  # noqa: F811
    from probe.atlas import atlas
    from probe.reports.atlas import atlas_page
    from test_html import IMG, SCRIPT

    out, page = tmp_path / "d.json", tmp_path / "d.html"
    code, _, stderr = run_cli(["dla", "--model", "tests/words.py:tiny_with_words", "--task", "ioi", "--count", "6",
                               "--self-repair", "--json", str(out), "--html", str(page)], capsys, monkeypatch)
    assert code == 0, stderr
    section = json.loads(out.read_text())["self_repair"]
    opened = open_page(page)
    drawn = opened.z(".probe-dla-repair")
    for row in section["heads"]:
        assert drawn[row["layer"]][row["head"]] == pytest.approx(row["self_repair"], abs=1e-6)
    assert len(opened.page.locator("table.probe-self-repair tr").all()) == 1 + len(section["heads"])
    opened.check_clean()
    built = atlas(tiny_loaded("llama_gqa"), self_repair=True, seq_len=24, num_seqs=2, repeat_len=8)
    payload = built.to_dict()
    payload["model"] = SCRIPT + IMG  # text stays text
    path = tmp_path / "atlas.html"
    blocks = {name: p.page_payload() for name, p in built.patterns.items()}
    path.write_text(atlas_page(payload, blocks), encoding="utf-8")
    opened = open_page(path)
    opened.page.click("tr.atlas-row[data-head='0.1']")
    opened.wait_ready(dashboard="0.1")
    text = opened.page.text_content(".atlas-dashboard")
    repair = payload["heads"][1]["self_repair"]
    assert "self-repair (total \u2212 direct)" in text and f"{repair['self_repair']:+.4f}" in text
    opened.check_clean()

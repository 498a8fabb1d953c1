"""Issue 27: activation patching, built as an ablation method (PatchAblation) that the sweep runs like any other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_loaded
from test_ablate import projection
from test_specific import swapped_loss

from probe.ablation import sweep
from probe.ablation.methods import PatchAblation, patch_method
from probe.ablation.statistics import head_outputs
from probe.hooks.run import logits_of, run_model
from probe.inputs import repeated_set
from probe.errors import ProbeError


def patched_loss(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor, head: tuple[int, int],
                 head_dim: int) -> float:
    """The corrupt run's mean next-token loss with `head`'s slice of the output projection's input taken from the
    same row of the clean run: two passes with plain pre-hooks, written independently of probe's editor."""
    return swapped_loss(model, corrupt, head, head_dim, torch.arange(corrupt.shape[0]), source=clean)


@pytest.mark.parametrize("mode", ["exact", "naive"])
def test_patching_a_head_equals_a_hand_written_two_pass_patch(mode: str) -> None:
    loaded = tiny_loaded("llama_gqa")
    clean = repeated_set(loaded, repeat_len=7, num_seqs=4, seed=1)
    corrupt = repeated_set(loaded, repeat_len=7, num_seqs=4, seed=2)
    method = PatchAblation(head_outputs(loaded, clean, batch_size=2))
    heads = [(0, 1), (1, 3), (1, 0)]
    result = sweep(loaded, corrupt, heads, method=method, mode=mode, batch_size=2)
    assert result.path.startswith(mode) and result.method == "patch"
    for entry in result.results:
        expected = patched_loss(loaded.model, clean.input_ids, corrupt.input_ids, entry.heads[0], 16)
        assert entry.loss == pytest.approx(expected, abs=1e-5)
    assert any(abs(entry.delta) > 1e-4 for entry in result.results)  # the runs differ: a patch changes the loss


def test_a_source_of_another_shape_is_one_line() -> None:
    loaded = tiny_loaded("llama_gqa")
    clean = repeated_set(loaded, repeat_len=7, num_seqs=4, seed=1)
    longer = repeated_set(loaded, repeat_len=9, num_seqs=4, seed=2)
    with pytest.raises(ProbeError, match="the two runs need the same rows and token lengths"):
        sweep(loaded, longer, [(0, 1)], method=PatchAblation(head_outputs(loaded, clean, batch_size=2)),
              batch_size=2)


def projection_patched_loss(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor, layer: int,
                            name: str, columns: slice) -> float:
    """The corrupt run's loss with columns of `layer`'s q/k/v projection output taken from the clean run: plain
    forward hooks on the projection (before the rotary embedding, which at the same positions is the same)."""
    module = getattr(model.model.layers[layer].self_attn, name)
    seen: dict[str, torch.Tensor] = {}
    handle = module.register_forward_hook(lambda _m, _a, out: seen.__setitem__("y", out.detach().clone()))
    with torch.no_grad():
        run_model(model, clean)
    handle.remove()

    def patch(_module, _args, out):
        out = out.clone()
        out[..., columns] = seen["y"][..., columns]
        return out

    handle = module.register_forward_hook(patch)
    try:
        with torch.no_grad():
            logits = logits_of(run_model(model, corrupt)).float()
    finally:
        handle.remove()
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), corrupt[:, 1:].reshape(-1)))


@pytest.mark.parametrize("component", ["query", "key", "value"])
def test_patching_a_query_key_or_value_equals_patching_the_projection_on_a_gqa_model(component: str) -> None:
    """The TransformerLens #980 case: on a grouped-query model (4 query heads, 2 key/value heads) a key or value
    patch is a key/value group's, fed to both of its query heads."""
    loaded = tiny_loaded("llama_gqa")
    clean = repeated_set(loaded, repeat_len=7, num_seqs=4, seed=1)
    corrupt = repeated_set(loaded, repeat_len=7, num_seqs=4, seed=2)
    method = patch_method(loaded, clean, component, batch_size=2)
    heads = [(0, 1), (1, 2), (1, 3)]
    exact = sweep(loaded, corrupt, heads, method=method, batch_size=2)
    naive = sweep(loaded, corrupt, heads, method=method, mode="naive", batch_size=2)
    assert exact.method == f"patch_{component}" and exact.path.startswith("exact")
    name = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}[component]
    for entry, reference in zip(exact.results, naive.results):
        layer, head = entry.heads[0]
        unit = head if component == "query" else head // 2  # query heads 2 and 3 share key/value head 1
        expected = projection_patched_loss(loaded.model, clean.input_ids, corrupt.input_ids, layer, name,
                                           slice(unit * 16, (unit + 1) * 16))
        assert entry.loss == pytest.approx(expected, abs=1e-5) and reference.loss == pytest.approx(expected, abs=1e-5)
    if component != "query":  # heads 2 and 3 of layer 1 feed on one key/value group: one patch
        assert exact.results[1].loss == pytest.approx(exact.results[2].loss, abs=1e-7)


def test_patching_an_input_of_a_module_of_its_own_is_one_line() -> None:
    from test_ablate import planted_loaded, small_set

    loaded = planted_loaded()
    with pytest.raises(ProbeError, match="this model's attention is its own module: patch the head's output"):
        patch_method(loaded, small_set(loaded), "key")


@pytest.mark.parametrize("component", ["output", "key"])
def test_a_patch_at_one_position_equals_the_naive_loop_and_a_hand_written_patch(component: str) -> None:
    loaded = tiny_loaded("llama_gqa")
    clean = repeated_set(loaded, repeat_len=7, num_seqs=4, seed=1)
    corrupt = repeated_set(loaded, repeat_len=7, num_seqs=4, seed=2)
    method = patch_method(loaded, clean, component, batch_size=2).at(5)
    heads, groups = [(0, 1), (1, 2)], [[(0, 0), (1, 3)]]  # a group over two layers: copies differ at layer 1
    exact = sweep(loaded, corrupt, heads, groups=groups, method=method, batch_size=2, stack=3)
    naive = sweep(loaded, corrupt, heads, groups=groups, method=method, mode="naive", batch_size=2)
    assert exact.path.startswith("exact") and "at position 5" in exact.mean
    assert [r.loss for r in exact.results] == pytest.approx([r.loss for r in naive.results], abs=1e-6)
    if component == "output":
        whole = sweep(loaded, corrupt, heads, method=patch_method(loaded, clean, batch_size=2), batch_size=2)
        assert all(abs(a.loss - b.loss) > 1e-6 for a, b in zip(exact.heads, whole.heads))  # one position is not all
        layer, head = heads[0]
        module, _ = projection(loaded.model, layer)
        seen: dict[str, torch.Tensor] = {}
        handle = module.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach().clone()))
        with torch.no_grad():
            run_model(loaded.model, clean.input_ids)
        handle.remove()
        columns = slice(head * 16, (head + 1) * 16)

        def patch(_module, args):
            x = args[0].clone()
            x[:, 5, columns] = seen["x"][:, 5, columns]
            return (x,)

        handle = module.register_forward_pre_hook(patch)
        with torch.no_grad():
            out = logits_of(run_model(loaded.model, corrupt.input_ids)).float()
        handle.remove()
        ids = corrupt.input_ids
        expected = float(F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)))
        assert exact.heads[0].loss == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# patch_heads: every head between a clean and a corrupted run, normalised by their logit differences


def ioi_runs(loaded, count: int = 8):
    """Clean IOI prompts and their ABC corruption (the subject's second mention replaced by a third name), each
    followed by its answer and distractor."""
    from probe.inputs import contrast_task
    from probe.patching import contrast_runs

    return contrast_runs(loaded, contrast_task(loaded, "ioi", count=count))


def projection_inputs(model, runs, layers=(0, 1)) -> dict:
    """layer -> the input of its output projection (every head's output) on one forward of `runs`, by plain hooks."""
    seen = {}
    handles = [projection(model, layer)[0].register_forward_pre_hook(
        lambda _m, args, layer=layer: seen.__setitem__(layer, args[0].detach().clone())) for layer in layers]
    with torch.no_grad():
        run_model(model, runs.input_ids, runs.attention_mask)
    for handle in handles:
        handle.remove()
    return seen


def last_position_logit_diffs(model, runs, current: dict | None = None) -> float:
    """Mean logit(answer) - logit(distractor) at the last prompt position, read off a full forward of each prompt
    alone (the answer and distractor that follow it in its row cut off); `current["row"]` says which row runs."""
    ids, scored = runs.input_ids, runs.scored
    diffs = []
    for row in range(ids.shape[0]):
        if current is not None:
            current["row"] = row
        last = int(scored[row].nonzero()[0])
        with torch.no_grad():
            logits = logits_of(run_model(model, ids[row:row + 1, :last + 1])).double()[0, -1]
        diffs.append(float(logits[ids[row, last + 1]] - logits[ids[row, last + 2]]))
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize("noising", [False, True])
def test_patch_heads_equals_a_hand_written_patch_and_normalises(noising: bool, monkeypatch) -> None:
    from test_specific import words_loaded

    import probe.inputs.contrast as contrast
    import probe.patching.heads as patching

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-3)  # a random tiny model's corruption changes little
    loaded = words_loaded()
    clean, corrupt = ioi_runs(loaded)
    heads = [(0, 1), (1, 2)]
    exact = patching.patch_heads(loaded, clean, corrupt, heads, noising=noising, batch_size=4)
    naive = patching.patch_heads(loaded, clean, corrupt, heads, noising=noising, batch_size=4, mode="naive")
    clean_ld, corrupt_ld = (last_position_logit_diffs(loaded.model, runs) for runs in (clean, corrupt))
    assert exact.clean_logit_diff == pytest.approx(clean_ld, abs=1e-5)
    assert exact.corrupt_logit_diff == pytest.approx(corrupt_ld, abs=1e-5)
    target, source = (clean, corrupt) if noising else (corrupt, clean)
    for entry, reference in zip(exact.entries, naive.entries):
        (layer, head), = entry.heads
        module, _ = projection(loaded.model, layer)
        seen, current = {}, {}
        handle = module.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach().clone()))
        with torch.no_grad():
            run_model(loaded.model, source.input_ids, source.attention_mask)
        handle.remove()
        columns = slice(head * 16, (head + 1) * 16)

        def patch(_module, args):  # the source row's values at this prompt's positions
            x = args[0].clone()
            x[..., columns] = seen["x"][current["row"], :x.shape[1], columns]
            return (x,)

        handle = module.register_forward_pre_hook(patch)
        patched = last_position_logit_diffs(loaded.model, target, current)
        handle.remove()
        assert entry.logit_diff == pytest.approx(patched, abs=1e-5)
        assert reference.logit_diff == pytest.approx(patched, abs=1e-5)
        assert entry.patch_effect == pytest.approx((entry.logit_diff - exact.corrupt_logit_diff) / (
            exact.clean_logit_diff - exact.corrupt_logit_diff), rel=1e-9)
    payload = exact.to_dict()
    assert payload["direction"] == ("noising" if noising else "denoising")
    assert [(row["layer"], row["head"]) for row in payload["heads"]] == heads


def test_patching_refuses_logit_differences_too_close_to_normalise() -> None:
    from test_specific import words_loaded

    from probe.patching import patch_heads

    loaded = words_loaded()
    clean, corrupt = ioi_runs(loaded)
    with pytest.raises(ProbeError, match="too close to normalise by"):
        patch_heads(loaded, clean, corrupt, [(0, 1)], batch_size=4)


# ---------------------------------------------------------------------------------------------------------------
# patch_contrast and `probe patch`


def test_exact_patching_equals_the_naive_loop_on_smollm2s_first_layers(smollm2) -> None:
    """SmolLM2 on IOI pairs: the exact sweep (prefix reused, copies stacked) gives the naive loop's numbers, the
    DLA column is the clean run's, and a key patch is its key/value group's (3 query heads each)."""
    from probe.inputs import contrast_task
    from probe.dla import logit_attribution
    from probe.patching import patch_contrast

    contrast = contrast_task(smollm2, "ioi", count=4, seed=1)
    heads = [(layer, head) for layer in (0, 1) for head in range(9)]
    exact = patch_contrast(smollm2, contrast, heads, batch_size=8)
    naive = patch_contrast(smollm2, contrast, heads, batch_size=8, mode="naive", attribution=False)
    assert exact.path.startswith("exact") and naive.path.startswith("naive")
    assert exact.clean_logit_diff > exact.corrupt_logit_diff + 1  # the corruption takes the behaviour away
    for mine, reference in zip(exact.entries, naive.entries):
        assert mine.heads == reference.heads
        assert mine.logit_diff == pytest.approx(reference.logit_diff, abs=1e-4)
    dla = logit_attribution(smollm2, contrast, per_position=False).per_head
    rows = exact.to_dict()["heads"]
    assert rows[3]["dla"] == pytest.approx(float(dla[0, 3]), abs=1e-6)
    keys = patch_contrast(smollm2, contrast, [(1, 0), (1, 4)], component="key", attribution=False)
    assert [entry.heads for entry in keys.entries] == [((1, 0), (1, 1), (1, 2)), ((1, 3), (1, 4), (1, 5))]
    assert [row["kv_head"] for row in keys.to_dict()["heads"]] == [0, 0, 0, 1, 1, 1]


def test_probe_patch_writes_json_csv_and_a_page(tmp_path, capsys, monkeypatch) -> None:
    import json

    import probe.inputs.contrast as contrast
    from conftest import run_cli

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    out, csv, page = tmp_path / "p.json", tmp_path / "p.csv", tmp_path / "p.html"
    code, stdout, stderr = run_cli(["patch", "--model", "tests/words.py:tiny_with_words", "--task", "ioi", "--count",
                                    "6", "--by-position", "--heads", "0.1,1.*", "--senders", "0.1,0.2", "--receivers",
                                    "1.0,1.3", "--json", str(out), "--csv", str(csv), "--html", str(page)], capsys,
                                   monkeypatch)
    assert code == 0, stderr
    payload = json.loads(out.read_text())
    assert {"clean_logit_diff", "corrupt_logit_diff", "heads"} <= set(payload)
    assert {"layer", "head", "patch_effect", "dla", "classes"} <= set(payload["heads"][0])
    assert len(payload["heads"]) == 5 and len(payload["by_position"]) == 5 * len(payload["tokens"])
    names = [token for token in payload["tokens"] if "/" in token]  # positions where the pairs' names differ
    assert payload["tokens"][0] == "<s>" and names and all(len(token.split("/")) <= 4 for token in names)
    assert "Activation patching of" in stdout and "layer,head,patch_effect,dla" in csv.read_text()
    assert payload["paths"]["senders"] == [[0, 1], [0, 2]] and len(payload["paths"]["patch_effect"][0]) == 2
    assert "Path patching" in stdout
    assert "window.probeReports.start(\"patch\"" in page.read_text()
    code, _, stderr = run_cli(["patch", "--model", "tests/words.py:tiny_with_words", "--task", "ioi", "--component",
                               "attention"], capsys, monkeypatch)
    assert code == 2 and "--component 'attention': use one of output, query, key, value" in stderr
    code, _, stderr = run_cli(["patch", "--model", "tests/words.py:tiny_with_words"], capsys, monkeypatch)
    assert code == 2 and "give --task or --pairs" in stderr
    code, _, stderr = run_cli(["patch", "--model", "tests/words.py:tiny_with_words", "--task", "ioi", "--senders",
                               "0.1"], capsys, monkeypatch)
    assert code == 2 and "takes --senders and --receivers together" in stderr
    code, stdout, stderr = run_cli(["patch", "--model", "tests/words.py:tiny_with_words", "--task", "ioi", "--count",
                                    "6", "--heads", "0.1", "--senders", "0.1,1.2", "--receivers", "logits",
                                    "--no-classes", "--json", str(out), "--force"], capsys, monkeypatch)
    assert code == 0, stderr
    direct = json.loads(out.read_text())["paths"]
    assert direct["receivers"] == ["logits"] and len(direct["patch_effect"]) == 2 and "direct path into" in stdout
    code, stdout, stderr = run_cli(["patch", "--model", "tests/words.py:tiny_with_words", "--task", "ioi", "--count",
                                    "6", "--estimate", "--no-classes", "--json", str(out), "--force"], capsys,
                                   monkeypatch)
    assert code == 0, stderr
    estimated = json.loads(out.read_text())
    assert estimated["mode"] == "estimate" and len(estimated["heads"]) == 8 and "attribution patching" in stdout
    code, _, stderr = run_cli(["patch", "--model", "tests/words.py:tiny_with_words", "--task", "ioi", "--estimate",
                               "--by-position"], capsys, monkeypatch)
    assert code == 2 and "--estimate covers each head at every position" in stderr


# ---------------------------------------------------------------------------------------------------------------
# path patching


def test_path_patching_equals_a_hand_written_two_pass_computation(monkeypatch) -> None:
    """A sender's effect through a receiver's value, on a grouped-query model: pass 1 with plain pre-hooks freezing
    every head's o_proj slice at the corrupted run's but the sender's (clean), recording the receiver's v_proj output;
    pass 2 the corrupted run with the receiver's key/value group's v_proj columns replaced by that recording."""
    import probe.inputs.contrast as contrast
    from probe.patching.paths import path_patch
    from test_specific import words_loaded

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)
    loaded = words_loaded()
    model = loaded.model
    clean, corrupt = ioi_runs(loaded, count=4)
    senders, receivers = [(0, 1), (0, 3)], [(1, 0), (1, 3)]
    result = path_patch(loaded, clean, corrupt, senders, receivers, component="value", batch_size=4)
    outputs = {name: projection_inputs(model, runs) for name, runs in (("clean", clean), ("corrupt", corrupt))}
    attention = model.model.layers[1].self_attn
    for i, (sender_layer, sender) in enumerate(senders):
        def freeze(_module, args, layer):
            x = outputs["corrupt"][layer].clone()
            if layer == sender_layer:
                x[..., sender * 16:(sender + 1) * 16] = outputs["clean"][layer][..., sender * 16:(sender + 1) * 16]
            return (x,)

        handles = [projection(model, layer)[0].register_forward_pre_hook(
            lambda m, args, layer=layer: freeze(m, args, layer)) for layer in (0, 1)]
        recorded = {}
        handles.append(attention.v_proj.register_forward_hook(
            lambda _m, _a, out: recorded.__setitem__("v", out.detach().clone())))
        with torch.no_grad():
            run_model(model, corrupt.input_ids, corrupt.attention_mask)
        for handle in handles:
            handle.remove()
        for j, (_, receiver) in enumerate(receivers):
            group = slice((receiver // 2) * 16, (receiver // 2 + 1) * 16)  # 4 query heads, 2 key/value heads
            current = {}

            def patch(_m, _a, out, group=group):
                out = out.clone()
                out[..., group] = recorded["v"][current["row"], :out.shape[1], group]
                return out

            handle = attention.v_proj.register_forward_hook(patch)
            expected = last_position_logit_diffs(model, corrupt, current)
            handle.remove()
            assert result.logit_diff[i][j] == pytest.approx(expected, abs=1e-5)
    assert result.to_dict()["patch_effect"][0][0] == pytest.approx(
        (result.logit_diff[0][0] - result.corrupt_logit_diff) / (result.clean_logit_diff - result.corrupt_logit_diff))
    with pytest.raises(ProbeError, match="only in a later layer"):
        path_patch(loaded, clean, corrupt, [(1, 0)], [(1, 2)], batch_size=4)


def test_the_direct_path_into_the_logits_equals_a_hand_written_computation(monkeypatch) -> None:
    """A sender's direct path: its o_proj output's change (its slice clean, every other slice corrupted) added to the
    input of the final norm of the corrupted run, with plain hooks; nothing in between sees it."""
    import probe.inputs.contrast as contrast
    from probe.patching.paths import LOGITS, direct_path, path_contrast
    from test_specific import words_loaded

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)
    loaded = words_loaded()
    model = loaded.model
    clean, corrupt = ioi_runs(loaded, count=4)
    senders = [(0, 2), (1, 1), (1, 3)]
    result = direct_path(loaded, clean, corrupt, senders, batch_size=3)
    inputs = {name: projection_inputs(model, runs) for name, runs in (("clean", clean), ("corrupt", corrupt))}
    for i, (layer, sender) in enumerate(senders):
        o_proj = projection(model, layer)[0]
        patched = inputs["corrupt"][layer].clone()
        patched[..., sender * 16:(sender + 1) * 16] = inputs["clean"][layer][..., sender * 16:(sender + 1) * 16]
        with torch.no_grad():
            change = o_proj(patched) - o_proj(inputs["corrupt"][layer])  # (rows, positions, d_model)
        current = {}
        handle = model.model.norm.register_forward_pre_hook(
            lambda _m, args: (args[0] + change[current["row"], :args[0].shape[1]],))
        expected = last_position_logit_diffs(model, corrupt, current)
        handle.remove()
        assert result.logit_diff[i][0] == pytest.approx(expected, abs=1e-5)
    assert result.receivers == [LOGITS] and result.to_dict()["receivers"] == ["logits"]
    assert result.corrupt_logit_diff == pytest.approx(last_position_logit_diffs(model, corrupt), abs=1e-5)
    with pytest.raises(ProbeError, match="give heads, or 'logits'"):
        path_contrast(loaded, contrast.contrast_task(loaded, "ioi", count=2), senders, "logit")


@pytest.mark.parametrize("component", ["query", "key", "value"])
def test_the_qk_fix_recomputes_the_patched_heads_then_takes_the_first_order(component: str, monkeypatch) -> None:
    """AtP*'s QK fix on a grouped-query model, written with plain hooks: the patched heads' outputs z' from a real
    forward with the projection's columns taken from the clean run, dLD/dz by autograd on the corrupted run; the
    estimate is LD_corrupt + dLD/dz . (z' - z) over the unit's heads (query head 2; key/value group 1 = heads 2, 3)."""
    import probe.inputs.contrast as contrast
    from probe.patching.estimate import estimate_patches
    from test_specific import words_loaded

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)
    loaded = words_loaded()
    model, (clean, corrupt) = loaded.model, ioi_runs(loaded, count=4)
    result = estimate_patches(loaded, clean, corrupt, [(1, 2)], component=component, batch_size=4)
    attention = model.model.layers[1].self_attn
    projection_of = {"query": attention.q_proj, "key": attention.k_proj, "value": attention.v_proj}[component]
    columns, heads = (slice(32, 48), slice(32, 48)) if component == "query" else (slice(16, 32), slice(32, 64))
    seen = {}
    handle = projection_of.register_forward_hook(lambda _m, _a, out: seen.__setitem__("source", out.detach()))
    with torch.no_grad():
        run_model(model, clean.input_ids, clean.attention_mask)
    handle.remove()

    def patched(_m, _a, out):
        out = out.clone()
        out[..., columns] = seen["source"][..., columns]
        return out

    def z_of(patch: bool, grad: bool = False):
        handles = [attention.o_proj.register_forward_pre_hook(
            lambda _m, args: (seen.__setitem__("z", args[0].detach().requires_grad_(grad)) or (seen["z"],)))]
        if patch:
            handles.append(projection_of.register_forward_hook(patched))
        with torch.set_grad_enabled(grad):
            logits = logits_of(run_model(model, corrupt.input_ids, corrupt.attention_mask))
        for handle in handles:
            handle.remove()
        return seen["z"], logits

    z_patched, _ = z_of(True)
    z, logits = z_of(False, grad=True)
    rows = torch.arange(corrupt.input_ids.shape[0])
    last = corrupt.scored.int().argmax(dim=1)
    ids = corrupt.input_ids
    diffs = logits[rows, last, ids[rows, last + 1]] - logits[rows, last, ids[rows, last + 2]]
    (grad,) = torch.autograd.grad(diffs.mean(), z)
    step = (z_patched - z.detach())[..., heads]
    expected = float(diffs.mean().detach()) + float((grad[..., heads] * step).double().sum())
    entry = result.entries[0]
    assert result.mode == "estimate" and entry.logit_diff == pytest.approx(expected, abs=1e-5)
    assert len(entry.heads) == (1 if component == "query" else 2) and "QK fix" in result.path


def test_attribution_patching_is_the_first_order_of_the_exact_patch(monkeypatch) -> None:
    """The estimate's change is the gradient times the patch: scaling the patch by a small step t changes the logit
    difference by t times the estimate (a central difference, measured with probe's own exact patching of a blend)."""
    import probe.inputs.contrast as contrast
    from probe.ablation.methods import PatchAblation
    from probe.ablation.statistics import HeadOutputs, head_outputs
    from probe.patching.estimate import estimate_patches
    from test_specific import words_loaded

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)
    loaded = words_loaded()
    clean, corrupt = ioi_runs(loaded, count=4)
    heads = [(0, 1), (1, 2)]
    estimated = estimate_patches(loaded, clean, corrupt, heads, batch_size=4)
    assert estimated.mode == "estimate" and [e.heads for e in estimated.entries] == [((0, 1),), ((1, 2),)]
    clean_out, corrupt_out = (head_outputs(loaded, run, batch_size=4) for run in (clean, corrupt))
    step = 1e-2

    def blended(t: float) -> HeadOutputs:
        return HeadOutputs([{layer: corrupt_out.values[b][layer] + t * (clean_out.values[b][layer]
                                                                        - corrupt_out.values[b][layer])
                             for layer in clean_out.values[b]} for b in range(len(clean_out.values))], "blend")

    plus = sweep(loaded, corrupt, heads, method=PatchAblation(blended(step)), batch_size=4)
    minus = sweep(loaded, corrupt, heads, method=PatchAblation(blended(-step)), batch_size=4)
    for entry, up, down in zip(estimated.entries, plus.results, minus.results):
        derivative = (up.task["margin"] - down.task["margin"]) / (2 * step)
        assert entry.logit_diff - estimated.corrupt_logit_diff == pytest.approx(derivative, rel=5e-3, abs=2e-5)


def test_patching_by_position_counts_every_positions_sweep_in_one_progress(monkeypatch) -> None:
    """By position, one sweep runs per position after the first: the progress counts them all as one total (a
    command by position went minutes without a line once the first sweep had reached its 100%)."""
    import probe.inputs.contrast as contrast
    from probe.patching import patch_heads
    from test_specific import words_loaded

    monkeypatch.setattr(contrast, "MIN_GAP", 1e-4)  # a random tiny model's corruption changes little
    loaded = words_loaded()
    clean, corrupt = ioi_runs(loaded, count=4)
    reports: list[tuple[int, int]] = []
    patch_heads(loaded, clean, corrupt, [(0, 1), (1, 0)], by_position=True, batch_size=4,
                progress=lambda *report: reports.append(report))
    positions = corrupt.input_ids.shape[1]
    assert reports[-1][1] % (1 + positions) == 0  # (1 + positions) sweeps of one size, all counted
    assert len(reports) >= 2 * (1 + positions)  # each sweep reports its baseline and its heads
    dones = [done for done, _ in reports]
    assert dones == sorted(dones) and reports[-1][0] == reports[-1][1]
    assert sum(done == total for done, total in reports) == 1  # 100% once, at the very end

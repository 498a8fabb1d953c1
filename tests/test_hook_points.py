"""The public hook points (probe.hooks.points) through `Trace`: what they read equals the attention computed by hand,
what they write equals the same change made to the weights, and the model comes back exactly."""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_hf
from planted import planted_mha, planted_textbook
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from probe.ablation import ablate
from probe.hooks.capture import attention_hooks
from probe.models.outputs import logits_of
from probe.hooks.run import run_model
from probe.errors import ProbeError
from probe.hooks.points import KINDS, POINTS, SITES
from probe.ablation.methods import add_to_head, scale_head
from probe.hooks.trace import Trace
from probe.inputs.contrast import ContrastSet, logit_diffs

LAYER = 1


def _manual_llama(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """q, k, v of layer LAYER from its own projections and rotary embedding, (b, n, heads, d)."""
    attention = model.model.layers[LAYER].self_attn
    seen = {}
    handle = attention.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    hidden, (cos, sin) = seen["hidden_states"], seen["position_embeddings"]
    b, n, _ = hidden.shape
    d = attention.head_dim
    q = attention.q_proj(hidden).view(b, n, -1, d).transpose(1, 2)
    k = attention.k_proj(hidden).view(b, n, -1, d).transpose(1, 2)
    v = attention.v_proj(hidden).view(b, n, -1, d)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v}


def _manual_gpt2(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    attention = model.transformer.h[LAYER].attn
    seen = {}
    handle = attention.register_forward_pre_hook(lambda m, args, kwargs: seen.update(hidden=args[0] if args else
                                                 kwargs["hidden_states"]), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    hidden = seen["hidden"]
    b, n, e = hidden.shape
    q, k, v = attention.c_attn(hidden).split(e, dim=2)
    heads = model.config.n_head
    return {name: t.view(b, n, heads, e // heads) for name, t in zip("qkv", (q, k, v))}


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention written out: (pattern (b, hq, n, n), z (b, n, hq, d)) from (b, n, h, d) inputs."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    n = q.shape[1]
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    pattern = logits.softmax(dim=-1)
    return pattern, torch.einsum("bhij,bjhd->bihd", pattern, v)


def _projection(model: torch.nn.Module) -> torch.nn.Module:
    """Layer LAYER's output projection, whose input is z."""
    if hasattr(model, "transformer"):
        return model.transformer.h[LAYER].attn.c_proj
    return model.model.layers[LAYER].self_attn.o_proj


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2"])
def test_reading_q_k_v_z_pattern_equals_the_manual_computation(kind: str) -> None:
    model = tiny_hf(kind)
    ids = torch.randint(1, 120, (2, 11))
    manual = (_manual_llama if kind == "llama_gqa" else _manual_gpt2)(model, ids)
    projected = {}
    handle = _projection(model).register_forward_pre_hook(lambda m, args: projected.update(z=args[0]))
    try:
        with torch.no_grad(), Trace(model, read=["q", "k", "v", "z", "pattern"], layers=[LAYER],
                                    query_block=4) as trace:
            model(ids)
    finally:
        handle.remove()
    read = trace[LAYER]
    assert set(trace._kept) == {LAYER}  # only the layer asked for
    if kind == "llama_gqa":
        assert read["k"].shape[2] == 2 and read["q"].shape[2] == 4  # key/value heads as they are
    for name in "qkv":
        torch.testing.assert_close(read[name], manual[name], rtol=1e-5, atol=1e-5)
    pattern, z = _attention(manual["q"], manual["k"], manual["v"])
    torch.testing.assert_close(read["pattern"], pattern, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(read["z"], z, rtol=1e-5, atol=1e-5)
    assert torch.equal(read["z"].flatten(2), projected["z"])  # exactly what the output projection read


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 2.0])
def test_scaling_z_equals_scaling_the_heads_slice_of_the_projection(kind: str, alpha: float) -> None:
    model = tiny_hf(kind)
    ids = torch.randint(1, 120, (2, 9))
    head, d = 3, 16
    with torch.no_grad(), Trace(model, {"z": {LAYER: scale_head(head, alpha)}}):
        hooked = logits_of(run_model(model, ids))
    projection = _projection(model)
    saved = projection.weight.detach().clone()
    with torch.no_grad():
        if kind == "gpt2":  # Conv1D: (in, out)
            projection.weight[head * d:(head + 1) * d] *= alpha
        else:
            projection.weight[:, head * d:(head + 1) * d] *= alpha
        by_weights = logits_of(run_model(model, ids))
        projection.weight.copy_(saved)
    torch.testing.assert_close(hooked, by_weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factory", [lambda: tiny_hf("llama_gqa"), planted_textbook, planted_mha])
def test_alpha_zero_equals_zero_ablation(factory) -> None:
    model = factory()
    ids = torch.randint(1, 20, (2, 9))
    with torch.no_grad():
        with ablate(model, [(LAYER, 1), (0, 2)], method="zero"):
            ablated = logits_of(run_model(model, ids))
        with Trace(model, {"z": {LAYER: scale_head(1, 0.0), 0: scale_head([2], 0.0)}}):
            scaled = logits_of(run_model(model, ids))
    assert torch.equal(scaled, ablated)


def test_writers_on_q_k_v_and_nested_with_ablation() -> None:
    """A value scaled to 0 zeroes the heads reading it; a Trace inside `ablate` sees the ablated z and adds its own."""
    model = tiny_hf("llama_gqa")
    ids = torch.randint(1, 120, (1, 8))
    with torch.no_grad(), Trace(model, {"v": {LAYER: scale_head(1, 0.0)}}, read=["z"], layers=[LAYER]) as trace:
        model(ids)
    z = trace[LAYER]["z"]
    assert torch.equal(z[:, :, 2:], torch.zeros_like(z[:, :, 2:]))  # query heads 2, 3 read key/value head 1
    assert z[:, :, :2].abs().sum() > 0
    vector = torch.arange(16.0)
    with torch.no_grad(), ablate(model, [(LAYER, 0)]), Trace(model, {"z": {LAYER: add_to_head(0, vector)}},
                                                             read=["z"], layers=[LAYER]) as trace:
        model(ids)
    torch.testing.assert_close(trace[LAYER]["z"][:, :, 0], vector.expand(1, 8, 16))  # zeroed, then added


def test_lse_read_where_it_can_be_rebuilt() -> None:
    model = tiny_hf("llama_gqa")
    ids = torch.randint(1, 120, (2, 10))
    with torch.no_grad(), Trace(model, read=["pattern"]) as patterns:
        model(ids)
    with torch.no_grad(), Trace(model, read=["lse"]) as trace:
        model(ids)
    manual = _manual_llama(model, ids)
    logits = torch.einsum("bihd,bjhd->bhij", manual["q"], manual["k"].repeat_interleave(2, dim=2)) * 16 ** -0.5
    logits = logits.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(trace[LAYER]["lse"], logits.logsumexp(-1), rtol=1e-5, atol=1e-5)
    assert patterns[LAYER]["pattern"].shape == (2, 4, 10, 10) and not trace.blocked


def _state(model: torch.nn.Module) -> tuple:
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode() + value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    hooks = [(name, list(m._forward_hooks), list(m._forward_pre_hooks), sorted(m.__dict__)) for name, m in
             model.named_modules()]
    configs = [m.config._attn_implementation_internal for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation_internal")]
    return digest.hexdigest(), hooks, configs


@pytest.mark.parametrize("factory", [lambda: tiny_hf("llama_gqa"), lambda: tiny_hf("gpt2"), planted_mha,
                                     planted_textbook])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_model_restored_exactly_after_an_error_inside_the_with(factory, error: type) -> None:
    model = factory()
    ids = torch.randint(1, 20, (1, 7))
    with torch.no_grad():
        before = logits_of(run_model(model, ids))
    state = _state(model)

    def explode(z: torch.Tensor, ctx) -> torch.Tensor:
        raise error("inside a writer")

    with pytest.raises(error), torch.no_grad(), Trace(model, {"z": {0: scale_head(0, 3.0)}}, read=["z"]):
        run_model(model, ids)  # a whole forward, edited
        with Trace(model, {"z": {LAYER: explode}}):  # nested, then raising inside a writer
            run_model(model, ids)
    assert _state(model) == state
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(model, ids)), before)


def test_unsupported_points_are_refused_in_one_line() -> None:
    cases = [
        (planted_textbook(), {}, ["q"], "hook point 'q' is not available on layer 0 (custom attention)"),
        (planted_textbook(), {}, ["lse"], "hook point 'lse' is not available on layer 0 (custom attention)"),
        (tiny_hf("gpt2"), {"pattern": {0: scale_head(0, 2.0)}}, [], "'pattern' is read-only"),
        (tiny_hf("gpt2"), {}, ["hook_z"], "no hook point 'hook_z'; the points are q, k, v, lse"),
        (tiny_hf("gpt2"), {}, ["inputs"], "no hook point 'inputs'"),
        (tiny_hf("gpt2"), {"z": {7: scale_head(0, 2.0)}}, [], "no attention layer 7: the model has layers 0 to 1"),
        (tiny_hf("gpt2"), {}, ["pattern", "lse"], "read `pattern` or `lse`, not both"),
    ]
    for model, edit, read, message in cases:
        state = _state(model)
        with pytest.raises(ProbeError, match=re.escape(message)) as raised, Trace(model, edit, read=read):
            pass
        assert "\n" not in str(raised.value)
        assert _state(model) == state  # refused before anything changed


def test_a_writer_that_changes_the_shape_is_refused() -> None:
    model = tiny_hf("llama_gqa")
    with pytest.raises(ProbeError, match="must keep"), torch.no_grad(), \
            Trace(model, {"z": {0: lambda z, ctx: z[:, :, :2]}}):
        model(torch.randint(1, 120, (1, 5)))


def test_the_registry_declares_every_point_fully() -> None:
    """Every point names a known site and layer kinds; a name that is no point is refused in one line."""
    public = [name for name, point in POINTS.items() if point.public]
    assert public == ["q", "k", "v", "lse", "pattern", "z"]
    for point in POINTS.values():
        assert point.site in SITES and point.kinds <= KINDS and point.carries
        assert (point.apply is not None) == (point.site == "inputs")
    model = planted_textbook()
    with pytest.raises(ProbeError, match="no hook point 'edit_heads'"), \
            attention_hooks(model, {"edit_heads": lambda z, ctx: z}):
        pass


def _worked_example() -> str:
    """The Python block of docs/hooks.md that follows its worked-example marker."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text(encoding="utf-8")
    after = page.split("<!-- worked example", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_docs_table_lists_every_public_point() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text(encoding="utf-8")
    lines = page.splitlines()
    first = next(index for index, line in enumerate(lines) if line.startswith("| `"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))  # the points' table
    rows = {line.split("|")[1].strip(" `"): line.split("|")[3:5] for line in table}
    public = {name: point for name, point in POINTS.items() if point.public}
    assert set(rows) == set(public)
    order = ["hf", "mha", "custom", "family"]
    for name, (writable, kinds) in rows.items():
        assert writable.strip() == ("yes" if public[name].writable else "no")
        assert kinds.strip() == ", ".join(kind for kind in order if kind in public[name].kinds)
    assert "print(" in _worked_example()


def test_the_worked_example_runs_and_equals_scaling_the_projection(capsys, monkeypatch, smollm2) -> None:
    """docs/hooks.md's example, run as written (its `load_model("smollm2")` handed the session's SmolLM2): head 23.3
    doubled through `z` is head 3's columns of layer 23's output projection doubled. The checks after it read the
    pairs of logit_diffs' first batch (8 of 32), a batch computed alone as it is within the whole set."""
    import probe

    monkeypatch.setattr(probe, "load_model", lambda spec, **kwargs: smollm2 if spec == "smollm2" and not kwargs else
                        pytest.fail(f"the example loads {spec!r} {kwargs}"))
    scope: dict = {}
    exec(compile(_worked_example(), "docs/hooks.md", "exec"), scope)
    loaded, ioi, clean, doubled = (scope[name] for name in ("loaded", "ioi", "clean", "doubled"))
    assert "with head 23.3 doubled" in capsys.readouterr().out
    first = _first_pairs(ioi, 8)
    projection = loaded.model.model.layers[23].self_attn.o_proj
    saved = projection.weight.detach().clone()
    try:
        with torch.no_grad():
            projection.weight[:, 3 * 64:4 * 64] *= 2
        by_weights = logit_diffs(loaded, first, first.clean)
    finally:
        with torch.no_grad():
            projection.weight.copy_(saved)
    torch.testing.assert_close(doubled[:8], by_weights, rtol=1e-4, atol=1e-4)
    assert doubled.mean() > clean.mean() + 1.0  # the head pushes the answer
    torch.testing.assert_close(logit_diffs(loaded, first, first.clean), clean[:8], rtol=0, atol=0)  # restored


def _first_pairs(contrast: ContrastSet, count: int) -> ContrastSet:
    """The contrast set's first `count` pairs, padded to the whole set's width (so that a batch of them is the batch
    logit_diffs runs within the whole set)."""
    return replace(contrast, clean=contrast.clean[:count], corrupt=contrast.corrupt[:count],
                   mask=contrast.mask[:count], answer=contrast.answer[:count],
                   distractor=contrast.distractor[:count], pairs=contrast.pairs[:count])


def test_lse_blocked_where_the_logits_cannot_be_rebuilt() -> None:
    model = tiny_hf("gemma2")  # soft-capped logits
    with torch.no_grad(), Trace(model, read=["lse"]) as trace:
        model(torch.randint(1, 120, (1, 6)))
    assert set(trace.blocked) == {0, 1} and "soft" in trace.blocked[0]
    assert not trace._kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scaling_keeps_the_dtype_and_equals_zero_ablation(dtype: torch.dtype) -> None:
    model = tiny_hf("llama_gqa").to(dtype)
    ids = torch.randint(1, 120, (2, 7))
    with torch.no_grad():
        with ablate(model, [(LAYER, 2)]):
            ablated = logits_of(run_model(model, ids))
        with Trace(model, {"z": {LAYER: scale_head(2, 0.0)}}, read=["z", "q"], layers=[LAYER]) as trace:
            scaled = logits_of(run_model(model, ids))
    assert torch.equal(scaled, ablated)
    assert trace[LAYER]["z"].dtype == dtype and trace[LAYER]["q"].dtype == dtype
    assert torch.equal(trace[LAYER]["z"][:, :, 2], torch.zeros_like(trace[LAYER]["z"][:, :, 2]))


def test_a_trace_around_generate_equals_the_projection_scaled() -> None:
    """Decoding with a KV cache (queries fewer than keys) goes through the same points."""
    model = tiny_hf("llama_gqa")
    ids = torch.randint(1, 120, (1, 5))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), Trace(model, {"z": {LAYER: scale_head(1, 3.0)}}, read=["z"], layers=[LAYER]) as trace:
        steered = model.generate(ids, **options)
    assert trace[LAYER]["z"].shape[1] == 1  # the last step's one query
    projection = _projection(model)
    saved = projection.weight.detach().clone()
    with torch.no_grad():
        projection.weight[:, 16:32] *= 3
        by_weights = model.generate(ids, **options)
        projection.weight.copy_(saved)
    assert torch.equal(steered, by_weights)


def test_mha_points_equal_its_own_projections() -> None:
    """nn.MultiheadAttention: q, k, v are its in-projection's slices, z is its out_proj's input, and the pattern
    is its own (need_weights)."""
    model = planted_mha()
    ids = torch.randint(1, 20, (2, 8))
    attention = model.layers[LAYER].attn
    seen = {}
    handles = [model.layers[LAYER].register_forward_pre_hook(lambda m, args: seen.update(x=args[0])),
               attention.out_proj.register_forward_pre_hook(lambda m, args: seen.update(z=args[0]))]
    try:
        with torch.no_grad(), Trace(model, read=["q", "k", "v", "z", "pattern"], layers=[LAYER]) as trace:
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    read, heads = trace[LAYER], attention.num_heads
    for name, weight in zip("qkv", attention.in_proj_weight.chunk(3)):
        expected = (seen["x"] @ weight.T).view(2, 8, heads, -1)
        torch.testing.assert_close(read[name], expected, rtol=1e-5, atol=1e-5)
    pattern, z = _attention(read["q"], read["k"], read["v"])
    torch.testing.assert_close(read["pattern"], pattern, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(read["z"], z, rtol=1e-5, atol=1e-5)
    assert torch.equal(read["z"].flatten(2), seen["z"])

"""Captured attention equals the model's own eager attention, and capturing leaves the model unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf, tiny_loaded

from probe.hooks.capture import attention_hooks, capture_attention
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.heads.classify import score_heads
from probe.inputs import ProbeSet
from probe.heads.scores import SCORES

ARCHITECTURES = ["llama_gqa", "llama_mqa", "qwen2", "mistral", "gemma2", "gpt2", "gpt_bigcode", "bert"]


def eager_reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None):
    """The model's own eager attention via output_attentions, switched to eager and back."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            output = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        model.set_attn_implementation(saved)
    return output


@pytest.mark.parametrize("kind", ARCHITECTURES)
@pytest.mark.parametrize("padded", [False, True])
def test_capture_equals_eager(kind: str, padded: bool) -> None:
    model = tiny_hf(kind)
    torch.manual_seed(1)
    ids = torch.randint(1, 120, (3, 17))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, 12:] = 0
        mask[2, 5:] = 0
    reference = eager_reference(model, ids, mask)
    before = model.config._attn_implementation
    patterns = capture_attention(model, ids, mask, query_block=4)  # several query blocks per layer
    assert model.config._attn_implementation == before
    assert sorted(patterns) == list(range(model.config.num_hidden_layers))
    n_heads = model.config.num_attention_heads
    for layer, pattern in patterns.items():
        assert pattern.shape == (3, n_heads, 17, 17)  # query heads, also under grouped/multi-query attention
        expected = reference.attentions[layer]
        valid = torch.ones(3, 17, dtype=torch.bool) if mask is None else mask.bool()
        rows = valid[:, None, :, None].expand_as(pattern)  # padded query rows are not attention of any token
        assert (pattern - expected).abs()[rows].max() <= 1e-5


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_capture_leaves_outputs_and_model_unchanged(kind: str) -> None:
    model = tiny_hf(kind)
    ids = torch.randint(1, 120, (2, 11))
    with torch.no_grad():
        before = logits_of(run_model(model, ids))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    with torch.no_grad(), attention_hooks(model, {"pattern": lambda w, ctx: seen.append(ctx.layer)}):
        during = logits_of(run_model(model, ids))
    with torch.no_grad():
        after = logits_of(run_model(model, ids))
    assert seen == list(range(model.config.num_hidden_layers))
    assert (during - before).abs().max() <= 1e-5
    assert torch.equal(after, before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_hooks_restored_after_error() -> None:
    model = tiny_hf("llama_gqa")
    before = model.config._attn_implementation

    def fail(weights, ctx):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), attention_hooks(model, {"pattern": fail}):
        run_model(model, torch.randint(1, 120, (1, 5)))
    assert model.config._attn_implementation == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_blocked_equals_unblocked_scores() -> None:
    loaded = tiny_loaded("llama_gqa")
    ids = torch.randint(1, 120, (4, 40))
    probe_set = ProbeSet("natural", "test", ids, offset=1)
    names = [name for name, score in SCORES.items() if score.probe == "natural"]
    whole = score_heads(loaded, probe_set, names)
    blocked = score_heads(loaded, probe_set, names, query_block=3)
    for name in names:
        assert torch.allclose(whole[name], blocked[name], atol=1e-6)


@pytest.mark.parametrize("kind", ["llama_gqa", "bert"])
def test_padded_batch_scores_equal_one_by_one(kind: str) -> None:
    """Scores pool (sequence, query) pairs; a padded batch must pool exactly what its sequences give alone."""
    loaded = tiny_loaded(kind)
    torch.manual_seed(2)
    ids = torch.randint(1, 120, (3, 30))
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0
    mask[2, 9:] = 0
    padded = ProbeSet("natural", "test", ids, offset=1, attention_mask=mask)
    names = [name for name, score in SCORES.items() if score.probe == "natural"]
    batched = score_heads(loaded, padded, names, batch_size=3)
    one_by_one = score_heads(loaded, padded, names, batch_size=1)  # each batch is cut to its real length
    for name in names:
        assert torch.allclose(batched[name], one_by_one[name], atol=1e-5), name


def test_layers_found_in_call_order() -> None:
    model = tiny_hf("gpt2")
    layers = attention_layers(model)
    assert [layer.module for layer in layers] == [block.attn for block in model.transformer.h]
    assert all(layer.kind == "hf" and layer.n_heads == 4 for layer in layers)
    mqa = attention_layers(tiny_hf("llama_mqa"))
    assert [(layer.n_heads, layer.n_kv_heads) for layer in mqa] == [(4, 1), (4, 1)]


# ---------------------------------------------------------------------------------------------------------------
# issue 18: masks on custom models, interrupts inside clean-up


class MaskedAttention(torch.nn.Module):
    """Causal textbook attention without positions that honours a key mask (1 = token, 0 = padding)."""

    def __init__(self, d_model: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.W_qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.W_o = torch.nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in self.W_qkv(x).split(d, -1))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5  # (b, h, n, n)
        blocked = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        if mask is not None:  # padding keys are blocked, except for a pad query itself (no row without a key)
            blocked = blocked | (~mask.bool()[:, None, None, :] & ~torch.eye(n, dtype=torch.bool))
        weights = scores.masked_fill(blocked, float("-inf")).softmax(-1)
        return self.W_o((weights @ v).transpose(1, 2).reshape(b, n, d)), weights


class MaskedModel(torch.nn.Module):
    def __init__(self, takes_mask: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vocab_size = 50
        self.embed = torch.nn.Embedding(50, 32)
        self.layers = torch.nn.ModuleList([MaskedAttention(), MaskedAttention()])
        self.unembed = torch.nn.Linear(32, 50)
        if not takes_mask:
            self.forward = self.forward_ids_only  # type: ignore[method-assign]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x, attention_mask)[0]
        return self.unembed(x)

    def forward_ids_only(self, input_ids: torch.Tensor) -> torch.Tensor:
        return MaskedModel.forward(self, input_ids)


def test_custom_model_gets_the_mask_left_padding_changes_nothing() -> None:
    model = MaskedModel(takes_mask=True).eval()
    ids = torch.randint(1, 50, (1, 9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    plain = capture_attention(model, ids)
    left = capture_attention(model, padded, mask)
    assert sorted(plain) == sorted(left) == [0, 1]
    for layer in plain:
        assert (left[layer][:, :, 4:, 4:] - plain[layer]).abs().max() <= 1e-6
        assert left[layer][:, :, 4:, :4].abs().max() == 0  # no real token attends to the padding
    with torch.no_grad():
        assert (logits_of(run_model(model, padded, mask))[:, 4:] - logits_of(run_model(model, ids))).abs().max() <= 1e-5


def test_custom_model_without_a_mask_argument_refuses_padding() -> None:
    from probe.errors import ProbeError

    model = MaskedModel(takes_mask=False).eval()
    ids = torch.randint(1, 50, (2, 6))
    mask = torch.ones_like(ids)
    assert torch.equal(capture_attention(model, ids, mask)[0], capture_attention(model, ids)[0])  # no padding: fine
    mask[1, :2] = 0
    with pytest.raises(ProbeError, match="takes no attention_mask") as raised:
        capture_attention(model, ids, mask)
    assert raised.value.parameter == "attention_mask"


class _InterruptOnce:
    """Raise KeyboardInterrupt at the first line of the next call of a function named `name`: as a Ctrl-C landing
    inside that restoration step."""

    def __init__(self, name: str) -> None:
        self.name, self.fired = name, False

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_name == self.name and not self.fired:
            return self.line
        return None

    def line(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return self.line


def _hook_state(model: torch.nn.Module) -> list:
    from probe.hooks.hf import RECORDING, SEAT

    return [(name, "forward" in m.__dict__, "_probe_hooks" in m.__dict__, len(m._forward_hooks),
             len(m._forward_pre_hooks), SEAT in m.__dict__ or RECORDING in m.__dict__)
            for name, m in model.named_modules()]


@pytest.mark.parametrize(("kind", "step"), [("llama_gqa", "__setattr__"), ("planted_textbook", "remove"),
                                            ("planted_mha", "put_back")])
def test_second_interrupt_inside_restoration_leaves_the_model_whole(kind: str, step: str) -> None:
    import sys

    import planted

    model = tiny_hf(kind) if kind == "llama_gqa" else getattr(planted, kind)()
    ids = torch.randint(1, 120, (1, 7))
    config = getattr(model, "config", None)
    implementation = None if config is None else config._attn_implementation_internal
    with torch.no_grad():
        before = logits_of(run_model(model, ids))
    state = _hook_state(model)
    interrupt = _InterruptOnce(step)

    def first_interrupt(weights, ctx):
        sys.settrace(interrupt)  # the next restoration step is interrupted too
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt), attention_hooks(model, {"pattern": first_interrupt}):
            run_model(model, ids)
    finally:
        sys.settrace(None)
    assert interrupt.fired
    assert _hook_state(model) == state
    assert config is None or config._attn_implementation_internal == implementation
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(model, ids)), before)


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2"])
def test_handlers_are_told_their_context(kind: str) -> None:
    """Every handler is `fn(payload, ctx)`: the layer and point, a pattern block's first query, and the inputs the
    layer computes from (its mask, with the padded keys of row 1, and its head grouping)."""
    model = tiny_hf(kind)
    ids = torch.randint(1, 120, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    blocks: list = []
    heads: list = []

    def read(weights: torch.Tensor, ctx) -> None:
        blocks.append((ctx.point, ctx.layer, ctx.start, weights.shape[2]))

    def halve(z: torch.Tensor, ctx) -> torch.Tensor:
        attends = ctx.mask if ctx.mask.dtype == torch.bool else ctx.mask == 0
        heads.append((ctx.point, ctx.layer, ctx.group, bool(attends[0, 0, -1].all()),
                      bool(attends[1, 0, -1, 6:].any())))
        return z * 0.5

    with torch.no_grad(), attention_hooks(model, {"pattern": read, "z": halve}, query_block=4):
        halved = logits_of(run_model(model, ids, mask))
    with torch.no_grad():
        plain = logits_of(run_model(model, ids, mask))
    group = model.config.num_attention_heads // getattr(model.config, "num_key_value_heads",
                                                        model.config.num_attention_heads)
    assert blocks == [("pattern", layer, start, min(4, 9 - start)) for layer in (0, 1) for start in (0, 4, 8)]
    assert heads == [("z", layer, group, True, False) for layer in (0, 1)]
    assert not torch.equal(halved, plain)  # the writer's result is what the layer went on with


def test_blocked_point_and_kernel_configuration() -> None:
    """A layer whose `lse` cannot be had tells the `blocked` point why; where a backend serves it, the backend runs
    with the configuration given to attention_hooks (an argument, not an attribute of a handler)."""
    import planted
    from probe.kernels import DEFAULT_CONFIG, KernelConfig, using_backend
    from probe.kernels.cpu import CpuBackend

    reasons: list = []
    with torch.no_grad(), attention_hooks(planted.planted_textbook(), {
            "lse": lambda statistics, ctx: reasons.append("served"),
            "blocked": lambda reason, ctx: reasons.append((ctx.layer, reason))}):
        pass
    assert reasons == [(layer, "attention computed inside the module (custom layer)") for layer in (0, 1)]

    configs: list = []

    class Recording(CpuBackend):
        def run(self, call, config=DEFAULT_CONFIG):
            configs.append(config)
            return super().run(call, config)

    config = KernelConfig()
    kept: list = []
    model = tiny_hf("llama_gqa")
    with torch.no_grad(), using_backend(Recording()), attention_hooks(
            model, {"lse": lambda statistics, ctx: kept.append(ctx.layer)}, config=config):
        run_model(model, torch.randint(1, 120, (1, 6)))
    assert kept == [0, 1] and len(configs) == 2 and all(each is config for each in configs)
    assert config is not DEFAULT_CONFIG



"""Direct logit attribution (probe.dla): the decomposition sums to the model's own logit difference on every family,
heads' shares by source position sum to their shares, a head's share by hand, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, tiny_hf
from families import tiny_family
from probe.inputs import ContrastSet, contrast_task
from probe.dla import Targets, attribute, logit_attribution, next_token_attribution
from probe.errors import ProbeError
from probe.models import LoadedModel

IDENTITY = 1e-4


def _loaded(model: torch.nn.Module, name: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name=name, vocab_size=model.config.vocab_size)


def random_contrast(lengths: list[int], vocab: int = 120, seed: int = 0) -> ContrastSet:
    """Pairs of random ids of the given lengths, right-padded, the corrupt differing at one position."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    clean = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    clean = clean * mask
    corrupt = clean.clone()
    corrupt[:, 1] = (corrupt[:, 1] + 1) % vocab
    answer = torch.randint(3, vocab, (len(lengths),), generator=generator)
    return ContrastSet("random", "random ids", clean, corrupt, mask, answer, (answer + 7) % vocab)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "phi", "qwen2", "gemma", "falcon"])
def test_the_shares_sum_to_the_logit_difference(family) -> None:
    loaded = _loaded(tiny_family(family), family)
    contrast = random_contrast([9, 6, 11, 11, 4])
    result = logit_attribution(loaded, contrast, batch_size=2)
    assert result.residual < IDENTITY
    assert result.shares.model_score.abs().max() > 100 * IDENTITY  # not vacuous: the scores are not all ~0
    with torch.no_grad():
        logits = loaded.model(contrast.clean, attention_mask=contrast.mask).logits
    last = logits[torch.arange(len(contrast)), contrast.last]
    own = last[torch.arange(len(contrast)), contrast.answer] - last[torch.arange(len(contrast)), contrast.distractor]
    assert torch.allclose(result.shares.model_score, own.double(), atol=1e-5)  # the score is the model's own
    payload = result.to_dict()
    assert payload["identity"]["max_residual"] < IDENTITY and len(payload["heads"]) == 2 * 4
    if family != "falcon":  # transformers-interface models: shares by source position too
        positions = result.shares.head_positions
        assert torch.allclose(positions.sum(dim=-1), result.shares.heads, atol=1e-6)
        for point, length in enumerate([9, 6, 11, 11, 4]):
            assert float(positions[point, ..., length:].abs().sum()) == 0.0  # nothing from the padding (causal)


def test_the_biases_and_a_layernorm_bias_have_shares() -> None:
    """Phi has biases in its output projections, its final LayerNorm and its LM head (zero at initialisation:
    made random here, so that the identity needs their shares)."""
    model = tiny_family("phi")
    torch.manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
    result = logit_attribution(_loaded(model, "phi"), random_contrast([5, 7]))
    assert result.shares.attention_biases.abs().min() > 1e-3 and result.shares.final_bias.abs().min() > 1e-3
    assert result.residual < IDENTITY


def test_a_heads_share_by_hand_on_gpt2() -> None:
    """Head 2 of the last layer: its slice of c_proj's input times its rows of c_proj's weight, centred, divided by
    ln_f's std of the stream, times the gain, dotted with W_U[answer] - W_U[distractor]."""
    model = tiny_family("gpt2")
    contrast = random_contrast([8, 8])
    kept = {}
    block = model.transformer.h[-1]
    hooks = [block.attn.c_proj.register_forward_pre_hook(lambda _m, args: kept.__setitem__("z", args[0])),
             model.transformer.ln_f.register_forward_pre_hook(lambda _m, args: kept.__setitem__("x", args[0]))]
    with torch.no_grad():
        model(contrast.clean)
    for hook in hooks:
        hook.remove()
    head, dim = 2, 16
    z = kept["z"][:, -1, head * dim:(head + 1) * dim].double()
    written = z @ block.attn.c_proj.weight[head * dim:(head + 1) * dim].double()  # Conv1D: (in, out)
    x = kept["x"][:, -1].double()
    ln = model.transformer.ln_f
    scale = (x.var(dim=-1, unbiased=False) + ln.eps).rsqrt()
    normed = (written - written.mean(dim=-1, keepdim=True)) * scale[:, None] * ln.weight.double()
    unembed = model.lm_head.weight.double()
    expected = (normed * (unembed[contrast.answer] - unembed[contrast.distractor])).sum(dim=-1)
    result = logit_attribution(_loaded(model, "gpt2"), contrast)
    assert torch.allclose(result.shares.heads[:, -1, head], expected, atol=1e-6)


def test_next_token_attribution_sums_to_the_logit_of_the_next_token() -> None:
    loaded = _loaded(tiny_family("llama"), "llama")
    ids = torch.randint(3, 120, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    result = next_token_attribution(loaded, ids, mask, batch_size=2)
    assert len(result.tokens) == 9 + 6 + 9 and result.residual < IDENTITY
    with torch.no_grad():
        logits = loaded.model(ids, attention_mask=mask).logits
    assert float(result.shares.model_score[0]) == pytest.approx(float(logits[0, 0, ids[0, 1]]), abs=1e-5)


def test_soft_capped_logits_are_read_before_capping() -> None:
    model = tiny_family("llama")
    model.config.final_logit_softcapping = 3.0  # llama ignores it: the score must then be the head's output
    result = logit_attribution(_loaded(model, "llama"), random_contrast([6]))
    assert result.capped and result.residual < IDENTITY


@pytest.mark.parametrize(("model", "message"), [
    (lambda: tiny_family("bert"), "needs an LM head"),
    (lambda: tiny_hf("gemma2"), "block 0 adds more than its attention and MLP outputs"),
    (lambda: tiny_family("bloom"), "output is not its heads through its output projection"),
])
def test_models_it_cannot_decompose_are_refused_in_one_line(model, message) -> None:
    loaded = _loaded(model(), "tiny")
    with pytest.raises(ProbeError, match=message) as error:
        attribute(loaded, torch.randint(3, 100, (1, 5)), Targets(torch.tensor([0]), torch.tensor([4]),
                                                                   torch.tensor([5]), torch.tensor([6])))
    assert "\n" not in str(error.value)


def test_smollm2_on_ioi_pairs(smollm2) -> None:
    contrast = contrast_task(smollm2, "ioi", count=4)
    result = logit_attribution(smollm2, contrast, batch_size=4)
    assert result.residual < IDENTITY
    assert torch.allclose(result.shares.head_positions.sum(dim=-1), result.shares.heads, atol=1e-5)
    payload = result.to_dict()
    assert payload["logit_diff"] > 1.0 and payload["logit_diff"] > payload["logit_diff_corrupt"]
    top = payload["per_position"]["points"][0]
    assert top["tokens"][-1] == "␣to" and len(top["values"][0]) == len(top["tokens"])


def test_the_dla_command(smollm2, tmp_path, capsys, monkeypatch) -> None:
    path = tmp_path / "dla.json"
    code, out, err = run_cli(["dla", "--task", "ioi", "--count", "4", "--top", "3", "--json", str(path)], capsys,
                             monkeypatch)
    assert code == 0, err
    payload = json.loads(path.read_text())
    assert payload["identity"]["max_residual"] < IDENTITY and payload["points"] == 4
    top = payload["heads"][0]
    assert f"{top['layer']}.{top['head']}" in out and "largest |sum - model's own|" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "ioi", "--pairs", "x.jsonl"], "give --task or --pairs"),
    (["--pairs", "{bad}"], "line 1: clean is 2 tokens and corrupt 3"),
    (["--task", "nope"], "--task 'nope': this command compares clean and corrupt prompts"),
])
def test_the_dla_command_refuses_in_one_line(smollm2, tmp_path, capsys, monkeypatch, args, message) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"clean": "a b", "corrupt": "a b c", "answer": " x", "distractor": " y"}) + "\n")
    monkeypatch.setattr("probe.cli.dla.load", lambda *args, **kwargs: smollm2)  # the session's model, not a reload
    code, _, err = run_cli(["dla", *[str(bad) if arg == "{bad}" else arg for arg in args]], capsys, monkeypatch)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_the_top_heads_sources_name_their_positions() -> None:
    from probe.reports.dla import _sources

    tokens = ["<s>", "When", "␣Mary", "␣and", "␣Daniel"]
    payload = {"per_position": {"heads": [{"layer": 5, "head": 1}],
                                "points": [{"tokens": tokens, "values": [[0.1, 0.0, -0.4, 0.05, 1.713]]}]}}
    line = str(_sources(payload))
    assert line.startswith("5.1 by source position on the first pair ('<s>When␣Mary␣and␣Daniel'): ")
    assert line.endswith("'␣Daniel' at position 4 +1.713, '␣Mary' at position 2 -0.400, '<s>' at position 0 +0.100, "
                         "'␣and' at position 3 +0.050")

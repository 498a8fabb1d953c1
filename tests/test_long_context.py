"""Long context: attention computed in query blocks gives the same scores and patterns as the unchunked computation
and as Hugging Face's eager attention; causal blocks skip the keys after their last query without changing a
number; a forward that only reads attention does not compute the full logits."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf, tiny_loaded

import probe.hooks.blocked as blocked
import probe.hooks.hf as hf
from probe.hooks.blocked import blocked_attention
from probe.hooks.capture import attention_hooks, capture_attention
from probe.hooks.run import run_model
from probe.inputs import ProbeSet
from probe.heads.accumulate import ScoreAccumulator
from probe.heads.classify import score_heads
from probe.heads.scores import SCORES, Batch, positional_score

LENGTH = 200  # long enough for several causal blocks (CAUSAL_BLOCK = 128 rows would give 2; small blocks more)


def _sets(loaded, length: int = LENGTH, num: int = 2):
    torch.manual_seed(3)
    vocab = loaded.vocab_size
    natural = ProbeSet("natural", "random", torch.randint(1, vocab, (num, length)), 1)
    half = torch.randint(1, vocab, (num, (length - 1) // 2))
    repeated = ProbeSet("repeated", "repeated", torch.cat([torch.zeros(num, 1, dtype=torch.long), half, half], 1), 1,
                        repeat_len=half.shape[1])
    return natural, repeated


def _scores(loaded, query_block: int | None) -> dict[str, torch.Tensor]:
    natural, repeated = _sets(loaded)
    names = [name for name, score in SCORES.items() if score.probe == "natural"]
    out = score_heads(loaded, natural, names, batch_size=2, query_block=query_block)
    out.update(score_heads(loaded, repeated, ["induction", "duplicate_token"], batch_size=2,
                           query_block=query_block))
    return out


def _eager_scores(loaded) -> dict[str, torch.Tensor]:
    """The same scores reduced from Hugging Face's own eager attention (output_attentions=True), one block."""
    model = loaded.model
    natural, repeated = _sets(loaded)
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    out = {}
    try:
        for probe_set, names in ((natural, [n for n, s in SCORES.items() if s.probe == "natural"]),
                                 (repeated, ["induction", "duplicate_token"])):
            with torch.no_grad():
                attentions = model(input_ids=probe_set.input_ids, output_attentions=True, use_cache=False).attentions
            accumulator = ScoreAccumulator(names, len(attentions), attentions[0].shape[1])
            accumulator.batch = Batch(torch.ones_like(probe_set.input_ids, dtype=torch.bool), probe_set.offset,
                                      probe_set.repeat_len)
            for layer, weights in enumerate(attentions):
                accumulator.update(layer, 0, weights.float())
            out.update(accumulator.result())
    finally:
        model.set_attn_implementation(saved)
    return out


@pytest.mark.parametrize("kind", ["llama_gqa", "llama_mqa", "gpt2", "gemma2"])
def test_chunked_scores_equal_unchunked_and_eager(kind: str) -> None:
    loaded = tiny_loaded(kind)
    unchunked = _scores(loaded, query_block=LENGTH)  # one block: the full (heads x n x n) matrix at once
    default = _scores(loaded, query_block=None)  # causal blocks, later keys skipped
    small = _scores(loaded, query_block=7)  # many blocks, the last one short
    eager = _eager_scores(loaded)
    for name in unchunked:
        assert (default[name] - unchunked[name]).abs().max() <= 1e-6, name
        assert (small[name] - unchunked[name]).abs().max() <= 1e-6, name
        assert (small[name] - eager[name]).abs().max() <= 1e-5, name


def test_block_budget_bounds_every_block(monkeypatch) -> None:
    """With a tiny BLOCK_BYTES every block handed out fits it, and the patterns still equal eager attention."""
    loaded = tiny_loaded("llama_gqa")
    model = loaded.model
    ids = torch.randint(1, 120, (2, LENGTH))
    budget = 2 * 4 * LENGTH * 4 * 10  # ten query rows of (batch 2 x heads 4 x keys) float32
    monkeypatch.setattr(blocked, "BLOCK_BYTES", budget)
    sizes = []
    with torch.no_grad(), attention_hooks(model, {"pattern": lambda w, ctx: sizes.append(w.shape)}):
        run_model(model, ids)
    assert sizes and all(s[2] * s[0] * s[1] * s[3] * 4 <= budget for s in sizes)
    assert all(s[3] == LENGTH for s in sizes)  # every block covers all keys, later ones as zeros
    patterns = capture_attention(model, ids)
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            reference = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(saved)
    for layer, pattern in patterns.items():
        assert (pattern - reference[layer]).abs().max() <= 1e-5


def test_blocked_attention_matches_reference_with_masks_and_offsets() -> None:
    """The function itself: GQA folding, causal truncation with queries at the end of the keys (a KV prefix),
    boolean and additive masks, softcap; outputs and weights against a direct computation."""
    torch.manual_seed(0)
    b, hq, hk, n, kv, d = 2, 6, 2, 37, 45, 8
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hk, kv, d), torch.randn(b, hk, kv, d)
    causal = torch.ones(n, kv, dtype=torch.bool).tril(kv - n)
    additive = torch.randn(b, 1, n, kv)
    for mask, is_causal, softcap in ((None, True, None), (None, False, None), (causal[None, None], False, None),
                                     (additive, False, None), (None, True, 5.0)):
        kr, vr = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        scores = q @ kr.transpose(-1, -2) * d**-0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if is_causal:
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        elif mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        elif mask is not None:
            scores = scores + mask
        expected_weights = scores.softmax(-1)
        expected = expected_weights @ vr
        for block in (None, 1, 5, n):
            seen = []
            out = blocked_attention(q, k, v, scaling=None, mask=mask, causal=is_causal, softcap=softcap,
                                    on_block=lambda start, w: seen.append((start, w.clone())), query_block=block)
            weights = torch.cat([w for _, w in seen], dim=2)
            assert weights.shape == (b, hq, n, kv)
            assert (weights - expected_weights).abs().max() <= 1e-6
            assert (out - expected).abs().max() <= 1e-5


def _positional_reference(weights, start, batch):
    """positional_score as first written, with argmax: the fast version must give exactly these numbers."""
    _b, h, block, n_keys = weights.shape
    queries = torch.arange(start, start + block)
    top = weights.argmax(dim=-1)
    valid = batch.valid
    results = []
    for shift in (-1, 1):
        keys = queries + shift
        ok = (keys >= 0) & (keys < n_keys)
        selected = ok[None, :] & valid[:, start:start + block] & valid[:, keys.clamp(0, n_keys - 1)]
        hit = (top == keys.view(1, 1, block)) & selected[:, None, :]
        results.append((hit.sum(dim=(0, 2)).double(), selected.sum().double().expand(h)))
    return torch.stack([results[0][0], results[1][0]]), torch.stack([results[0][1], results[1][1]])


def test_positional_score_equals_argmax_definition_with_ties_and_nan() -> None:
    torch.manual_seed(0)
    b, h, n = 2, 3, 16
    weights = torch.rand(b, h, n, n).softmax(-1)
    weights[0, 0, 5, :] = 0
    weights[0, 0, 5, [2, 4]] = 0.5  # tie: the earlier key wins, so not i-1
    weights[0, 1, 7, :] = 0
    weights[0, 1, 7, [6, 9]] = 0.5  # tie with i-1 first: i-1 wins
    weights[1, 2, :, :] = 1 / n  # all equal: key 0 wins everywhere
    weights[1, 0, 3, :] = weights[1, 0, 3, 2]  # row of ties on i-1
    for i in range(1, n):
        weights[0, 2, i, :] = 0
        weights[0, 2, i, i - 1] = 1  # a true previous-token head
    weights[1, 1, 9, 11] = float("nan")
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, 12:] = False
    batch = Batch(valid, 1, None)
    for start, stop in ((0, n), (0, 6), (6, 16), (3, 4)):
        block = weights[:, :, start:stop]
        got = positional_score(block, start, batch)
        expected = _positional_reference(block, start, batch)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (start, stop)


def test_scores_of_truncated_blocks_equal_their_definitions() -> None:
    """Blocks handed out by causal attention (keys after the block's last query never computed, zeros) with exact
    ties (a head whose query is zero attends uniformly): the positional score equals argmax on the full-width block,
    the diagonal scores equal A[i, i + shift] read one entry at a time."""
    torch.manual_seed(1)
    b, hq, hk, n, d = 2, 6, 2, 45, 8
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
    q[:, 1] = 0  # uniform rows: every key ties with the maximum
    k[:, :, 7] = k[:, :, 6]  # keys 6 and 7 equal: rows tie between a neighbour and another key
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, 40:] = False
    batch = Batch(valid, 1, None)
    seen = []

    def check(start: int, weights: torch.Tensor) -> None:
        seen.append(blocked.keys_computed(weights))
        untouched = weights.clone()
        got = positional_score(weights, start, batch)
        assert torch.equal(weights, untouched)  # the block is read, never changed
        expected = _positional_reference(weights, start, batch)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), start
        for shift in (-1, 1):
            sums, counts = SCORES["previous_token"].reduce(weights, start, batch) if shift == -1 else \
                SCORES["next_token"].reduce(weights, start, batch)
            rows = [(s, i) for s in range(b) for i in range(start, start + weights.shape[2])
                    if 0 <= i + shift < n and valid[s, i] and valid[s, i + shift]]
            expected_sums = sum((weights[s, :, i - start, i + shift].double() for s, i in rows), torch.zeros(hq,
                                dtype=torch.float64))
            assert torch.allclose(sums, expected_sums, atol=1e-6) and int(counts[0]) == len(rows)

    with torch.no_grad():
        for block in (4, 16, n):
            blocked_attention(q, k, v, scaling=None, mask=None, causal=True, on_block=check, query_block=block)
    assert min(seen) < n  # truncated blocks were handed out


def test_blocked_attention_under_autograd_gives_gradients() -> None:
    """With inputs that need gradients the reused buffers (out= arguments record no gradients) are not used: the
    output and its gradient equal the direct computation's."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 4, 20, 8, requires_grad=True), torch.randn(1, 2, 20, 8, requires_grad=True),
               torch.randn(1, 2, 20, 8, requires_grad=True))
    blocks = []
    out = blocked_attention(q, k, v, scaling=None, mask=None, causal=True, query_block=6,
                            on_block=lambda start, w: blocks.append(w.detach().clone()))
    out.sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kr.transpose(-1, -2) * 8**-0.5).masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(),
                                                               torch.finfo(torch.float32).min)
    expected = scores.softmax(-1) @ vr
    expected.sum().backward()
    assert (out - expected).abs().max() <= 1e-5
    assert all((a - t.grad).abs().max() <= 1e-5 for a, t in zip(got, (q, k, v)))
    assert (torch.cat(blocks, dim=2) - scores.softmax(-1)).abs().max() <= 1e-6


def test_attention_only_forward_skips_the_full_logits() -> None:
    model = tiny_hf("llama_gqa")
    ids = torch.randint(1, 120, (2, 30))
    with torch.no_grad():
        full = run_model(model, ids).logits
        last = run_model(model, ids, logits=False).logits
    assert full.shape == (2, 30, 120) and last.shape == (2, 1, 120)
    assert (last[:, 0] - full[:, -1]).abs().max() <= 1e-5
    bert = tiny_hf("bert")  # no logits_to_keep: runs as before
    with torch.no_grad():
        assert run_model(bert, ids, logits=False).last_hidden_state.shape == (2, 30, 64)


def test_unpadded_causal_batch_builds_no_mask() -> None:
    """Without padding, probe_sdpa hands attention no (b, 1, n, n) mask: causality is applied per block."""
    model = tiny_hf("llama_gqa")
    masks = []
    original = hf._hf_weights_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return original(module, query, key, value, attention_mask, **kwargs)

    hf._hf_weights_attention = spy
    try:
        with torch.no_grad(), attention_hooks(model, {"pattern": lambda *a: None}):
            run_model(model, torch.randint(1, 120, (2, 50)))
    finally:
        hf._hf_weights_attention = original
    assert masks and all(mask is None for mask in masks)


@pytest.mark.parametrize("mode", ["exact", "naive"])
def test_ablation_sweep_with_chunked_logits_equals_full_logits(monkeypatch, mode: str) -> None:
    """Long-context sweeps never hold the full logits: the loss comes from the last block's output, the model's head
    run on a few positions at a time. Forced here on a tiny model; the numbers must not change."""
    import probe.ablation as ablate
    from probe.ablation import blocks as readouts

    loaded = tiny_loaded("llama_gqa")
    natural, repeated = _sets(loaded, length=40, num=3)
    heads = [(0, 0), (0, 3), (1, 1), (1, 2)]
    for probe_set in (natural, repeated):
        full = ablate.sweep(loaded, probe_set, heads, mode=mode, batch_size=2)
        monkeypatch.setattr(readouts, "LOGITS_BYTES", 0)
        monkeypatch.setattr(readouts, "LOGITS_CHUNK_BYTES", 2 * 2 * 120 * 4 * 7)  # 7 positions a chunk
        calls = []
        original = readouts.Final.logits
        monkeypatch.setattr(readouts.Final, "logits", lambda self, positions: calls.append(len(positions))
                            or original(self, positions))
        chunked = ablate.sweep(loaded, probe_set, heads, mode=mode, batch_size=2)
        monkeypatch.undo()
        assert calls and max(calls) < probe_set.input_ids.shape[1] - 1  # the lean path ran, in chunks
        assert chunked.path == full.path
        assert abs(chunked.baseline_loss - full.baseline_loss) <= 1e-6
        for a, b in zip(full.results, chunked.results):
            assert a.heads == b.heads
            assert abs(a.loss - b.loss) <= 1e-6
            for name in a.parts:
                assert abs(a.parts[name] - b.parts[name]) <= 1e-6

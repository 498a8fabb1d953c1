"""Scores from the fused statistics (probe/accel/ reading probe/kernels/' records): the fast path equals the blocked
path (the reference) on every family where it applies, with padding, on sliding-window layers and on the real default
model; where a layer's logits cannot be rebuilt, the result's path says so and the numbers are the blocked path's.
Each stage of the CPU backend's staged search is forced at short lengths through its SearchConfig
(`CpuBackend(search=...)`) and counted through its public stage method."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from torch import Tensor
from conftest import tiny_hf, tiny_loaded
from families import ADAPTED, FAMILY_MODELS, tiny_family

import probe.accel.accumulate as accumulate
import probe.heads.scores as scores
from probe.accel import ACCELERATORS, Diagonal, register_accelerator
from probe.accel.classes import positional_from_lse, streaming_from_lse
from probe.hooks.capture import attention_hooks, capture_attention
from probe.hooks.run import run_model
from probe.inputs import ProbeSet
from probe.errors import ProbeError
from probe.heads.classify import score_heads
from probe.heads.scores import SCORES, Batch, Score, diagonal_mass, register_score, streaming_score
from probe.heads.classify import HeadScores
from probe.kernels import DEFAULT_CONFIG, DEFAULT_SEARCH, CpuBackend, KernelConfig, SearchConfig, StagedSearch, Weights
from probe.kernels.base import using_backend
from probe.kernels.cpu import cpu_statistics
from probe.models import LoadedModel

TOLERANCE = 1e-5


def _searched(loaded: LoadedModel, probe_set: ProbeSet, names: list[str], search: SearchConfig = DEFAULT_SEARCH,
              config: KernelConfig = DEFAULT_CONFIG, batch_size: int = 3) -> HeadScores:
    """score_heads on the fast path, the CPU backend searching row maxima with `search`."""
    with using_backend(CpuBackend(search)):
        return score_heads(loaded, probe_set, names, batch_size=batch_size, config=config)


def _cpu_weights(query: Tensor, key: Tensor, scaling: float, lse: Tensor, search: SearchConfig = DEFAULT_SEARCH,
                 config: KernelConfig = DEFAULT_CONFIG) -> Weights:
    """The weights of a plain causal CPU record of these queries and keys, its search tuned by `search`."""
    return Weights(cpu_statistics(query, key, None, scaling, True, lse, config, StagedSearch(search)))


def _padded_sets(vocab: int, length: int = 40, num: int = 3) -> tuple[ProbeSet, ProbeSet]:
    """A natural and a repeated set with right padding (rows of three lengths)."""
    torch.manual_seed(0)
    ids = torch.randint(1, vocab, (num, length))
    mask = torch.ones_like(ids)
    mask[1, 30:], mask[2, 12:] = 0, 0
    half = torch.randint(1, vocab, (num, (length - 1) // 2))
    repeated = torch.cat([torch.zeros(num, 1, dtype=torch.long), half, half], dim=1)
    repeated_mask = torch.ones_like(repeated)
    repeated_mask[1, 25:] = 0
    return (ProbeSet("natural", "random", ids, 1, attention_mask=mask),
            ProbeSet("repeated", "random, repeated", repeated, 1, repeat_len=half.shape[1],
                     attention_mask=repeated_mask))


def _both_paths(loaded: LoadedModel, probe_sets: tuple[ProbeSet, ...]) -> tuple[dict, dict, set[str]]:
    fast, blocked, paths = {}, {}, set()
    for probe_set in probe_sets:
        names = [name for name, score in SCORES.items()  # a class without an accelerator has no other path to match
                 if score.probe == probe_set.name and name in ACCELERATORS]
        lse = score_heads(loaded, probe_set, names, batch_size=2)
        fast.update(lse)
        paths.add(lse.path)
        blocked.update(score_heads(loaded, probe_set, names, batch_size=2, path="blocked"))
    return fast, blocked, paths


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_fast_path_equals_blocked_on_every_family_with_padding(name: str) -> None:
    loaded = LoadedModel(model=tiny_family(name), tokenizer=None, name=name, vocab_size=120)
    fast, blocked, paths = _both_paths(loaded, _padded_sets(120))
    for score in fast:
        assert (fast[score] - blocked[score]).abs().max() <= TOLERANCE, score
    if name in ADAPTED:  # their attention is computed inside the module: the blocked path, said so
        assert all(path.startswith("blocked at layers 0, 1: attention computed inside the module") for path in paths)
    else:
        assert paths == {"cpu"}


def _gemma3(sliding_window: int) -> LoadedModel:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=4096, sliding_window=sliding_window,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = tf.Gemma3ForCausalLM(config).eval()
    return LoadedModel(model=model, tokenizer=None, name="tiny-gemma3", vocab_size=120)


def test_sliding_window_layers_of_gemma3_at_2048_tokens() -> None:
    """Gemma-3's sliding-window layers hand the fused kernel their mask; the rebuilt weights follow it."""
    loaded = _gemma3(sliding_window=64)
    torch.manual_seed(1)
    half = torch.randint(1, 120, (1, 1023))
    repeated = ProbeSet("repeated", "random", torch.cat([torch.zeros(1, 1, dtype=torch.long), half, half], 1), 1,
                        repeat_len=1023)
    natural = ProbeSet("natural", "random", torch.randint(1, 120, (1, 2048)), 1)
    fast, blocked, paths = _both_paths(loaded, (natural, repeated))
    assert paths == {"cpu"}
    for score in fast:
        assert (fast[score] - blocked[score]).abs().max() <= TOLERANCE, score
    assert float(blocked["induction"][0].max()) < 1e-6  # the earlier copy lies outside a 64-key window
    fast_padded, blocked_padded, _ = _both_paths(loaded, _padded_sets(120))
    for score in fast_padded:
        assert (fast_padded[score] - blocked_padded[score]).abs().max() <= TOLERANCE, score


@pytest.mark.slow
def test_default_model_past_the_band_threshold(smollm2, monkeypatch) -> None:
    """SmolLM2 with more keys than the default search's `band_from` (1024), so that its every stage at this length
    (the rivals, the band, whole rows) meets the real model's rows (the band's counted): both probe sets past it."""
    length = DEFAULT_SEARCH.band_from + 256
    torch.manual_seed(2)
    half = torch.randint(100, smollm2.vocab_size, (1, (length - 1) // 2))
    bos = torch.tensor([[smollm2.tokenizer.bos_token_id]])
    repeated = ProbeSet("repeated", "random", torch.cat([bos, half, half], 1), 1, repeat_len=half.shape[1])
    text = torch.randint(100, smollm2.vocab_size, (1, length - 1))
    natural = ProbeSet("natural", "random", torch.cat([bos, text], 1), 1)
    assert min(repeated.input_ids.shape[1], natural.input_ids.shape[1]) > DEFAULT_SEARCH.band_from
    banded: list[int] = []
    band = StagedSearch.band_stage
    monkeypatch.setattr(StagedSearch, "band_stage", lambda self, weights, found, shift:
                        banded.append(len(found)) or band(self, weights, found, shift))
    fast, blocked, paths = _both_paths(smollm2, (natural, repeated))
    assert paths == {"cpu"} and sum(banded) > 0
    for score in fast:
        assert (fast[score] - blocked[score]).abs().max() <= TOLERANCE, score
    assert float(fast["induction"].max()) > 0.5  # real induction heads, found on the fast path


def test_positional_rows_the_band_cannot_decide_are_settled_exactly(monkeypatch) -> None:
    """With a band of the neighbours only (keys i - 1 .. i + 1), most rows go to the exact row maximum; the numbers
    do not change."""
    loaded = tiny_loaded("llama_gqa")
    natural, _ = _padded_sets(120, length=64)
    blocked = score_heads(loaded, natural, ["positional"], batch_size=3, path="blocked")
    settled: list[int] = []
    settle = StagedSearch.settle_stage
    monkeypatch.setattr(StagedSearch, "settle_stage", lambda self, weights, found, shift:
                        settled.append(len(found)) or settle(self, weights, found, shift))
    fast = _searched(loaded, natural, ["positional"], replace(DEFAULT_SEARCH, positional_band=2))
    assert sum(settled) > 100
    assert torch.equal(fast["positional"], blocked["positional"])


def _near_slices(search: SearchConfig, span: int, before: int) -> SearchConfig:
    """Stages 2 and 4 at any length, with near slices of `span` positions and `before` earlier keys."""
    return replace(search, band_from=0, near_from=0, near_span=span, near_before=before)


@pytest.mark.parametrize("stages", ["band", "near", "one_head_at_a_time", "no_rivals"])
def test_every_stage_of_the_positional_fast_path_equals_blocked(monkeypatch, stages: str) -> None:
    """Stage 2 (the gathered band) and stage 3 (the near keys: slices of 16 positions and the 8 keys before them,
    behind a band of the neighbours only), forced at short lengths, the whole rows one key/value head at a time, and
    a stage 1 without rivals (most rows go on): each gives the blocked path's numbers exactly."""
    loaded = tiny_loaded("llama_gqa")
    natural, _ = _padded_sets(120, length=64)
    blocked = score_heads(loaded, natural, ["positional"], batch_size=3, path="blocked")
    config, search = DEFAULT_CONFIG, DEFAULT_SEARCH
    if stages in ("band", "near"):
        search = _near_slices(search, 16, 8)
    if stages == "near":  # a band of the neighbours only: most rows it leaves open go to the near keys
        search = replace(search, positional_band=2)
    if stages == "one_head_at_a_time":
        config = replace(config, rows_at_once=0)
    if stages == "no_rivals":
        search = replace(search, positional_rivals=())
    decided: dict[str, list[int]] = {"band_stage": [], "near_stage": []}
    for stage in decided:
        def counting(self, weights, found, shift, original=getattr(StagedSearch, stage), stage=stage):  # noqa: B008
            hits, still_open = original(self, weights, found, shift)
            decided[stage].append(len(found) - len(still_open))
            return hits, still_open

        monkeypatch.setattr(StagedSearch, stage, counting)
    fast = _searched(loaded, natural, ["positional"], search, config)
    assert torch.equal(fast["positional"], blocked["positional"])
    assert (sum(decided["band_stage"]) > 20) == (stages == "band")  # the forced stage decides rows
    assert (sum(decided["near_stage"]) > 20) == (stages == "near")


@pytest.mark.parametrize("batch_size", [1, 3])
def test_positional_witnesses_stage_equals_blocked(monkeypatch, batch_size: int) -> None:
    """Stage 3 (the first and the longest keys as witnesses that beat the neighbour), forced at short lengths behind
    a band of the neighbours only: it decides rows, and the numbers equal the blocked path's exactly, with padding
    (an additive mask) and without (causal)."""
    loaded = tiny_loaded("llama_gqa")
    natural, _ = _padded_sets(120, length=64)
    blocked = score_heads(loaded, natural, ["positional"], batch_size=batch_size, path="blocked")
    search = replace(DEFAULT_SEARCH, positional_band=2, witnesses_from=0, first_keys=4, longest_keys=4)
    decided, masked = [], []
    witnesses = StagedSearch.witness_stage

    def counting(self, weights, found, shift):
        still_open = witnesses(self, weights, found, shift)
        decided.append(len(found) - len(still_open))
        masked.append(weights.bias is not None)
        return still_open

    monkeypatch.setattr(StagedSearch, "witness_stage", counting)
    fast = _searched(loaded, natural, ["positional"], search, batch_size=batch_size)
    assert torch.equal(fast["positional"], blocked["positional"])
    assert sum(decided) > 20
    assert any(masked) == (batch_size > 1)


def test_beaten_by_witnesses_agrees_with_whole_rows() -> None:
    """A row is beaten only where a visible witness (one of the first keys or the longest, not the key itself) has a
    larger logit, and surely where one has a clearly larger logit."""
    torch.manual_seed(3)
    query, key = torch.randn(2, 4, 50, 8), torch.randn(2, 2, 50, 8)
    key[:, :, 30] *= 5  # the longest key of each head: a witness though it is not among the first
    attention = _cpu_weights(query, key, 0.3, torch.zeros(2, 4, 50))
    found = torch.cartesian_prod(torch.arange(2), torch.arange(4), torch.arange(1, 50))  # (b, h, query)
    keys = found[:, 2] - 1
    beaten = StagedSearch().beaten_by_witnesses(attention, found, keys, 3, 1)
    logits = torch.matmul(query, key.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3  # (b, h, n, n)
    rows = logits[found[:, 0], found[:, 1], found[:, 2]]  # (k, n)
    witness = torch.zeros(len(found), 50, dtype=torch.bool)
    witness[:, [0, 1, 2, 30]] = True
    witness &= torch.arange(50) <= found[:, 2:3]  # causal
    witness[torch.arange(len(found)), keys] = False
    best = rows.masked_fill(~witness, float("-inf")).amax(dim=-1)
    own = rows[torch.arange(len(found)), keys]
    assert not bool((beaten & (best <= own)).any())
    assert bool(beaten[best > own + 0.01].all())
    assert 50 < int(beaten.sum()) < len(found)


@pytest.mark.parametrize("stages", ["whole rows", "band and near"])
def test_layers_read_in_groups_equal_each_layer_alone(monkeypatch, stages: str) -> None:
    """Short unpadded inputs: the accumulator reads the layer calls of a batch together (side_by_side: one call,
    their heads side by side, each still reading its own key/value head); every score equals the layer-by-layer
    reading, and positional the blocked path's, exactly."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256)).eval()
    loaded = LoadedModel(model=model, tokenizer=None, name="tiny", vocab_size=120)
    torch.manual_seed(5)
    half = torch.randint(1, 120, (3, 31))
    repeated = ProbeSet("repeated", "random", torch.cat([torch.zeros(3, 1, dtype=torch.long), half, half], 1), 1,
                        repeat_len=31)
    natural = ProbeSet("natural", "random", torch.randint(1, 120, (3, 64)), 1)
    search = _near_slices(DEFAULT_SEARCH, 16, 8) if stages == "band and near" else DEFAULT_SEARCH
    groups: list[int] = []
    flush = accumulate.FusedAccumulator.flush
    monkeypatch.setattr(accumulate.FusedAccumulator, "flush",
                        lambda self: groups.append(len(self.pending)) or flush(self))
    assert not ACCELERATORS["sep"].layers_at_once  # read each layer call alone: the others still read groups
    for probe_set in (natural, repeated):
        names = [name for name, score in SCORES.items() if score.probe == probe_set.name and score.by_default]
        grouped = _searched(loaded, probe_set, names, search)
        alone = _searched(loaded, probe_set, names, search, replace(DEFAULT_CONFIG, group_bytes=0))
        for name in names:
            assert torch.allclose(grouped[name], alone[name], rtol=0, atol=1e-6), name
        assert max(groups) == 5, probe_set.name  # every layer of a batch in one group, then one at a time
        groups.clear()
    blocked = score_heads(loaded, natural, ["positional"], batch_size=3, path="blocked")
    assert torch.equal(score_heads(loaded, natural, ["positional"], batch_size=3)["positional"],
                       blocked["positional"])


def _causal_logits(query: Tensor, key: Tensor, scaling: float) -> Tensor:
    """(b, hq, n, n) scaled logits of grouped-query heads, later keys at -inf: what argmax is asked of."""
    n = query.shape[2]
    logits = torch.matmul(query, key.repeat_interleave(query.shape[1] // key.shape[1], dim=1).transpose(-1, -2))
    return (logits * scaling).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


BOUNDED = replace(DEFAULT_SEARCH, bounds_on_cpu=True, bounds_from=0)
"""Whole rows bounded first (bfloat16) at any length and on any CPU,"""
ONE_HEAD = replace(DEFAULT_CONFIG, rows_at_once=0)
"""one key/value head at a time."""


def _bounded_rows(monkeypatch) -> dict[str, int]:
    """Counts the rows the bounds were asked about and those they left unsure."""
    counted = {"rows": 0, "unsure": 0}
    bounded = StagedSearch.bounded_tops

    def counting(self, *args):
        top, unsure = bounded(self, *args)
        counted["rows"] += len(top)
        counted["unsure"] += int(unsure.sum())
        return top, unsure

    monkeypatch.setattr(StagedSearch, "bounded_tops", counting)
    return counted


def test_bounded_whole_rows_equal_blocked(monkeypatch) -> None:
    """Whole rows bounded in bfloat16 first (forced at a short length): the bounds decide most rows, the float32
    logits of the few keys whose bound reaches the neighbour's (CANDIDATES) most of the rest, and the positional
    scores equal the blocked path's exactly, with those keys read or not."""
    loaded = tiny_loaded("llama_gqa")
    tokens = torch.randint(1, 120, (3, 64), generator=torch.Generator().manual_seed(2))
    natural = ProbeSet("natural", "random", tokens, 1)
    blocked = score_heads(loaded, natural, ["positional"], batch_size=3, path="blocked")
    counted = _bounded_rows(monkeypatch)
    search = replace(BOUNDED, positional_band=2, positional_rivals=())  # most rows go on to the whole rows
    unsure = {}
    for candidates in (-1, DEFAULT_SEARCH.candidates):  # -1: no key's logit read, every row the bounds leave goes whole
        counted.update(rows=0, unsure=0)
        fast = _searched(loaded, natural, ["positional"], replace(search, candidates=candidates), ONE_HEAD)
        assert torch.equal(fast["positional"], blocked["positional"]), candidates
        unsure[candidates] = counted["unsure"]
    assert counted["rows"] > 500 and 0 < unsure[-1] < counted["rows"] / 2
    assert unsure[DEFAULT_SEARCH.candidates] < unsure[-1]


@pytest.mark.parametrize("stage", ["whole rows", "near", "bounds"])
def test_positional_fast_path_breaks_ties_as_argmax(monkeypatch, stage: str) -> None:
    """Keys that copy the neighbour's key tie with it exactly: the earliest maximum wins, as argmax says, on every
    stage (stage 1 rivals, the near keys (forced: slices of 8 positions and 4 keys before), the whole rows, bounded
    in bfloat16 first or not)."""
    search = _near_slices(DEFAULT_SEARCH, 8, 4) if stage == "near" else BOUNDED if stage == "bounds" else DEFAULT_SEARCH
    config = ONE_HEAD if stage == "bounds" else DEFAULT_CONFIG
    counted = _bounded_rows(monkeypatch) if stage == "bounds" else {"rows": 1}
    torch.manual_seed(3)
    b, hq, hk, n, d = 2, 4, 2, 40, 8
    query, key = torch.randn(b, hq, n, d), torch.randn(b, hk, n, d)
    key[:, :, 10:20] = key[:, :, 9:19].clone()  # key j = key j - 1: ties between neighbours and rivals
    key[:, :, 30] = key[:, :, 2]  # a far copy: only the whole row sees it
    logits = _causal_logits(query, key, 0.5)
    attention = _cpu_weights(query, key, 0.5, torch.logsumexp(logits, dim=-1), search, config)
    batch = Batch(valid=torch.ones(b, n, dtype=torch.bool), offset=1, repeat_len=None)
    sums, counts = positional_from_lse(attention, batch)
    top = logits.argmax(dim=-1)[..., 1:]  # queries 1 .. n - 1, neighbour i - 1
    assert torch.equal(sums[0], (top == torch.arange(n - 1)).sum(dim=(0, 2)).double())
    assert torch.equal(sums[1], torch.zeros(hq, dtype=torch.float64))  # the next key is causally hidden
    assert torch.equal(counts[0], torch.full((hq,), float(b * (n - 1)), dtype=torch.float64))
    assert counted["rows"] > 0  # the whole rows were asked (bounded first where the stage says so)


def test_bounded_rows_read_only_the_keys_a_row_sees(monkeypatch) -> None:
    """Rows close to a tie (neighbouring keys close), bounded: the float32 logits of the keys whose bound reaches a
    row's key never include keys the row may not see (causally hidden) or the key itself, and each row's answer is
    argmax's, with those keys read or every unsure row whole."""
    counted = _bounded_rows(monkeypatch)
    torch.manual_seed(5)
    b, hq, hk, n, d = 1, 4, 2, 64, 8
    query, drift = torch.randn(b, hq, n, d), torch.randn(b, hk, n, d)
    key = torch.cumsum(drift * 0.05, dim=2) + torch.randn(b, hk, 1, d)  # neighbouring keys close: close calls
    logits = _causal_logits(query, key, 0.5)
    rows, unsure = torch.arange(1, n).repeat(hq // hk), {}
    for candidates in (-1, DEFAULT_SEARCH.candidates):  # -1: every row the bounds leave goes whole
        search = StagedSearch(replace(BOUNDED, candidates=candidates))
        attention = _cpu_weights(query, key, 0.5, torch.zeros(b, hq, n), search.config, ONE_HEAD)
        counted.update(unsure=0)
        for kv_head in range(hk):
            heads = torch.arange(hq // hk).repeat_interleave(n - 1) + kv_head * (hq // hk)
            top = search.tops(attention, 0, kv_head, heads, rows, rows - 1)
            assert torch.equal(top, logits[0, heads, rows].argmax(dim=-1) == rows - 1), (kv_head, candidates)
        unsure[candidates] = counted["unsure"]
    assert unsure[DEFAULT_SEARCH.candidates] < unsure[-1]


def test_bounded_rows_count_a_nan_logit_as_the_maximum(monkeypatch) -> None:
    """A key whose logits are NaN holds every later row's maximum, as argmax says: bounded rows decide nothing
    there (the NaN reaches the bound, the longest key's norm and the candidates) and leave it to the whole row."""
    counted = _bounded_rows(monkeypatch)
    torch.manual_seed(4)
    b, hq, hk, n, d = 1, 4, 2, 48, 8
    query, key = torch.randn(b, hq, n, d), torch.randn(b, hk, n, d)
    key[:, :, 25, 0] = float("nan")
    logits = _causal_logits(query, key, 0.5)
    search = replace(BOUNDED, positional_rivals=(), positional_band=2)
    attention = _cpu_weights(query, key, 0.5, torch.logsumexp(logits, dim=-1), search, ONE_HEAD)  # NaN from 25 on
    batch = Batch(valid=torch.ones(b, n, dtype=torch.bool), offset=1, repeat_len=None)
    sums, _ = positional_from_lse(attention, batch)
    top = logits.argmax(dim=-1)[..., 1:]  # NaN at key 25: the maximum of rows 25 ..
    assert torch.equal(sums[0], (top == torch.arange(n - 1)).sum(dim=(0, 2)).double())
    assert counted["rows"] > 0


def test_streaming_band_equals_the_blocked_reduction() -> None:
    """The band of sink + recent keys, rebuilt from the log-sum-exp, against the weights of the same forward."""
    model = tiny_hf("llama_gqa")
    torch.manual_seed(4)
    ids = torch.randint(1, 120, (2, 90))
    mask = torch.ones_like(ids)
    mask[1, 70:] = 0
    batch = Batch(valid=mask.bool(), offset=1, repeat_len=None)
    kept = {}

    def keep(attention, ctx):
        kept[ctx.layer] = attention

    def blocked(reason, ctx):
        raise AssertionError(reason)

    with torch.no_grad(), attention_hooks(model, {"lse": keep, "blocked": blocked}):
        run_model(model, ids, mask)
    weights = capture_attention(model, ids, mask)
    for layer, attention in kept.items():
        fast = streaming_from_lse(Weights(attention), batch, sink=2, recent=8)
        reference = streaming_score(weights[layer], 0, batch, sink=2, recent=8)
        assert torch.equal(fast[1], reference[1])
        assert (fast[0] - reference[0]).abs().max() <= TOLERANCE * float(reference[1][0])


def _two_back(weights: Tensor, start: int, batch: Batch) -> tuple[Tensor, Tensor]:
    return diagonal_mass(weights, start, batch, -2)


def test_a_declared_diagonal_gets_the_fast_path() -> None:
    """A new class's accelerator, a diagonal, declares its offset and nothing else: registered by the class's name
    beside the class's Score, the runner reads the class with it."""
    register_score(Score("two_back", "natural", 0.5, "attends two tokens back", _two_back))
    register_accelerator("two_back", Diagonal(lambda batch: -2))
    try:
        loaded = tiny_loaded("llama_gqa")
        natural, _ = _padded_sets(120)
        fast = score_heads(loaded, natural, ["two_back"], batch_size=2)
        blocked = score_heads(loaded, natural, ["two_back"], batch_size=2, path="blocked")
        assert fast.path == "cpu" and blocked.path == "blocked"
        assert fast["two_back"].shape == (2, 4)  # grouped-query: one score per query head
        assert (fast["two_back"] - blocked["two_back"]).abs().max() <= TOLERANCE
        assert float(blocked["two_back"].max()) > 0
    finally:
        del SCORES["two_back"], ACCELERATORS["two_back"]


def test_a_score_without_fast_path_costs_only_itself_the_blocked_path_and_lse_is_refused() -> None:
    """A class without a fast path runs blocked in a pass of its own: the others keep the fast path (their numbers
    are the fast path's, bit for bit), and it gets the blocked path's numbers."""
    register_score(scores.Score("plain_prev", "natural", 0.5, "previous token, blocked only",
                                scores.previous_token_score, "B"))
    try:
        loaded = tiny_loaded("llama_gqa")
        natural, _ = _padded_sets(120)
        steps: list[tuple[int, int]] = []
        auto = score_heads(loaded, natural, ["plain_prev", "sink", "previous_token"], batch_size=2,
                           progress=lambda done, total: steps.append((done, total)))
        assert auto.path == "cpu; blocked for plain_prev (no fast path)"
        assert list(auto) == ["plain_prev", "sink", "previous_token"]
        fast = score_heads(loaded, natural, ["sink", "previous_token"], batch_size=2)
        assert fast.path == "cpu"
        assert torch.equal(auto["sink"], fast["sink"]) and torch.equal(auto["previous_token"], fast["previous_token"])
        blocked = score_heads(loaded, natural, ["previous_token"], batch_size=2, path="blocked")
        assert torch.equal(auto["plain_prev"], blocked["previous_token"])
        assert steps[-1][0] == steps[-1][1] == 2 * 2 * 2  # two passes of two batches of two layers
        with pytest.raises(ProbeError, match="no fast path for plain_prev"):
            score_heads(loaded, natural, ["plain_prev"], path="lse")
    finally:
        del SCORES["plain_prev"]


def test_soft_capped_layers_fall_back_and_say_why() -> None:
    loaded = tiny_loaded("gemma2")  # attention logits soft-capped: the fused kernel cannot rebuild them
    natural, repeated = _padded_sets(120)
    fast, blocked, paths = _both_paths(loaded, (natural, repeated))
    assert paths == {"blocked at layers 0, 1: soft-capped logits (the fused kernel has no soft-capping)"}
    for score in fast:
        assert torch.equal(fast[score], blocked[score]), score


def test_kv_heads_scoring_pass_fast_equals_blocked(smollm2) -> None:
    from probe.kv import score_needles
    from probe.inputs import NeedleOptions, needle_set

    needles = needle_set(smollm2, NeedleOptions(lengths=(320,), depths=(0.5,), seed=3))
    fast = score_needles(smollm2, needles, recent=32)
    blocked = score_needles(smollm2, needles, recent=32, fast=False)
    assert fast[2].exact == blocked[2].exact
    assert (fast[0] - blocked[0]).abs().max() <= TOLERANCE
    assert (fast[1] - blocked[1]).abs().max() <= TOLERANCE


def test_value_heads_smaller_than_query_heads_take_the_fast_path() -> None:
    """Multi-head latent attention (DeepSeek V3: value heads of 12 against query/key heads of 24 here, 128 against 192
    in real checkpoints): the CPU backend serves every layer, and the model's output is its own."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=120, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
        max_position_embeddings=256)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    ids = torch.randint(1, 120, (2, 40), generator=torch.Generator().manual_seed(1))
    served: list[tuple[int, str, int]] = []

    def keep(attention, ctx):
        served.append((ctx.layer, attention.backend, attention.query.shape[-1]))

    def blocked(reason, ctx):
        raise AssertionError(reason)

    with torch.no_grad():
        own = model(input_ids=ids).logits
        with attention_hooks(model, {"lse": keep, "blocked": blocked}):
            hooked = run_model(model, ids, None).logits
    assert served == [(0, "cpu", 24), (1, "cpu", 24)]
    assert (own - hooked).abs().max() <= TOLERANCE

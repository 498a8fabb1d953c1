"""The FlexAttention and sdpa backends (probe/kernels/flex.py, probe/kernels/sdpa.py) on the CPU, as far as each runs
here. sdpa-flash: the whole composition (the CPU's flash op for the output and log-sum-exp, the Triton statistics
pass through Triton's interpreter for the top keys, TRITON_INTERPRET=1 set below) through every case of
tests/test_backends.py and through `score_heads` on a tiny model. FlexAttention: torch computes its row maxima on
CUDA only, so here the masks built for it run through flex_attention's eager CPU path (output and log-sum-exp), and
its statistics answer positional's question from row maxima given to them (the float32 maxima moved by up to nine
tenths of the rounding they allow): argmax's answer on every case, ties included."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before Triton is first imported (probe.kernels.cuda imports it lazily); on a GPU
    os.environ["TRITON_INTERPRET"] = "1"  # the interpreter stays off: torch.compile's FlexAttention kernel needs Triton

import pytest
import test_backends as shared
from attention_calls import masked_logits, moved
from conftest import tiny_loaded

from probe.heads.classify import score_heads
from probe.accel import ACCELERATORS
from probe.heads.scores import SCORES
from probe.kernels import BACKENDS, DEFAULT_CONFIG, REFERENCE, AttentionCall, additive_bias, using_backend
from probe.kernels import flex as flex_kernel
from probe.kernels import FusedStatistics, Weights
from probe.kernels.flex import (MAXIMA_SEARCH, FlexBackend, aux_request, block_mask_for, flex_outputs, flex_statistics,
                                modifications)
from probe.kernels.sdpa import KERNELS, TRITON, SdpaBackend

pytest.importorskip("triton", reason="triton is not installed: the top keys' pass cannot run")
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),  # numpy, on the padding rows
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),  # of the interpreter's tiles
              pytest.mark.filterwarnings("ignore::FutureWarning"),  # flex_attention's return_lse, asked on purpose
              pytest.mark.filterwarnings("ignore::UserWarning")]  # flex_attention's eager path: not compiled

FLASH = next(backend for backend in BACKENDS if backend.name == "sdpa-flash")
FLEX = next(backend for backend in BACKENDS if backend.name == "flex-attention")
DTYPES = [torch.float32, torch.bfloat16]


def _sliding_window() -> AttentionCall:
    """A window of 5 keys over 40 tokens (Mistral, Gemma's local layers), grouped-query heads."""
    generator = torch.Generator().manual_seed(12)
    query, key, value = (torch.randn(1, 4, 40, 16, generator=generator),
                         *(torch.randn(1, 2, 40, 16, generator=generator) for _ in range(2)))
    distance = torch.arange(40)[:, None] - torch.arange(40)[None, :]
    window = ((distance >= 0) & (distance < 5))[None, None]
    return AttentionCall(query, key, value, additive_bias(window, None, query.dtype), 0.25, False)


CASES = {**shared.CASES, "sliding window": _sliding_window}


@pytest.fixture
def eager_flex(monkeypatch: pytest.MonkeyPatch) -> object:
    """flex_attention run eagerly (the CPU's only path to a log-sum-exp: the whole matrix, not the fused kernel)."""
    module = flex_kernel.flex_module()
    monkeypatch.setattr(module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    return module.flex_attention  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(shared.CASES))
def test_sdpa_flash_with_the_triton_top_keys_passes_the_backend_cases(case: str, dtype: torch.dtype,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_backends.py's check, the backend on the CPU: its output and log-sum-exp from the CPU's flash op,
    each row's top key from the Triton pass (carried as top_keys), against the reference."""
    monkeypatch.setitem(shared.DEVICES, FLASH.name, "cpu")
    shared.test_backend_equals_the_reference(FLASH, case, dtype)
    call = moved(CASES[case](), dtype)
    _, statistics = FLASH.run(call, DEFAULT_CONFIG)
    if TRITON.problem(call) == "":  # the interpreter (no GPU here): the Triton pass's top keys, argmax's answer
        assert statistics.top_keys is not None
        assert Weights(statistics).neighbour_reads((-1, 1)) == ((), ())  # positional reads them: no diagonal
        assert torch.equal(statistics.top_keys.long(), masked_logits(call).argmax(dim=-1))


def test_sdpa_without_triton_finds_the_maxima_from_whole_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Triton pass does not serve the call (here: the interpreter off), the statistics carry no top keys
    and answer from whole rows, the same counts."""
    call = CASES["ties"]()
    if TRITON.problem(call):
        pytest.skip(f"the Triton pass: {TRITON.problem(call)}")
    _, with_triton = FLASH.run(call, DEFAULT_CONFIG)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert FLASH.problem(call) == ""
    _, without = FLASH.run(call, DEFAULT_CONFIG)
    assert without.top_keys is None and with_triton.top_keys is not None
    selected = torch.ones(2, 40, dtype=torch.bool)
    for shift in (-1, 0):
        assert torch.equal(Weights(without).neighbour_hits(selected, shift),
                           Weights(with_triton).neighbour_hits(selected, shift))


def test_six_default_scores_through_sdpa_flash_equal_the_blocked_path() -> None:
    """A tiny grouped-query llama, right-padded: every layer served by sdpa-flash (its name in the result's path),
    each default score within 1e-5 of the blocked path in float32."""
    loaded = tiny_loaded("llama_gqa")
    torch.manual_seed(0)
    ids = torch.randint(1, loaded.vocab_size, (3, 24))
    mask = torch.ones_like(ids)
    mask[1, 17:], mask[2, 9:] = 0, 0
    half = torch.randint(1, loaded.vocab_size, (3, 11))
    repeated = torch.cat([torch.zeros(3, 1, dtype=torch.long), half, half], dim=1)
    from probe.inputs import ProbeSet

    for probe_set in (ProbeSet("natural", "random", ids, 1, attention_mask=mask),
                      ProbeSet("repeated", "random, repeated", repeated, 1, repeat_len=11)):
        names = [name for name, score in SCORES.items() if score.probe == probe_set.name and name in ACCELERATORS]
        with using_backend(FLASH):
            fast = score_heads(loaded, probe_set, names, batch_size=2, path="lse")
        blocked = score_heads(loaded, probe_set, names, batch_size=2, path="blocked")
        assert fast.path == "sdpa-flash", fast.path
        for name in names:
            assert (fast[name] - blocked[name]).abs().max() <= 1e-5, name


def test_sdpa_flash_reads_nothing_back_to_the_host_inside_a_forward() -> None:
    """Every default score through sdpa-flash with the Triton pass's top keys, a padded batch (an additive bias):
    nothing inside the forward waits for the device (tests/host_reads.py)."""
    from host_reads import host_reads

    from probe.inputs import ProbeSet

    loaded = tiny_loaded("llama_gqa")
    if TRITON.problem(CASES["causal"]()):
        pytest.skip(f"the Triton pass: {TRITON.problem(CASES['causal']())}")
    generator = torch.Generator().manual_seed(0)
    half = torch.randint(3, 120, (2, 19), generator=generator)
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), half, half], dim=1)
    mask = torch.ones_like(ids)
    mask[-1, -5:] = 0
    probe_set = ProbeSet("repeated", "random tokens, repeated", ids, 1, attention_mask=mask, repeat_len=19)
    names = [name for name, score in SCORES.items() if score.by_default and score.probe == "repeated"]
    with using_backend(FLASH), host_reads(loaded.model) as reads:
        scores = score_heads(loaded, probe_set, names, batch_size=2, path="lse")
    assert scores.path == "sdpa-flash"
    assert not reads, "\n".join(dict.fromkeys(reads))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_flex_masks_give_the_reference_attention(case: str, dtype: torch.dtype, eager_flex: object) -> None:
    """The score_mod and block mask built from the call (causal, a padding mask, a bias, a sliding window; grouped
    heads, dv != d, heads padded to 16), through flex_attention's eager CPU path: the reference's output and
    log-sum-exp."""
    call = moved(CASES[case](), dtype)
    output, lse, maxima = flex_outputs(call, eager_flex, maxima=False)  # type: ignore[arg-type]
    expected, reference = REFERENCE.run(call, DEFAULT_CONFIG)
    tolerance = shared.TOLERANCE[dtype]
    assert maxima is None and output.shape == expected.shape and output.dtype == dtype
    assert (output.float() - expected.float()).abs().max() <= tolerance
    assert lse.dtype == torch.float32 and (lse - reference.lse).abs().max() <= tolerance * 4


def test_flex_block_mask_skips_hidden_blocks() -> None:
    """A sliding window of 16 keys over 1024 tokens: the block mask keeps only the blocks on the diagonal and the one
    before (whole hidden blocks never computed), from the same mask_mod the kernel applies inside partial blocks."""
    n = 1024
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    window = ((distance >= 0) & (distance < 16))[None, None]
    query = torch.zeros(1, 2, n, 16)
    call = AttentionCall(query, query, query, additive_bias(window, None, query.dtype), 0.25, False)
    _, mask_mod = modifications(call)
    assert mask_mod is not None
    blocks = block_mask_for(mask_mod, call)
    assert int(blocks.kv_num_blocks.sum()) + int(blocks.full_kv_num_blocks.sum()) == 8 + 7  # of 64
    plain = AttentionCall(query, query, query, None, 0.25, True)
    assert modifications(plain)[0] is None and modifications(AttentionCall(query, query, query, None, 0.25,
                                                                           False)) == (None, None)


def _maxima_moved(call: AttentionCall, statistics: FusedStatistics, fraction: float) -> torch.Tensor:
    """Each row's float32 maximum moved up or down (alternating rows) by `fraction` of the rounding the statistics
    allow the kernel's."""
    maxima = masked_logits(call).amax(dim=-1)
    rounding = MAXIMA_SEARCH.rounding(Weights(statistics), maxima, maxima)
    sign = (torch.arange(maxima.shape[-1]) % 2 * 2 - 1).to(maxima)
    return maxima + sign * fraction * rounding


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_flex_statistics_answer_from_the_row_maxima(case: str, dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Positional's question from row maxima that err by up to 0.9 of the allowed rounding: argmax's answer (the
    earliest maximum on ties) for every neighbour; only the rows the maxima cannot decide are computed whole, and
    row_tops (which needs the index) is argmax's."""
    call = moved(CASES[case](), dtype).with_dense_bias()  # what FlexBackend.run hands its statistics
    _, reference = REFERENCE.run(call, DEFAULT_CONFIG)
    plain_causal = call.causal and call.bias is None
    statistics = flex_statistics(call.query, call.key, call.bias, call.scaling, plain_causal, reference.lse)
    statistics.row_maxima = _maxima_moved(call, statistics, 0.9)
    assert Weights(statistics).neighbour_reads((-1, 0)) == ((-1, 0), ())  # `decided` reads the neighbours' weights
    whole: list[int] = []
    original = Weights.tops_of_rows
    monkeypatch.setattr(Weights, "tops_of_rows",
                        lambda self, found, keys, tops=None: whole.append(len(found)) or original(self, found, keys,
                                                                                                  tops))
    logits = masked_logits(call)
    b, hq, n, _ = call.query.shape
    for shift in (-1, 0):
        rows = torch.arange(max(0, -shift), n)
        expected = (logits[:, :, rows].argmax(dim=-1) == rows + shift).sum(dim=(0, 2)).double()
        selected = torch.ones(b, n, dtype=torch.bool)
        selected[:, :max(0, -shift)] = False
        assert torch.equal(Weights(statistics).neighbour_hits(selected, shift), expected), shift
    assert sum(whole) < 2 * b * hq * n  # the maxima decided some rows
    every = torch.arange(n)
    assert torch.equal(Weights(statistics).row_tops(every), logits.argmax(dim=-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's row maxima: computed on CUDA only")
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_flex_kernel_maxima_lie_within_the_rounding_allowed(case: str, dtype: torch.dtype) -> None:
    """On a GPU: the compiled kernel's row maxima lie within `MaximaSearch.rounding` of the float32 maxima (the
    bound every decision from them rests on), and its log-sum-exp within the same of the reference's."""
    call = moved(CASES[case](), dtype, "cuda")
    assert FLEX.problem(call) == ""
    with torch.no_grad():
        _, statistics = FLEX.run(call, DEFAULT_CONFIG)
        _, reference = REFERENCE.run(call, DEFAULT_CONFIG)
    assert isinstance(statistics, FusedStatistics) and statistics.row_maxima is not None
    maxima = masked_logits(call).amax(dim=-1)
    rounding = MAXIMA_SEARCH.rounding(Weights(statistics), maxima, maxima)
    assert bool(((statistics.row_maxima - maxima).abs() <= rounding).all())
    assert bool(((statistics.lse - reference.lse).abs() <= rounding).all())


def _previous_token_head() -> AttentionCall:
    """Queries that look like the key before them: the neighbour i - 1 is most rows' top, many of them at
    weights under one half, which the maxima cannot decide."""
    generator = torch.Generator().manual_seed(13)
    key = torch.randn(1, 2, 96, 16, generator=generator)
    query = torch.roll(key, 1, dims=2) * 0.6 + 0.5 * torch.randn(1, 2, 96, 16, generator=generator)
    return AttentionCall(query, key, key, None, 0.25, True)


@pytest.mark.parametrize("triton_pass", [True, False], ids=["triton pass", "whole rows"])
def test_flex_statistics_settle_many_undecided_rows_in_one_pass(triton_pass: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A previous-token head leaves most rows undecided by the maxima: one Triton statistics pass gives every row's
    top key (kept as top_keys), or, where Triton does not serve the call, whole rows do; argmax's counts either way."""
    if not triton_pass:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif TRITON.problem(CASES["causal"]()):
        pytest.skip(f"the Triton pass: {TRITON.problem(CASES['causal']())}")
    call = _previous_token_head()
    _, reference = REFERENCE.run(call, DEFAULT_CONFIG)
    statistics = flex_statistics(call.query, call.key, None, call.scaling, True, reference.lse,
                                 maxima=masked_logits(call).amax(dim=-1))
    _, undecided = MAXIMA_SEARCH.decided(Weights(statistics), masked_logits(call).amax(dim=-1), -1)
    assert float(undecided.float().mean()) > flex_kernel.WHOLE_ROWS
    selected = torch.ones(1, 96, dtype=torch.bool)
    selected[:, 0] = False
    rows = torch.arange(1, 96)
    expected = (masked_logits(call)[:, :, rows].argmax(dim=-1) == rows - 1).sum(dim=(0, 2)).double()
    assert expected.sum() > 0.75 * 2 * 95
    assert torch.equal(Weights(statistics).neighbour_hits(selected, -1), expected)
    assert (statistics.top_keys is not None) == triton_pass


@pytest.mark.parametrize("triton_pass", [True, False], ids=["triton pass", "whole rows"])
def test_flex_statistics_without_maxima(triton_pass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Statistics without row maxima (layer calls read side by side, which keeps only top keys; a torch that gives
    none): the same counts, from the Triton pass's top keys where it serves the call, else from whole rows."""
    if not triton_pass:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif TRITON.problem(CASES["causal"]()):
        pytest.skip(f"the Triton pass: {TRITON.problem(CASES['causal']())}")
    from probe.kernels import side_by_side

    ties = CASES["ties"]()
    calls = [ties, AttentionCall(ties.query.flip(2), ties.key, ties.value, None, 3.0, True)]  # other queries
    parts = []
    for call in calls:
        _, reference = REFERENCE.run(call, DEFAULT_CONFIG)
        parts.append(flex_statistics(call.query, call.key, None, call.scaling, True, reference.lse,
                                     maxima=masked_logits(call).amax(dim=-1)))
    joined = side_by_side(parts)
    assert joined.backend == "flex-attention" and joined.row_maxima is None
    assert Weights(joined).neighbour_reads((0,)) == ((), ())  # no maxima: nothing of the table is read
    selected = torch.ones(2, 40, dtype=torch.bool)
    expected = torch.cat([Weights(part).neighbour_hits(selected, 0) for part in parts])
    assert torch.equal(Weights(joined).neighbour_hits(selected, 0), expected)
    assert (joined.top_keys is not None) == triton_pass


def test_flex_asks_for_what_this_torch_has(monkeypatch: pytest.MonkeyPatch, eager_flex: object) -> None:
    """torch 2.9 and later: AuxRequest(lse=True, max_scores=True); a torch without AuxRequest: return_lse=True, its
    answer unpacked the same way."""
    kwargs, has_maxima = aux_request()
    assert has_maxima and kwargs["return_aux"].lse and kwargs["return_aux"].max_scores
    call = CASES["grouped-query"]()
    _, expected_lse, _ = flex_outputs(call, eager_flex, maxima=False)  # type: ignore[arg-type]
    monkeypatch.delattr(flex_kernel.flex_module(), "AuxRequest")
    assert aux_request() == ({"return_lse": True}, False)
    _, lse, maxima = flex_outputs(call, eager_flex)  # type: ignore[arg-type]
    assert maxima is None and torch.equal(lse, expected_lse)


def test_refusals_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlexAttention's row maxima run on CUDA only; cuDNN is CUDA's; a device no kernel is wired for is named; a
    call no backend rebuilds (soft-capping) is refused by each first."""
    call = CASES["causal"]()
    assert "cuda only, not cpu" in FLEX.problem(call)
    cudnn = SdpaBackend("cudnn")
    assert cudnn.name == "sdpa-cudnn" and "not wired for cpu" in cudnn.problem(call)
    assert FLASH.problem(call) == "" and ("flash", "cpu") in KERNELS
    meta = AttentionCall(*(tensor.to("meta") for tensor in (call.query, call.key, call.value)), None, 0.25, True)
    assert "not wired for meta" in FLASH.problem(meta) and "not meta" in FLEX.problem(meta)
    capped = AttentionCall(call.query, call.key, call.value, None, 0.25, True, softcap=30.0)
    for backend in (FLEX, FLASH, cudnn):
        assert backend.problem(capped).startswith("soft-capped logits")
    with pytest.raises(ValueError, match="'flash' or 'cudnn'"):
        SdpaBackend("math")
    assert isinstance(FLEX, FlexBackend)

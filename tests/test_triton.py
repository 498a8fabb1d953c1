"""The CUDA backend's Triton kernel (probe/kernels/cuda.py), run here by Triton's interpreter (TRITON_INTERPRET=1,
set below: the same kernel on CPU tensors, slowly, so the shapes are tiny) against the blocked reference: the output,
each row's log-sum-exp and its top key (argmax of the float32 logits: the earliest on ties, a NaN the largest), on
causal, padded, sliding-window (as a bias, and as a key mask and window), grouped- and multi-query, dv != d,
odd-length, tied and NaN calls in each dtype; and the six default scores through `score_heads` with the backend forced,
against the blocked path. Its compiled form: tests/test_kernel_compile.py."""

from __future__ import annotations

import os
from collections.abc import Iterable

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first decorated (probe.kernels.cuda decorates lazily)

import pytest
import torch
from attention_calls import masked_logits, moved
from conftest import tiny_hf, tiny_loaded
from families import ADAPTED, FAMILY_MODELS, tiny_family

from probe.heads.classify import score_heads
from probe.heads.scores import SCORES
from probe.inputs import ProbeSet
from probe.kernels import (DEFAULT_CONFIG, REFERENCE, AttentionCall, CpuBackend, FusedStatistics, KernelConfig, Label,
                           Weights, additive_bias, using_backend)
from probe.kernels.base import Backend
from probe.kernels.cuda import CudaBackend
from probe.models import LoadedModel

triton = pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernel cannot run")
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),  # numpy, on the padding rows
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]  # past n of the interpreter's tiles

CUDA = CudaBackend()
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}  # output; lse: 4x (one rounding of
# the inputs' products is all the kernel adds: float32 accumulation of exact bfloat16 / float16 products)
SIX = ["previous_token", "sink", "induction", "duplicate_token", "next_token", "positional"]


def _qkv(b: int, hq: int, hk: int, n: int, d: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, d, generator=generator), torch.randn(b, hk, n, d, generator=generator),
            torch.randn(b, hk, n, dv, generator=generator))


def _masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
            scaling: float) -> AttentionCall:
    """A call whose boolean mask (True: attend) the hooks made additive, as they hand it to a backend."""
    return AttentionCall(query, key, value, additive_bias(mask, None, query.dtype), scaling, False)


def _padded() -> AttentionCall:
    """Right padding and causal, grouped-query: a boolean key-padding mask made additive."""
    query, key, value = _qkv(3, 4, 2, 20, 16, 16, seed=1)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, 14:], valid[2, 7:] = False, False
    return _masked(query, key, value, torch.ones(20, 20, dtype=torch.bool).tril()[None, None] &
                   valid[:, None, None, :], 0.25)


def _sliding_window() -> AttentionCall:
    """A sliding window of 5 keys (Mistral, Gemma-2/3's local layers) over 40 tokens: crosses two key blocks."""
    query, key, value = _qkv(1, 2, 2, 40, 16, 16, seed=2)
    distance = torch.arange(40)[:, None] - torch.arange(40)[None, :]
    return _masked(query, key, value, ((distance >= 0) & (distance < 5))[None, None], 0.25)


def _ties_and_nan() -> AttentionCall:
    """Keys that copy earlier keys (the earliest must win), a NaN key (every row that sees it: that key) and a NaN
    query row (its whole row NaN: key 0)."""
    query, key, value = _qkv(1, 2, 1, 36, 16, 16, seed=3)
    key[:, :, 10:20] = key[:, :, 9:19].clone()
    key[:, :, 33] = key[:, :, 2]
    key[0, 0, 30, 3] = float("nan")
    query[0, 1, 5, 0] = float("nan")
    return AttentionCall(query, key, value, None, 3.0, True)


def _key_mask_padded() -> AttentionCall:
    """Right padding as a (b, kv) key mask beside causal masking (what the hooks hand over for transformers' padded
    masks), 70 tokens: key blocks seen whole, the diagonal's and the padding's."""
    query, key, value = _qkv(2, 2, 1, 70, 16, 16, seed=10)
    valid = torch.ones(2, 70, dtype=torch.bool)
    valid[1, 45:] = False
    return AttentionCall(query, key, value, None, 0.25, True, key_mask=valid)


def _key_mask_bidirectional() -> AttentionCall:
    """An encoder's left and right padding: a key mask alone, no causal masking."""
    query, key, value = _qkv(2, 2, 2, 41, 16, 32, seed=11)
    valid = torch.ones(2, 41, dtype=torch.bool)
    valid[0, :9], valid[1, 30:] = False, False
    return AttentionCall(query, key, value, None, 0.3, False, key_mask=valid)


def _window(n: int, window: int, padded_from: int | None, seed: int) -> AttentionCall:
    """A causal sliding window as an int (and right padding as a key mask where given)."""
    query, key, value = _qkv(1 if padded_from is None else 2, 2, 2, n, 16, 16, seed=seed)
    valid = None
    if padded_from is not None:
        valid = torch.ones(2, n, dtype=torch.bool)
        valid[1, padded_from:] = False
    return AttentionCall(query, key, value, None, 0.25, True, key_mask=valid, window=window)


CASES = {
    "causal": lambda: AttentionCall(*_qkv(2, 4, 4, 24, 16, 16, seed=0), None, 0.25, True),
    "key mask, padded": _key_mask_padded,
    "key mask, bidirectional": _key_mask_bidirectional,
    "window 5 as an int": lambda: _window(40, 5, None, 12),  # narrower than a block
    "window 70, padded": lambda: _window(130, 70, 100, 13),  # blocks seen whole between the edge and the diagonal
    "padded": _padded,
    "sliding window": _sliding_window,
    "grouped-query": lambda: AttentionCall(*_qkv(1, 6, 2, 33, 16, 16, seed=4), None, 0.35, True),
    "multi-query, not causal": lambda: AttentionCall(*_qkv(1, 4, 1, 29, 16, 16, seed=5), None, 0.35, False),
    "value head smaller (MLA)": lambda: AttentionCall(*_qkv(1, 2, 2, 21, 24, 16, seed=6), None, 24 ** -0.5, True),
    "value head larger": lambda: AttentionCall(*_qkv(1, 2, 2, 15, 16, 40, seed=7), None, 0.25, False),
    "one token": lambda: AttentionCall(*_qkv(1, 2, 2, 1, 16, 16, seed=8), None, 0.25, True),
    "odd length, head 80": lambda: AttentionCall(*_qkv(1, 2, 1, 45, 80, 80, seed=9), None, 80 ** -0.5, True),
    "ties and NaN": _ties_and_nan,
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_reference(case: str, dtype: torch.dtype) -> None:
    call = moved(CASES[case](), dtype)
    assert CUDA.problem(call) == ""
    output, statistics = CUDA.run(call)
    expected, reference = REFERENCE.run(call)
    b, hq, n, _ = call.query.shape
    assert isinstance(statistics, FusedStatistics) and statistics.backend == "cuda"
    assert output.shape == expected.shape == (b, n, hq, call.value.shape[-1]) and output.dtype == dtype
    assert statistics.lse.dtype == torch.float32 and statistics.top_keys is not None
    nan_rows = reference.lse.isnan()
    assert torch.equal(statistics.lse.isnan(), nan_rows)
    assert (statistics.lse - reference.lse).nan_to_num(0.0).abs().max() <= TOLERANCE[dtype] * 4
    finite = ~expected.float().isnan()
    assert torch.equal(~output.float().isnan(), finite)
    assert (output.float() - expected.float())[finite].abs().max() <= TOLERANCE[dtype]
    # argmax's answer, ties and NaN included
    assert torch.equal(statistics.top_keys.long(), masked_logits(call).argmax(dim=-1))
    selected = torch.ones(b, n, dtype=torch.bool)
    for shift in (-1, 0):  # positional's question, from the kernel's indices, against whole rows (the reference)
        chosen = selected.clone()
        chosen[:, :max(0, -shift)] = False
        hits = Weights(statistics).neighbour_hits(chosen, shift)
        assert hits.dtype == torch.float64 and hits.shape == (hq,)
        if dtype == torch.float32:  # the reference rebuilds bfloat16 logits in bfloat16: its ties are others
            assert torch.equal(hits, Weights(reference).neighbour_hits(chosen, shift)), shift


@pytest.mark.parametrize("case", ["key mask, padded", "window 70, padded"])
def test_labels_read_the_key_mask_and_window_as_they_are(case: str) -> None:
    """The diagonals and columns of a call masked by a key mask and a window come from the label kernel reading the
    (b, kv) key mask and the int window where each key lies: the reference's weights (from the dense bias they stand
    for), exactly 0 where a key is hidden, and no dense bias made on the way."""
    call = CASES[case]()
    assert call.key_mask is not None and call.bias is None
    _, statistics = CUDA.run(call)
    _, reference = REFERENCE.run(call)
    assert statistics.bias is None and statistics.key_mask is call.key_mask and statistics.window == call.window
    labels = [Label("diagonal", shift) for shift in (-3, -1, 0, 1)] + [Label("column", key) for key in (0, 5)]
    weights = Weights(statistics)
    table, expected = weights.stacked(labels), Weights(reference).stacked(labels)
    assert "dense_bias" not in vars(weights)  # the key mask was read, never made (n, kv)
    finite = ~expected.isnan()
    assert torch.equal(~table.isnan(), finite) and (table - expected)[finite].abs().max() <= 2e-6
    assert torch.equal(table[finite] == 0, expected[finite] == 0)  # hidden keys: exactly 0 on both


@pytest.mark.parametrize("case", ["padded", "grouped-query", "value head smaller (MLA)", "ties and NaN",
                                  "key mask, padded", "window 70, padded"])
@pytest.mark.slow
def test_statistics_alone_beside_torchs_output(case: str) -> None:
    """Design (b) of issue 44: CudaBackend(output="sdpa") takes the layer's output from torch's sdpa and runs the
    kernel without values (attention_statistics): the output is attention's, the log-sum-exp and top keys are the
    full kernel's bit for bit."""
    call = CASES[case]()
    output, statistics = CudaBackend(output="sdpa").run(call)
    _, full = CUDA.run(call)
    expected, _ = REFERENCE.run(call)
    assert output.shape == expected.shape and output.is_contiguous()
    finite = ~expected.isnan()
    assert torch.equal(~output.isnan(), finite) and (output - expected)[finite].abs().max() <= 2e-5
    assert torch.equal(statistics.lse.nan_to_num(), full.lse.nan_to_num())
    assert torch.equal(statistics.top_keys, full.top_keys)
    with pytest.raises(ValueError, match="'kernel' or 'sdpa'"):
        CudaBackend(output="flash")


def test_side_by_side_carries_the_top_keys() -> None:
    """Several layer calls read as one (the accumulator's grouping) keep each row's top key with its head."""
    from probe.kernels import side_by_side

    calls = [CUDA.run(CASES["causal"]())[1], CUDA.run(AttentionCall(*_qkv(2, 4, 4, 24, 16, 16, seed=11), None,
                                                                   0.25, True))[1]]
    joined = side_by_side(calls)
    assert isinstance(joined, FusedStatistics) and joined.backend == "cuda" and joined.top_keys is not None
    assert torch.equal(joined.top_keys, torch.cat([call.top_keys for call in calls], dim=1))  # type: ignore[misc]
    selected = torch.ones(2, 24, dtype=torch.bool)
    assert torch.equal(Weights(joined).neighbour_hits(selected, 0),
                       torch.cat([Weights(call).neighbour_hits(selected, 0) for call in calls]))


def test_refusals_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Soft-capping (a weight rebuilt from the uncapped logit would not be the capped one), CPU tensors without the
    interpreter, integer inputs and head sizes over 256 are refused with their reason."""
    call = CASES["causal"]()
    capped = AttentionCall(call.query, call.key, call.value, None, 0.25, True, softcap=30.0)
    assert CUDA.problem(capped).startswith("soft-capped logits")
    wide = AttentionCall(*_qkv(1, 1, 1, 2, 320, 16, seed=0), None, 0.25, True)
    assert "head size over 256" in CUDA.problem(wide)
    assert "float32, bfloat16, float16" in CUDA.problem(moved(call, torch.float64))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "runs on cuda, not cpu" in CUDA.problem(call)


def _probe_sets(vocab: int) -> list[ProbeSet]:
    """A natural and a repeated set, right-padded (a bias: layers read one at a time), and a repeated set without
    padding (no bias: the accumulator reads the layers side by side)."""
    torch.manual_seed(0)
    ids = torch.randint(1, vocab, (3, 24))
    mask = torch.ones_like(ids)
    mask[1, 17:], mask[2, 9:] = 0, 0
    half = torch.randint(1, vocab, (3, 11))
    repeated = torch.cat([torch.zeros(3, 1, dtype=torch.long), half, half], dim=1)
    repeated_mask = torch.ones_like(repeated)
    repeated_mask[1, 15:] = 0
    return [ProbeSet("natural", "random", ids, 1, attention_mask=mask),
            ProbeSet("repeated", "random, repeated", repeated, 1, repeat_len=11, attention_mask=repeated_mask),
            ProbeSet("repeated", "random, repeated", repeated, 1, repeat_len=11)]


def _against_blocked(loaded: LoadedModel, probe_sets: list[ProbeSet]) -> tuple[dict[str, float], set[str]]:
    """The largest difference of each default score, CUDA backend forced (using_backend) against the blocked path,
    and the paths the forced runs took."""
    differences, paths = {}, set()
    for probe_set in probe_sets:
        names = [name for name in SIX if SCORES[name].probe == probe_set.name]
        with using_backend(CUDA):
            fast = score_heads(loaded, probe_set, names, batch_size=2, path="lse")
        blocked = score_heads(loaded, probe_set, names, batch_size=2, path="blocked")
        paths.add(fast.path)
        for name in names:
            assert fast[name].shape == blocked[name].shape
            differences[name] = max(differences.get(name, 0.0), float((fast[name] - blocked[name]).abs().max()))
    return differences, paths


@pytest.mark.slow
def test_six_default_scores_through_the_kernel_equal_the_blocked_path() -> None:
    """A tiny grouped-query llama, padded and not: every layer served by the kernel (path "cuda"), each of the six
    default scores within 1e-5 of the blocked path in float32. In bfloat16 the diagonals and columns stay within
    1e-4; positional may differ by whole rows, where a row's two largest logits are closer than bfloat16's rounding
    of the blocked path's weights (its argmax reads rounded weights, the kernel's float32 logits)."""
    loaded = tiny_loaded("llama_gqa")
    differences, paths = _against_blocked(loaded, _probe_sets(loaded.vocab_size))
    assert paths == {"cuda"} and max(differences.values()) <= 1e-5, (paths, differences)
    loaded.model.to(torch.bfloat16)
    differences, paths = _against_blocked(loaded, _probe_sets(loaded.vocab_size)[:2])
    assert paths == {"cuda"}
    assert max(value for name, value in differences.items() if name != "positional") <= 1e-4, differences


class _Recording(CudaBackend):
    """The CUDA backend, keeping every call the hooks hand it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []

    def run(self, call: AttentionCall, config: KernelConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, FusedStatistics]:
        self.calls.append(call)
        return super().run(call, config)


@pytest.mark.slow
def test_padding_and_a_sliding_window_reach_the_kernel_as_a_key_mask_and_an_int() -> None:
    """A padded batch through a tiny Mistral with a sliding window of 16 (under the sequence's 24 tokens; wide
    enough that every padding query's window still holds a real key): every layer call reaches the kernel as a
    (b, kv) key mask and the window, no dense bias, and the six default scores equal the blocked path's
    (transformers' own masks) within 1e-5."""
    model = tiny_hf("mistral", sliding_window=16)
    loaded = LoadedModel(model=model, tokenizer=None, name="tiny-mistral", vocab_size=120)
    recording = _Recording()
    probe_sets = _probe_sets(120)[:2]
    for probe_set in probe_sets:
        names = [name for name in SIX if SCORES[name].probe == probe_set.name]
        with using_backend(recording):
            fast = score_heads(loaded, probe_set, names, batch_size=2, path="lse")
        blocked = score_heads(loaded, probe_set, names, batch_size=2, path="blocked")
        assert fast.path == "cuda"
        assert max(float((fast[name] - blocked[name]).abs().max()) for name in names) <= 1e-5
    structured = [call for call in recording.calls if call.key_mask is not None]
    assert all(call.bias is None for call in recording.calls)  # never a dense bias (a batch shorter than the
    assert structured and all(call.window == 16 and call.causal and  # window with no padding has no mask at all)
                              call.key_mask.shape == (call.query.shape[0], call.key.shape[2]) for call in structured)
    assert any(not bool(call.key_mask.all()) for call in structured)  # the padded batches' keys


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in FAMILY_MODELS if name not in ADAPTED])
def test_every_family_through_the_kernel_equals_the_blocked_path(name: str) -> None:
    """Every family read through transformers' attention interface (tests/families.py: grouped-query, multi-head
    latent attention's value heads, Gemma-3n's shared keys, encoders without a causal mask), right-padded: the six
    default scores within 1e-5 of the blocked path in float32, every layer served by the kernel."""
    loaded = LoadedModel(model=tiny_family(name), tokenizer=None, name=name, vocab_size=120)
    differences, paths = _against_blocked(loaded, _probe_sets(120)[:2])
    assert paths == {"cuda"}, paths
    assert max(differences.values()) <= 1e-5, differences


RIVALS = {Label("diagonal", shift) for shift in (-4, -3, -2, -1, 0, 1)} | {Label("column", 0)}
"""What the CPU's staged search reads for positional's neighbours i - 1 and i + 1 (its rivals stage, with the default
SearchConfig: the rival diagonals and key 0), computed in the layer's one pass with the other scores' labels."""


@pytest.mark.slow
@pytest.mark.parametrize("backend", [CUDA, CpuBackend()], ids=lambda backend: backend.name)
def test_positional_prefetches_what_the_records_search_reads(backend: Backend,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Which diagonals and columns a layer computes for positional is the record's to say: on the CUDA backend's
    record the kernel's top keys answer, so the layer computes only what the other scores read themselves
    (previous token's diagonal, the sink's column; nothing for positional alone: the label kernel is never
    launched); on the CPU's, the staged search's rivals, all in the one pass with the others' (no later read computes
    any). Padded (each layer read alone) and not (layers read side by side); positional equals the blocked path's."""
    computed: list[set[Label]] = []  # the labels each prefetch computed, where it computed any
    prefetch = Weights.prefetch

    def counted(self: Weights, shifts: Iterable[int], columns: Iterable[int] = ()) -> None:
        before = set(self.tables)
        prefetch(self, shifts, columns)
        if set(self.tables) - before:
            computed.append(set(self.tables) - before)

    monkeypatch.setattr(Weights, "prefetch", counted)
    loaded = tiny_loaded("llama_gqa")
    padded = _probe_sets(loaded.vocab_size)[0]
    for probe_set in (padded, ProbeSet("natural", "random", padded.input_ids, 1)):
        blocked = score_heads(loaded, probe_set, ["positional"], batch_size=2, path="blocked")
        for names, own in ((["positional"], set()), (["previous_token", "sink", "positional"],
                                                      {Label("diagonal", -1), Label("column", 0)})):
            computed.clear()
            with using_backend(backend):
                fast = score_heads(loaded, probe_set, names, batch_size=2, path="lse")
            assert fast.path == backend.name
            assert torch.equal(fast["positional"], blocked["positional"]), (names, probe_set.attention_mask)
            expected = own if backend is CUDA else own | RIVALS
            assert computed if expected else not computed, (names, computed)
            assert all(labels == expected for labels in computed), (names, computed)

"""Every registered fused-attention backend against the blocked reference (probe/kernels/reference.py), on the same
cases: the output, each row's log-sum-exp, the weights rebuilt from the statistics, and which rows' top key is their
neighbour. A new backend is checked by being registered (probe/kernels/__init__.py) and named in DEVICES (the device
its calls are made on: skipped where this machine lacks it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attention_calls import masked_logits, moved

from probe.kernels import (BACKENDS, DEFAULT_CONFIG, REFERENCE, AttentionCall, ReferenceBackend, Weights, additive_bias,
                           backend_for)
from probe.kernels.base import Backend, rebuild_problem

DEVICES: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "flex-attention": "cuda", "sdpa-flash": "cuda",
                           "sdpa-cudnn": "cuda"}
"""Backend name -> the device its cases run on (a CUDA backend: "cuda")."""

PARTIAL = {"sdpa-flash", "sdpa-cudnn"}
"""Backends whose kernels take only some of the cases on their device (half precision; the flash kernel no mask): a
case such a backend's `problem` refuses is skipped with its reason. Every other backend serves every case."""

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # output and weights: the kernels sum in another order


def _qkv(b: int, hq: int, hk: int, n: int, d: int, dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, d, generator=generator), torch.randn(b, hk, n, d, generator=generator),
            torch.randn(b, hk, n, dv, generator=generator))


def _causal() -> AttentionCall:
    query, key, value = _qkv(2, 4, 4, 24, 16, 16)
    return AttentionCall(query, key, value, None, 16 ** -0.5, True)


def _padded_bool_mask() -> AttentionCall:
    """Right padding as transformers hands it over: a boolean mask, causal and padded keys hidden."""
    query, key, value = _qkv(3, 4, 2, 20, 8, 8, seed=1)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, 14:], valid[2, 7:] = False, False
    mask = torch.ones(20, 20, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    return AttentionCall(query, key, value, additive_bias(mask, None, query.dtype), 8 ** -0.5, False)


def _additive_bias() -> AttentionCall:
    """A position bias per head (ALiBi-like slopes) on top of a causal additive mask."""
    query, key, value = _qkv(2, 4, 4, 18, 8, 8, seed=2)
    distance = torch.arange(18)[None, :] - torch.arange(18)[:, None]
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None]
    causal = torch.zeros(18, 18).masked_fill(distance > 0, float("-inf"))
    return AttentionCall(query, key, value, additive_bias(causal[None, None], (slopes * distance)[None], query.dtype),
                         0.3, False)


def _grouped_query() -> AttentionCall:
    query, key, value = _qkv(2, 6, 2, 33, 8, 8, seed=3)
    return AttentionCall(query, key, value, None, 0.35, True)


def _multi_query() -> AttentionCall:
    query, key, value = _qkv(1, 4, 1, 29, 8, 8, seed=4)
    return AttentionCall(query, key, value, None, 0.35, True)


def _smaller_value_head() -> AttentionCall:
    """Multi-head latent attention's shape (DeepSeek V2 / V3: value heads of 128 against query heads of 192)."""
    query, key, value = _qkv(2, 4, 4, 21, 24, 16, seed=5)
    return AttentionCall(query, key, value, None, 24 ** -0.5, True)


def _larger_value_head() -> AttentionCall:
    query, key, value = _qkv(1, 2, 2, 15, 8, 12, seed=6)
    return AttentionCall(query, key, value, None, 8 ** -0.5, False)


def _odd_lengths() -> AttentionCall:
    query, key, value = _qkv(1, 2, 2, 1, 8, 8, seed=7)  # one query, one key
    longer = _qkv(1, 2, 2, 131, 8, 8, seed=8)
    return AttentionCall(torch.cat([query, longer[0]], 2), torch.cat([key, longer[1]], 2),
                         torch.cat([value, longer[2]], 2), None, 0.4, True)


def _ties() -> AttentionCall:
    """Keys that copy their predecessor: the neighbour and a rival hold the same logit (the earliest must win), and a
    far copy only a whole row sees."""
    query, key, value = _qkv(2, 4, 2, 40, 8, 8, seed=9)
    key[:, :, 10:20] = key[:, :, 9:19].clone()
    key[:, :, 30] = key[:, :, 2]
    return AttentionCall(query, key, value, None, 3.0, True)  # sharp rows: two tied keys hold most of a row


def _key_mask_right_padded() -> AttentionCall:
    """Right padding as the hooks hand over a mask transformers made from padding and causality: a (b, kv) key mask
    beside the causal flag, no bias."""
    query, key, value = _qkv(3, 4, 2, 20, 8, 8, seed=10)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, 14:], valid[2, 7:] = False, False
    return AttentionCall(query, key, value, None, 8 ** -0.5, True, key_mask=valid)


def _key_mask_bidirectional() -> AttentionCall:
    """An encoder's padding, left and right (no causal mask): a key mask alone."""
    query, key, value = _qkv(2, 2, 2, 17, 8, 8, seed=11)
    valid = torch.ones(2, 17, dtype=torch.bool)
    valid[0, :5], valid[1, 12:] = False, False
    return AttentionCall(query, key, value, None, 0.4, False, key_mask=valid)


def _window() -> AttentionCall:
    """A causal sliding window of 6 keys over 37 tokens (Mistral's, Gemma's local layers), no padding."""
    query, key, value = _qkv(2, 4, 2, 37, 8, 8, seed=12)
    return AttentionCall(query, key, value, None, 0.35, True, window=6)


def _window_padded() -> AttentionCall:
    """A sliding window of 8 and right padding together (every padding query's window still holds a real key)."""
    query, key, value = _qkv(2, 2, 1, 26, 8, 8, seed=13)
    valid = torch.ones(2, 26, dtype=torch.bool)
    valid[1, 22:] = False
    return AttentionCall(query, key, value, None, 0.5, True, key_mask=valid, window=8)


CASES = {"causal": _causal, "padded bool mask": _padded_bool_mask, "additive bias": _additive_bias,
         "grouped-query": _grouped_query, "multi-query": _multi_query, "value head smaller": _smaller_value_head,
         "value head larger": _larger_value_head, "odd lengths": _odd_lengths, "ties": _ties,
         "key mask, right padded": _key_mask_right_padded, "key mask, bidirectional": _key_mask_bidirectional,
         "sliding window": _window, "sliding window, padded": _window_padded}
STRUCTURED = ["key mask, right padded", "key mask, bidirectional", "sliding window", "sliding window, padded"]


def _device(backend: Backend) -> str:
    """The device the backend's cases run on (skipped where this machine has none)."""
    assert backend.name in DEVICES, f"name the device of backend {backend.name!r} in DEVICES"
    device = DEVICES[backend.name]
    if device != "cpu" and not getattr(torch, device).is_available():
        pytest.skip(f"{backend.name}: no {device} on this machine")
    return device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda backend: backend.name)
def test_backend_equals_the_reference(backend: Backend, case: str, dtype: torch.dtype) -> None:
    call = moved(CASES[case](), dtype, _device(backend))
    reason = backend.problem(call)
    if reason and backend.name in PARTIAL:
        pytest.skip(f"{backend.name} refuses the case: {reason}")
    assert reason == ""
    with torch.no_grad():
        output, statistics = backend.run(call, DEFAULT_CONFIG)
        expected, reference = REFERENCE.run(call, DEFAULT_CONFIG)
    b, hq, n, _ = call.query.shape
    tolerance = TOLERANCE[dtype]
    assert output.shape == expected.shape == (b, n, hq, call.value.shape[-1])
    assert output.dtype == call.value.dtype
    assert (output.float() - expected.float()).abs().max() <= tolerance
    assert statistics.lse.dtype == torch.float32 and statistics.backend == backend.name
    assert (statistics.lse - reference.lse).abs().max() <= tolerance * 4
    device = call.query.device
    every = torch.arange(n, device=device)
    weights = Weights(statistics).rows(every)
    assert (weights - Weights(reference).rows(every)).abs().max() <= tolerance
    # bfloat16 too: its weights are rebuilt from float32 logits of its queries and keys (docs/precision.md)
    assert (weights.sum(dim=-1) - 1).abs().max() <= tolerance * 4  # the log-sum-exp fits the logits rebuilt
    # which key tops each row: argmax's answer, ties to the earliest
    selected = torch.ones(b, n, dtype=torch.bool, device=device)
    logits = masked_logits(call)
    for shift in (-1, 0):
        rows = torch.arange(max(0, -shift), n, device=device)
        top = logits[:, :, rows].argmax(dim=-1) == (rows + shift)
        hits = top.sum(dim=(0, 2)).double().cpu()
        chosen = selected.clone()
        chosen[:, :max(0, -shift)] = False
        read = Weights(statistics)  # what the record says neighbour_hits reads, computed first, as a layer does:
        read.prefetch(*read.neighbour_reads((shift,)))
        declared = set(read.tables)
        assert torch.equal(read.neighbour_hits(chosen, shift).cpu(), hits), shift
        assert set(read.tables) == declared, shift  # it read no diagonal or column beyond what it declared
        assert torch.equal(Weights(reference).neighbour_hits(chosen, shift).cpu(), hits), shift


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda backend: backend.name)
def test_every_backend_refuses_what_cannot_be_rebuilt(backend: Backend) -> None:
    """Soft-capping and learned sinks change the weights a log-sum-exp rebuilds: every backend refuses, and
    backend_for says why in one reason."""
    call = _causal()
    for refused, reason in ((AttentionCall(call.query, call.key, call.value, None, 0.25, True, softcap=30.0),
                             "soft-capped logits"),
                            (AttentionCall(call.query, call.key, call.value, None, 0.25, True,
                                           sinks=torch.zeros(4)), "learned sink logits")):
        assert rebuild_problem(refused).startswith(reason)
        assert backend.problem(refused).startswith(reason)
        assert backend_for(refused)[0] is None and backend_for(refused)[1].startswith(reason)
    assert backend_for(call)[0] is not None


def test_a_cpu_call_is_served_by_the_cpu_backend_and_a_meta_call_by_none() -> None:
    """The hooks ask backend_for: a CPU call gets the CPU kernel; a device no backend is wired for gets the reason
    (the layer then runs the blocked path)."""
    call = _causal()
    backend, reason = backend_for(call)
    assert backend is not None and backend.name == "cpu" and reason == ""
    meta = AttentionCall(*(tensor.to("meta") for tensor in (call.query, call.key, call.value)), None, 0.25, True)
    backend, reason = backend_for(meta)
    assert backend is None and "meta" in reason


@pytest.mark.parametrize("case", ["padded bool mask", "odd lengths"])
def test_the_reference_in_query_blocks_equals_one_block(case: str) -> None:
    """The reference forms its logits a block of queries at a time (`ReferenceBackend(block=...)`): blocks of 7
    queries give the numbers of one block, bit for bit."""
    call = CASES[case]()
    output, statistics = REFERENCE.run(call, DEFAULT_CONFIG)
    blocked_output, blocked = ReferenceBackend(block=7).run(call, DEFAULT_CONFIG)
    assert torch.equal(output, blocked_output) and torch.equal(statistics.lse, blocked.lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", STRUCTURED)
@pytest.mark.parametrize("backend", [*BACKENDS, REFERENCE], ids=lambda backend: backend.name)
def test_a_key_mask_and_window_give_the_numbers_of_their_dense_bias(backend: Backend, case: str,
                                                                      dtype: torch.dtype) -> None:
    """A call whose mask is a key mask and window (what the hooks hand over for transformers' padding and sliding
    window masks) gives the numbers of the same call with the boolean mask they stand for made additive
    (`additive_bias`, what the hooks handed over before): bit for bit on backends that read a dense mask (the CPU
    kernel, the reference), within the tolerance on a kernel that reads the key mask and window themselves."""
    call = moved(CASES[case](), dtype, "cpu" if backend is REFERENCE else _device(backend))
    n, kv = call.query.shape[2], call.key.shape[2]
    distance = torch.arange(n)[:, None] + kv - n - torch.arange(kv)[None, :]
    seen = (distance >= 0) if call.causal else torch.ones(n, kv, dtype=torch.bool)
    if call.window is not None:
        seen = seen & (distance < call.window)
    seen = seen.to(call.query.device)
    key_mask = call.key_mask if call.key_mask is not None else torch.ones(1, kv, dtype=torch.bool)
    mask = seen[None, None] & key_mask.to(call.query.device)[:, None, None, :]
    dense = AttentionCall(call.query, call.key, call.value, additive_bias(mask, None, dtype), call.scaling, False)
    assert torch.equal(call.dense_bias(), dense.bias)
    assert call.key_mask is None or call.dense_bias() is call.dense_bias()  # made once per key mask (per forward)
    assert backend.problem(call) == "" and backend.problem(dense) == ""
    with torch.no_grad():
        output, statistics = backend.run(call, DEFAULT_CONFIG)
        dense_output, dense_statistics = backend.run(dense, DEFAULT_CONFIG)
    if backend.name in ("cpu", "reference"):
        assert torch.equal(output, dense_output) and torch.equal(statistics.lse, dense_statistics.lse)
    else:
        assert (output.float() - dense_output.float()).abs().max() <= TOLERANCE[dtype]
        assert (statistics.lse - dense_statistics.lse).abs().max() <= TOLERANCE[dtype] * 4


def test_refused_mask_forms() -> None:
    """A window without causal masking, or a bias beside a key mask, is no form any backend reads."""
    call = _window()
    assert "without causal" in rebuild_problem(replace(call, causal=False))
    assert "one mask form" in rebuild_problem(replace(call, bias=torch.zeros(1, 1, 37, 37)))

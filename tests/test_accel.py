"""Every registered accelerator (probe.accel.ACCELERATORS) against its head class's reduce (probe.heads.scores): the
sums and counts an entry reads of one layer call's fused statistics equal the reduce's over that call's weights, on
the CPU backend and on the CUDA backend's record through Triton's interpreter (TRITON_INTERPRET=1, set below: the
kernels on CPU tensors), causal and right-padded, on the batch of the class's probe set. A new accelerator is covered
here by its registration; a new probe set needs its batch in `_batch`."""

from __future__ import annotations

import functools
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first decorated (probe.kernels.cuda decorates lazily)

import pytest
import torch
from attention_calls import masked_logits
from torch import Tensor

from probe.accel import ACCELERATORS, Diagonal, register_accelerator
from probe.errors import ProbeError
from probe.heads.scores import SCORES, Batch, NeedleBatch
from probe.kernels import AttentionCall, CpuBackend, FusedStatistics, Weights
from probe.kernels.cuda import CudaBackend

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),  # numpy, on the padding rows
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]  # past n of the interpreter's tiles

REPEAT = 140
LENGTH = 1 + 2 * REPEAT  # past streaming's sink + recent keys (4 + 256): its band is read, not only its zeros
TOLERANCE = 1e-5  # of a mean (sums / counts): the rebuilt weights against softmax's, float32
BACKENDS = {backend.name: backend for backend in (CpuBackend(), CudaBackend())}


def _call(padded: bool) -> AttentionCall:
    """A causal grouped-query call (2 sequences, 4 query heads on 2 key/value heads); padded: the second sequence's
    last 40 keys are padding, a (b, kv) key mask as the hooks hand it over."""
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(2, 4, LENGTH, 16, generator=generator)
    key, value = torch.randn(2, 2, LENGTH, 16, generator=generator), torch.randn(2, 2, LENGTH, 16, generator=generator)
    key[:, :, 0] *= 3  # a sink key that many rows attend most
    return AttentionCall(query, key, value, None, 0.5, True, key_mask=_valid(padded) if padded else None)


def _valid(padded: bool) -> Tensor:
    valid = torch.ones(2, LENGTH, dtype=torch.bool)
    if padded:
        valid[1, LENGTH - 40:] = False
    return valid


def _batch(probe: str, valid: Tensor) -> Batch:
    """The batch a class's probe set hands its scores: random text, BOS + R tokens repeated twice, needle prompts
    (answer rows copied from a needle position, some predicted correctly)."""
    if probe == "natural":
        return Batch(valid=valid, offset=1, repeat_len=None)
    if probe == "repeated":
        return Batch(valid=valid, offset=1, repeat_len=REPEAT)
    assert probe == "needle", f"a batch for the {probe} probe set"
    generator = torch.Generator().manual_seed(8)
    sources = torch.full(valid.shape, -1)
    answers = torch.arange(LENGTH - 60, LENGTH - 45)
    sources[:, answers] = torch.randint(5, 100, (2, len(answers)), generator=generator)
    correct = torch.rand(valid.shape, generator=generator) < 0.7
    return NeedleBatch(valid=valid, offset=1, repeat_len=None, sources=sources, correct=correct)


@functools.cache
def _record(backend: str, padded: bool) -> tuple[FusedStatistics, Tensor]:
    """The backend's statistics of the call, and its weights (b, hq, n, kv) as softmax makes them: one block of
    every query (made once: the records stay plain, every entry reads them anew through its own Weights)."""
    call = _call(padded)
    assert BACKENDS[backend].problem(call) == "", BACKENDS[backend].problem(call)
    return BACKENDS[backend].run(call)[1], masked_logits(call).softmax(dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(ACCELERATORS))
def test_every_accelerator_equals_its_class_reduce(name: str, backend: str, padded: bool) -> None:
    statistics, weights = _record(backend, padded)
    batch = _batch(SCORES[name].probe, _valid(padded))
    sums, counts = ACCELERATORS[name](Weights(statistics), batch)
    expected_sums, expected_counts = SCORES[name].reduce(weights, 0, batch)
    assert torch.equal(counts.cpu(), expected_counts) and float(expected_counts.min()) > 0, name
    difference = (sums.cpu() / counts.cpu() - expected_sums / expected_counts).abs().max()
    assert difference <= TOLERANCE, (name, float(difference))
    if torch.equal(expected_sums, expected_sums.round()):  # whole numbers (rows counted, or no key): exactly
        assert torch.equal(sums.cpu(), expected_sums), name


def test_an_accelerator_is_registered_for_a_class_once() -> None:
    """By the name of a registered class (its reduce is what the entry must equal), and once."""
    with pytest.raises(ProbeError, match="no head class named 'two_back'"):
        register_accelerator("two_back", Diagonal(lambda batch: -2))
    with pytest.raises(ProbeError, match="has an accelerator already"):
        register_accelerator("previous_token", Diagonal(lambda batch: -1))

"""No host synchronisation inside a forward whose layers the CUDA backend serves (issue 44): `score_heads` with every
default score and streaming, on an unpadded batch (layer calls read side by side) and a padded one (an additive
bias), and kv-heads' scoring pass (`score_needles`: streaming sums and the answer rows' top keys), run through
Triton's interpreter (TRITON_INTERPRET=1: the CUDA backend's kernel on CPU tensors) while tests/host_reads.py
records every host read probe asks for inside the forward. On a GPU `python -m bench gpu` checks the same with
`torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import os
import random
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first decorated (probe.kernels.cuda decorates lazily)

import pytest
import torch
from conftest import tiny_loaded
from host_reads import host_reads

from probe.heads.classify import score_heads
from probe.heads.scores import SCORES
from probe.inputs import NeedleOptions, ProbeSet, needle_set
from probe.kernels import using_backend
from probe.kernels.cuda import CudaBackend
from probe.kernels.fused import _gathered_keys
from probe.kv import score_needles
from probe.models import load_model

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernel cannot run")
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),  # numpy, on the padding rows
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]  # past n of the interpreter's tiles

DEFAULT = [name for name, score in SCORES.items() if score.by_default]
NAMES = [*DEFAULT, "streaming"]


def _repeated(batch: int, length: int, padded: int) -> ProbeSet:
    """BOS + R random tokens repeated twice, `batch` sequences; the last `padded` positions of the last one are
    padding (an attention mask: the kernel reads an additive bias)."""
    generator = torch.Generator().manual_seed(0)
    half = torch.randint(3, 120, (batch, (length - 1) // 2), generator=generator)
    ids = torch.cat([torch.ones(batch, 1, dtype=torch.long), half, half], dim=1)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[-1, -padded:] = 0
    return ProbeSet("repeated", "random tokens, repeated", ids, 1, attention_mask=mask, repeat_len=half.shape[1])


@pytest.mark.parametrize("batch, length, padded, names", [
    (1, 265, 0, NAMES),  # streaming reads queries past 4 sink + 256 recent keys; layer calls read side by side
    (2, 40, 5, DEFAULT),  # padding: an additive bias, each layer call read alone, two last keys for sep
], ids=["plain", "padded"])
@pytest.mark.slow
def test_score_heads_reads_nothing_back_to_the_host_inside_a_forward(batch: int, length: int, padded: int,
                                                                     names: list[str]) -> None:
    loaded = tiny_loaded("llama_gqa")
    with using_backend(CudaBackend()), host_reads(loaded.model) as reads:
        scores = score_heads(loaded, _repeated(batch, length, padded), names, batch_size=2, path="lse")
    assert scores.path == "cuda"
    assert not reads, "\n".join(dict.fromkeys(reads))
    assert all(torch.isfinite(scores[name]).all() for name in names) and scores["sink"].max() > 0


@pytest.mark.slow
def test_kv_heads_scoring_pass_reads_nothing_back_to_the_host_inside_a_forward() -> None:
    loaded = tiny_loaded("llama_gqa")
    needles = needle_set(loaded, NeedleOptions(lengths=(48, 64), depths=(0.5,), seed=3))
    with using_backend(CudaBackend()), host_reads(loaded.model) as reads:
        retrieval, streaming, run = score_needles(loaded, needles, sink=4, recent=8)
    assert not reads, "\n".join(dict.fromkeys(reads))
    assert streaming.min() > 0 and len(run.exact) == 2


@pytest.mark.slow
def test_kv_heads_scores_from_the_kernels_top_keys_equal_the_blocked_path() -> None:
    """The answer rows' top keys from the kernel (`row_tops`), fetched after the forward, give the blocked path's
    retrieval scores on the planted GPT-2, whose head 1.1 copies the needle; streaming sums kept on the device
    equal the blocked path's too."""
    loaded = load_model(f"{Path(__file__).parent / 'planted.py'}:planted_gpt2")
    needles = needle_set(loaded, NeedleOptions(lengths=(40, 48), depths=(0.5,), seed=1))
    with using_backend(CudaBackend()):
        retrieval, streaming, run = score_needles(loaded, needles, sink=1, recent=4)
    blocked = score_needles(loaded, needles, sink=1, recent=4, fast=False)
    assert all(run.exact) and blocked[2].exact == run.exact
    assert retrieval[1, 1] > 0.99 and torch.equal(retrieval, blocked[0])
    assert torch.allclose(streaming, blocked[1], atol=1e-5)


def test_which_gathered_keys_are_hidden_is_decided_from_the_integers_as_the_mask_says() -> None:
    """`_any_hidden` (no read of the mask: it would wait for a GPU) against the mask itself, on random queries, key
    offsets and fixed keys, causal or not, with and without a key/value prefix."""
    generator = random.Random(0)
    for _ in range(3000):
        n = generator.randint(1, 12)
        kv = n + generator.choice([0, 0, generator.randint(1, 5)])
        offsets = tuple(generator.sample(range(-8, 4), generator.randint(0, 3)))
        keys = tuple(generator.sample(range(-2, 14), generator.randint(0, 2)))
        start = generator.randint(0, n)
        stop, causal = generator.randint(start, n), generator.random() < 0.5
        gathered = _gathered_keys(1, n, kv, 1, offsets, keys, start, stop, causal, torch.device("cpu"))
        rows = torch.arange(start, stop)[:, None]
        wanted = torch.cat([rows + torch.tensor(offsets, dtype=torch.long),
                            torch.tensor(keys, dtype=torch.long).expand(stop - start, -1)], dim=1)
        hidden = (wanted < 0) | (wanted >= kv) | (causal & (wanted > rows + kv - n))
        assert (gathered.hidden is not None) == bool(hidden.any()), (n, kv, offsets, keys, start, stop, causal)
        if gathered.hidden is not None:
            assert torch.equal(gathered.hidden, hidden)

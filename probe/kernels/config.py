"""Every tuning constant of the fused-attention kernels and of the searches for row maxima, in one frozen object.

None of them changes a number: each says how work is chunked or which cheap stage is tried before an exact one, so a
test (or a user on another machine) passes `dataclasses.replace(KernelConfig(), ...)` to force a stage at a short
length, and the result must not move. The fused statistics object carries its config; `score_heads`, `classify`'s
accumulator and `kv_heads`' scoring take an optional `config=`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _bfloat16_matmuls_fast() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16): its bfloat16 matmuls run ~3x faster than float32."""
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


@dataclass(frozen=True)
class KernelConfig:
    """How the fast path chunks its work and which stages it tries. Defaults are measured (bench/RESULTS.md)."""

    # rebuilding weights from the log-sum-exp (probe.kernels.fused.FusedAttention)
    row_chunk: int = 128  # query rows whose logits are computed whole at once (exact row maxima), at least
    rows_at_once: int = 2**21  # logits of the padded rows of every key/value head at once, at most (else one head)
    row_logits: int = 2**20  # logits of whole rows computed at once, at most (row_chunk rows beyond that)
    band_block: int = 64  # query rows per block of a band: each block computes band_block + width - 1 keys
    band_rows: int = 64 * 2**20 // 4  # logits of a band chunk (batch x heads x rows x keys), in floats
    diagonal_rows: int = 4096  # query rows whose diagonals' keys are gathered at once
    gathered_columns: int = 4  # columns computed with the diagonals' gather; more go through one matmul
    near_span: int = 1024  # query positions of one bucket of the near-keys stage: its rows share one slice of keys
    near_before: int = 1024  # keys before a bucket that its slice includes
    gathered_rows: int = 2048  # rows of a gathered band at once (their keys: rows x width x head_dim floats)
    bound: float = 2.0**-7  # bfloat16 upper bounds of logits: q . k + bound |q| |k| (roundings need <= 0.0059 |q||k|)
    bounds_on_cpu: bool = field(default_factory=_bfloat16_matmuls_fast)  # whether bounding whole rows pays here
    candidates: int = 64  # keys a bounded row may have whose bound reaches its key's logit: float32 logits decide
    bounds_from: int = 16384  # keys from which whole rows are bounded first (2.5x faster at 32768 keys; at 8192 the
    # operations around the matmul cost what it saves)
    # the staged search for whether a neighbour is its row's top key (probe.kernels.search)
    positional_band: int = 16  # keys i - 15 .. i + 1 (and key 0) whose weights decide most rows left open
    positional_rivals: tuple[int, ...] = (0, -2, -3, -4, -1, 1)  # offsets read for every row: cheap diagonals
    near_from: int = 4096  # keys past which the open rows go to the near keys (at 4096 and fewer the slice and the
    # whole row after it cost more than the whole row alone)
    first_keys: int = 256  # likely witnesses that beat the neighbour of a row the band leaves open: the first keys,
    longest_keys: int = 64  # and the longest keys of the key/value head (measured at 32768 tokens)
    witnesses_from: int = 8192  # keys past which open rows are read against the witnesses (at 8192: break-even)
    band_from: int = 1024  # keys past which the rows stage 1 left open go to the band; shorter rows go whole
    margin: float = 1e-4  # a neighbour is surely the top when it outweighs the mass of the keys not computed by this
    # reading several layer calls as one (probe.heads.accumulate)
    group_bytes: int = 32 * 2**20  # queries and keys of layer calls held back to be read together, at most
    # the blocked reference backend (probe.kernels.reference)
    reference_block: int = 256  # queries whose logits (b, hq, block, kv) it forms at once


DEFAULT_CONFIG = KernelConfig()
"""The configuration used where none is passed."""

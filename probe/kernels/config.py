"""How every backend's statistics are read into weights and scores: chunk sizes, in one frozen object.

None of them changes a number, so a test passes `dataclasses.replace(KernelConfig(), ...)` to force a chunking at a
short length and the result must not move. What one backend alone tunes lives with it (`SearchConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    """How the fast path chunks its work. Defaults are measured (bench/RESULTS.md)."""

    # rebuilding weights from the log-sum-exp (probe.kernels.fused.Weights)
    row_chunk: int = 128  # query rows whose logits are computed whole at once (exact row maxima), at least
    rows_at_once: int = 2**21  # logits of the padded rows of every key/value head at once, at most (else one head)
    row_logits: int = 2**20  # logits of whole rows computed at once, at most (row_chunk rows beyond that)
    band_block: int = 64  # query rows per block of a band: each block computes band_block + width - 1 keys
    band_rows: int = 64 * 2**20 // 4  # logits of a band chunk (batch x heads x rows x keys), in floats
    diagonal_rows: int = 4096  # query rows whose diagonals' keys are gathered at once
    gathered_columns: int = 4  # columns computed with the diagonals' gather; more go through one matmul
    gathered_rows: int = 2048  # rows of a gathered band at once (their keys: rows x width x head_dim floats)
    # reading several layer calls as one (probe.accel.accumulate)
    group_bytes: int = 32 * 2**20  # queries and keys of layer calls held back to be read together, at most
    moments: bool = False  # also write each row's moments (probe.kernels.moments, for probe.headvis)


DEFAULT_CONFIG = KernelConfig()
"""The configuration used where none is passed."""

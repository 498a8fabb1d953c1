"""Small models for `probe track` tests, as FILE.py:FUNCTION factories: the example's attention-only byte model at a
tiny size, and the planted model (tests/planted.py) whose induction head can be switched off in a checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "induction"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import AttentionOnly, ByteTokenizer
from planted import HEAD_DIM, planted_textbook


def tiny() -> tuple[torch.nn.Module, ByteTokenizer]:
    """2 layers x 4 heads, d_model 32, 64 positions: a checkpoint is 40 kB."""
    torch.manual_seed(0)
    return AttentionOnly(n_layers=2, d_model=32, n_heads=4, max_len=64), ByteTokenizer()


def wider() -> tuple[torch.nn.Module, ByteTokenizer]:
    """Another architecture: d_model 48."""
    return AttentionOnly(n_layers=2, d_model=48, n_heads=4, max_len=64), ByteTokenizer()


def planted() -> torch.nn.Module:
    return planted_textbook()


def planted_state(induction: bool) -> dict[str, torch.Tensor]:
    """The planted model's weights, its induction head (1.1) on, or off (its query zeroed: uniform attention)."""
    state = {name: tensor.clone() for name, tensor in planted_textbook().state_dict().items()}
    if not induction:
        state["layers.1.W_q.weight"][HEAD_DIM:2 * HEAD_DIM] = 0.0
    return state

"""Tiny models whose own float16 forward overflows (float16 ends at 65504), for tests/test_overflow.py; each is a
`--model FILE:FUNCTION` spec. Loaded in float32 they are finite: the weights are large, not broken."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a --model spec, outside pytest's path

from planted import PlantedModel, planted_textbook
from words import tiny_with_words


def mlp_overflow() -> tuple[torch.nn.Module, Any]:
    """Block 0's MLP writes values past 65504 (its down projection scaled by 1e8): every later layer reads inf/NaN."""
    model, tokenizer = tiny_with_words()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1e8)
    return model, tokenizer


def attention_overflow() -> tuple[torch.nn.Module, Any]:
    """Eager attention (logits formed in the model's dtype) with queries and keys scaled by 1e3: in float16 the
    model's own attention logits pass 65504 and its softmax gives NaN, which o_proj then reads."""
    model, tokenizer = tiny_with_words()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(1e3)
            layer.self_attn.k_proj.weight.mul_(1e3)
    return model, tokenizer


def planted_overflow() -> PlantedModel:
    """The planted custom model (a needle-ready tokenizer-free model) with layer 1's queries past 65504."""
    model = planted_textbook()
    with torch.no_grad():
        model.layers[1].W_q.weight.mul_(1e6)
    return model

"""A small attention-only transformer over bytes, written for the induction example (docs/track.md).

Olsson et al. (2022), "In-context Learning and Induction Heads", study attention-only models of one to three layers:
a token embedding, attention layers adding into the residual stream, an unembedding; no MLPs, no layer norms. Two
layers are the fewest in which an induction head can form (a previous-token head in layer 0 whose output the
layer-1 head's keys read: K-composition). This is that model, over bytes (vocabulary 256 + BOS). Positions enter
through rotary embeddings of queries and keys (Su et al. 2021, RoFormer): attending one token back is then the same
weights at every position, so a previous-token head can form in a few hundred steps on a CPU, where learned absolute
positions would need it learnt for each of the 512 positions.

`model()` is the `FILE.py:FUNCTION` factory `probe track --model examples/induction/model.py:model` calls; the
checkpoints' state dicts are loaded into what it returns.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

BOS = 256
VOCAB = 257
MAX_LEN = 256  # BOS + 255 bytes in training; the example scores in-context learning at tokens 25 and 250


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, and a BOS token (256): the tokenizer interface probe's probe sets read."""

    bos_token_id = BOS
    all_special_ids = [BOS]

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        ids = list(text.encode("utf-8"))
        return {"input_ids": [BOS, *ids] if add_special_tokens else ids}

    def decode(self, ids: Any, **_: Any) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Any) -> list[str]:
        return ["<bos>" if int(i) == BOS else bytes([int(i)]).decode("latin-1") for i in ids]


def rotary(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary positions on the first half of each head's features (Su et al. 2021; partial, as GPT-NeoX and Pythia
    do): pair (i, i + d/4) of position p turned by p * base^(-4i/d). The other half carries no position, so that a
    head can match content at any distance (an induction head's key matches a token hundreds of positions back)."""
    n, quarter = x.shape[-2], x.shape[-1] // 4
    frequencies = base ** (-torch.arange(quarter, dtype=torch.float32, device=x.device) / quarter)
    angles = torch.arange(n, dtype=torch.float32, device=x.device)[:, None] * frequencies  # (n, d/4)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second, rest = x[..., :quarter], x[..., quarter:2 * quarter], x[..., 2 * quarter:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos, rest], dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention returning (output, weights), the form probe's hooks read."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for w in (self.W_q, self.W_k, self.W_v))
        q, k = rotary(q), rotary(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.W_o((weights @ v).transpose(1, 2).reshape(b, n, d)), weights


class AttentionOnly(nn.Module):
    """Embedding, `n_layers` attention layers (rotary positions) into the residual stream, unembedding."""

    def __init__(self, n_layers: int = 2, d_model: int = 128, n_heads: int = 4, max_len: int = MAX_LEN,
                 vocab_size: int = VOCAB) -> None:
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(Attention(d_model, n_heads) for _ in range(n_layers))
        self.unembed = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        if input_ids.shape[1] > self.max_len:
            raise ValueError(f"{input_ids.shape[1]} positions: the model takes at most {self.max_len}")
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)[0]
        return self.unembed(x)


def model() -> tuple[nn.Module, ByteTokenizer]:
    """The example's model (2 layers x 4 heads, d_model 128) and its byte tokenizer, untrained."""
    torch.manual_seed(0)
    return AttentionOnly(), ByteTokenizer()

"""Two-layer attention-only models whose heads are set by hand, so that which head does what is known.

Residual stream (d_model = 1024): one-hot token | one-hot position | previous-token slot | induction slot |
a constant 1 | a junk slot that nothing reads. Heads (layer.head):
- 0.0 previous-token head: query = position i, key = position j + 1, so it attends to i - 1; it copies the token
  there into the previous-token slot.
- 0.1 sink head: constant query, key = [position == 0], so it attends to position 0; writes into the junk slot.
- 1.1 induction head: query = current token, key = previous-token slot, so it attends to the position after an
  earlier copy of the current token; it copies that token into the induction slot, which the unembedding reads:
  the model predicts the second copy of a repeated sequence and nothing else.
- 0.2, 0.3, 1.0, 1.2, 1.3: small random heads with diffuse attention, writing into the junk slot.

`planted_textbook()` uses hand-written attention modules (separate W_q/W_k/W_v, or a fused W_qkv), `planted_mha()`
the same weights in nn.MultiheadAttention. Use them as `tests/planted.py:planted_textbook` model specs too.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

VOCAB = 200
MAX_LEN = 256
N_HEADS = 4
HEAD_DIM = 256
D_MODEL = N_HEADS * HEAD_DIM
TOK, POS = 0, VOCAB
PREV = POS + MAX_LEN
IND = PREV + VOCAB
ONE = IND + VOCAB
JUNK = ONE + 1
SHARP = 20.0 * math.sqrt(HEAD_DIM)  # a score of 20 after the 1/sqrt(d) scaling: attention ~1 on the target

PLANTED = {"previous_token": {(0, 0)}, "sink": {(0, 1)}, "induction": {(1, 1)}}
UNRELATED = [(0, 2), (0, 3), (1, 0), (1, 2), (1, 3)]


class TextbookAttention(nn.Module):
    """Multi-head causal self-attention as textbooks write it, returning (output, attention_weights)."""

    def __init__(self, d_model: int, num_heads: int, fused: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.fused = num_heads, d_model // num_heads, fused
        if fused:
            self.W_qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        else:
            self.W_q = nn.Linear(d_model, d_model, bias=False)
            self.W_k = nn.Linear(d_model, d_model, bias=False)
            self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, n, d = x.shape
        if self.fused:
            q, k, v = self.W_qkv(x).split(d, dim=-1)
        else:
            q, k, v = self.W_q(x), self.W_k(x), self.W_v(x)
        q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        heads = (weights @ v).transpose(1, 2).reshape(b, n, d)
        return self.W_o(heads), weights


class MHABlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, num_heads, bias=False, batch_first=True)

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        n = x.shape[1]
        future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        out, _ = self.attn(x, x, x, attn_mask=future, need_weights=False)
        return out, None


class PlantedModel(nn.Module):
    """Attention-only: embed (token + position one-hots), two attention layers, read the induction slot."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.vocab_size = VOCAB
        self.max_len = MAX_LEN
        self.layers = nn.ModuleList(layers)
        self.unembed_scale = 10.0

    def forward(self, input_ids: Tensor) -> Tensor:
        b, n = input_ids.shape
        x = torch.zeros(b, n, D_MODEL, device=input_ids.device, dtype=next(self.parameters()).dtype)
        x[..., TOK:TOK + VOCAB] = nn.functional.one_hot(input_ids, VOCAB).to(x.dtype)
        x[..., POS:POS + n] = torch.eye(n, device=input_ids.device, dtype=x.dtype)
        x[..., ONE] = 1.0
        for layer in self.layers:
            x = x + layer(x)[0]
        return x[..., IND:IND + VOCAB] * self.unembed_scale


def planted_weights(seed: int = 0) -> list[dict[str, Tensor]]:
    """Per layer, W_q/W_k/W_v/W_o (out, in) as nn.Linear stores them."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(2):
        w = {name: torch.zeros(D_MODEL, D_MODEL) for name in ("W_q", "W_k", "W_v", "W_o")}
        layers.append(w)

    def rows(head: int) -> slice:
        return slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)

    def random_head(w: dict[str, Tensor], head: int) -> None:
        for name in ("W_q", "W_k", "W_v"):
            w[name][rows(head), :POS + MAX_LEN] = torch.randn(HEAD_DIM, POS + MAX_LEN, generator=generator) * 0.05
        w["W_o"][JUNK:JUNK + 8, rows(head)] = torch.randn(8, HEAD_DIM, generator=generator) * 0.05

    first, second = layers
    # 0.0 previous-token head
    h = rows(0)
    for i in range(MAX_LEN):
        first["W_q"][h.start + i, POS + i] = SHARP
    for j in range(MAX_LEN - 1):
        first["W_k"][h.start + j + 1, POS + j] = 1.0
    for t in range(VOCAB):
        first["W_v"][h.start + t, TOK + t] = 1.0
        first["W_o"][PREV + t, h.start + t] = 1.0
    # 0.1 sink head
    h = rows(1)
    first["W_q"][h.start, ONE] = SHARP
    first["W_k"][h.start, POS + 0] = 1.0
    first["W_v"][h.start, ONE] = 1.0
    first["W_o"][JUNK + 9, h.start] = 1.0
    random_head(first, 2)
    random_head(first, 3)
    # 1.1 induction head
    h = rows(1)
    for t in range(VOCAB):
        second["W_q"][h.start + t, TOK + t] = SHARP
        second["W_k"][h.start + t, PREV + t] = 1.0
        second["W_v"][h.start + t, TOK + t] = 1.0
        second["W_o"][IND + t, h.start + t] = 1.0
    random_head(second, 0)
    random_head(second, 2)
    random_head(second, 3)
    return layers


def planted_textbook(fused: bool = False) -> PlantedModel:
    layers = []
    for w in planted_weights():
        attention = TextbookAttention(D_MODEL, N_HEADS, fused=fused)
        with torch.no_grad():
            if fused:
                attention.W_qkv.weight.copy_(torch.cat([w["W_q"], w["W_k"], w["W_v"]]))
            else:
                for name in ("W_q", "W_k", "W_v"):
                    getattr(attention, name).weight.copy_(w[name])
            attention.W_o.weight.copy_(w["W_o"])
        layers.append(attention)
    return PlantedModel(layers).eval()


def planted_fused() -> PlantedModel:
    return planted_textbook(fused=True)


def planted_mha() -> PlantedModel:
    layers = []
    for w in planted_weights():
        block = MHABlock(D_MODEL, N_HEADS)
        with torch.no_grad():
            block.attn.in_proj_weight.copy_(torch.cat([w["W_q"], w["W_k"], w["W_v"]]))
            block.attn.out_proj.weight.copy_(w["W_o"])
        layers.append(block)
    return PlantedModel(layers).eval()


class PlantedLM(PlantedModel):
    """The planted model with its one-hot embedding and its readout as modules (nn.Embedding, nn.Linear): the
    copying score and the OV circuit read through the unembedding find them there."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__(layers)
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        with torch.no_grad():
            self.embed.weight.zero_()
            self.embed.weight[:, TOK:TOK + VOCAB] = torch.eye(VOCAB)
            self.lm_head.weight.zero_()
            self.lm_head.weight[:, IND:IND + VOCAB] = torch.eye(VOCAB) * self.unembed_scale

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: Tensor) -> Tensor:
        n = input_ids.shape[1]
        x = self.embed(input_ids)
        x[..., POS:POS + n] = torch.eye(n, device=input_ids.device)
        x[..., ONE] = 1.0
        for layer in self.layers:
            x = x + layer(x)[0]
        return self.lm_head(x)


def planted_lm() -> PlantedLM:
    """planted_textbook's heads in a model with an embedding and an LM head."""
    return PlantedLM(list(planted_textbook().layers)).eval()


def planted_gpt2() -> nn.Module:
    """planted_textbook's heads inside a transformers GPT-2 (layer norms made identities, MLPs writing nothing, the LM
    head reading the induction slot), so that what needs transformers attention (window ablation, the calibrated
    kv-heads budget) meets a model whose one retrieval head (1.1) is known."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=D_MODEL, n_layer=2, n_head=N_HEADS,
                        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                        attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.transformer.wte.weight[:, TOK:TOK + VOCAB] = torch.eye(VOCAB)
        model.transformer.wte.weight[:, ONE] = 1.0
        model.transformer.wpe.weight.zero_()
        model.transformer.wpe.weight[:, POS:POS + MAX_LEN] = torch.eye(MAX_LEN)
        for block, w in zip(model.transformer.h, planted_weights()):
            block.ln_1, block.ln_2 = nn.Identity(), nn.Identity()
            block.attn.c_attn.weight.copy_(torch.cat([w["W_q"], w["W_k"], w["W_v"]]).T)  # Conv1D: (in, out)
            block.attn.c_proj.weight.copy_(w["W_o"].T)
            for bias in (block.attn.c_attn.bias, block.attn.c_proj.bias, block.mlp.c_proj.bias):
                bias.zero_()
            block.mlp.c_proj.weight.zero_()
        model.transformer.ln_f = nn.Identity()
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, IND:IND + VOCAB] = torch.eye(VOCAB) * 10.0
    return model

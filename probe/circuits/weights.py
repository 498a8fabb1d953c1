"""Per-head weight matrices, read from the model's attention modules, in the row-vector convention of Elhage et al.
2021 ("A Mathematical Framework for Transformer Circuits"): a head reads the residual stream x (d_model) as
q = x W_Q, k = x W_K, v = x W_V (each d_model -> d_head) and writes z W_O (d_head -> d_model).

- Grouped-query attention: the key/value weights a group of query heads shares belong to each of them (query head h
  takes key/value head h // (n_heads / n_kv_heads), as transformers' repeat_kv does).
- The gain of the normalisation in front of the attention (RMSNorm or LayerNorm weight) is folded into W_Q, W_K and
  W_V: it scales the inputs' coordinates. What cannot be folded is ignored: the division by the norm of x (a scalar
  per position), LayerNorm's centring and biases, and rotary position embeddings (which rotate q and k by position;
  weight-based scores see the weights as if there were none).
- Multi-head latent attention (DeepSeek V2 / V3): queries and keys/values go through low-rank latents with a norm
  between the two projections; the product of the two is the head's matrix (the latent norm's gain folded in, its
  division ignored like the pre-attention norm's), and the rotary part of the key, one for all heads, is each head's.
  W_V and W_O are then d_model -> v_head_dim and back, smaller than W_Q and W_K's d_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.models.parts import input_embeddings, output_embeddings

PRE_ATTENTION_NORMS = ("input_layernorm", "ln_1", "attention_norm", "norm1", "ln_attn", "pre_attention_layernorm")
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


@dataclass
class HeadWeights:
    """One layer's per-query-head matrices, float64, with the pre-attention norm's gain folded in."""

    W_Q: Tensor  # (n_heads, d_model, d_head)
    W_K: Tensor  # (n_heads, d_model, d_head), a key/value group's weights repeated for each of its query heads
    W_V: Tensor  # (n_heads, d_model, d_value): d_value is d_head except under multi-head latent attention
    W_O: Tensor  # (n_heads, d_value, d_model)
    folded: str  # what was folded, for reports ("" when nothing was found)


def _split_rows(weight: Tensor, heads: int, head_dim: int) -> Tensor:
    """nn.Linear weight (heads * head_dim, d_model) -> (heads, d_model, head_dim)."""
    return weight.reshape(heads, head_dim, -1).transpose(1, 2)


def _latent(up: Any, norm: Any, down: Tensor) -> Tensor:
    """The product of a low-rank pair `norm(x down^T) up^T` as one (out, in) weight, the norm's gain folded in."""
    gain = _gain(norm)
    middle = up.weight.detach().double() if gain is None else up.weight.detach().double() * gain[None, :]
    return middle @ down.detach().double()


def _latent_projections(module: Any, layer: AttentionLayer) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DeepSeek's multi-head latent attention as (q, k, v, o) weights of per-head layout: keys [no rotary | rotary]."""
    heads, nope, value = layer.n_heads, module.qk_nope_head_dim, layer.value_dim
    if getattr(module, "q_proj", None) is not None:
        q = module.q_proj.weight.detach().double()
    else:
        q = _latent(module.q_b_proj, module.q_a_layernorm, module.q_a_proj.weight)
    down = module.kv_a_proj_with_mqa.weight
    rank = down.shape[0] - module.qk_rope_head_dim
    kv = _latent(module.kv_b_proj, module.kv_a_layernorm, down[:rank]).reshape(heads, nope + value, -1)
    rotary = down[rank:].detach().double()[None].expand(heads, -1, -1)  # one rotary key, shared by every head
    k = torch.cat([kv[:, :nope], rotary], dim=1).reshape(heads * layer.head_dim, -1)
    return q, k, kv[:, nope:].reshape(heads * value, -1), module.o_proj.weight


def _projections(module: nn.Module, layer: AttentionLayer) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v) weights as nn.Linear stores them (out, in) and the output weight (d_model, n_heads * d_value)."""
    q_size, kv_size = layer.n_heads * layer.head_dim, layer.n_kv_heads * layer.head_dim
    if hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
        return _latent_projections(module, layer)
    names = [("q_proj", "k_proj", "v_proj", "o_proj"), ("W_q", "W_k", "W_v", "W_o")]
    for names_ in names:
        linears: list[Any] = [getattr(module, name, None) for name in names_]
        if all(isinstance(linear, nn.Linear) for linear in linears):
            wq, wk, wv, wo = linears
            return wq.weight, wk.weight, wv.weight, wo.weight
    fused_linear = getattr(module, "qkv_proj", None) or getattr(module, "W_qkv", None)
    if isinstance(fused_linear, nn.Linear):
        out: Any = getattr(module, "o_proj", None) or getattr(module, "W_o", None)
        q, k, v = fused_linear.weight.split([q_size, kv_size, kv_size])
        return q, k, v, out.weight
    attn, proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if attn is not None and proj is not None:  # GPT-2 Conv1D: weight (in, out)
        q, k, v = attn.weight.T.split([q_size, kv_size, kv_size])
        return q, k, v, proj.weight.T
    if isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
        q, k, v = module.in_proj_weight.split([q_size, kv_size, kv_size])
        return q, k, v, module.out_proj.weight
    raise ProbeError(f"cannot read the weights of {type(module).__name__}: weight-based scores read q/k/v/o_proj, "
                     "W_q/W_k/W_v/W_o, a fused qkv_proj/W_qkv, GPT-2's c_attn/c_proj, DeepSeek's latent "
                     "kv_a_proj_with_mqa/kv_b_proj and nn.MultiheadAttention",
                     parameter="model")


def _gain(norm: nn.Module | None) -> Tensor | None:
    """The normalisation's per-coordinate gain (Gemma stores it as weight - 1)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor):
        return None
    gain = weight.detach().double()
    return gain + 1.0 if "Gemma" in type(norm).__name__ else gain


def _parent(model: nn.Module, module: nn.Module) -> nn.Module | None:
    for name, candidate in model.named_modules():
        if candidate is module:
            return model.get_submodule(name.rpartition(".")[0])
    return None


def _named_child(parent: nn.Module | None, names: tuple[str, ...]) -> tuple[str, nn.Module | None]:
    for name in names:
        child = getattr(parent, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return "", None


def layer_weights(model: nn.Module, layer: AttentionLayer) -> HeadWeights:
    """One attention layer's per-head W_Q, W_K, W_V, W_O (see the module docstring)."""
    q, k, v, o = (w.detach().double() for w in _projections(layer.module, layer))
    heads, kv_heads, head_dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    group = heads // max(kv_heads, 1)
    W_Q = _split_rows(q, heads, head_dim)
    W_K = _split_rows(k, kv_heads, head_dim).repeat_interleave(group, dim=0)
    W_V = _split_rows(v, kv_heads, layer.value_dim).repeat_interleave(group, dim=0)
    W_O = o.T.reshape(heads, layer.value_dim, -1)  # (n_heads, d_value, d_model)
    name, norm = _named_child(_parent(model, layer.module), PRE_ATTENTION_NORMS)
    gain = _gain(norm)
    if gain is not None and gain.shape[0] == W_Q.shape[1]:
        W_Q, W_K, W_V = (gain[None, :, None] * w for w in (W_Q, W_K, W_V))
    else:
        name = ""
    return HeadWeights(W_Q, W_K, W_V, W_O, name)


def all_layer_weights(model: nn.Module) -> list[HeadWeights]:
    """Every attention layer's per-head weights (`layer_weights`), in layer order; refused on an encoder-decoder."""
    layers = attention_layers(model)
    if any(layer.stack for layer in layers):  # composition assumes every head reads and writes one stream
        raise ProbeError("weight-based composition reads one residual stream, and an encoder-decoder has two (the "
                         "encoder's and the decoder's, joined by cross-attention): circuits does not apply to it")
    return [layer_weights(model, layer) for layer in layers]


def embedding_matrices(model: nn.Module) -> tuple[Tensor, Tensor]:
    """W_E (vocab, d_model) and W_U (d_model, vocab) float32, the final norm's gain folded into W_U."""
    embed, unembed = input_embeddings(model), output_embeddings(model)
    if not isinstance(embed, nn.Embedding) or not isinstance(unembed, nn.Linear):
        raise ProbeError("the copying score needs token embeddings and an LM head (a causal language model)",
                         parameter="model")
    W_E = embed.weight.detach().float()
    W_U = unembed.weight.detach().float().T  # (d_model, vocab)
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    _, norm = _named_child(body, FINAL_NORMS)
    gain = _gain(norm)
    if gain is not None and gain.shape[0] == W_U.shape[0]:
        W_U = gain.float()[:, None] * W_U
    return W_E, W_U

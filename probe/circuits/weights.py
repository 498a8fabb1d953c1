"""Per-head weight matrices in the row-vector convention of Elhage et al. 2021 (docs/circuits.md): q = x W_Q,
k = x W_K, v = x W_V, a head writes z W_O. A key/value group's weights belong to each of its query heads; the
pre-attention norm's gain is folded into W_Q, W_K, W_V; what the weights cannot say (the norm's division, centring,
biases, rotary embeddings) is ignored. Multi-head latent attention's two projections are multiplied into one
(probe.models.parts), so its W_V and W_O are d_model -> v_head_dim and back.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.models.parts import (FINAL_NORMS, attention_projections, base_model, gain, input_embeddings, named_child,
                                output_embeddings, pre_attention_norm)


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


def layer_weights(model: nn.Module, layer: AttentionLayer) -> HeadWeights:
    """One attention layer's per-head W_Q, W_K, W_V, W_O (see the module docstring)."""
    projections = attention_projections(layer.module, layer.n_heads, layer.n_kv_heads, layer.head_dim, layer.value_dim)
    q, k, v, o = (w.detach().double() for w in projections)
    heads, kv_heads, head_dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    group = heads // max(kv_heads, 1)
    W_Q = _split_rows(q, heads, head_dim)
    W_K = _split_rows(k, kv_heads, head_dim).repeat_interleave(group, dim=0)
    W_V = _split_rows(v, kv_heads, layer.value_dim).repeat_interleave(group, dim=0)
    W_O = o.T.reshape(heads, layer.value_dim, -1)  # (n_heads, d_value, d_model)
    name, norm = pre_attention_norm(model, layer.module)
    scale = gain(norm)
    if scale is not None and scale.shape[0] == W_Q.shape[1]:
        W_Q, W_K, W_V = (scale[None, :, None] * w for w in (W_Q, W_K, W_V))
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
    _, norm = named_child(base_model(model), FINAL_NORMS)
    scale = gain(norm)
    if scale is not None and scale.shape[0] == W_U.shape[0]:
        W_U = scale.float()[:, None] * W_U
    return W_E, W_U

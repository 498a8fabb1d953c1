"""Weight-based scores of heads and pairs of heads (Elhage et al. 2021; docs/circuits.md), no data needed. Weights
are per query head, row vectors: q = x W_Q, k = x W_K, v = x W_V, a head writes z W_O; a key/value group's weights
belong to each of its query heads, the pre-attention norm's gain is folded into W_Q, W_K, W_V, and what the weights
cannot say (the norm's division, centring, biases, rotary embeddings) is ignored; multi-head latent attention's two
projections are multiplied into one (probe.models.parts), so its W_V and W_O are d_model -> v_head_dim and back.
Composition of A into B: ||M_A M_B||_F / (||M_A||_F ||M_B||_F), M_A = W_OV of A, M_B = W_QK^T (K), W_QK (Q) or W_OV
(V) of B, against Gaussian matrices of the same shapes; every matrix has rank d_head, so the norms are taken on
d_head x d_head QR triangles. Copying: sum(lambda) / sum(|lambda|) of W_E W_OV W_U's eigenvalues, from the
d_head x d_head W_O W_U W_E W_V (eig(AB) = eig(BA)), float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.models.parts import (FINAL_NORMS, attention_projections, base_model, gain, input_embeddings, named_child,
                                output_embeddings, pre_attention_norm)
from probe.progress import ProgressArg, callback, reports

KINDS = ("k", "q", "v")
UNIT = "layer pairs"  # what `composition_scores` counts in its progress
BASELINE_SAMPLES = 16  # pairs of random draws; the mean is close to 1/sqrt(d_model)


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


def _factors(weights: HeadWeights, kind: str) -> tuple[Tensor, Tensor]:
    """(left (n_heads, d_model, d_head), right (n_heads, d_head, d_model)) with M = left @ right: W_OV for the
    earlier head ("ov"), W_QK^T ("k"), W_QK ("q") or W_OV ("v") for the later one."""
    if kind in ("ov", "v"):
        return weights.W_V, weights.W_O
    if kind == "k":
        return weights.W_K, weights.W_Q.transpose(1, 2)
    if kind == "q":
        return weights.W_Q, weights.W_K.transpose(1, 2)
    raise ProbeError(f"unknown composition {kind!r}: use one of {', '.join(KINDS)}", parameter="kind")


def _triangles(left: Tensor, right: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """QR triangles of left and right^T (each (n, d_head, d_head)), and ||left @ right||_F per head."""
    t_left = torch.linalg.qr(left).R
    t_right = torch.linalg.qr(right.transpose(1, 2)).R
    norms = torch.linalg.matrix_norm(t_left @ t_right.transpose(1, 2))
    return t_left, t_right, norms


def distinct_heads(left: Tensor) -> tuple[Tensor, Tensor]:
    """(the distinct matrices of `left` (n, d_model, d_head), each head's index among them): a grouped-query layer's
    key and value weights are one matrix per group, repeated for each of its query heads."""
    keep: list[int] = []
    index = []
    for head in range(left.shape[0]):
        found = next((i for i, kept in enumerate(keep) if torch.equal(left[kept], left[head])), None)
        if found is None:
            keep.append(head)
            found = len(keep) - 1
        index.append(found)
    return left[keep], torch.tensor(index)


def composition_between(earlier: tuple[Tensor, Tensor], later: tuple[Tensor, Tensor],
                        triangles: tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]],
                        distinct: tuple[Tensor, Tensor]) -> Tensor:
    """(heads of A, heads of B) composition of earlier[0] @ earlier[1] into later[0] @ later[1]; `triangles` and
    `distinct` (of later[0]) are computed once per layer, and a key/value group's product once per group."""
    (t_a, _, a_norms), (_, t_b_right, b_norms) = triangles
    left, index = distinct
    middle = torch.einsum("aik,bkj->abij", earlier[1], left)[:, index]  # (heads A, heads B, d_head, d_head)
    product = t_a[:, None] @ middle @ t_b_right.transpose(1, 2)[None]
    return torch.linalg.matrix_norm(product) / (a_norms[:, None] * b_norms[None, :]).clamp(min=1e-300)


@lru_cache(maxsize=16)
def random_baseline(d_model: int, d_head: int, samples: int = BASELINE_SAMPLES, seed: int = 0) -> float:
    """Mean composition score of independent Gaussian matrices of the same shapes, cached per shape."""
    generator = torch.Generator().manual_seed(seed)

    def draw() -> tuple[Tensor, Tensor]:
        return (torch.randn(samples, d_model, d_head, generator=generator, dtype=torch.float64),
                torch.randn(samples, d_head, d_model, generator=generator, dtype=torch.float64))

    earlier, later = draw(), draw()  # the i-th A into the i-th B
    (t_a, _, a_norms), (_, t_b_right, b_norms) = _triangles(*earlier), _triangles(*later)
    product = t_a @ (earlier[1] @ later[0]) @ t_b_right.transpose(1, 2)  # (samples, d_head, d_head)
    return float((torch.linalg.matrix_norm(product) / (a_norms * b_norms).clamp(min=1e-300)).mean())


@dataclass
class Composition:
    """Composition scores of every earlier head into every later head; NaN where A is not in an earlier layer."""

    model: str
    scores: dict[str, Tensor]  # kind -> (n_layers, n_heads, n_layers, n_heads): [A layer, A head, B layer, B head]
    baseline: float
    folded: str  # the norm whose gain was folded into the reading weights ("" if none)

    def score(self, kind: str, earlier: tuple[int, int], later: tuple[int, int]) -> float:
        return float(self.scores[kind][earlier[0], earlier[1], later[0], later[1]])

    def rank_in_layer(self, kind: str, earlier: tuple[int, int], later: tuple[int, int]) -> int:
        """1 if `earlier` composes into `later` most strongly of its layer's heads."""
        row = self.scores[kind][earlier[0], :, later[0], later[1]]
        return int((row > row[earlier[1]]).sum()) + 1


@reports("composition")
def composition_scores(model: nn.Module, name: str = "", kinds: tuple[str, ...] = KINDS, *,
                       progress: ProgressArg = None) -> Composition:
    """K-, Q- and V-composition of every head into every head of a later layer; progress in layer pairs."""
    layers = all_layer_weights(model)
    n_layers, n_heads = len(layers), max(w.W_Q.shape[0] for w in layers)
    result = {}
    total, done, report = len(kinds) * n_layers * (n_layers - 1) // 2, 0, callback(progress) or (lambda *_: None)
    report(0, total)
    for kind in kinds:
        table = torch.full((n_layers, n_heads, n_layers, n_heads), float("nan"), dtype=torch.float64)
        earlier = [_factors(w, "ov") for w in layers]
        earlier_triangles = [_triangles(*factors) for factors in earlier]  # once per layer, not once per pair
        for b, weights in enumerate(layers):
            later = _factors(weights, kind)
            later_triangles, distinct = _triangles(*later), distinct_heads(later[0])
            for a in range(b):
                scores = composition_between(earlier[a], later, triangles=(earlier_triangles[a], later_triangles),
                                             distinct=distinct)
                table[a, :scores.shape[0], b, :scores.shape[1]] = scores
            done += b
            if b:
                report(done, total)
        result[kind] = table
    d_model, d_head = layers[0].W_Q.shape[1:]
    return Composition(name, result, random_baseline(d_model, d_head), layers[0].folded)


def copying_scores(model: nn.Module) -> Tensor:
    """(n_layers, n_heads) copying scores (see the module docstring)."""
    W_E, W_U = embedding_matrices(model)
    readback = (W_U @ W_E).double()  # (d_model, d_model): unembed, then embed again
    layers = all_layer_weights(model)
    table = torch.full((len(layers), max(w.W_Q.shape[0] for w in layers)), float("nan"), dtype=torch.float64)
    for index, weights in enumerate(layers):
        small = weights.W_O @ readback @ weights.W_V  # (n_heads, d_head, d_head)
        eigenvalues = torch.linalg.eigvals(small)
        table[index, :small.shape[0]] = eigenvalues.sum(dim=-1).real / eigenvalues.abs().sum(dim=-1).clamp(min=1e-300)
    return table

"""A model's parts (projections, norms, MLP, embeddings), each by the first of its families' names a module has: the
one list of part names."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError

SEPARATE_PROJECTIONS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("W_q", "W_k", "W_v", "W_o"))
"""Query, key, value and output projections as four nn.Linear."""
FUSED_PROJECTIONS = ("qkv_proj", "W_qkv")  # one nn.Linear for the queries, keys and values, beside o_proj / W_o
OUTPUT_PROJECTIONS = ("o_proj", "dense", "c_proj", "out_proj", "W_o", "wo")
"""The output projection (its input is the heads, head-major): Llama's, BLOOM's and Falcon's, GPT-2's Conv1D,
GPT-J's and the rest."""
TEXTBOOK_OUTPUT_PROJECTIONS = ("W_o", "out_proj", "o_proj")  # what marks a hand-written attention module
PRE_ATTENTION_NORMS = ("input_layernorm", "ln_1", "attention_norm", "norm1", "ln_attn", "pre_attention_layernorm")
QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
MLPS = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
POSITION_EMBEDDINGS = ("wpe", "embed_positions", "position_embeddings")


def _part(model: nn.Module, getter_name: str) -> nn.Module | None:
    getter = getattr(model, getter_name, None)
    try:
        found = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):  # transformers' base class for a model that has none
        return None
    return found if isinstance(found, nn.Module) else None


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The token embedding (`get_input_embeddings()`), or None."""
    return _part(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The LM head (`get_output_embeddings()`), or None."""
    return _part(model, "get_output_embeddings")


def base_model(model: nn.Module) -> nn.Module | None:
    """The model under the head (`base_model_prefix`: Llama's `model`, GPT-2's `transformer`), or None."""
    return getattr(model, getattr(model, "base_model_prefix", ""), None)


def position_embedding(model: nn.Module) -> nn.Module | None:
    """The learned position embedding (GPT-2's `wpe`) of the base model; None where it has none (rotary models)."""
    body = base_model(model)
    return named_child(model if body is None else body, POSITION_EMBEDDINGS)[1]


def named_child(parent: nn.Module | None, names: tuple[str, ...]) -> tuple[str, nn.Module | None]:
    """The first of `names` that is a submodule of `parent`, and its name; ("", None) where none is."""
    for name in names:
        child = getattr(parent, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return "", None


def pre_attention_norm(model: nn.Module, attention: nn.Module) -> tuple[str, nn.Module | None]:
    """The norm in front of an attention module (in its block), and its name; ("", None) where none is found."""
    block = next((model.get_submodule(name.rpartition(".")[0]) for name, module in model.named_modules()
                  if module is attention), None)
    return named_child(block, PRE_ATTENTION_NORMS)


def gain(norm: nn.Module | None) -> Tensor | None:
    """A normalisation's per-coordinate gain, float64 (Gemma stores it as weight - 1); None where it has none."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor):
        return None
    found = weight.detach().double()
    return found + 1.0 if "Gemma" in type(norm).__name__ else found


def qk_norms(attention: nn.Module) -> list[str]:
    """The names of the attention's query and key norms (Qwen3's, OLMo 2's), where it has them."""
    return [name for name in QK_NORMS if isinstance(getattr(attention, name, None), nn.Module)]


def separate_projections(attention: nn.Module) -> list[nn.Linear] | None:
    """The query, key and value projections where they are three nn.Linear (q_proj, k_proj, v_proj), else None."""
    linears = [getattr(attention, name, None) for name in SEPARATE_PROJECTIONS[0][:3]]
    return linears if all(isinstance(linear, nn.Linear) for linear in linears) else None  # type: ignore[return-value]


def output_projection_weight(attention: nn.Module, width: int, d_model: int) -> tuple[Tensor, Tensor | None] | None:
    """The output projection as (in, out) = (width, d_model) float64 on the CPU, and its bias; None where no part of
    that shape has one of OUTPUT_PROJECTIONS' names."""
    for name in OUTPUT_PROJECTIONS:
        module = getattr(attention, name, None)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            continue
        matrix = weight.T if isinstance(module, nn.Linear) else weight  # GPT-2's Conv1D stores (in, out)
        if tuple(matrix.shape) == (width, d_model):
            bias = getattr(module, "bias", None)
            return matrix.detach().double().cpu(), None if bias is None else bias.detach().double().cpu()
    return None


def _latent(up: Any, norm: Any, down: Tensor) -> Tensor:
    """The product of a low-rank pair `norm(x down^T) up^T` as one (out, in) weight, the norm's gain folded in."""
    found = gain(norm)
    middle = up.weight.detach().double() if found is None else up.weight.detach().double() * found[None, :]
    return middle @ down.detach().double()


def _latent_projections(module: Any, heads: int, head_dim: int,
                        value_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DeepSeek's multi-head latent attention as (q, k, v, o) weights of per-head layout: keys [no rotary | rotary]."""
    nope = module.qk_nope_head_dim
    if getattr(module, "q_proj", None) is not None:
        q = module.q_proj.weight.detach().double()
    else:
        q = _latent(module.q_b_proj, module.q_a_layernorm, module.q_a_proj.weight)
    down = module.kv_a_proj_with_mqa.weight
    rank = down.shape[0] - module.qk_rope_head_dim
    kv = _latent(module.kv_b_proj, module.kv_a_layernorm, down[:rank]).reshape(heads, nope + value_dim, -1)
    rotary = down[rank:].detach().double()[None].expand(heads, -1, -1)  # one rotary key, shared by every head
    k = torch.cat([kv[:, :nope], rotary], dim=1).reshape(heads * head_dim, -1)
    return q, k, kv[:, nope:].reshape(heads * value_dim, -1), module.o_proj.weight


def attention_projections(module: nn.Module, heads: int, kv_heads: int, head_dim: int,
                          value_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v) weights as nn.Linear stores them (out, in) and the output weight (d_model, heads * value_dim)."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    if hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
        return _latent_projections(module, heads, head_dim, value_dim)
    for names in SEPARATE_PROJECTIONS:
        linears: list[Any] = [getattr(module, name, None) for name in names]
        if all(isinstance(linear, nn.Linear) for linear in linears):
            wq, wk, wv, wo = linears
            return wq.weight, wk.weight, wv.weight, wo.weight
    fused_linear = getattr(module, FUSED_PROJECTIONS[0], None) or getattr(module, FUSED_PROJECTIONS[1], None)
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

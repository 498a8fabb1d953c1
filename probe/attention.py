"""Find a model's attention layers, and hook them: read each head's attention weights, edit each head's output.

Everything goes through one context manager, `attention_hooks`, in the spirit of baukit's nethook: it installs
what it needs on entry and restores the model exactly on exit, also when the body raises.

Three kinds of attention layer are handled, one function each:
- Hugging Face models whose attention goes through transformers' attention interface (Llama, Gemma, Qwen,
  Mistral, GPT-2, BERT, ...). probe registers its own attention implementation, `probe_sdpa` or `probe_eager`
  (named after the mask format it keeps), and switches the model to it for the duration. Layers that nobody reads
  run the model's original implementation; layers that are read compute eager attention in query blocks and hand
  each block of weights, per query head (grouped- and multi-query attention repeated to query heads), to the
  caller, so nothing of size heads x n x n is kept for more than one block.
- `nn.MultiheadAttention`: its forward is replaced, for the duration, by the same blocked computation.
- hand-written modules in the textbook style (`num_heads`, an output projection `W_o` / `out_proj` / `o_proj`,
  forward returning `(output, attention_weights)`): weights are read from the returned tuple, head outputs are
  edited at the input of the output projection.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.errors import ProbeError

WeightsHook = Callable[[int, int, Tensor], None]
"""(layer, first query index of the block, weights (batch, query_heads, block, keys)) -> None."""
HeadsEdit = Callable[[int, Tensor], Tensor]
"""(layer, head outputs (batch, queries, heads, head_dim), before the output projection) -> replacement."""

OUTPUT_PROJECTIONS = ("W_o", "out_proj", "o_proj")
BLOCK_BYTES = 256 * 2**20  # scores of one query block, per temporary; bounds peak memory at long context
CAUSAL_BLOCK = 128  # smallest query block worth splitting causal attention into


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer, numbered in the order the model calls it."""

    index: int
    module: nn.Module
    kind: str  # "hf", "mha" or "custom"
    n_heads: int  # query heads
    n_kv_heads: int
    head_dim: int


# ---------------------------------------------------------------------------------------------------------------
# the shared computation


def _choose_block(batch: int, heads: int, queries: int, keys: int, query_block: int | None) -> int:
    if query_block is not None:
        return max(1, query_block)
    per_query = batch * heads * keys * 4
    return max(1, min(queries, BLOCK_BYTES // max(per_query, 1)))


def blocked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scaling: float | None,
    mask: Tensor | None,
    causal: bool,
    on_block: Callable[[int, Tensor], None] | None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    position_bias: Tensor | None = None,
    dropout: float = 0.0,
    query_block: int | None = None,
) -> Tensor:
    """Eager softmax attention, computed query block by query block.

    query (b, hq, n, d), key/value (b, hk, kv, d) with hq a multiple of hk; mask broadcastable to (b, hq, n, kv),
    boolean (True = attend) or additive float. Returns (b, hq, n, d). `on_block(start, weights)` sees the float32
    weights of queries start .. start + block over all keys: the same numbers eager attention produces.

    Cost-saving details that do not change the numbers: grouped-query heads are computed by folding the query
    heads of one key/value head into the query axis (no repeated copies of keys and values); the scaling is applied
    to the query block; and without a mask, causal attention computes only the keys up to the block's last query
    (the later ones get weight 0, written as zeros into the block handed to `on_block`).
    """
    batch, n_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys = key.shape[1], key.shape[2]
    repeat = n_heads // n_kv_heads
    offset = n_keys - n_queries  # queries are the last n positions of the keys
    scaling = head_dim**-0.5 if scaling is None else scaling
    truncate = causal and mask is None and offset >= 0  # keys after a block's last query are never attended
    block = _choose_block(batch, n_heads, n_queries, n_keys, query_block)
    if truncate and query_block is None:  # several blocks, so that the skipped keys add up (<= 1/16 computed twice)
        block = min(block, max(CAUSAL_BLOCK, -(-n_queries // 8)))
    future = None
    if truncate and n_queries > 1:
        size = min(block, n_queries)
        future = torch.ones(size, size, dtype=torch.bool, device=query.device).triu_(1)
    key_t = key.transpose(-1, -2)  # (b, hk, d, kv)
    outputs = []
    for start in range(0, n_queries, block):
        stop = min(start + block, n_queries)
        size = stop - start
        limit = stop + offset if truncate else n_keys  # keys this block can attend to
        # (b, hk, repeat * size, d): the query heads sharing a key/value head, one after the other
        q = query[:, :, start:stop].reshape(batch, n_kv_heads, repeat * size, head_dim) * scaling
        scores = torch.matmul(q, key_t[..., :limit]).view(batch, n_heads, size, limit)
        del q
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if position_bias is not None:
            bias = position_bias[..., start:stop, :limit] if position_bias.shape[-2] > 1 else position_bias[..., :limit]
            scores = scores + bias
        if mask is not None:
            block_mask = mask[..., start:stop, :n_keys] if mask.shape[-2] > 1 else mask[..., :n_keys]
            if block_mask.dtype == torch.bool:
                scores = scores.masked_fill_(block_mask.logical_not(), torch.finfo(scores.dtype).min)
            elif block_mask.dtype == scores.dtype:
                scores = scores.add_(block_mask)
            else:
                scores = scores + block_mask
        elif future is not None:  # causal: only the last `size` keys can lie after a query
            scores[..., limit - size:].masked_fill_(future[:size, :size], torch.finfo(scores.dtype).min)
        if sinks is not None:  # learned sink logits (gpt-oss): one extra column, dropped after the softmax
            sink_column = sinks.reshape(1, -1, 1, 1).expand(batch, -1, size, 1).to(scores.dtype)
            combined = torch.cat([scores, sink_column], dim=-1)
            del scores
            combined = combined - combined.max(dim=-1, keepdim=True).values
            weights = F.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
            del combined
        else:
            weights = F.softmax(scores, dim=-1, dtype=torch.float32)
            del scores
        if on_block is not None:
            if limit < n_keys:
                full = weights.new_empty(batch, n_heads, size, n_keys)
                full[..., :limit] = weights
                full[..., limit:] = 0
                on_block(start, full)
                del full
            else:
                on_block(start, weights)
        weights = weights.to(value.dtype)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout, training=True)
        out = torch.matmul(weights.reshape(batch, n_kv_heads, repeat * size, limit), value[:, :, :limit])
        outputs.append(out.view(batch, n_heads, size, head_dim))
        del weights, out
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face: one registered attention implementation


@dataclass
class _HFHooks:
    layer: int
    on_weights: WeightsHook | None
    edit_heads: HeadsEdit | None
    query_block: int | None


_HF_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, _HFHooks]" = weakref.WeakKeyDictionary()
_HF_RECORDER: list[list[tuple[nn.Module, int, int, int]]] = []  # discovery runs append here
_ORIGINAL_IMPLEMENTATION = {"probe_sdpa": "sdpa", "probe_eager": "eager"}


def _original_function(name: str, module: nn.Module) -> Callable[..., tuple[Tensor, Any]]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":  # each modeling file has its own eager function; use the model's own
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if own is not None:
            return own
        return _hf_weights_attention
    return ALL_ATTENTION_FUNCTIONS[name]


def _hf_weights_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                          on_block: Callable[[int, Tensor], None] | None = None, query_block: int | None = None,
                          **kwargs: Any) -> tuple[Tensor, None]:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    output = blocked_attention(
        query, key, value, scaling=scaling, mask=attention_mask, causal=bool(causal) and attention_mask is None,
        on_block=on_block, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
        position_bias=kwargs.get("position_bias"), dropout=dropout if module.training else 0.0,
        query_block=query_block,
    )
    return output.transpose(1, 2).contiguous(), None


def _make_hf_implementation(name: str) -> Callable[..., tuple[Tensor, Any]]:
    original_name = _ORIGINAL_IMPLEMENTATION[name]

    def probe_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                        attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Any]:
        for recording in _HF_RECORDER:
            recording.append((module, query.shape[1], key.shape[1], query.shape[-1]))
        hooks = _HF_ACTIVE.get(module)
        if hooks is not None and hooks.on_weights is not None:
            layer, on_weights = hooks.layer, hooks.on_weights
            output, _ = _hf_weights_attention(module, query, key, value, attention_mask,
                                              on_block=lambda start, weights: on_weights(layer, start, weights),
                                              query_block=hooks.query_block, **kwargs)
        else:
            output, _ = _original_function(original_name, module)(module, query, key, value, attention_mask, **kwargs)
        if hooks is not None and hooks.edit_heads is not None:
            output = hooks.edit_heads(hooks.layer, output)
        return output, None

    return probe_attention


_REGISTERED = False


def _register_hf() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for name, original in _ORIGINAL_IMPLEMENTATION.items():
        AttentionInterface.register(name, _make_hf_implementation(name))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    _REGISTERED = True


def _configs(model: nn.Module) -> list[Any]:
    """Every distinct config object in the model (composite models have one per sub-model)."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextmanager
def _hf_implementation(model: nn.Module) -> Iterator[None]:
    """Switch every config of the model to probe's implementation, and back on exit, whatever happens."""
    _register_hf()
    saved = [(config, config._attn_implementation_internal) for config in _configs(model)]
    try:
        for config, implementation in saved:
            if not (isinstance(implementation, str) and implementation.startswith("probe_")):
                keep = "eager" if implementation == "eager" else "sdpa"  # flash/flex/kernels: sdpa reads the same
                config._attn_implementation_internal = f"probe_{keep}"
        yield
    finally:
        for config, implementation in saved:
            config._attn_implementation_internal = implementation


def is_hf_model(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "_attn_implementation_internal")


# ---------------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention: the same blocked computation, in place of its forward


def _mha_forward(self: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                 key_padding_mask: Tensor | None = None, need_weights: bool = True, attn_mask: Tensor | None = None,
                 average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    hooks: _HFHooks = self._probe_hooks  # type: ignore[attr-defined]
    if self.bias_k is not None or self.add_zero_attn:
        raise ProbeError("nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported")
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    if not self.batch_first or unbatched:  # (L, N, E) -> (N, L, E)
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    batch, n_queries, _ = query.shape
    n_keys, heads = key.shape[1], self.num_heads
    head_dim = self.embed_dim // heads
    if self._qkv_same_embed_dim:
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
    b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
    q = F.linear(query, w_q, b_q).view(batch, n_queries, heads, head_dim).transpose(1, 2)
    k = F.linear(key, w_k, b_k).view(batch, n_keys, heads, head_dim).transpose(1, 2)
    v = F.linear(value, w_v, b_v).view(batch, n_keys, heads, head_dim).transpose(1, 2)

    mask = None  # additive float, broadcastable to (b, h, n, kv); MHA's boolean masks mean "do not attend"
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype != torch.bool else torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(
            attn_mask, float("-inf"))
        mask = mask.view(batch, heads, n_queries, n_keys) if mask.dim() == 3 else mask.view(1, 1, n_queries, n_keys)
    if key_padding_mask is not None:
        padding = key_padding_mask if key_padding_mask.dtype != torch.bool else torch.zeros_like(
            key_padding_mask, dtype=q.dtype).masked_fill(key_padding_mask, float("-inf"))
        padding = padding.view(batch, 1, 1, n_keys)
        mask = padding if mask is None else mask + padding

    kept: list[Tensor] = []
    on_weights = hooks.on_weights

    def on_block(start: int, weights: Tensor) -> None:
        if on_weights is not None:
            on_weights(hooks.layer, start, weights)
        if need_weights:
            kept.append(weights)

    heads_out = blocked_attention(q, k, v, scaling=None, mask=mask, causal=False, on_block=on_block,
                                  dropout=self.dropout if self.training else 0.0, query_block=hooks.query_block)
    heads_out = heads_out.transpose(1, 2)  # (b, n, h, d)
    if hooks.edit_heads is not None:
        heads_out = hooks.edit_heads(hooks.layer, heads_out)
    output = self.out_proj(heads_out.reshape(batch, n_queries, self.embed_dim))
    if not self.batch_first or unbatched:
        output = output.transpose(0, 1)
    if unbatched:
        output = output.squeeze(1)
    if not need_weights:
        return output, None
    weights = torch.cat(kept, dim=2).to(output.dtype)
    if average_attn_weights:
        weights = weights.mean(dim=1)
    return output, weights.squeeze(0) if unbatched else weights


@contextmanager
def _mha_hooks(module: nn.MultiheadAttention, hooks: _HFHooks) -> Iterator[None]:
    module._probe_hooks = hooks  # type: ignore[attr-defined]
    # under accelerate's hooks (device map, offloading) `forward` is its wrapper, which loads the weights and then
    # calls `_old_forward`: replace that one, so the weights are still brought in; put back exactly what was there
    target = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    saved = module.__dict__.get(target)
    setattr(module, target, types.MethodType(_mha_forward, module))
    try:
        yield
    finally:
        if saved is None:
            delattr(module, target)
        else:
            setattr(module, target, saved)
        del module._probe_hooks


# ---------------------------------------------------------------------------------------------------------------
# hand-written attention modules returning (output, weights)


def _output_projection(module: nn.Module) -> nn.Module | None:
    for name in OUTPUT_PROJECTIONS:
        projection = getattr(module, name, None)
        if isinstance(projection, nn.Module):
            return projection
    return None


def _is_custom_attention(module: nn.Module) -> bool:
    return (
        not isinstance(module, nn.MultiheadAttention)
        and isinstance(getattr(module, "num_heads", None), int)
        and any(hasattr(module, name) for name in OUTPUT_PROJECTIONS)
    )


@contextmanager
def _custom_hooks(module: nn.Module, hooks: _HFHooks) -> Iterator[None]:
    handles = []
    if hooks.on_weights is not None:
        def read_weights(_module: nn.Module, _inputs: Any, output: Any) -> None:
            hooks.on_weights(hooks.layer, 0, output[1].float())  # type: ignore[misc]

        handles.append(module.register_forward_hook(read_weights))
    if hooks.edit_heads is not None:
        projection = _output_projection(module)
        if projection is None:
            raise ProbeError(f"cannot edit the heads of {type(module).__name__}: its output projection "
                             f"({'/'.join(OUTPUT_PROJECTIONS)}) is not an nn.Module")
        heads = module.num_heads

        def edit_input(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            merged = args[0]
            split = merged.reshape(*merged.shape[:-1], heads, merged.shape[-1] // heads)
            edited = hooks.edit_heads(hooks.layer, split)  # type: ignore[misc]
            return (edited.reshape(merged.shape), *args[1:])

        handles.append(projection.register_forward_pre_hook(edit_input))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------------------------
# discovery and the public context manager


_LAYERS: "weakref.WeakKeyDictionary[nn.Module, list[AttentionLayer]]" = weakref.WeakKeyDictionary()


def _device(model: nn.Module) -> torch.device:
    """Where the inputs go; with accelerate's offloading the first parameter may be on 'meta' (see placement)."""
    from probe.placement import input_device

    return input_device(model)


def accepts_argument(model: nn.Module, argument: str) -> bool:
    """Whether the model's forward takes `argument` by name."""
    import inspect

    try:
        return argument in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def run_model(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, *,
              logits: bool | Tensor = True) -> Any:
    """One forward pass the way probe runs every model: HF with its mask and no KV cache, custom with ids only.

    `logits=False`: the caller only reads attention, so a Hugging Face LM computes the logits of the last position
    only (`logits_to_keep=1`); at 8192 tokens the full logits of a 49k vocabulary would take 1.6 GB. A 1-D tensor of
    positions: the logits of those positions only. Models without `logits_to_keep` compute all, as before.
    """
    input_ids = input_ids.to(_device(model))
    if is_hf_model(model):
        kwargs: dict[str, Any] = {"input_ids": input_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(input_ids.device)
        if getattr(model.config, "use_cache", None) is not None:
            kwargs["use_cache"] = False
        if isinstance(logits, Tensor):
            if accepts_argument(model, "logits_to_keep"):
                kwargs["logits_to_keep"] = logits.to(input_ids.device)
        elif not logits and accepts_argument(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = 1
        return model(**kwargs)
    return model(input_ids)


def logits_of(output: Any) -> Tensor:
    """The logits (or, for a model without an LM head, the last hidden states) of a forward's output."""
    if isinstance(output, Tensor):
        return output
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise ProbeError(f"the model's forward returned {type(output).__name__}: expected logits (batch, seq, vocab) "
                     "or a tuple whose first item is the logits")


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """The model's attention layers in call order, found once by a forward pass on two tokens and remembered."""
    if model in _LAYERS:
        return _LAYERS[model]
    ids = torch.zeros(1, 2, dtype=torch.long)
    layers: list[AttentionLayer] = []
    if is_hf_model(model):
        recording: list[tuple[nn.Module, int, int, int]] = []
        _HF_RECORDER.append(recording)
        try:
            with torch.no_grad(), _hf_implementation(model):
                run_model(model, ids)
        except Exception as error:
            raise ProbeError(f"the model's forward failed on a two-token input: {type(error).__name__}: {error}") from error
        finally:
            _HF_RECORDER.remove(recording)
        seen: set[int] = set()
        for module, n_heads, n_kv_heads, head_dim in recording:
            if id(module) not in seen:
                seen.add(id(module))
                layers.append(AttentionLayer(len(layers), module, "hf", n_heads, n_kv_heads, head_dim))
    else:
        candidates = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention) or _is_custom_attention(m)]
        order: list[tuple[nn.Module, Any]] = []
        handles = [m.register_forward_hook(lambda mod, _i, out: order.append((mod, out))) for m in candidates]
        try:
            with torch.no_grad():
                run_model(model, ids)
        except Exception as error:
            raise ProbeError(f"the model's forward failed on token ids (1, 2): {type(error).__name__}: {error}") from error
        finally:
            for handle in handles:
                handle.remove()
        seen = set()
        for module, output in order:
            if id(module) in seen:
                continue
            seen.add(id(module))
            if isinstance(module, nn.MultiheadAttention):
                heads = module.num_heads
                layers.append(AttentionLayer(len(layers), module, "mha", heads, heads, module.embed_dim // heads))
            elif (isinstance(output, (tuple, list)) and len(output) >= 2 and isinstance(output[1], Tensor)
                  and output[1].dim() == 4 and output[1].shape[1] == module.num_heads):
                heads = module.num_heads
                head_dim = output[0].shape[-1] // heads if isinstance(output[0], Tensor) else 0
                layers.append(AttentionLayer(len(layers), module, "custom", heads, heads, head_dim))
    if not layers:
        raise ProbeError(f"no attention layers found in {type(model).__name__}: probe reads Hugging Face models "
                         "that use transformers' attention interface, nn.MultiheadAttention, and modules with "
                         "num_heads and W_o/out_proj/o_proj that return (output, attention_weights)")
    _LAYERS[model] = layers
    return layers


@contextmanager
def attention_hooks(
    model: nn.Module,
    on_weights: WeightsHook | None = None,
    edit_heads: HeadsEdit | None = None,
    layers: set[int] | None = None,
    query_block: int | None = None,
) -> Iterator[list[AttentionLayer]]:
    """Hook every attention layer (or those in `layers`) for the body of the `with`.

    `on_weights(layer, start, weights)` receives each layer's attention weights, (batch, query_heads, block,
    keys) in float32, in query blocks. `edit_heads(layer, heads)` may replace each layer's head outputs
    (batch, queries, heads, head_dim) before the output projection. On exit the model is exactly as before.
    """
    found = attention_layers(model)
    chosen = [layer for layer in found if layers is None or layer.index in layers]
    with ExitStack() as stack:
        if any(layer.kind == "hf" for layer in chosen):
            stack.enter_context(_hf_implementation(model))
        for layer in chosen:
            hooks = _HFHooks(layer.index, on_weights, edit_heads, query_block)
            if layer.kind == "hf":
                _HF_ACTIVE[layer.module] = hooks
                stack.callback(_HF_ACTIVE.pop, layer.module, None)
            elif layer.kind == "mha":
                stack.enter_context(_mha_hooks(layer.module, hooks))  # type: ignore[arg-type]
            else:
                stack.enter_context(_custom_hooks(layer.module, hooks))
        yield found


def capture_attention(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None,
                      layers: set[int] | None = None, query_block: int | None = None) -> dict[int, Tensor]:
    """Run one forward and return full attention patterns {layer: (batch, query_heads, q, k)} in float32.

    Keeps everything it is asked for: meant for heatmaps and tests, not for scoring long inputs.
    """
    blocks: dict[int, list[Tensor]] = {}

    def keep(layer: int, start: int, weights: Tensor) -> None:
        blocks.setdefault(layer, []).append(weights.detach().cpu())

    with torch.no_grad(), attention_hooks(model, on_weights=keep, layers=layers, query_block=query_block):
        run_model(model, input_ids, attention_mask)
    return {layer: torch.cat(parts, dim=2) for layer, parts in sorted(blocks.items())}

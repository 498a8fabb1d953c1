"""Attention patterns ready to draw: what the HTML reports show, computed here so that reports only render. Weights
are kept as uint16 integers (weight * 10**decimals: they compress well on a page), token strings made visible. Long
inputs are shown as a window (`max_tokens` positions from `start`), the model run on the context up to its end, its
attention streamed a query block at a time; `note` says how much attention goes to keys outside the window."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from probe.frames import frame, head_columns, head_name
from probe.inputs import (DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN, ProbeOptions,
                          build_probe_set, context_length, is_encoder)
from probe.errors import ProbeError
from probe.heads.classify import Classification
from probe.heads.scores import SCORES
from probe.hooks.capture import stream_attention
from probe.hooks.types import HookContext
from probe.hooks.layers import attention_layers
from probe.hooks.stacks import decoder_start, layer_names
from probe.models import LoadedModel
from probe.provenance import model_dtype
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, LAYER_NAMES, MODEL, NAME, NUMBER
from probe.schemas.declare import Payload, payload, published, schema_field
from probe.schemas.pages import PatternsPage

DEFAULT_MAX_TOKENS = 512
TOKEN_LIMIT = 1024
DEFAULT_DECIMALS = 3
LARGE_TEXT = 2_000_000  # characters: longer texts are tokenized only as far as needed
THUMBNAIL = 32  # overview thumbnails are at most THUMBNAIL x THUMBNAIL (max-pooled)
AVERAGE = -1  # the head number of "mean over the layer's heads"

SYMBOLS = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
_SENTENCEPIECE_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class HeadWeights(Payload, frozen=True):
    """One head's rounded weights, as `probe heatmap --json` writes them."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    name: str = schema_field(NAME)
    weights: list[list[float]] = schema_field("query rows of key weights", items=Field("array", "a row", items=NUMBER))


@published("heatmap", 1, "The shown heads' attention weights on one text (probe heatmap --json): per head a list of "
           "query rows.", rows="one per head, query and key position",
           columns={**HEAD_COLUMNS, "query": Field("integer", "the query's position"),
                    "key": Field("integer", "the key's position"),
                    "query_token": Field("string", "the query's token"),
                    "key_token": Field("string", "the key's token"), "weight": Field("number", "the attention weight")})
class Patterns(Payload):
    """Attention of some heads on one token sequence, rounded for a page: `values[i]` is head `heads[i]` (AVERAGE:
    the layer's mean); `to_dict()` is the heatmap payload, `page_payload()` what pages draw."""

    model: str = schema_field(MODEL)
    # what the model ran in: docs/precision.md says how far a half-precision run lies
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)
    source: str = schema_field("what the tokens are")
    tokens: list[str] = schema_field("the visible token strings", items="a token")  # one per position
    first: int = schema_field("the position of the first token shown", default=0, kw_only=True)  # of a window
    total_tokens: int = schema_field("tokens in the input before any cut")
    decimals: int = schema_field("decimals the weights are rounded to")
    causal: bool = schema_field("whether a query sees only earlier keys")
    note: str = schema_field("what was cut, if anything", default="", kw_only=True)
    # encoder-decoders: `enc0`, `dec0`, `x0`, ... (probe.hooks.stacks)
    layer_names: list[str] | None = schema_field(LAYER_NAMES, default=None, kw_only=True)
    heads: list[tuple[int, int]]
    values: np.ndarray  # (len(heads), n, n) uint16
    n_layers: int
    n_heads: int
    thumbnails: np.ndarray | None = None  # (len(heads), t, t) uint8: max-pooled weight * 255, for overviews
    meta: dict[str, Any] = field(default_factory=dict)

    @payload("each head shown", key="heads", items="a head")
    def head_weights(self) -> list[HeadWeights]:
        """The shown heads' rounded weights (NaN where a causal model masks the key), not the layer averages."""
        return [HeadWeights(layer, head, head_name(layer, head, self.layer_names),
                            np.round(self.weights(layer, head), self.decimals).tolist())
                for layer, head in self.heads if head >= 0]

    @property
    def labels(self) -> list[str]:
        """Axis labels: position and visible token, e.g. '5:␣the', unique even when tokens repeat."""
        return [f"{i}:{token}" for i, token in enumerate(self.tokens, start=self.first)]

    @property
    def scale(self) -> int:
        return 10**self.decimals

    def index(self, layer: int, head: int) -> int:
        """Position of (layer, head) in `heads`."""
        try:
            return self.heads.index((layer, head))
        except ValueError:
            raise ProbeError(f"no pattern of layer {layer} head {head} here", parameter="heads") from None

    def page_payload(self) -> PatternsPage:
        """The plain payload the HTML pages take (values and thumbnails stay numpy arrays)."""
        out: PatternsPage = {
            "model": self.model, "source": self.source, "tokens": list(self.tokens), "labels": self.labels,
            "heads": [[layer, head] for layer, head in self.heads], "values": self.values, "decimals": self.decimals,
            "scale": self.scale, "causal": self.causal, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "total_tokens": self.total_tokens, "note": self.note, "first": self.first, "thumbnails": self.thumbnails,
            "meta": dict(self.meta), "average": AVERAGE, "dtype": self.dtype}
        if self.layer_names:
            out["layer_names"] = self.layer_names
        return out

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head, query and key shown: the heatmap schema's columns. Needs pandas."""
        rows = []
        for layer, head in (pair for pair in self.heads if pair[1] >= 0):
            weights = self.weights(layer, head)
            for query, row in enumerate(weights):
                for key in range(query + 1 if self.causal else len(row)):
                    rows.append({**head_columns(layer, head, self.layer_names), "query": self.first + query,
                                 "key": self.first + key, "query_token": self.tokens[query],
                                 "key_token": self.tokens[key], "weight": float(row[key])})
        return frame(rows)

    def __repr__(self) -> str:
        """A short summary (the dataclass' own repr would print every weight)."""
        return (f"Patterns({self.model!r}: {len(self.heads)} heads of {self.n_layers}x{self.n_heads} on "
                f"{len(self.tokens)} of {self.total_tokens} tokens from {self.source})")

    def _repr_html_(self) -> str:
        from probe.reports.html import heatmap_page  # reports render; the library never needs them otherwise

        return heatmap_page(self.page_payload(), embed_plotly=False)

    def weights(self, layer: int, head: int) -> np.ndarray:
        """The rounded weights of one head as float32 (n, n), NaN where a causal model masks the key."""
        out = self.values[self.index(layer, head)].astype(np.float32) / self.scale
        if self.causal:
            out[np.triu_indices(out.shape[0], 1)] = np.nan
        return out


def visible(text: str) -> str:
    """Whitespace and invisible characters as symbols ('␣', '↵', '⇥', escapes); an empty token is '∅'."""
    out = []
    for char in text:
        if char in SYMBOLS:
            out.append(SYMBOLS[char])
        elif unicodedata.category(char) in ("Cc", "Cf", "Zs", "Zl", "Zp", "Co", "Cn", "Cs"):
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out) or "∅"


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table (transformers' own), reversed: the characters of byte-level BPE vocabularies."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _partial_bytes(raw: str) -> bytes | None:
    """The bytes of a token that is part of a UTF-8 character, or None if the raw token is not byte-level."""
    match = _SENTENCEPIECE_BYTE.match(raw)
    if match:
        return bytes([int(match.group(1), 16)])
    decoder = _byte_decoder()
    if raw and all(char in decoder for char in raw):
        return bytes(decoder[char] for char in raw)
    return None


def token_strings(loaded: LoadedModel, ids: list[int] | Tensor) -> list[str]:
    """One visible string per token id: specials in ⟨ ⟩, a partial UTF-8 character as its bytes, '#id' untokenized."""
    ids = [int(i) for i in (ids.tolist() if isinstance(ids, Tensor) else ids)]
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        return [f"#{i}" for i in ids]
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    try:
        raws = tokenizer.convert_ids_to_tokens(ids)
    except Exception:  # a tokenizer without the method: decoding alone is enough
        raws = [None] * len(ids)
    out = []
    for token_id, raw in zip(ids, raws):
        if token_id in special:
            out.append(f"⟨{visible(str(raw) if raw is not None else tokenizer.decode([token_id]))}⟩")
            continue
        text = tokenizer.decode([token_id])
        if "\ufffd" in text and isinstance(raw, str) and "\ufffd" not in raw:
            data = _partial_bytes(raw)
            if data is not None:
                text = data.decode("utf-8", errors="backslashreplace")
                text = "".join(SYMBOLS.get(c, c) for c in text)  # the \\x escapes are already visible
                out.append(text)
                continue
        out.append(visible(text))
    return out


def text_ids(loaded: LoadedModel, text: str) -> list[int]:
    """Token ids of a text the way probe sets are built: BOS first where the model has one, no other specials."""
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ProbeError("this model has no tokenizer, so it cannot read text: return (model, tokenizer) from the "
                         "factory")
    if not text:
        raise ProbeError("the text is empty", parameter="text")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ProbeError("the text gives no tokens", parameter="text")
    bos = decoder_start(loaded.model)  # an encoder-decoder's decoder starts as it was trained (probe.inputs)
    bos = getattr(tokenizer, "bos_token_id", None) if bos is None else bos
    if bos is None:
        bos = getattr(getattr(loaded.model, "config", None), "bos_token_id", None)
    return ([bos] if isinstance(bos, int) else []) + ids


def _round(weights: Tensor, decimals: int) -> np.ndarray:
    return (weights.float() * 10**decimals).round_().clamp_(0, 65535).to(torch.int32).numpy().astype(np.uint16)


def _thumbnail(weights: Tensor) -> np.ndarray:
    """(heads, n, n) -> (heads, t, t) uint8 by max-pooling, so that thin stripes survive the shrinking."""
    n = weights.shape[-1]
    kernel = -(-n // THUMBNAIL)
    pooled = F.max_pool2d(weights[None].float(), kernel, ceil_mode=True)[0] if kernel > 1 else weights.float()
    return (pooled * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def _window_attention(loaded: LoadedModel, ids: Tensor, layers: set[int], start: int, stop: int
                      ) -> tuple[dict[int, Tensor], float]:
    """Each layer's (heads, w, w) attention inside the window, and the mean share going to keys outside it."""
    kept: dict[int, list[Tensor]] = {}
    outside = [0.0, 0]

    def keep(weights: Tensor, ctx: HookContext) -> None:
        layer, first = ctx.layer, ctx.start
        rows = weights[0, :, max(start - first, 0):max(stop - first, 0)]  # (heads, block rows in the window, keys)
        if rows.shape[1] == 0:
            return
        inside = rows[..., start:stop]
        outside[0] += float((rows.sum(dim=-1) - inside.sum(dim=-1)).sum())
        outside[1] += rows.shape[0] * rows.shape[1]
        kept.setdefault(layer, []).append(inside.detach().cpu().clone())

    stream_attention(loaded.model, ids[None], keep, layers=layers)
    return {layer: torch.cat(parts, dim=1) for layer, parts in kept.items()}, outside[0] / max(outside[1], 1)


def _check_options(decimals: int, max_tokens: int) -> None:
    if not 1 <= decimals <= 4:
        raise ProbeError(f"decimals must be between 1 and 4, got {decimals}", parameter="decimals")
    if not 2 <= max_tokens <= TOKEN_LIMIT:
        raise ProbeError(f"max_tokens must be between 2 and {TOKEN_LIMIT}, got {max_tokens}: a page of every "
                         f"head beyond {TOKEN_LIMIT} tokens is too large for a browser", parameter="max_tokens")


def _window(loaded: LoadedModel, input_ids: list[int] | Tensor, start: int, max_tokens: int,
            causal_model: bool) -> tuple[Tensor, int]:
    """The whole input (total,) and the window's end; a causal model runs on the input up to that end alone."""
    ids = torch.as_tensor(input_ids if not isinstance(input_ids, Tensor) else input_ids.reshape(-1), dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ProbeError("attention patterns need one non-empty sequence of token ids", parameter="input_ids")
    total = int(ids.numel())
    if not 0 <= start < total:
        raise ProbeError(f"start must be a position of the input, 0 to {total - 1:,}; got {start:,}",
                         parameter="start")
    stop = min(start + max_tokens, total)
    limit = context_length(loaded)
    if limit is not None and (stop if causal_model else total) > limit:
        raise ProbeError(f"the window ends at token {stop:,}, past the model's context of {limit:,}: use a smaller "
                         "start or max_tokens, or a shorter text", parameter="start")
    return ids, stop


def _wanted_layers(n_layers: int, layers: set[int] | None, heads: list[tuple[int, int]] | None) -> set[int]:
    if heads is not None:
        layers = {layer for layer, _ in heads}
    wanted = set(range(n_layers)) if layers is None else set(layers)
    bad = sorted(layer for layer in wanted if not 0 <= layer < n_layers)
    if bad:
        raise ProbeError(f"layer {bad[0]} does not exist: the model has {n_layers} layers (0-{n_layers - 1})",
                         parameter="layers")
    if not wanted:
        raise ProbeError("no layers chosen", parameter="layers")
    return wanted


def _window_note(total: int, start: int, stop: int, causal_model: bool, outside: float,
                 input_description: str | None) -> str:
    """What a page of a window shows, in words; empty when it shows the whole input."""
    if stop - start >= total:
        return ""
    ran = (f"the model ran on the first {stop:,}, so each query sees every key before it"
           if causal_model else "the model ran on all of them")
    described = input_description or f"the input has {total:,} tokens"
    note = (f"{described}; this page shows positions {start:,} to {stop - 1:,} "
            f"(at most {TOKEN_LIMIT:,} positions): {ran}")
    if start > 0 or not causal_model:
        note += (f", but only keys inside the window are drawn; {outside:.1%} of these queries' attention (mean "
                 f"over the heads of the layers shown) goes to keys outside it")
    return note


def _pick(captured: dict[int, Tensor], heads: list[tuple[int, int]] | None, average: bool, thumbnails: bool,
          decimals: int) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray | None, bool]:
    """Each wanted layer's heads (all, or those in `heads`), plus its mean over heads when `average`: the heads, their
    rounded values, their thumbnails and whether every layer was causal."""
    picked: list[tuple[int, int]] = []
    values, small, causal = [], [], True
    for layer in sorted(captured):
        weights = captured.pop(layer)  # (h, n, n)
        causal = causal and bool((torch.triu(weights, 1) == 0).all())
        layer_heads = [h for (at, h) in heads if at == layer] if heads is not None else list(range(weights.shape[0]))
        for head in layer_heads:
            if not 0 <= head < weights.shape[0]:
                raise ProbeError(f"head {head} does not exist: layer {layer} has {weights.shape[0]} heads",
                                 parameter="heads")
        chosen = weights[layer_heads]  # (len(layer_heads), n, n)
        if heads is None and average:
            chosen = torch.cat([chosen, weights.mean(dim=0, keepdim=True)])
            layer_heads = layer_heads + [AVERAGE]
        picked.extend((layer, head) for head in layer_heads)
        values.append(_round(chosen, decimals))
        if thumbnails:
            small.append(_thumbnail(chosen))
        del weights, chosen
    return picked, np.concatenate(values), np.concatenate(small) if thumbnails else None, causal


def attention_patterns(
    loaded: LoadedModel,
    input_ids: list[int] | Tensor,
    *,
    source: str,
    layers: set[int] | None = None,
    heads: list[tuple[int, int]] | None = None,
    average: bool = True,
    thumbnails: bool = True,
    decimals: int = DEFAULT_DECIMALS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    start: int = 0,
    input_description: str | None = None,
) -> Patterns:
    """Run the model on one sequence and keep the patterns of every head of `layers` (default all), each layer's mean
    with `average`, or exactly `heads`; at most `max_tokens` positions from `start` (a window, said in `note`)."""
    _check_options(decimals, max_tokens)
    causal_model = not is_encoder(loaded)
    ids, stop = _window(loaded, input_ids, start, max_tokens, causal_model)
    found = attention_layers(loaded.model)
    wanted = _wanted_layers(len(found), layers, heads)
    # later tokens change nothing a causal model's window sees
    captured, outside = _window_attention(loaded, ids[:stop] if causal_model else ids, wanted, start, stop)
    picked, values, small, causal = _pick(captured, heads, average, thumbnails, decimals)
    return Patterns(
        model=loaded.name,
        source=source,
        tokens=token_strings(loaded, ids[start:stop]),
        heads=picked,
        values=values,
        decimals=decimals,
        causal=causal,
        n_layers=len(found),
        n_heads=max(layer.n_heads for layer in found),
        total_tokens=int(ids.numel()),
        note=_window_note(int(ids.numel()), start, stop, causal_model, outside, input_description),
        thumbnails=small,
        first=start,
        layer_names=layer_names(found),
        dtype=model_dtype(loaded),
    )


def text_patterns(loaded: LoadedModel, text: str, *, source: str, layers: set[int] | None = None,
                  decimals: int = DEFAULT_DECIMALS, max_tokens: int = DEFAULT_MAX_TOKENS, start: int = 0) -> Patterns:
    """Every head's pattern (and each layer's average) on a text, windowed: what `probe heatmap` draws; a long text
    is tokenized only as far as the window needs."""
    _check_options(decimals, max_tokens)
    if len(text) <= LARGE_TEXT or is_encoder(loaded):
        return attention_patterns(loaded, text_ids(loaded, text), source=source, layers=layers, decimals=decimals,
                                  max_tokens=max_tokens, start=start)
    needed = start + max_tokens
    chars = max(4096, needed * 16)
    while True:  # the margin of 16 tokens keeps the cut from changing the tokens used
        ids = text_ids(loaded, text[:chars])
        if len(ids) >= needed + 16 or chars >= len(text):
            break
        chars *= 2
    # one token past the window tells attention_patterns there is more; a causal model does not run on it
    described = f"the text has {len(text):,} characters, more than {needed:,} tokens" if len(ids) > needed else None
    return attention_patterns(loaded, ids[:needed + 1], source=source, layers=layers, decimals=decimals,
                              max_tokens=max_tokens, start=start, input_description=described)


def classification_patterns(loaded: LoadedModel, result: Classification, *, data: str | Path | None = None,
                            seq_len: int | None = None, repeat_len: int | None = None, seed: int | None = None,
                            decimals: int = DEFAULT_DECIMALS) -> dict[str, Patterns]:
    """{probe set name: patterns of the heads flagged by the classes scored on it}, on the set's first sequence (the
    set rebuilt with the run's options)."""
    wanted: dict[str, set[tuple[int, int]]] = {}
    for name in result.scores:
        probe = SCORES[name].probe if name in SCORES else "natural"
        flagged = {(layer, head) for layer, head, _ in result.flagged(name)}
        if flagged:
            wanted.setdefault(probe, set()).update(flagged)
    seed = DEFAULT_SEED if seed is None else seed
    out: dict[str, Patterns] = {}
    for probe, heads in wanted.items():
        num_seqs = int(result.probe_sets.get(probe, {}).get("num_seqs", DEFAULT_NUM_SEQS))
        options = ProbeOptions(data=data, seq_len=seq_len or DEFAULT_SEQ_LEN, num_seqs=num_seqs,
                               repeat_len=repeat_len or DEFAULT_REPEAT_LEN, seed=seed)
        probe_set = build_probe_set(probe, loaded, options)
        patterns = attention_patterns(loaded, probe_set.input_ids[0],
                                      source=f"{probe_set.description}; sequence 0 of the set",
                                      heads=sorted(heads), average=False, thumbnails=False, decimals=decimals,
                                      max_tokens=TOKEN_LIMIT)
        patterns.meta = {"probe_set": probe, "repeat_len": probe_set.repeat_len, "offset": probe_set.offset}
        out[probe] = patterns
    return out

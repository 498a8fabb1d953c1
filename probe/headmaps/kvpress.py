"""A DuoAttention folder (`probe kv-heads --export duo:DIR`) as NVIDIA's kvpress reads a head pattern
(`DuoAttentionPress.load_attention_pattern`, kvpress 0.5.5), so any model's map plugs in; kvpress is not imported."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from probe.errors import ProbeError
from probe.headmaps.formats import DUO_CONFIG, DUO_FILE, DUO_THRESHOLD, read_json
from probe.reading import is_file


def kvpress_pattern(path: str | Path, model: Any | None = None) -> tuple[int, int, np.ndarray]:
    """`(sink_size, recent_size, head_scores)` as kvpress returns them; shape checked against `model` where given."""
    folder = Path(path)
    table, config = folder / DUO_FILE, folder / DUO_CONFIG
    for needed in (table, config):
        if not is_file(needed):
            raise ProbeError(f"{needed} does not exist: give the folder `probe kv-heads --export duo:DIR` wrote")
    settings = read_json(config)
    missing = [key for key in ("sink_size", "recent_size") if not isinstance(settings.get(key), int)]
    if missing:
        raise ProbeError(f"{config} has no integer {', '.join(missing)}: kvpress needs both (export the map again "
                         "with `probe kv-heads --export duo:DIR`)")
    scores = np.clip(np.atleast_2d(np.loadtxt(table, dtype=float, delimiter="\t")), 0, 1)
    if model is not None:
        config_of = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layers = config_of.num_hidden_layers
        kv_heads = getattr(config_of, "num_key_value_heads", None) or config_of.num_attention_heads
        if scores.shape != (layers, kv_heads):
            raise ProbeError(f"{table} is {scores.shape[0]} layers x {scores.shape[1]} KV heads; the model has "
                             f"{layers} x {kv_heads}: export the map from this model")
    return settings["sink_size"], settings["recent_size"], scores


def kvpress_head_ratio(path: str | Path) -> float:
    """The `head_compression_ratio` that streams exactly the map's streaming KV heads."""
    _, _, scores = kvpress_pattern(path)
    settings = read_json(Path(path) / DUO_CONFIG)
    threshold = float(settings.get("threshold") or DUO_THRESHOLD)
    return float((scores <= threshold).sum() / scores.size)


def kvpress_removable(sink: int, recent: int, length: int) -> float:
    """The most of a `length`-token cache DuoAttentionPress removes: every KV head streamed."""
    return max(0.0, 1.0 - (sink + recent) / length)


def check_kvpress_ratio(ratio: float, sink: int, recent: int, length: int) -> None:
    """A fraction of the KV cache to remove that kvpress's DuoAttentionPress can reach at `length` tokens."""
    if not math.isfinite(ratio) or not 0.0 < ratio < 1.0:
        raise ProbeError(f"kvpress_ratio is the fraction of the KV cache kvpress removes, in (0, 1); got {ratio:g}",
                         parameter="kvpress_ratio")
    most = kvpress_removable(sink, recent, length)
    if ratio > most:
        raise ProbeError(f"kvpress_ratio {ratio:g}: streaming every KV head removes {most:.4f} of a {length}-token "
                         f"cache (sink {sink} + recent {recent} kept); give at most that, or longer lengths",
                         parameter="kvpress_ratio")


def kvpress_streamed(ratio: float, n_kv_heads: int, sink: int, recent: int, length: int) -> tuple[int, float]:
    """(k, k / n): the KV heads to stream for DuoAttentionPress to remove nearest `ratio` of the cache."""
    check_kvpress_ratio(ratio, sink, recent, length)
    streamed = min(n_kv_heads, round(ratio / kvpress_removable(sink, recent, length) * n_kv_heads))
    return streamed, streamed / n_kv_heads

"""A DuoAttention folder (`probe kv-heads --export duo:DIR`) as NVIDIA's kvpress reads a head pattern.

kvpress's `DuoAttentionPress.load_attention_pattern(model)` (kvpress 0.5.5) downloads DuoAttention's files for six
checkpoints and returns `(sink_size, recent_size, head_scores)`: config.json's two sizes and the TSV read with
`np.loadtxt(..., dtype=float, delimiter="\\t")`, clipped to [0, 1]. `kvpress_pattern(DIR)` returns the same from a
local folder, so any model's map plugs in (docs/kv-heads.md shows how). kvpress is not imported here: probe does not
depend on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from probe.errors import ProbeError
from probe.headmaps.formats import DUO_CONFIG, DUO_FILE, DUO_THRESHOLD, read_json
from probe.reading import is_file


def kvpress_pattern(path: str | Path, model: Any | None = None) -> tuple[int, int, np.ndarray]:
    """`(sink_size, recent_size, head_scores)` of the DuoAttention folder `path`, exactly as kvpress's
    `DuoAttentionPress.load_attention_pattern` returns DuoAttention's own (scores float64, layers x KV heads,
    clipped to [0, 1]). With `model` (a Hugging Face model), the map's shape is checked against its layers and KV
    heads, since kvpress would index past a smaller map without a clear error."""
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
    """The `head_compression_ratio` for kvpress's DuoAttentionPress that streams exactly the KV heads the map in
    `path` labels streaming (gate at or below config.json's threshold): kvpress streams the lowest-scored fraction
    of heads, and probe's export ranks every streaming head below every full one."""
    _, _, scores = kvpress_pattern(path)
    settings = read_json(Path(path) / DUO_CONFIG)
    threshold = float(settings.get("threshold") or DUO_THRESHOLD)
    return float((scores <= threshold).sum() / scores.size)

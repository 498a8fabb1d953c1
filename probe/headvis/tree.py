"""What HeadVis reads, with the field names of Neuronpedia's pipeline (utils/neuronpedia-utils/neuronpedia_utils/
headvis): its head-metrics JSON (`neuronpedia_json`) and the frontend's data tree (`write_tree`), a head's sampled
sequences as sparse COO (flat index q x seq_len + k) in equal-frequency intervals of max_activation (1 lowest)."""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from probe.headvis.metrics import METRICS
from probe.headvis.result import HeadVisMetrics, Sample
from probe.schemas.common import rounded

N_INTERVALS = 5
SAMPLES_PER_INTERVAL = 3
SAMPLES_PER_TOP_INTERVAL = 10
SPARSE_THRESHOLD = 0.005
ACTIVATION_BINS = 50
QK_DISTANCE_EDGES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
TOP_TOKENS = 50
DESCRIPTIONS = {
    "self_attention_score": "Mean attention from each query position to itself (the diagonal).",
    "prev_token_score": "Mean attention to the immediately preceding token (first subdiagonal).",
    "pattern_entropy": "Mean Shannon entropy of each row of the attention matrix.",
    "qk_distance": "Mean |q - k| weighted by attention mass.",
    "qk_distance_variance": "Variance of |q - k| weighted by attention mass.",
    "induction_score": "Average attention from a query token to the position after a prior occurrence of the same "
                       "token.",
}


def neuronpedia_json(result: HeadVisMetrics) -> dict[str, Any]:
    """The published head-metrics JSON: the run's config and each metric layers x heads (null: not a number)."""
    config = {"model_name": result.model, "dataset_name": result.probe_set.get("description", ""),
              "n_sequences": result.counts["sequences"], "seq_len": result.probe_set.get("length"),
              "dtype": result.dtype, "attn_implementation": result.path, "n_layers": result.n_layers,
              "n_heads": result.n_heads}
    return {"config": config, "metrics": {name: [[rounded(value) for value in row]
                                                 for row in result.metrics[name].tolist()] for name in METRICS}}


def write_tree(result: HeadVisMetrics, directory: str | Path, *, sparse_threshold: float = SPARSE_THRESHOLD,
               n_intervals: int = N_INTERVALS) -> Path:
    """The HeadVis frontend's data tree of the result under `directory` (made where missing)."""
    root = Path(directory)
    (root / "heads").mkdir(parents=True, exist_ok=True)
    (root / "attributions").mkdir(exist_ok=True)
    _dump(root / "scatter_data.json", scatter_rows(result))
    for layer in range(result.n_layers):
        for head in range(result.n_heads):
            _dump(root / "heads" / f"L{layer}H{head}.json",
                  head_file(result, layer, head, sparse_threshold, n_intervals))
    _dump(root / "server_config.json", {})
    _dump(root / "attributions" / "manifest.json", {})
    _dump(root / "config.json", tree_config(result, n_intervals), indent=2)
    return root


def _dump(path: Path, payload: Any, indent: int | None = None) -> None:
    path.write_text(json.dumps(payload, indent=indent) + "\n", encoding="utf-8")


def scatter_rows(result: HeadVisMetrics) -> list[dict[str, Any]]:
    """scatter_data.json: one row per head, its layer, head and six metrics (4 decimals, null: not a number)."""
    return [{"layer": layer, "head": head,
             **{name: rounded(result.metrics[name][layer, head], 4) for name in METRICS}}
            for layer in range(result.n_layers) for head in range(result.n_heads)]


def tree_config(result: HeadVisMetrics, n_intervals: int) -> dict[str, Any]:
    """config.json: what the frontend lists and plots, and the run's own config under pipeline_config."""
    return {"model_name": result.model, "np_model_id": result.model,
            "dataset_name": result.probe_set.get("description", ""),
            "heads": [[layer, head] for layer in range(result.n_layers) for head in range(result.n_heads)],
            "n_layers": result.n_layers, "n_heads": result.n_heads, "n_intervals": n_intervals,
            "metrics": list(METRICS), "metric_descriptions": dict(DESCRIPTIONS),
            "head_data_pattern": "L{layer}H{head}.json", "has_umap": False, "umap_heads": [],
            "custom_plots": [{"key": "qk_distance_histogram", "label": "Q-K distance"},
                             {"key": "histogram", "label": "Activation distribution"}],
            "custom_tables": [{"key": "top_query_tokens", "label": "Top query tokens"},
                              {"key": "top_key_tokens", "label": "Top key tokens"}],
            "statistics_display": {"n_samples": {"label": "Samples kept", "format": "default"},
                                   "mean_max_activation": {"label": "Mean max activation", "format": "default"}},
            "pipeline_config": {**neuronpedia_json(result)["config"], "counts": result.counts,
                                "options": result.options,
                                "actual_sequences_processed": result.counts["sequences"],
                                "num_hidden_layers": result.n_layers, "num_attention_heads": result.n_heads,
                                "attention_layer_indices": list(range(result.n_layers))}}


def head_file(result: HeadVisMetrics, layer: int, head: int, sparse_threshold: float,
              n_intervals: int) -> dict[str, Any]:
    """heads/L{layer}H{head}.json."""
    largest = result.max_activation[:, layer, head].numpy() if result.max_activation is not None else np.zeros(0)
    sequences = _sequences(result.samples, layer, head, largest, sparse_threshold, n_intervals)
    bins = np.clip((largest * ACTIVATION_BINS).astype(np.int64), 0, ACTIVATION_BINS - 1)
    return {"sequences": sequences,
            "qk_distance_histogram": distance_histogram(sequences),
            "top_query_tokens": top_tokens(sequences, "query"),
            "top_key_tokens": top_tokens(sequences, "key"),
            "histogram": {"bin_edges": [round(float(edge), 4) for edge in np.linspace(0.0, 1.0, ACTIVATION_BINS + 1)],
                          "bin_values": np.bincount(bins, minlength=ACTIVATION_BINS).tolist()},
            "statistics": {"n_samples": len(sequences),
                           "mean_max_activation": rounded(largest.mean(), 4) if len(largest) else None}}


def intervals(largest: np.ndarray, count: int) -> list[float]:
    """Equal-frequency boundaries of the max activations: value number round(i x n / count) of the sorted ones."""
    ordered = np.sort(largest)
    n = len(ordered)
    if count <= 1 or n == 0:
        return [0.0] * max(count - 1, 0)
    return [float(ordered[min(round(i * n / count), n - 1)]) for i in range(1, count)]


def _sequences(samples: list[Sample], layer: int, head: int, largest: np.ndarray, sparse_threshold: float,
               n_intervals: int) -> list[dict[str, Any]]:
    """One head's sampled sequences in their intervals, lowest first, SAMPLES_PER_INTERVAL each (the top: more)."""
    boundaries = intervals(largest, n_intervals)
    by_interval: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for sample in samples:
        record = sparse_record(sample, layer, head, sparse_threshold)
        if record is None:
            continue
        value = float(largest[sample.index])
        record["interval"] = min(bisect.bisect_right(boundaries, value), n_intervals - 1) + 1
        record["max_activation"] = rounded(value, 4)
        by_interval[record["interval"]].append(record)
    out = []
    for interval in sorted(by_interval):
        found = by_interval[interval]
        if interval == n_intervals:
            found = sorted(found, key=lambda item: -item["max_activation"])[:SAMPLES_PER_TOP_INTERVAL]
        out.extend(found[:SAMPLES_PER_INTERVAL] if interval < n_intervals else found)
    return [{key: record[key] for key in ("sequence_id", "interval", "tokens", "attention_indices",
                                          "attention_values", "seq_len", "max_activation")} for record in out]


def sparse_record(sample: Sample, layer: int, head: int, sparse_threshold: float) -> dict[str, Any] | None:
    """One sequence's kept weights of one head as flat COO sorted by q then k; None where none reaches the threshold."""
    if (layer, head) not in sample.rows:
        return None
    values, keys = sample.rows[(layer, head)]
    length = len(sample.tokens)
    kept = (values >= sparse_threshold) & (keys < length)
    if not kept.any():
        return None
    queries = np.broadcast_to(np.arange(length)[:, None], values.shape)[kept]
    columns = keys[kept].astype(np.int64)
    order = np.lexsort((columns, queries))
    return {"sequence_id": sample.index, "tokens": sample.tokens,
            "attention_indices": (queries[order] * length + columns[order]).astype(int).tolist(),
            "attention_values": [round(float(value), 4) for value in values[kept][order]], "seq_len": length}


def _entries(sequences: list[dict[str, Any]]) -> Any:
    """(sequence, query, key, weight) of every kept entry."""
    for sequence in sequences:
        length = sequence["seq_len"]
        for flat, value in zip(sequence["attention_indices"], sequence["attention_values"]):
            yield sequence, flat // length, flat % length, value


def distance_histogram(sequences: list[dict[str, Any]]) -> dict[str, Any]:
    """|q - k| in QK_DISTANCE_EDGES' bins, weighted by the kept entries' weights."""
    values = [0.0] * (len(QK_DISTANCE_EDGES) - 1)
    for _, query, key, weight in _entries(sequences):
        index = bisect.bisect_right(QK_DISTANCE_EDGES, abs(query - key)) - 1
        if 0 <= index < len(values):
            values[index] += weight
    return {"bin_edges": list(QK_DISTANCE_EDGES), "bin_values": [round(value, 4) for value in values]}


def top_tokens(sequences: list[dict[str, Any]], side: str) -> list[dict[str, Any]]:
    """The TOP_TOKENS token strings with the most kept weight on the query or key side."""
    mass: dict[str, float] = defaultdict(float)
    for sequence, query, key, weight in _entries(sequences):
        mass[sequence["tokens"][query if side == "query" else key]] += weight
    ranked = sorted(mass.items(), key=lambda item: -item[1])[:TOP_TOKENS]
    return [{"token": token, "weight": round(weight, 4)} for token, weight in ranked]

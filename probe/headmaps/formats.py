"""The registry of head-map formats: each recognises a file, reads it into a `HeadMap` with its convention and,
where probe writes the format, writes one. A new format is one `register_format(HeadFormat(...))` call."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from probe.atomic import write_atomically
from probe.errors import ProbeError, first_line
from probe.headmaps.maps import KV, QUERY, HeadMap
from probe.reading import exists, is_file, loads

DUO_FILE = "full_attention_heads.tsv"  # DuoAttention's map (mit-han-lab/duo-attention attn_patterns/)
DUO_CONFIG = "config.json"  # beside it: sink_size, recent_size (DuoAttention's), threshold (probe's)
DUO_THRESHOLD = 0.5  # DuoAttention keeps a KV head full where its gate is above this (config.json's `threshold`)
SHARE = "score, 0 to 1"  # the unit of probe's head-class scores (shares of attention or of hits) and of a gate
GATE = "DuoAttention gate"  # the quantity of DuoAttention's map and of probe kv-heads' `duo` values
GATE_UNIT = "gate, 0 to 1"


@dataclass(frozen=True)
class HeadFormat:
    """One format; `settings_file`: where a writer puts its `settings` beside the map."""

    name: str
    convention: str  # in words: which heads a value belongs to
    summary: str
    recognises: Callable[[Path], bool]
    read: Callable[[Path, str | None], HeadMap]
    write: Callable[[HeadMap, Path, dict[str, Any]], None] | None = None
    settings_file: str | None = None


FORMATS: dict[str, HeadFormat] = {}


def register_format(entry: HeadFormat) -> HeadFormat:
    """Add a format (asked after those registered before it)."""
    FORMATS[entry.name] = entry
    return entry


def read_map(path: str | Path, score: str | None = None) -> HeadMap:
    """The head map in `path` (a file or DuoAttention folder) by the first format that knows it; `score`: which."""
    where = Path(path)
    if not exists(where):
        raise ProbeError(f"{where} does not exist: give a head-map file (or a DuoAttention folder)")
    for entry in FORMATS.values():
        if entry.recognises(where):
            try:
                return entry.read(where, score)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
                raise ProbeError(f"{where} looks like a {entry.name} file but is malformed ({type(error).__name__}: "
                                 f"{first_line(error)}): write it again") from None
    raise ProbeError(f"{where} is no head map probe reads: formats {', '.join(FORMATS)} (docs/compare.md)")


def write_map(head_map: HeadMap, path: str | Path, format: str, settings: dict[str, Any] | None = None) -> Path:
    """Write `head_map` in `format`, `settings` in its settings file (DuoAttention's config.json); the path."""
    entry = FORMATS.get(format)
    if entry is None or entry.write is None:
        writers = [name for name, known in FORMATS.items() if known.write is not None]
        raise ProbeError(f"format {format!r} has no writer: use one of {', '.join(writers)}", parameter="format")
    if settings and entry.settings_file is None:
        raise ProbeError(f"format {format!r} has no settings file: write it without settings", parameter="settings")
    entry.write(head_map, Path(path), settings or {})
    return Path(path)


def pick_score(fields: list[str], score: str | None, source: Path) -> str:
    """`score` where the file has it, or its only one; else refused, listing the choices."""
    if not fields:
        raise ProbeError(f"{source} holds no head scores: write it again, or give another file")
    if score is not None and score in fields:
        return score
    if score is not None:
        raise ProbeError(f"{source} holds nothing called {score!r}: choose score from {', '.join(fields)}",
                         parameter="score")
    if len(fields) == 1:
        return fields[0]
    raise ProbeError(f"{source} holds several scores: choose one with score ({', '.join(fields)})", parameter="score")


def read_json(path: Path) -> Any:
    """The JSON in a file, or one line saying why it is not."""
    try:
        return loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProbeError(f"{path} is not readable JSON ({first_line(error)})") from None


def _json_with(test: Callable[[Any], bool]) -> Callable[[Path], bool]:
    def recognises(path: Path) -> bool:
        if not (is_file(path) and path.suffix.lower() == ".json"):
            return False
        try:
            return test(loads(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return False
    return recognises


def _is_probe(payload: Any, *keys: str) -> bool:
    return isinstance(payload, dict) and all(key in payload for key in keys) and isinstance(payload["heads"], list)


def _grid(rows: list[dict[str, Any]], shape: tuple[int, int], value: Callable[[dict[str, Any]], Any],
          column: str = "head") -> np.ndarray:
    """A layers x heads matrix of `value(row)` over a payload's rows (None and missing heads: NaN)."""
    grid = np.full(shape, np.nan)
    for row in rows:
        found = value(row)
        grid[row["layer"], row[column]] = np.nan if found is None else float(found)
    return grid


def _read_classify(path: Path, score: str | None) -> HeadMap:
    """probe classify --json: one query-head map per class score; labels are the heads the class flags."""
    payload = read_json(path)
    heads = payload["heads"]
    name = pick_score(list(heads[0]["scores"]) if heads else [], score, path)
    shape = (payload["n_layers"], payload["n_heads"])
    labels = _grid(heads, shape, lambda row: name in row["labels"]) == 1
    return HeadMap(_grid(heads, shape, lambda row: row["scores"].get(name)), QUERY, str(path), "probe-classify",
                   name, n_heads=payload["n_heads"], n_kv_heads=payload.get("n_kv_heads"), dtype=payload.get("dtype"),
                   model=payload.get("model"), labels=labels, label_name=name,
                   threshold=(payload.get("thresholds") or {}).get(name), quantity=f"{name} score", unit=SHARE)


KV_FIELDS = {"retrieval": QUERY, "streaming": QUERY, "kv_retrieval": KV, "kv_streaming": KV, "duo": KV}
"""probe kv-heads' maps: per query head (`heads`), per KV head (`kv_heads`), and the DuoAttention values."""


def kv_heads_map(payload: dict[str, Any], score: str | None, source: str | Path) -> HeadMap:
    """One map (`score`: one of KV_FIELDS) of a `KVHeads.to_dict()` payload; labels: the KV heads kept full."""
    path = Path(source)
    name = pick_score(list(KV_FIELDS), score, path)
    n_layers, n_heads, n_kv = payload["n_layers"], payload["n_heads"], payload["n_kv_heads"]
    full = _grid(payload["kv_heads"], (n_layers, n_kv), lambda row: row["label"] == "full", "kv_head") == 1
    if name == "duo":
        values = np.asarray(payload["duo_full_attention_heads"], dtype=np.float64)
    elif KV_FIELDS[name] == KV:
        values = _grid(payload["kv_heads"], (n_layers, n_kv), lambda row: row[name[3:]], "kv_head")
    else:
        values = _grid(payload["heads"], (n_layers, n_heads), lambda row: row[name])
    kv = KV_FIELDS[name] == KV
    return HeadMap(values, KV_FIELDS[name], str(path), "probe-kv-heads", name, n_heads=n_heads, n_kv_heads=n_kv,
                   dtype=payload.get("dtype"), model=payload.get("model"), labels=full if kv else None,
                   label_name="full" if kv else None, threshold=DUO_THRESHOLD if name == "duo" else None,
                   quantity=GATE if name == "duo" else f"{name.removeprefix('kv_')} score",  # kv_: its query heads'
                   unit=GATE_UNIT if name == "duo" else SHARE)


def duo_config(payload: dict[str, Any]) -> dict[str, Any]:
    """DuoAttention's config.json for a `KVHeads.to_dict()` payload: sink, recent (and kvpress's ratio)."""
    press = (payload.get("budget") or {}).get("kvpress")
    return {"sink_size": payload["sink"], "recent_size": payload["recent"],
            **({"head_compression_ratio": press["head_compression_ratio"]} if press else {})}


def razor_map(payload: dict[str, Any]) -> dict[str, list[int]]:
    """RazorAttention's {layer: [kv_head, ...]} of full KV heads (write-only: it omits how many a layer has)."""
    out: dict[str, list[int]] = {str(layer): [] for layer in range(payload["n_layers"])}
    for row in payload["kv_heads"]:
        if row["label"] == "full":
            out[str(row["layer"])].append(row["kv_head"])
    return out


def _read_ablate(path: Path, score: str | None) -> HeadMap:
    """probe ablate --json: the metric's change per ablated head (`delta`, and each part's `*_delta`)."""
    payload = read_json(path)
    heads = payload["heads"]
    fields = ["delta", *sorted({key for row in heads for key in row if key.endswith("_delta")})]
    name = pick_score(fields, score, path)
    values = _grid(heads, (payload["n_layers"], payload["n_heads"]), lambda row: row.get(name))
    metric = payload.get("metric") or "metric"
    part = "" if name == "delta" else f" on {name.removesuffix('_delta')}"
    return HeadMap(values, QUERY, str(path), "probe-ablate", name, n_heads=payload["n_heads"],
                   dtype=payload.get("dtype"), model=payload.get("model"),
                   quantity=f"change in {metric}{part} when the head is ablated", unit=f"{metric} change",
                   signed=True)


HEAD_KEY = re.compile(r"^(\d+)-(\d+)$")


def _is_retrieval_head(payload: Any) -> bool:
    return isinstance(payload, dict) and bool(payload) and all(
        HEAD_KEY.match(key) and isinstance(value, (list, int, float)) for key, value in payload.items())


def _read_retrieval_head(path: Path, score: str | None) -> HeadMap:
    """Wu et al. 2024 (nightdessert/Retrieval_Head `head_score/*.json`): a head's value is the mean of its list."""
    pick_score(["retrieval"], score, path)
    payload = read_json(path)
    cells = {tuple(int(part) for part in HEAD_KEY.match(key).groups()): value  # type: ignore[union-attr]
             for key, value in payload.items()}
    values = np.full((max(layer for layer, _ in cells) + 1, max(head for _, head in cells) + 1), np.nan)
    for (layer, head), scores in cells.items():
        trials = [scores] if isinstance(scores, (int, float)) else scores
        if not trials or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in trials):
            raise ProbeError(f"{path}: head {layer}-{head} has no list of numbers")
        values[layer, head] = float(np.mean(trials))
    return HeadMap(values, QUERY, str(path), "retrieval-head", "retrieval", quantity="retrieval score", unit=SHARE)


def _write_retrieval_head(head_map: HeadMap, path: Path, settings: dict[str, Any]) -> None:
    """One line `{"L-H": [value]}` per query head, layers then heads (HeadKV reads the first line in order)."""
    query = head_map if head_map.convention == QUERY else head_map.to_query(head_map.n_heads or head_map.columns)
    scores = {f"{layer}-{head}": [float(query.values[layer, head])] for layer in range(query.n_layers)
              for head in range(query.columns) if not np.isnan(query.values[layer, head])}
    write_atomically(path, json.dumps(scores) + "\n")  # json writes a float as repr: the same float64 back


def _duo_file(path: Path) -> Path:
    return path / DUO_FILE if path.is_dir() else path


def _read_duo(path: Path, score: str | None) -> HeadMap:
    """DuoAttention's gate per KV head (full where above config.json's threshold, 0.5 by default)."""
    pick_score(["full_attention"], score, path)
    table = _duo_file(path)
    values = _matrix(table, "\t")
    config = table.with_name(DUO_CONFIG)
    settings = read_json(config) if is_file(config) else {}
    threshold = float(settings.get("threshold") or DUO_THRESHOLD)
    with np.errstate(invalid="ignore"):
        labels = values > threshold
    return HeadMap(values, KV, str(path), "duo", "full_attention", n_kv_heads=values.shape[1], labels=labels,
                   label_name="full", threshold=threshold, model=settings.get("model_name"), quantity=GATE,
                   unit=GATE_UNIT)


def _write_duo(head_map: HeadMap, path: Path, settings: dict[str, Any]) -> None:
    """A DuoAttention folder: the TSV and a config.json of its threshold and `settings` (load_attn_pattern's)."""
    if head_map.convention != KV:
        raise ProbeError(f"DuoAttention's map is over KV heads; {head_map.source} is over query heads: group it "
                         "first (HeadMap.to_kv)")
    path.mkdir(parents=True, exist_ok=True)
    rows = ("\t".join(f"{value:.18e}" for value in row) + "\n" for row in head_map.values)  # numpy.savetxt's form
    write_atomically(path / DUO_FILE, "".join(rows))
    threshold = head_map.threshold if head_map.threshold is not None else DUO_THRESHOLD
    write_atomically(path / DUO_CONFIG, json.dumps({**settings, "threshold": threshold}) + "\n")


def _matrix(path: Path, delimiter: str) -> np.ndarray:
    """A numeric text matrix, one row per layer (a single row is one layer)."""
    try:
        return np.loadtxt(path, dtype=np.float64, delimiter=delimiter, ndmin=2)
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise ProbeError(f"{path} is not a numeric layers x heads matrix ({first_line(error)})") from None


def _read_tensor(path: Path, score: str | None) -> HeadMap:
    """A [n_layers, n_heads] tensor (TransformerLens' head_detector): .pt (a dict: one score per key), .npy, or a CSV /
    TSV matrix."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".pt":
            import torch  # only for a .pt file

            loaded = torch.load(path, map_location="cpu", weights_only=True)
        elif suffix == ".npy":
            loaded = np.load(path, allow_pickle=False)
        else:
            loaded = _matrix(path, "\t" if suffix == ".tsv" else ",")
    except ProbeError:
        raise
    except Exception as error:  # torch.load and np.load raise many kinds on a file that is not theirs
        raise ProbeError(f"{path} is not a tensor file probe can read ({first_line(error)})") from None
    fields = loaded if isinstance(loaded, dict) else {"value": loaded}
    name = pick_score([str(key) for key in fields], score, path)
    tensor = fields[name]
    values = np.asarray(tensor.float().numpy() if hasattr(tensor, "float") else tensor, dtype=np.float64)
    if values.ndim != 2:
        raise ProbeError(f"{path}: a head map is [n_layers, n_heads], got shape {tuple(values.shape)}")
    return HeadMap(values, QUERY, str(path), "tensor", name, n_heads=values.shape[1])  # dtype, quantity: not said


def _write_tensor(head_map: HeadMap, path: Path, settings: dict[str, Any]) -> None:
    """The values as [n_layers, heads] float32: .pt (a torch tensor), .npy, or a CSV / TSV matrix."""
    suffix = path.suffix.lower()
    if suffix == ".pt":
        import torch

        torch.save(torch.tensor(head_map.values, dtype=torch.float32), path)
    elif suffix == ".npy":
        np.save(path, head_map.values.astype(np.float32))
    elif suffix in (".csv", ".tsv"):
        np.savetxt(path, head_map.values, delimiter="\t" if suffix == ".tsv" else ",", fmt="%.9g")
    else:
        raise ProbeError(f"{path}: a tensor file ends in .pt, .npy, .csv or .tsv", parameter="path")


register_format(HeadFormat(
    "duo", "KV heads", "DuoAttention: a folder or full_attention_heads.tsv (+ config.json): gate per KV head",
    lambda path: _duo_file(path).name == DUO_FILE and is_file(_duo_file(path)), _read_duo, _write_duo, DUO_CONFIG))
register_format(HeadFormat(
    "probe-classify", "query heads", "probe classify --json: one score per class, its flagged heads labelled",
    _json_with(lambda data: _is_probe(data, "heads", "classes", "thresholds")), _read_classify))
register_format(HeadFormat(
    "probe-kv-heads", "query heads or KV heads (by score)", "probe kv-heads --json: retrieval, streaming, "
    "kv_retrieval, kv_streaming, duo", _json_with(lambda data: _is_probe(data, "heads", "kv_heads", "n_kv_heads")),
    lambda path, score: kv_heads_map(read_json(path), score, path)))
register_format(HeadFormat(
    "probe-ablate", "query heads", "probe ablate --json: delta (and each part's *_delta) per head",
    _json_with(lambda data: _is_probe(data, "heads", "baseline_loss", "n_heads")), _read_ablate))
register_format(HeadFormat(
    "retrieval-head", "query heads", "Retrieval_Head (Wu et al. 2024) head_score JSON {\"L-H\": [score per "
    "trial]}; probe's --export headkv:", _json_with(_is_retrieval_head), _read_retrieval_head,
    _write_retrieval_head))
register_format(HeadFormat(
    "tensor", "query heads", "a TransformerLens-style [n_layers, n_heads] tensor: .pt, .npy, or a CSV / TSV matrix",
    lambda path: is_file(path) and path.suffix.lower() in (".pt", ".npy", ".csv", ".tsv"), _read_tensor,
    _write_tensor))


def _is_neuronpedia_metrics(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("config"), dict) and isinstance(data.get("metrics"), dict) \
        and all(isinstance(rows, list) for rows in data["metrics"].values())


def _read_neuronpedia(path: Path, score: str | None) -> HeadMap:
    """Neuronpedia's head-metrics JSON: one map per metric, with its unit (nats are never compared with shares)."""
    from probe.headvis.result import UNITS

    payload = read_json(path)
    name = pick_score(list(payload["metrics"]), score, path)
    values = np.array([[np.nan if value is None else float(value) for value in row]
                       for row in payload["metrics"][name]], dtype=np.float64)
    config = payload["config"]
    return HeadMap(values, QUERY, str(path), "neuronpedia-headvis", name, n_heads=values.shape[1],
                   dtype=config.get("dtype"), model=config.get("model_name"), quantity=name.replace("_", " "),
                   unit=UNITS.get(name))


def _write_neuronpedia(head_map: HeadMap, path: Path, settings: dict[str, Any]) -> None:
    """One map as Neuronpedia's head-metrics JSON: its metric alone, null where a value is not a number."""
    rows = [[None if np.isnan(value) else float(value) for value in row] for row in head_map.values.tolist()]
    config = {"model_name": head_map.model, "dtype": head_map.dtype, "n_layers": len(rows), "n_heads": len(rows[0])}
    write_atomically(path, json.dumps({"config": config, "metrics": {head_map.score: rows}}) + "\n")


register_format(HeadFormat(
    "neuronpedia-headvis", "query heads", "Neuronpedia HeadVis head-metrics JSON {\"config\", \"metrics\": {name: "
    "layers x heads}}; probe headvis --neuronpedia-json", _json_with(_is_neuronpedia_metrics), _read_neuronpedia,
    _write_neuronpedia))

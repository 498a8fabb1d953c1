"""The results stream: a header line then one line per finished ablation, flushed as each finishes, for `resume`."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from probe.ablation.heads import distinct
from probe.ablation.methods import AblationMethod
from probe.ablation.results import AblationResult, HeadResult
from probe.inputs import ProbeSet
from probe.atomic import write_atomically
from probe.errors import ProbeError
from probe.reading import loads
from probe.models import LoadedModel, cache_root

RESULTS_FORMAT = 1


def fingerprint(loaded: LoadedModel, probe_set: ProbeSet, method: AblationMethod, metric: str) -> str:
    """What makes two sweeps' numbers comparable: model, data, method (and what it depends on), metric."""
    digest = hashlib.sha256()
    digest.update(json.dumps([loaded.name, method.name, metric, probe_set.offset, probe_set.repeat_len]).encode())
    digest.update(probe_set.input_ids.cpu().contiguous().numpy().tobytes())
    for extra in (probe_set.attention_mask, probe_set.source_ids, probe_set.source_mask):  # sources: probe.inputs.pairs
        if extra is not None:
            digest.update(extra.cpu().contiguous().numpy().tobytes())
    method.add_to_fingerprint(digest)
    return digest.hexdigest()[:24]


def write_stream(path: Path, header: dict[str, Any], entries: Sequence[Any]) -> None:
    """A results stream (a header line, one line per entry's `to_dict()`), written atomically."""
    lines = [json.dumps(header)] + [json.dumps(entry.to_dict()) for entry in entries]
    write_atomically(path, "\n".join(lines) + "\n")


HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "fingerprint": (str,), "model": (str,), "method": (str,), "data": (str,), "metric": (str,),
    "baseline_loss": (int, float), "n_layers": (int,), "n_heads": (int,)}
"""What every results header holds, and of which type: what resuming and `load_results` read."""


def _header(path: Path, entry: Any) -> dict[str, Any]:
    """The header line, checked: a file whose first line is not one is not a results file."""
    version = entry.get("probe_ablation") if isinstance(entry, dict) else None
    if version != RESULTS_FORMAT or isinstance(version, bool):  # true == 1 in Python
        raise ProbeError(f"{path} is not a probe ablation results file")
    for key, types in HEADER_TYPES.items():
        if not isinstance(entry.get(key), types) or isinstance(entry.get(key), bool):
            raise ProbeError(f"{path} line 1 is a malformed results header (its {key!r}); start the sweep over")
    if entry["n_layers"] < 1 or entry["n_heads"] < 1 or not isinstance(entry.get("baseline_parts", {}), dict):
        raise ProbeError(f"{path} line 1 is a malformed results header; start the sweep over")
    return entry


def _entry(path: Path, number: int, entry: Any, header: dict[str, Any]) -> HeadResult:
    try:
        result = HeadResult.from_dict(entry)
        for layer, head in result.heads:
            if layer >= header["n_layers"] or head >= header["n_heads"]:
                raise ProbeError(f"head {layer}.{head} is not one of the sweep's {header['n_layers']} layers x "
                                 f"{header['n_heads']} heads")
        return result
    except ProbeError as error:
        raise ProbeError(f"{path} line {number} is malformed: {error}; remove that line (its ablation runs again "
                         "when the sweep resumes) or start the sweep over") from None


def json_lines(path: Path, kind: str, missing: str = "results file") -> list[tuple[int, Any]]:
    """(line number, entry) of each JSON line of a results stream; a half-written last line is ignored."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise ProbeError(f"{missing} not found: {path}") from None
    except UnicodeDecodeError:
        raise ProbeError(f"{path} is not a probe {kind} results file") from None
    entries: list[tuple[int, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entries.append((number, loads(line)))
        except json.JSONDecodeError:
            if number >= len(lines) - 1:  # the last line, cut short by an interruption
                break
            raise ProbeError(f"{path} line {number} is not JSON: not a probe {kind} results file") from None
    if not entries:
        raise ProbeError(f"{path} is empty: not a probe {kind} results file")
    return entries


def read_results(path: str | Path) -> tuple[dict[str, Any], list[HeadResult]]:
    """The header and the finished ablations of a results stream; a half-written last line is ignored."""
    path = Path(path)
    (_, first), *rest = json_lines(path, "ablation")
    header = _header(path, first)
    return header, [_entry(path, number, entry, header) for number, entry in rest]


def load_results(*paths: str | Path) -> AblationResult:
    """An AblationResult from one or more results streams of the same sweep (e.g. one per process)."""
    if not paths:
        raise ProbeError("no results files given")
    headers: list[dict[str, Any]] = []
    results: list[HeadResult] = []
    for path in paths:
        header, entries = read_results(path)
        if headers and header["fingerprint"] != headers[0]["fingerprint"]:
            raise ProbeError(f"{path} comes from a different sweep (model, data or method) than {paths[0]}")
        headers.append(header)
        results.extend(entries)
    return result_of(headers[0], distinct(results, key=lambda r: r.heads))


def result_of(h: dict[str, Any], results: list[HeadResult], **more: Any) -> AblationResult:
    """The AblationResult of a results header and `results`; `more`: what the header does not hold (mode, path)."""
    return AblationResult(model=h["model"], method=h["method"], data=h["data"], metric=h["metric"],
                          baseline_loss=h["baseline_loss"], results=results, n_layers=h["n_layers"],
                          n_heads=h["n_heads"], baseline_parts=h.get("baseline_parts", {}),
                          probe_set=h.get("probe_set", {}), mean=h.get("mean"), task=h.get("task"),
                          layer_names=h.get("layer_names"), dtype=h.get("dtype", "float32"),
                          **{"mode": h.get("mode", "exact"), "path": h.get("path", "")} | more)


class LineStream:
    """A stream rewritten as `header` and `entries`, then one JSON line appended per finished entry, flushed at once,
    so an interruption loses nothing finished; `done` holds the entries by `key`."""

    def __init__(self, path: Path, header: dict[str, Any], entries: Sequence[Any], key: Callable[[Any], Any]) -> None:
        self.path, self.key = path, key
        write_stream(path, header, entries)  # drops a half-written last line
        self.done = {key(entry): entry for entry in entries}
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open while the stream lives; close() closes it)

    def write(self, result: Any) -> None:
        self.file.write(json.dumps(result.to_dict()) + "\n")
        self.file.flush()
        self.done[self.key(result)] = result

    def close(self) -> None:
        self.file.close()


def sweep_stream(path: Path, header: dict[str, Any], resume: bool) -> LineStream:
    """The results stream of a sweep; with `resume`, continuing the one at `path` (`check_same_sweep` said it is the
    same model, dtype and probe set; refused if it is another method or data)."""
    entries: list[HeadResult] = []
    if resume and path.exists() and path.stat().st_size > 0:
        old, entries = read_results(path)
        if old.get("fingerprint") != header["fingerprint"]:
            raise ProbeError(f"cannot resume from {path}: it holds a sweep of a different model, data or method "
                             "(start over without resume, or with another results_path)", parameter="resume")
        if not math.isclose(old["baseline_loss"], header["baseline_loss"], rel_tol=1e-5, abs_tol=1e-7):
            raise ProbeError(f"cannot resume from {path}: its baseline loss {old['baseline_loss']:.6f} differs "
                             f"from this model's {header['baseline_loss']:.6f} (different weights?)")
        header = old
    return LineStream(path, header, entries, key=lambda result: result.heads)


def _set_name(header: dict[str, Any]) -> str:
    probe_set = header.get("probe_set") or {}
    return str(probe_set.get("description") or probe_set.get("name") or "?")


def _difference(old: dict[str, Any], header: dict[str, Any]) -> str | None:
    """What makes the sweep in a results file another one than this: its model, dtype or probe set (None: same)."""
    same_weights = old.get("model_sha256") == header.get("model_sha256") or None in (old.get("model_sha256"),
                                                                                     header.get("model_sha256"))
    if old.get("model") != header.get("model") or not same_weights:
        hashes = [str(h.get("model_sha256") or "")[:12] for h in (old, header)]
        shown = [f"{h.get('model')}" + (f" (sha256 {short}...)" if short else "") for h, short in zip((old, header),
                                                                                                       hashes)]
        return f"another model: {shown[0]}, not {shown[1]}"
    if "dtype" in old and old["dtype"] != header.get("dtype"):
        return f"another dtype: {old['dtype']}, not {header.get('dtype')}"
    as_read = json.loads(json.dumps(header.get("probe_set"), default=str))  # as the file would hold it
    if old.get("probe_set") and old.get("probe_set") != as_read:
        return f"another probe set: {_set_name(old)}, not {_set_name(header)}"
    return None


def check_same_sweep(path: Path, identity: dict[str, Any]) -> None:
    """Before any work: a results file to continue holds a sweep of this model, dtype and probe set, else one line."""
    difference = _difference(read_results(path)[0], identity) if path.is_file() and path.stat().st_size > 0 else None
    if difference is not None:
        raise ProbeError(f"cannot continue the sweep in {path}: it holds a sweep of {difference} (start over "
                         "without resume, or with another results file)", parameter="resume")


def cached_results_path(key: dict[str, Any], folder: str = "ablate", stem: str = "sweep") -> Path:
    """Where a run streams without a results file: probe's cache, named by `key`, so that resume finds it again."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / folder / f"{stem}-{digest}.jsonl"  # every command's sweeps in one folder


def finished_count(path: Path) -> int:
    """Ablations a results stream holds (0 for a missing, empty or unreadable one)."""
    try:
        return len(read_results(path)[1]) if path.is_file() and path.stat().st_size else 0
    except ProbeError:
        return 0

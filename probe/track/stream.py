"""The track results stream: a header line then one line per finished checkpoint, flushed as each finishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from probe.atomic import write_atomically
from probe.errors import ProbeError
from probe.track.result import CheckpointResult

TRACK_FORMAT = 1


def write_track_stream(path: Path, header: dict[str, Any], entries: list[CheckpointResult]) -> None:
    """Header and entries, written atomically (a temporary file, renamed)."""
    lines = [json.dumps(header)] + [json.dumps(entry.to_dict()) for entry in entries]
    write_atomically(path, "\n".join(lines) + "\n")


def read_track(path: str | Path) -> tuple[dict[str, Any], list[CheckpointResult]]:
    """The header and finished checkpoints of a stream; a last line cut short by an interruption is ignored."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    except FileNotFoundError:
        raise ProbeError(f"track results file not found: {path}") from None
    except UnicodeDecodeError:
        raise ProbeError(f"{path} is not a probe track results file") from None
    entries = []
    for number, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) - 1 and number > 0:
                break
            raise ProbeError(f"{path} line {number + 1} is not JSON: not a probe track results file") from None
        if number == 0 and (not isinstance(entry, dict) or entry.get("probe_track") != TRACK_FORMAT):
            raise ProbeError(f"{path} is not a probe track results file")
        if number > 0:
            entries.append(CheckpointResult.from_dict(entry))
    if not lines:
        raise ProbeError(f"{path} is empty: not a probe track results file")
    return json.loads(lines[0]), entries


def finished(path: Path, identity: dict[str, Any]) -> list[CheckpointResult]:
    """The checkpoints a stream holds for this run (same model and options), else one line saying it is another."""
    if not path.is_file() or path.stat().st_size == 0:
        return []
    header, entries = read_track(path)
    as_read = json.loads(json.dumps(identity, default=str))
    if header.get("identity") != as_read:
        changed = sorted(k for k in set(as_read) | set(header.get("identity", {}))
                         if as_read.get(k) != header.get("identity", {}).get(k))
        raise ProbeError(f"cannot resume from {path}: it holds another run ({', '.join(changed) or 'format'} "
                         "differ); start over without resume, or with another results file", parameter="resume")
    return entries


class TrackStream:
    """Appends one line per finished checkpoint, flushed at once; `done` holds what the file held (resume)."""

    def __init__(self, path: Path, identity: dict[str, Any], resume: bool,
                 known: list[CheckpointResult] | None = None) -> None:
        self.path = path
        entries = known if known is not None else (finished(path, identity) if resume else [])
        self.done = {entry.name: entry for entry in entries}
        write_track_stream(path, {"probe_track": TRACK_FORMAT, "identity": identity}, list(self.done.values()))
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open while the stream lives; close() closes it)

    def write(self, result: CheckpointResult) -> None:
        self.file.write(json.dumps(result.to_dict()) + "\n")
        self.file.flush()
        self.done[result.name] = result

    def close(self) -> None:
        self.file.close()

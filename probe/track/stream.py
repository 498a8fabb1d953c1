"""The track results stream: a header line then one line per finished checkpoint, flushed as each finishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from probe.ablation.stream import LineStream
from probe.errors import ProbeError
from probe.track.result import CheckpointResult

TRACK_FORMAT = 1


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


class TrackStream(LineStream):
    """The stream of a track run, by checkpoint name; `done` holds what the file held (resume) or `known`."""

    done: dict[str, CheckpointResult]

    def __init__(self, path: Path, identity: dict[str, Any], resume: bool,
                 known: list[CheckpointResult] | None = None) -> None:
        entries = known if known is not None else (finished(path, identity) if resume else [])
        super().__init__(path, {"probe_track": TRACK_FORMAT, "identity": identity},
                         list({entry.name: entry for entry in entries}.values()), key=lambda result: result.name)

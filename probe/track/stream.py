"""The track results stream: a header line then one line per finished checkpoint, flushed as each finishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from probe.ablation.stream import LineStream, json_lines
from probe.errors import ProbeError
from probe.track.result import CheckpointResult

TRACK_FORMAT = 1


def read_track(path: str | Path) -> tuple[dict[str, Any], list[CheckpointResult]]:
    """The header and finished checkpoints of a stream; a last line cut short by an interruption is ignored."""
    path = Path(path)
    (_, header), *rest = json_lines(path, "track", "track results file")
    if not isinstance(header, dict) or header.get("probe_track") != TRACK_FORMAT:
        raise ProbeError(f"{path} is not a probe track results file")
    return header, [CheckpointResult.from_dict(entry) for _, entry in rest]


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

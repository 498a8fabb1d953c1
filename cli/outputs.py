"""The files a command writes: checked before any work, a warning for non-finite numbers, provenance in each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from probe.cli.progress import note, warn
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.provenance import command_line, provenance, utc_now
from probe.reports.files import (check_writable, non_finite_heads, provenance_path, stamp_outputs, write_csv,
                                 write_json, write_text)
from probe.schemas import header

SHOWN_HEADS = 10  # heads named in the non-finite warning
OVERFLOW_HINTS = {"float16": "float16 ends at 65504 and the model's values passed it there: try --dtype bfloat16 "
                             "(float32's range) or float32",
                  "bfloat16": "The model's bfloat16 forward gave NaN or infinity there: try --dtype float32"}


def check_distinct(files: dict[str, Path | None]) -> None:
    """No two outputs at one path: the second write would replace the first. `files` maps flags to paths or None."""
    seen: dict[Path, str] = {}
    for flag, path in files.items():
        if path is None:
            continue
        key = path.resolve()
        if key in seen:
            raise ProbeError(f"{seen[key]} and {flag} both name {path}: give each output its own file")
        seen[key] = flag


def check_outputs(files: dict[str, Path | None], *, force: bool) -> None:
    """The outputs (a CSV's sidecar too) are distinct, and none replaces a file without `force`."""
    csv_path = files.get("--csv")
    if csv_path is not None:
        files = {**files, "--csv (its provenance)": provenance_path(csv_path)}
    check_distinct(files)
    for path in files.values():
        if path is not None:
            check_writable(path, force=force)


def save(path: Path | None, write: Callable[[Path], Any]) -> None:
    """Write one output (`write(path)`, atomic in reports.files) where its flag was given, and say so."""
    if path is not None:
        write(path)
        note(f"wrote {path}")


def save_json(path: Path | None, payload: dict[str, Any], kind: str) -> None:
    """Write a result's JSON where --json was given, named as schema `kind` (probe.schemas: `probe schema KIND`)."""
    save(path, lambda target: write_json(target, payload, schema=header(kind)))


Payload = dict[str, Any]


def save_results(payload: Payload, kind: str, json_path: Path | None, csv_path: Path | None = None,
                 html_path: Path | None = None, *, rows: Callable[[Payload], list[Payload]] | None = None,
                 page: Callable[[Payload], str] | None = None) -> None:
    """A result's --json, --csv (`rows(payload)`) and --html (`page(payload)`), each where its flag was given."""
    save_json(json_path, payload, kind)
    if rows is not None:
        save(csv_path, lambda target: write_csv(target, rows(payload)))
    if page is not None:
        save(html_path, lambda target: write_text(target, page(payload)))


def warn_non_finite(payload: dict[str, Any]) -> None:
    """One line naming the heads whose numbers are NaN or infinite (half precision overflowing, usually)."""
    heads = non_finite_heads(payload)
    if not heads:
        return
    shown = ", ".join(heads[:SHOWN_HEADS]) + (f" and {len(heads) - SHOWN_HEADS} more" if len(heads) > SHOWN_HEADS
                                              else "")
    warn(f"warning: numbers that are not finite (NaN or infinity) for {shown}; JSON writes them as null. "
         + OVERFLOW_HINTS.get(str(payload.get("dtype")), "The model's forward gave NaN or infinity there."))


_command: dict[str, Any] = {}  # the running command's parameters (cli.app.Command puts them here)


def remember_parameters(parameters: dict[str, Any]) -> None:
    """The parameters of the command about to run, for its provenance (its seed)."""
    _command.clear()
    _command.update(parameters)


def record_provenance(loaded: LoadedModel) -> None:
    """Every file written from now on records its provenance, made at the first: a run writing none hashes nothing."""
    seed = _command.get("seed")
    command, loaded_at = command_line(), utc_now()

    def made() -> dict[str, Any]:
        return provenance(loaded, seed=seed if isinstance(seed, int) else None, command=command) | {
            "timestamp_utc": loaded_at}

    stamp_outputs(made)


def forget_provenance() -> None:
    """After a command: files written later (another command in the same process) do not carry this one's."""
    _command.clear()
    stamp_outputs(None)


def check_sweep_outputs(files: dict[str, Path | None], results: Path | None, *, resume: bool, force: bool,
                        writes: bool) -> None:
    """A sweep's outputs (where this process `writes` them) and its --results: a file in a folder that exists,
    holding no other sweep unless --resume (continue) or --force."""
    check_distinct({**files, "--results": results})
    if writes:
        check_outputs(files, force=force)
    if results is None:
        return
    if results.is_dir():
        raise ProbeError(f"--results {results} is a folder: give a file name")
    if not results.parent.exists():
        raise ProbeError(f"folder {results.parent} does not exist: create it first")
    if results.exists() and results.stat().st_size > 0 and not (resume or force):
        raise ProbeError(f"{results} exists: pass --resume to continue that sweep, or --force to start over")

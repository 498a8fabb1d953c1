"""What produced a result file (versions, the model and its content hash, setup, command), added in reports.files:
files by their bytes (cached), a hub id by its commit, weights made by code by their tensors."""

from __future__ import annotations

import hashlib
import json
import platform
import shlex
import sys
from collections import Counter
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from probe.atomic import write_atomically
from probe.errors import DISTRIBUTION
from probe.models import LoadedModel, cache_root
CHUNK = 1 << 22  # bytes read at a time when hashing a file
MAX_TENSOR_HASH = 4 << 30  # weights made by code: hashed up to this many bytes


def version_of(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cache_file() -> Path:
    return cache_root() / "provenance" / "files.json"


def _read_cache() -> dict[str, Any]:
    try:
        return json.loads(_cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict[str, Any]) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(cache, indent=1))
    except OSError:
        pass  # an unwritable cache only costs the hash again next time


def _gguf_quantisation(path: Path) -> str | None:
    """The GGUF file's main quantisation (the most common tensor type, e.g. Q4_1), read from its tensor table."""
    try:
        from gguf import GGUFReader

        types = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors)
    except Exception:  # provenance never stops a run: an unreadable table leaves the type unknown
        return None
    quantised = [(count, name) for name, count in types.items() if name not in ("F32", "F16", "BF16")]
    return max(quantised)[1] if quantised else None


def file_facts(path: str | Path) -> dict[str, Any]:
    """sha256 of a file's bytes (and a GGUF file's quantisation), cached by path, size and modification time."""
    path = Path(path)
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cache = _read_cache()
    if key not in cache:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            for block in iter(lambda: file.read(CHUNK), b""):
                digest.update(block)
        facts: dict[str, Any] = {"sha256": digest.hexdigest(), "bytes": stat.st_size}
        if path.suffix == ".gguf":
            facts["quantisation"] = _gguf_quantisation(path)
        cache[key] = facts
        _write_cache(cache)
    return cache[key]


def tensor_hash(model: nn.Module) -> str | None:
    """sha256 of the parameters and buffers; None past MAX_TENSOR_HASH bytes or for tensors that cannot be read."""
    state = model.state_dict()
    if sum(t.numel() * t.element_size() for t in state.values()) > MAX_TENSOR_HASH:
        return None
    digest = hashlib.sha256()
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            return None
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_facts(loaded: LoadedModel) -> dict[str, Any]:
    """The resolved model with its content hash (`hash_of` says of what), and whether its weights were dequantised."""
    origin = loaded.origin
    facts: dict[str, Any] = {"name": loaded.name, **(origin.to_dict() if origin else {"kind": "unknown"})}
    if origin is not None and origin.weights:
        files = [file_facts(path) for path in origin.weights]
        digest = files[0]["sha256"] if len(files) == 1 else hashlib.sha256(
            "".join(f["sha256"] for f in files).encode()).hexdigest()
        facts.update(sha256=digest, hash_of="the weight file's bytes" if len(files) == 1 else
                     f"the sha256s of its {len(files)} weight files' bytes, in name order")
        quantisation = files[0].get("quantisation")
    elif origin is not None and origin.kind == "hub":
        facts.update(sha256=None, hash_of="none: the hub revision names the content")
        quantisation = None
    else:
        digest = tensor_hash(loaded.model)
        facts.update(sha256=digest, hash_of="the parameters and buffers (names, shapes, dtypes, bytes)"
                     if digest else "none: weights too large or not in memory")
        quantisation = None
    dequantised = origin is not None and origin.dequantised
    facts["dequantised"] = (f"GGUF {quantisation or 'quantised'} weights dequantised to {model_dtype(loaded)}"
                            if dequantised else None)
    return facts


def model_dtype(loaded: LoadedModel) -> str:
    """The floating dtype of the model's parameters ('float32'), or their dtypes joined where they mix."""
    return module_dtype(loaded.model)


def module_dtype(model: nn.Module) -> str:
    """model_dtype of a bare module: 'float32', 'bfloat16+float32' where they mix, 'none' without floating ones."""
    kinds = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    return "+".join(kinds) or "none"


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, the program shown as `probe` (python -m probe.cli, or the script's path, say)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["probe", *args])


def provenance(loaded: LoadedModel, *, seed: int | None = None, command: str | None = None) -> dict[str, Any]:
    """What produced a result: versions, the model (resolved, hashed), dtype, device, command line, seed, UTC time."""
    return {
        "probe": version_of(DISTRIBUTION), "torch": torch.__version__, "transformers": version_of("transformers"),
        "python": platform.python_version(), "model": model_facts(loaded), "dtype": model_dtype(loaded),
        "device": "+".join(sorted({str(p.device) for p in loaded.model.parameters()})) or "none",  # a map's joined
        "command": command, "seed": seed, "timestamp_utc": utc_now(),
    }


def utc_now() -> str:
    """The time now as provenance writes it: 2026-01-31T12:00:00Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

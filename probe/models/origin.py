"""Where a loaded model came from: what provenance records and what `--resume` compares (probe.provenance)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probe.models.aliases import ALIASES, alias_path
from probe.models.custom import is_custom_spec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class ModelOrigin:
    """The resolved model: `kind` gguf, folder, hub, custom or module; `weights`: the files whose bytes identify it
    (none for a hub id, whose commit does, or for code-made weights, whose tensors do)."""

    kind: str
    source: str
    revision: str | None = None
    weights: tuple[str, ...] = ()
    dequantised: bool = False  # a GGUF file's quantised weights turned into floats

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "revision": self.revision}


def origin_of(spec: str, model: Any) -> ModelOrigin:
    """The origin of what `load_model(spec)` loaded (a spec it accepted)."""
    if spec in ALIASES or spec.endswith(".gguf"):
        path = alias_path(ALIASES[spec]) if spec in ALIASES else Path(spec)
        resolved = str(Path(str(path)).resolve())
        return ModelOrigin("gguf", resolved, weights=(resolved,), dequantised=True)
    if is_custom_spec(spec):
        file, _, function = spec.rpartition(":")
        return ModelOrigin("custom", f"{Path(file).resolve()}:{function}")
    folder = Path(spec)
    if folder.is_dir():
        files = sorted(str(path.resolve()) for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES)
        return ModelOrigin("folder", str(folder.resolve()), weights=tuple(files))
    revision = getattr(getattr(model, "config", None), "_commit_hash", None)
    return ModelOrigin("hub", spec, revision=revision if isinstance(revision, str) else None)


def module_origin(model: Any) -> ModelOrigin:
    """An nn.Module handed to load_model: its class names it; its tensors identify it."""
    kind = type(model)
    return ModelOrigin("module", f"{kind.__module__}.{kind.__qualname__}")

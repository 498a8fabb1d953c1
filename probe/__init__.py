"""probe: find out what each attention head of a transformer does.

The names here are the ones most scripts need; everything else is imported from the module that defines it
(`probe.ablation`, `probe.atlas`, `probe.heads`, `probe.hooks`, `probe.inputs`, ...: docs/reference). No name here
shadows a module: `probe.classify` is the function (the code lives in `probe.heads.classify`), and `probe.atlas` is
the package (its function is `probe.atlas.atlas`).
"""

from types import ModuleType as _ModuleType

from probe.ablation.methods import add_to_head, scale_head  # noqa: F401 (re-exported through __all__)
from probe.atlas import Atlas  # noqa: F401
from probe.errors import ProbeError  # noqa: F401
from probe.heads.classify import Classification, classify  # noqa: F401
from probe.hooks.capture import attention_hooks, capture_attention  # noqa: F401
from probe.hooks.layers import attention_layers  # noqa: F401
from probe.hooks.trace import Trace  # noqa: F401
from probe.kv import KVHeads, kv_heads  # noqa: F401
from probe.models import LoadedModel, load_model  # noqa: F401

__all__ = sorted(name for name, value in globals().items() if not name.startswith("_")
                 and not isinstance(value, _ModuleType))
"""The names imported above (no second list to keep)."""

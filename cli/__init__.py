"""The `probe` command (the typer app is `app.py`).

Installed, this folder is `probe/cli`; in a checkout it is `cli/` beside `probe/`, mapped to `probe.cli` by the
checkout's editable install. A second checkout run with another checkout's install would mix the two silently, so it
is refused here.
"""

from pathlib import Path as _Path

import probe as _probe

_CLI = _Path(__file__).resolve().parent
_LIBRARY = _Path(_probe.__file__).resolve().parent
if _LIBRARY not in (_CLI.parent, _CLI.parent / "probe"):
    raise ImportError(f"probe is {_LIBRARY} but probe.cli is {_CLI}: this environment's editable install is another "
                      "checkout's; run `pip install -e .` in the checkout you run, or give it its own environment "
                      "(`bash install.sh`)")

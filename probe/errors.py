"""The one exception probe raises for bad input: the CLI turns it into a single line and a non-zero exit."""

from __future__ import annotations

DISTRIBUTION = "probe-heads"
"""What pip installs probe as: `probe` on PyPI is another project's, so every install hint names this one."""


_BREAKS = {ord(char): repr(char)[1:-1] for char in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


class ProbeError(Exception):
    """Bad input or an unusable model, saying what to do; the CLI rewrites `parameter` to its flag."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message.translate(_BREAKS))  # escaped: a quoted path with a newline must not make two lines
        self.parameter = parameter


def first_line(error: BaseException) -> str:
    """The first line of an error's message ('' if it has none): foreign errors are quoted in one line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def install_hint(extra: str) -> str:
    """The pip command that installs an optional extra of probe: `pip install 'probe-heads[EXTRA]'`."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"

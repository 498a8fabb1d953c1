"""The documentation site's CLI reference: the typer app's `--help` as Markdown."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from probe.cli.app import app

WIDTH = 100  # columns the help is laid out in (rich wraps to the terminal: the page is one fixed width)


def command_names() -> list[str]:
    """The commands, in the order `probe --help` lists them."""
    return list(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def command_help(name: str | None = None, width: int = WIDTH) -> str:
    """What `probe NAME --help` (`probe --help` for None) prints at `width` columns, without colours."""
    args = [name, "--help"] if name else ["--help"]
    result = CliRunner().invoke(app, args, prog_name="probe",
                                env={"COLUMNS": str(width), "TERMINAL_WIDTH": str(width), "NO_COLOR": "1"})
    if result.exit_code != 0:
        raise RuntimeError(f"probe {' '.join(args)} exited {result.exit_code}: {result.output}")
    return "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines())


def markdown(width: int = WIDTH) -> str:
    """Every command's help as one Markdown page body: `probe --help`, then one section per command."""
    sections = ["## probe", "", "```text", command_help(None, width), "```"]
    for name in command_names():
        sections += ["", f"## probe {name}", "", "```text", command_help(name, width), "```"]
    return "\n".join(sections) + "\n"

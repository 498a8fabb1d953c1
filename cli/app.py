"""The `probe` command, a thin typer layer over the library. Every failure's one line and exit code live here; a
library message about a parameter (`seq_len`) names the running command's flag for it (`--seq-len`)."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from probe.cli import (ablate, atlas, circuits, classify, compare, dla, headvis, heatmap, kv_heads, models, patch,
                       prune, qk, schema, serve, steer, syntax, track)
from probe.cli.allocator import keep_freed_buffers
from probe.cli.checks import check_before_loading
from probe.cli.options import Debug, Quiet, Threads, Verbose
from probe.cli.outputs import forget_provenance, remember_parameters
from probe.cli.progress import Interrupted, set_quiet, warn
from probe.errors import ProbeError
from probe.provenance import DISTRIBUTION, version_of
from probe.reports.labels import computed_on
from probe.threads import use_threads


_state: dict[str, Any] = {"debug": False, "quiet": False, "verbose": False, "threads": None, "params": []}

def _apply_flags() -> None:
    """Put the global flags' state into effect (`-q` and `-v` together are refused: they contradict each other)."""
    if _state["quiet"] and _state["verbose"]:
        raise ProbeError("-q and -v contradict each other: give one")
    set_quiet(_state["quiet"])
    configure_logging(_state["verbose"])
    computed_on(use_threads(_state["threads"]))


def _late_flags(given: dict[str, Any]) -> None:
    """The global flags given after the command: they add to those given before it (`--threads` replaces)."""
    threads = given.pop("threads")
    for name, value in given.items():
        _state[name] = _state[name] or value
    _state["threads"] = _state["threads"] if threads is None else threads
    _apply_flags()


class _BareFlags:
    """typer's rich help writes `<bool>` after a flag, as if it took a value: a flag is shown bare."""

    def get_params(self, ctx: Any) -> list[Any]:  # click's Context and Parameter (typer's own copy of click)
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class Command(_BareFlags, TyperCommand):
    """A probe command: its parameters remembered for its files' provenance, the global flags taken after its name
    too (`probe classify -q`), where a newcomer types them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:  # typer's rich help reads markup: `[kv_head, ...]` would vanish as a tag
            if isinstance(param, (TyperOption, TyperArgument)) and param.help:
                param.help = escape(param.help)
        self.params.extend(_LATE_FLAGS)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        _state["params"] = self.params  # a library error names the option that sets its parameter (flag_message)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: Any) -> Any:
        _late_flags({param.name: ctx.params.pop(param.name) for param in _LATE_FLAGS})
        remember_parameters(dict(ctx.params))
        check_before_loading(ctx.params)
        return super().invoke(ctx)


class Group(_BareFlags, TyperGroup):
    """The probe command group (flags shown bare in --help)."""


app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Find out what each attention head of a transformer does.")
for command in (classify.classify, models.models, heatmap.heatmap, ablate.ablate, syntax.syntax, circuits.circuits,
                prune.prune, kv_heads.kv_heads, dla.dla, patch.patch, track.track, atlas.atlas, steer.steer,
                schema.schema, compare.compare, qk.qk, serve.serve, headvis.headvis):
    app.command(cls=Command)(command)

LIBRARY_NAMES = {"thresholds": "threshold", "start": "window_start", "order_by": "order", "top_k": "top"}
"""A library parameter that a command's option sets under another name: that option's name. Every other library
parameter is the option of its own name."""

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process stopped by Ctrl-C


def flag_of(parameter: str | None, params: Sequence[Any]) -> str | None:
    """The long flag of the command's option that sets the library's `parameter`, or None."""
    name = LIBRARY_NAMES.get(parameter or "", parameter)
    for param in params:
        if param.name == name and isinstance(param, TyperOption):
            return max(param.opts, key=len)
    return None


def flag_message(error: ProbeError, params: Sequence[Any]) -> str:
    """The error's message with its parameter's name (first as a word) replaced by its flag among `params`."""
    message, flag = str(error), flag_of(error.parameter, params)
    if flag is None or error.parameter is None:
        return message
    return re.sub(rf"(?<![\w-]){re.escape(error.parameter)}(?![\w-])", flag, message, count=1)


def _rank_prefix() -> str:
    """Under torchrun every process reports its own error: name the process, except rank 0 (the one that reports)."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    return f"rank {rank}: " if world not in ("", "1") and rank not in ("", "0") else ""


def _usage_line(error: BaseException) -> str | None:
    """typer's usage error in one line (none where typer has shown the help instead: `probe` alone)."""
    message = error.format_message() if isinstance(error, typer.TyperException) else str(error)
    return f"error: {message}" if message else None


Describe = Callable[[BaseException], "str | None"]
EXITS: tuple[tuple[type[BaseException], int | None, Describe, bool], ...] = (
    # (kind of failure, exit code (None: its own exit_code), its one line (None: nothing), --debug re-raises it)
    (ProbeError, 2, lambda error: f"{_rank_prefix()}error: {flag_message(error, _state['params'])}", True),  # type: ignore[arg-type]
    (typer.Exit, None, lambda error: None, False),  # --help and the like
    (typer.TyperException, None, lambda error: _usage_line(error), False),  # usage errors: their own code, 2
    (typer.Abort, INTERRUPTED, lambda error: "interrupted", False),
    (KeyboardInterrupt, INTERRUPTED, lambda error: str(error) or "interrupted", False),  # cli.progress.Interrupted
    (Exception, 1, lambda error: f"{_rank_prefix()}error: {type(error).__name__}: {error} (run with --debug for the "
                                 "traceback)", True),
)
"""Every failure, first match wins."""


def _exit(error: BaseException) -> None:
    """Leave as EXITS says for this error: its one line on stderr, its exit code (--debug: the traceback)."""
    for kind, code, describe, traceback in EXITS:
        if isinstance(error, kind):
            if traceback and _state["debug"]:
                raise error
            message = describe(error)
            if message:
                warn(message)
            sys.exit(code if code is not None else getattr(error, "exit_code", 1))


def _print_version(value: bool) -> None:
    """--version: the installed probe's, from the package metadata (the one place it is set: pyproject.toml)."""
    if value:
        found = version_of(DISTRIBUTION)
        typer.echo(f"probe {found or 'unknown (not installed: pip install -e . gives it a version)'}")
        raise typer.Exit()


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (a test, or a notebook, may have replaced it since)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


_LOG_HANDLER = _Stderr()
_LOG_HANDLER.setFormatter(logging.Formatter("%(name)s: %(message)s"))


def configure_logging(verbose: bool) -> None:
    """-v: the library's logging (the `probe` logger) at INFO on stderr; without it, Python's default (warnings)."""
    logger = logging.getLogger("probe")
    logger.removeHandler(_LOG_HANDLER)
    logger.setLevel(logging.INFO if verbose else logging.NOTSET)
    if verbose:
        logger.addHandler(_LOG_HANDLER)


@app.callback()
def _options(
    debug: Debug = False,
    quiet: Quiet = False,
    verbose: Verbose = False,
    threads: Threads = None,
    _version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                  help="Show probe's version and exit."),
) -> None:
    """The global flags given before the command (each command takes them after its name too)."""
    _state.update(debug=debug, quiet=quiet, verbose=verbose, threads=threads)
    _apply_flags()


_flags_app = typer.Typer(add_completion=False)  # typer makes the flags' options, each command takes after its name
_flags_app.command()(_options)
_LATE_FLAGS = [param for param in typer.main.get_command(_flags_app).params if param.name != "_version"]


def main() -> None:
    """Entry point: run the app; a failure becomes one line on stderr and the exit code EXITS gives it."""
    keep_freed_buffers()
    Interrupted.take()  # an earlier run's in this process (tests, a notebook) is not this one's
    try:
        outcome = app(standalone_mode=False)
    except (Exception, KeyboardInterrupt) as error:
        _exit(error)
        raise
    finally:
        forget_provenance()
        _state["params"] = []
    if outcome == INTERRUPTED:  # typer turns Ctrl-C into an exit code, returned rather than raised
        _exit(Interrupted.take())
    if isinstance(outcome, int) and outcome:
        sys.exit(outcome)

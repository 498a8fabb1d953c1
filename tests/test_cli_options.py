"""Every command-line flag is declared in one place: options.py where more than one command takes it, else the one
command's module; a command reads no other command's options; `--pairs` and `--task` mean one thing everywhere."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import typer.main

from probe.cli.app import app

CLI = Path(__file__).resolve().parents[1] / "cli"
SHARED = "options.py"


def declarations() -> dict[str, list[str]]:
    """Flag -> the modules of cli/ whose typer.Option calls declare it (once per declaration)."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Option":
                flags = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
                if flags:
                    found[flags[0]].append(path.name)
    return found


def test_a_flag_is_declared_once_in_one_module() -> None:
    found = declarations()
    assert "--model" in found and "--pairs" in found  # the scan reads the declarations
    spread = {flag: modules for flag, modules in found.items() if len(set(modules)) > 1}
    assert not spread, f"declare these once, in cli/{SHARED}: {spread}"
    twice = {flag: modules for flag, modules in found.items() if len(modules) > 1 and set(modules) != {SHARED}}
    assert not twice, f"declared twice in one command's module: {twice}"


def test_a_flag_more_than_one_command_takes_lives_in_options() -> None:
    commands: dict[str, set[str]] = defaultdict(set)
    for command in typer.main.get_command(app).commands.values():  # type: ignore[attr-defined]
        for parameter in command.params:
            for flag in parameter.opts:
                commands[flag].add(command.name)
    found = declarations()
    outside = {flag: sorted(names) for flag, names in commands.items()
               if len(names) > 1 and flag in found and set(found[flag]) != {SHARED}}
    assert not outside, f"taken by several commands, declared outside cli/{SHARED}: {outside}"


def test_no_command_reads_another_commands_options() -> None:
    aliases = {path.stem: {node.targets[0].id for node in ast.parse(path.read_text(encoding="utf-8")).body
                           if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                           and isinstance(node.value, ast.Subscript)
                           and getattr(node.value.value, "id", "") == "Annotated"}
               for path in CLI.glob("*.py") if path.name != SHARED}
    borrowed = []
    for path in CLI.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("probe.cli."):
                owner = (node.module or "").rsplit(".", 1)[1]
                borrowed += [f"{path.name} takes {alias.name} from {owner}.py" for alias in node.names
                             if alias.name in aliases.get(owner, set())]
    assert not borrowed, borrowed


def _help(command: str, flag: str) -> str:
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return next(str(parameter.help) for parameter in click_command.params if flag in parameter.opts)


def test_pairs_are_clean_corrupt_rows_and_seq2seq_is_source_target_everywhere() -> None:
    group = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    taking = {flag: [name for name, command in group.items() if any(flag in p.opts for p in command.params)]
              for flag in ("--pairs", "--seq2seq", "--task")}
    assert {"dla", "patch", "steer"} <= set(taking["--pairs"]) and "ablate" not in taking["--pairs"]
    assert taking["--seq2seq"] == ["ablate"]
    assert all('"clean"' in _help(name, "--pairs") for name in taking["--pairs"])
    assert '"source"' in _help("ablate", "--seq2seq") and '"clean"' not in _help("ablate", "--seq2seq")
    assert len({_help(name, "--task") for name in taking["--task"]}) == 1


def test_ablate_refuses_a_task_beside_seq2seq_texts_and_patch_a_task_file(tmp_path: Path, capsys,
                                                                          monkeypatch) -> None:
    from conftest import run_cli

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"source": "a", "target": "b"}\n', encoding="utf-8")
    code, _, stderr = run_cli(["ablate", "--seq2seq", str(rows), "--task", "sva"], capsys, monkeypatch)
    assert code == 2 and stderr.strip() == "error: --seq2seq replaces --data and --task: give one of them"
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "The keys", "answer": " are", "distractor": " is"}\n', encoding="utf-8")
    for command in ("patch", "dla"):  # refused before any model loads: a task file has no corrupt prompts
        code, _, stderr = run_cli([command, "--model", "no-such-model", "--task", str(task)], capsys, monkeypatch)
        assert code == 2 and "--pairs" in stderr and len(stderr.strip().splitlines()) == 1, stderr

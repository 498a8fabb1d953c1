"""The shape of the code (issue 11): data flows one way, with no import cycle and no function-level import to hide
one; the library (probe/) knows nothing of the CLI (cli/, the module probe.cli) and reaches the renderers (reports/,
probe.reports) only lazily from `_repr_html_`; the renderers take nothing from the library but its error type (and
the pages' types, for the type checker); no function runs past LONG_FUNCTION lines without a written
reason; nothing imports cli or reports by their folder names (issue 20: installed, they exist only as probe.cli and
probe.reports)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"probe": "probe", "cli": "probe.cli", "reports": "probe.reports"}  # folder -> its module (pyproject.toml)
CLI, REPORTS = FOLDERS["cli"], FOLDERS["reports"]
LONG_FUNCTION = 60  # lines; a longer function needs a `# long: why` comment on the line above its def


@dataclass(frozen=True)
class ImportEdge:
    source: str  # importing module
    target: str  # imported project module
    function: str | None  # the enclosing function's name, None at module level
    line: int


def module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([FOLDERS[folder], *(parts[:-1] if parts[-1] == "__init__" else parts)])


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def in_library(module: str) -> bool:
    return within(module, "probe") and not within(module, CLI) and not within(module, REPORTS)


def _imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges() -> list[ImportEdge]:
    """Every import of a project module by a project module, with the function it sits in (if any)."""
    modules = project_modules()
    edges = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes: list[tuple[ast.AST, str | None]] = [(tree, None)]
        while scopes:
            node, function = scopes.pop()
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                for name in _imported_names(child, package):
                    target = _resolve(name, modules)
                    if target is not None and target != module:
                        edges.append(ImportEdge(module, target, function, child.lineno))
                scopes.append((child, inner))
    return edges


def cycles(edges: list[ImportEdge]) -> list[list[str]]:
    """Strongly connected components of more than one module (a package and its own children excepted)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return [c for c in found if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]


def test_no_import_cycle_even_through_function_level_imports() -> None:
    assert cycles(import_edges()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = [ImportEdge("probe.a", "probe.b", None, 1), ImportEdge("probe.b", "probe.a", "late", 9)]
    assert cycles(edges) == [["probe.a", "probe.b"]]


def test_library_knows_nothing_of_the_cli_and_renders_nothing() -> None:
    edges = import_edges()
    into_cli = [e for e in edges if in_library(e.source) and within(e.target, CLI)]
    assert into_cli == []
    into_reports = [e for e in edges if in_library(e.source) and within(e.target, REPORTS)
                    and e.function != "_repr_html_"]
    assert into_reports == [], "probe/ may call reports/ only lazily, from _repr_html_"


def test_reports_take_only_the_error_type_from_probe() -> None:
    """...and, for the type checker, the pages' TypedDicts (probe/schemas/pages.py), a module that imports nothing of
    probe; a kind's payload reaches a report as the plain dict its `to_dict()` made."""
    taken = {e.target for e in import_edges() if within(e.source, REPORTS) and in_library(e.target)}
    types = {"probe.schemas.pages"}
    assert taken <= {"probe.errors", *types}
    for module in types:
        text = (ROOT / "probe" / "schemas" / f"{module.rsplit('.', 1)[1]}.py").read_text(encoding="utf-8")
        assert not [e for e in import_edges() if e.source == module] and "import probe" not in text, module


def test_the_module_names_follow_the_installed_layout() -> None:
    modules = project_modules()
    assert modules["probe.cli.app"] == ROOT / "cli" / "app.py"
    assert modules["probe.reports"] == ROOT / "reports" / "__init__.py"
    assert in_library("probe.heads.classify") and not in_library("probe.cli.app") and not in_library("probe.reports")


def long_functions(source: str, where: str = "") -> list[str]:
    """Functions (methods and nested ones too) longer than LONG_FUNCTION lines, decorators not counted, whose first
    line (its first decorator, or the def) has no `# long: why` comment on the line above."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            reason = first >= 2 and lines[first - 2].strip().startswith("# long:")
            if length > LONG_FUNCTION and not reason:
                found.append(f"{where}{node.name} ({length} lines)")
    return found


def test_no_long_function_without_a_reason() -> None:
    """docs/architecture.md's promise: no function in probe/, cli/ or reports/ over 60 lines without its reason."""
    found = [name for path in project_modules().values()
             for name in long_functions(path.read_text(encoding="utf-8"), f"{path.relative_to(ROOT)}:")]
    assert found == []


def test_the_long_function_finder_finds_long_functions() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(LONG_FUNCTION))  # the def and these: one line too many
    fits = "".join(f"    x{i} = {i}\n" for i in range(LONG_FUNCTION - 1))
    source = (f"def short():\n{fits}\n\nclass C:\n    @staticmethod\n    def method():\n"
              + body.replace("\n    ", "\n        ").replace("    x0", "        x0", 1)
              + f"\n# long: one table\n@property\ndef explained():\n{body}\ndef bare():\n{body}")
    too_long = f"({LONG_FUNCTION + 1} lines)"
    assert sorted(long_functions(source)) == [f"bare {too_long}", f"method {too_long}"]


def test_no_module_of_probe_is_hidden_by_a_name_of_the_same_name() -> None:
    """`probe.atlas` is the package, `probe.classify` the function (there is no module probe/classify.py): a name
    that `probe/__init__.py` binds over a submodule of the same name would hide one behind the other."""
    import importlib
    import sys

    import probe

    hidden = []
    for module in project_modules():
        parent, _, name = module.rpartition(".")
        if parent == "probe" and in_library(module):
            importlib.import_module(module)
            if getattr(probe, name) is not sys.modules[module]:
                hidden.append(module)
    assert hidden == []


OLD_NAME = re.compile(r"(cli|reports)(\.\w+)*")  # a module named by its folder: `cli.app`, `reports`


def old_names(node: ast.AST) -> list[str]:
    """Modules this node names by their folder: an import, a dotted string ("cli.app.main", a monkeypatch target), or
    the module after `-m` in a command line."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""] if not node.level else []
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        names = [node.value] if "." in node.value else []
    elif isinstance(node, (ast.List, ast.Tuple)):
        items = [item.value if isinstance(item, ast.Constant) else None for item in node.elts]
        names = [str(after) for before, after in zip(items, items[1:]) if before == "-m"]
    else:
        names = []
    return [name for name in names if OLD_NAME.fullmatch(name)]


@pytest.mark.slow
def test_nothing_names_the_cli_or_the_renderers_by_their_folders() -> None:
    """`from cli.app import ...` or `python -m cli` works in a checkout (its root is on sys.path) and fails where the
    wheel is installed; a monkeypatch of "cli.x.f" patches a second copy of the module, not the one that runs."""
    found = []
    tests = [path for path in (ROOT / "tests").glob("*.py") if path.name != "test_structure.py"]  # (its examples)
    for path in [*project_modules().values(), *tests, *(ROOT / "bench").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            found += [f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}: {name}" for name in old_names(node)]
    assert found == []


def test_the_old_name_finder_finds_old_names() -> None:
    source = 'import reports.html\nfrom cli import app\nf("cli.app.load", ["-m", "cli"], "reports.files")\n'
    found = [name for node in ast.walk(ast.parse(source)) for name in old_names(node)]
    assert sorted(found) == ["cli", "cli", "cli.app.load", "reports.files", "reports.html"]
    fine = 'import probe.reports.html\nf("probe.cli.app.load", ["-m", "probe.cli"], ROOT / "reports", "a.b")\n'
    assert [name for node in ast.walk(ast.parse(fine)) for name in old_names(node)] == []

"""The shape of the code (issue 11): data flows one way, with no import cycle and no function-level import to hide
one; probe/ knows nothing of the CLI and reaches reports/ only lazily from `_repr_html_`; reports/ takes nothing
from probe but its error type; no function runs past LONG_FUNCTION lines without a written reason."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("probe", "cli", "reports")
LONG_FUNCTION = 60  # lines; a longer function needs a `# long: why` comment on the line above its def


@dataclass(frozen=True)
class ImportEdge:
    source: str  # importing module
    target: str  # imported project module
    function: str | None  # the enclosing function's name, None at module level
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


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
    into_cli = [e for e in edges if e.source.startswith("probe") and e.target.startswith("cli")]
    assert into_cli == []
    into_reports = [e for e in edges if e.source.startswith("probe") and e.target.startswith("reports")
                    and e.function != "_repr_html_"]
    assert into_reports == [], "probe/ may call reports/ only lazily, from _repr_html_"


def test_reports_take_only_the_error_type_from_probe() -> None:
    taken = {e.target for e in import_edges() if e.source.startswith("reports") and e.target.startswith("probe")}
    assert taken <= {"probe.errors"}


def test_no_long_function_without_a_reason() -> None:
    long = []
    for path in project_modules().values():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                reason = lines[first - 2].strip().startswith("# long:") if first >= 2 else False
                if length > LONG_FUNCTION and not reason:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({length} lines)")
    assert long == []

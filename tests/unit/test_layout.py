"""The code's layout rules: modules import in one direction (no cycles, not even
through imports for type checking only), and the admin CLI stands alone."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = {
    "daemon/kvoffloadd": "kvoffloadd",
    "libclient/kvoffload": "kvoffload",
    "tools/kvoffloadctl": "kvoffloadctl",
    "tools/kvoffloadbench": "kvoffloadbench",
}


def modules() -> dict[str, Path]:
    out = {}
    for root, pkg in PACKAGES.items():
        for path in (ROOT / root).rglob("*.py"):
            rel = path.relative_to(ROOT / root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((pkg, *rel))] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ours that ``name`` imports, anywhere in the file."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parent = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                mod = f"{parent}.{mod}" if mod else parent
            found |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert "kvoffload.namespace" in graph["kvoffload.client"]  # the walk sees imports
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles(graph) == []


def test_the_admin_cli_imports_no_benchmark() -> None:
    known = modules()
    cli = [n for n in known if n.startswith("kvoffloadctl")]
    assert set(cli) == {"kvoffloadctl", "kvoffloadctl.__main__", "kvoffloadctl.cli"}
    for name in cli:
        assert not {m for m in imports(name, known[name], known) if "bench" in m}

"""The code's layout rules: modules import in one direction (no cycles, not even
through imports for type checking only), each package's layers are kept (the lists
below are the ones its ``__init__`` docstring states), the daemon uses only the
client library's shared parts, and the admin CLI stands alone."""

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


# Lowest first: a module may import its own layer and the layers below it.
LAYERS = {
    "kvoffloadd": [
        {"", "trust", "ledger", "loopthread"},
        {"region"},
        {"index"},
        {"configtables", "config", "access"},
        {"copies"},
        {"tiers"},
        {"service"},
        {"server"},
        {"main", "__main__", "configdoc"},
    ],
    "kvoffload": [
        {"protocol", "version"},
        {"datapath", "cuda"},
        {"link"},
        {"", "client", "namespace", "worker", "cache", "plans", "paths"},
        {"engine"},
        {"vllm", "sglang"},
    ],
}
# What of the client library the daemon may use: the wire protocol and shared planning.
DAEMON_USES = {"protocol", "version", "datapath", "cuda", "plans", "paths"}


def layer_of(module: str) -> tuple[str, int] | None:
    pkg, _, rest = module.partition(".")
    if pkg not in LAYERS:
        return None
    top = rest.split(".")[0]
    for i, names in enumerate(LAYERS[pkg]):
        if top in names:
            return pkg, i
    raise AssertionError(f"{module} belongs to no layer of {pkg}: add it to LAYERS")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, deps in graph.items():
        own = layer_of(name)
        if own is None:
            continue
        for dep in deps:
            theirs = layer_of(dep)
            if theirs is None:
                continue
            if theirs[0] != own[0]:
                top = dep.partition(".")[2].split(".")[0]
                if own[0] == "kvoffload" or top not in DAEMON_USES:
                    bad.append(f"{name} -> {dep} (across packages)")
            elif theirs[1] > own[1]:
                bad.append(f"{name} -> {dep} (a higher layer)")
    return sorted(bad)


def test_packages_import_only_their_own_layer_and_below() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert layer_violations({"kvoffloadd.region.x": {"kvoffloadd.service.y"}}) == [
        "kvoffloadd.region.x -> kvoffloadd.service.y (a higher layer)"
    ]
    assert layer_violations({"kvoffloadd.index.x": {"kvoffload.client"}}) == [
        "kvoffloadd.index.x -> kvoffload.client (across packages)"
    ]
    assert layer_violations(graph) == []


def test_every_sub_package_states_its_rules() -> None:
    for root in ("daemon/kvoffloadd", "libclient/kvoffload"):
        for init in (ROOT / root).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert "Rules:" in doc or "Layers" in doc, f"{init} states no rules"


def test_the_admin_cli_imports_no_benchmark() -> None:
    known = modules()
    cli = [n for n in known if n.startswith("kvoffloadctl")]
    assert set(cli) == {
        "kvoffloadctl",
        "kvoffloadctl.__main__",
        "kvoffloadctl.cli",
        "kvoffloadctl.check",
    }
    for name in cli:
        assert not {m for m in imports(name, known[name], known) if "bench" in m}

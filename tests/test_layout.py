"""The house layout: imports go one way between packages (partir <- tactics <- search <-
automap) and no module imports another that imports it back, directly or through
others, at module level or inside a function."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("partir", "tactics", "search", "automap")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The project modules `name` imports anywhere in it. `from . import sub` depends on
    the submodule, not on the package it sits in."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parent = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (parent, node.module) if p)
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            out.update(subs if len(subs) == len(node.names) else [target, *subs])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, m) for m in _imports(name, path, modules))
    return graph


def test_no_module_imports_itself_back():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_imports_go_one_way_between_packages():
    rank = {p: i for i, p in enumerate(PACKAGES)}
    wrong = [(a, b) for a, b in _graph().edges if rank[b.split(".")[0]] > rank[a.split(".")[0]]]
    assert not wrong, f"imports against partir <- tactics <- search <- automap: {wrong[:5]}"

"""The library's import graph: no cycles, and no library module imports the CLI layer.

Scanned with `ast` (nothing is imported): module-level imports and those inside
functions, in the forms `import jspec.x`, `from jspec import x`, `from jspec.x import y`
(and the same for pallas_kernels). A package's `__init__` is left out of the graph: it
re-exports, and importing `jspec.x` runs it first either way.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jspec", "pallas_kernels")


def _modules() -> dict[str, str]:
    """Dotted module name -> file, every .py under the packages."""
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3]
                    out[rel.replace(os.sep, ".")] = os.path.join(d, f)
    return out


def _imports(path: str, modules) -> set[str]:
    """The package modules a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from jspec import x`: x may be a module; `from jspec.x import y`: jspec.x.
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in modules:  # `import jspec.x.y`: the deepest module named
                n = n.rpartition(".")[0]
            if n and not n.endswith("__init__") and n not in PACKAGES:
                found.add(n)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    modules = {m.removesuffix(".__init__"): f for m, f in modules.items()}
    return {m: _imports(f, modules) - {m} for m, f in modules.items() if m not in PACKAGES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_function_level_imports():
    graph = _graph()
    assert "jspec.model" in graph["jspec.speculative"]  # module level
    assert "jspec.drafting" in graph["jspec.drafters"]
    assert "pallas_kernels.matmul" in graph["jspec.model"]
    # A cycle through an import inside a function is found too.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_library_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_only_the_cli_layer_imports_jspec_cli():
    graph = _graph()
    users = sorted(m for m, deps in graph.items() if "jspec.cli" in deps)
    assert users == [], f"library modules import jspec.cli: {users}"

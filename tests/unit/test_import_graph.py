"""No import circle anywhere in mindio/ (issue #14).

The graph is read from the source with ``ast`` (nothing is imported): one node per module of the
package, one edge per import statement that names another module of it -- at module level *and*
inside functions and methods (a deferred import still ties the two files together; deferring it only
hides the circle from the interpreter). Imports under ``if TYPE_CHECKING:`` are left out (they never
run). ``from . import x`` is an edge to the submodule ``x`` when there is one, else to the package's
``__init__``; ``from .x import y`` to ``x`` (and to ``x.y`` when that is a submodule). The implicit
import of a module's parent packages is not an edge (every module would then depend on its package).
"""
from __future__ import annotations

import ast
import pathlib

import mindio

ROOT = pathlib.Path(mindio.__file__).resolve().parent
PKG = "mindio"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods and "." in t:  # import a.b.c of a name inside a.b
                    t = t.rpartition(".")[0]
                if t in mods and t != mod and (t == PKG or t.startswith(PKG + ".")):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one circle path."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(_circle(graph, set(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _circle(graph, comp: set) -> list[str]:
    """One closed path through a component: start at its first module, walk back to it (BFS)."""
    start = min(comp)
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start] + [f"(component: {sorted(comp)})"]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return sorted(comp)


def test_graph_is_read():
    g = import_graph()
    assert "mindio.ttp.controller.controller" in g and "mindio.ttp.wire.protocol" in g["mindio.ttp.controller.controller"]
    # a function-level import is an edge too
    assert "mindio.acp" in g["mindio"]


def test_no_import_circle_in_mindio():
    found = cycles(import_graph())
    assert not found, "import circles in mindio/ (module- and function-level imports):\n" + "\n".join(
        " -> ".join(c) for c in found)

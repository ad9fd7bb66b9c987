"""No dispatch by a name built at run time in mindio/ (issue #14): strategies, rank actions and the
checkpoint daemon's requests are found in explicit tables (Controller.STRATEGIES,
Processor.ACTIONS, acp Operations.OPS), never with ``getattr(self, "_run_" + name)``.

Read with ``ast`` over every module: a ``getattr``/``hasattr`` on ``self`` or ``cls`` with a name that is
not a literal, or any ``getattr``/``hasattr`` whose name is built (an f-string, ``"prefix" + x``), fails.
Looking up a torch dtype or a signal by its name (``getattr(torch, name)``) is not dispatch: allowed."""
from __future__ import annotations

import ast
import pathlib

import mindio

ROOT = pathlib.Path(mindio.__file__).resolve().parent


def _name_dispatches(tree: ast.AST):
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        obj, name = node.args[0], node.args[1]
        if isinstance(name, ast.Constant):
            continue
        built = isinstance(name, (ast.JoinedStr, ast.BinOp)) or (
            isinstance(name, ast.Call) and isinstance(name.func, ast.Attribute) and name.func.attr == "format")
        on_self = isinstance(obj, ast.Name) and obj.id in ("self", "cls")
        if built or on_self:
            yield node.lineno, ast.unparse(node)


def test_the_rule_catches_the_old_dispatch():
    old = 'def f(self, name):\n    return getattr(self, "_run_" + name)(1), getattr(self, f"_do_{name}", None)\n'
    assert len(list(_name_dispatches(ast.parse(old)))) == 2
    assert not list(_name_dispatches(ast.parse("getattr(torch, name)\ngetattr(self, '_x', None)\n")))


def test_no_getattr_by_name_dispatch_in_mindio():
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {code}" for path in sorted(ROOT.rglob("*.py"))
             for line, code in _name_dispatches(ast.parse(path.read_text(), str(path)))]
    assert not found, "dispatch by a built name (use an explicit table):\n" + "\n".join(found)

"""The launcher's high-availability parts (ha.py, switch.py, elastic.py) and preempt.py use the node's agent only
through :class:`mindio.launch.view.WorkerView` -- a narrow, explicit surface -- and none of them
imports agent.py (issue #14: ha.py used to take the whole agent and reach into its private state).
Read from the source with ``ast``; every ``agent.<name>`` / ``self.agent.<name>`` must be a member of
the view, and the agent must have each member the view names."""
from __future__ import annotations

import ast
import pathlib

import mindio.launch.view as view

LAUNCH = pathlib.Path(view.__file__).parent
PARTS = ("ha.py", "switch.py", "elastic.py", "preempt.py")


def _members() -> set:
    tree = ast.parse(pathlib.Path(view.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerView")
    out = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            out.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            out.add(node.name)
    return out


def _uses(path: pathlib.Path):
    """(line, name) of every attribute taken of ``agent`` or ``self.agent``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "agent") or (
                isinstance(v, ast.Attribute) and v.attr == "agent" and isinstance(v.value, ast.Name)
                and v.value.id == "self"):
            yield node.lineno, node.attr


def test_parts_use_only_the_worker_view():
    members = _members()
    assert {"store", "lock", "workers", "replace_local"} <= members
    stray = [f"{name}:{line}: agent.{attr}" for name in PARTS for line, attr in _uses(LAUNCH / name)
             if attr not in members]
    assert not stray, "used outside mindio.launch.view.WorkerView:\n" + "\n".join(stray)


def test_parts_do_not_import_the_agent():
    for name in PARTS:
        for node in ast.walk(ast.parse((LAUNCH / name).read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("agent", "mindio.launch.agent") and not (
                    node.level and any(a.name == "agent" for a in node.names)), f"{name} imports agent.py"


def test_the_agent_has_every_member_of_the_view():
    """Class-level names of agent.Agent, and the ``self.<name> =`` assignments of its methods."""
    tree = ast.parse((LAUNCH / "agent.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Agent")
    has = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            has.add(node.name)
        elif isinstance(node, ast.Assign):
            has.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    has.add(t.attr)
    missing = sorted(_members() - has)
    assert not missing, f"agent.Agent lacks {missing} of the WorkerView"

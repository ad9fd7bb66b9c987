"""Issue 34, "parts own their state": the controller's parts get their collaborators (core.Core: the rank
table, the lock, the action engine, the state machine, the brain, their peers), not the controller; the
stop round lives in one module; an incident's cause is vocab.Cause, never a bare string. Ratchets on the
source (as test_composition.py), plus the Core a real controller hands its parts."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from mindio.ttp.controller.controller import Controller
from mindio.ttp.controller.core import SHARED, Core

CONTROLLER = Path(__file__).resolve().parents[2] / "mindio" / "ttp" / "controller"
# the parts and strategies (every module of the controller but the controller itself, its rank table, its
# status server and the pure functions it calls)
PARTS = ("incident.py", "retry.py", "stopround.py", "pause.py", "recover.py", "hotswitch.py", "elastic_flow.py",
         "dump.py", "sequence.py", "strategy.py", "watch.py", "core.py")


def _source(name: str) -> str:
    return (CONTROLLER / name).read_text()


def test_no_part_reaches_into_the_controller():
    """0 references to the controller from a part: neither ``ctl._lock`` nor ``ctl.anything`` (was 93 private,
    372 in all at 2bcf39c), and no part imports controller.py."""
    found = {name: len(re.findall(r"\bctl\.", _source(name))) for name in PARTS}
    assert not any(found.values()), found
    # nor a private name of the Core (it has none: a `core._lock` is an AttributeError at run time)
    private = {name: re.findall(r"\bcore\._\w+", _source(name)) for name in PARTS}
    assert not any(private.values()), private
    imports = [name for name in PARTS for node in ast.walk(ast.parse(_source(name)))
               if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("controller")]
    assert not imports, imports


def test_no_part_takes_the_controller_in_its_constructor():
    """Each part's ``__init__`` takes the Core (or nothing): no parameter named ``ctl`` / ``controller``, in
    any class or function of a part; and a real controller hands every part the same Core it uses."""
    bad = [(name, node.name, a.arg) for name in PARTS for node in ast.walk(ast.parse(_source(name)))
           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
           for a in node.args.args + node.args.kwonlyargs if a.arg in ("ctl", "controller")]
    assert not bad, bad
    ctl = Controller(0, 4, {"dump"}, b"k" * 32)
    parts = ("incidents", "pause", "liveness", "stop_round", "replacements", "hot_switch", "elastic")
    assert all(getattr(ctl, name).core is ctl.core and getattr(ctl.core, name) is getattr(ctl, name)
               for name in parts)
    assert list(inspect.signature(Core.__init__).parameters)[:2] == ["self", "world_size"]
    # the controller's shared attributes are the Core's: one object, written on either side
    ctl.gen, ctl.action_limit, ctl.core.exit_code = 7, 1.5, 3
    assert (ctl.core.gen, ctl.core.action_limit, ctl.exit_code) == (7, 1.5, 3)
    assert all(getattr(ctl, name) is getattr(ctl.core, attr) for name, attr in SHARED.items()
               if not isinstance(getattr(ctl.core, attr), (int, float, str, type(None))))
    assert (ctl.ranks, ctl.sm, ctl._lock, ctl.final) == (ctl.core.ranks, ctl.core.sm, ctl.core.lock, ctl.core.final)


def test_the_stop_round_lives_in_one_module():
    """stopround.py holds the stop round; no other module of the controller defines it or sends its
    ``advance`` / ``teardown`` / ``unblock`` actions."""
    defs = [(p.name, node.name) for p in sorted(CONTROLLER.glob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.ClassDef) and node.name == "StopRound"]
    assert defs == [("stopround.py", "StopRound")]
    sends = [(p.name, node.lineno) for p in sorted(CONTROLLER.glob("*.py")) if p.name != "stopround.py"
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
             and node.args[0].value in ("advance", "teardown", "unblock")]
    assert not sends, sends


def test_an_incidents_cause_is_never_a_bare_string():
    """vocab.Cause everywhere an incident's cause is given, compared or set (its value reaches the event
    log unchanged)."""
    from mindio.vocab import Cause

    found = []
    for p in sorted(CONTROLLER.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and any(
                    k.arg == "cause" and isinstance(k.value, ast.Constant) for k in node.keywords) and (
                    getattr(node.func, "attr", None) == "open" or getattr(node.func, "id", None) == "Incident"):
                found.append((p.name, node.lineno))
            if isinstance(node, ast.Compare) and any(isinstance(x, ast.Attribute) and x.attr == "cause"
                                                     for x in [node.left, *node.comparators]) \
                    and any(isinstance(x, ast.Constant) and isinstance(x.value, str)
                            for x in [node.left, *node.comparators]):
                found.append((p.name, node.lineno))
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Attribute) and t.attr == "cause" for t in node.targets):
                found.append((p.name, node.lineno))
    assert not found, found
    assert [c.value for c in Cause] == ["fault", "dump_request", "pause", "hot_switch", "cluster_brain"]
    assert f"{Cause.DUMP_REQUEST}" == "dump_request" and Cause("pause") is Cause.PAUSE


def test_an_incident_is_four_steps():
    """IncidentFlow.run is stop -> facts -> decide -> execute, each a method of its own (and short)."""
    from mindio.ttp.controller.incident import IncidentFlow

    for name in ("run", "stop", "facts", "decide", "execute"):
        lines = inspect.getsource(getattr(IncidentFlow, name)).count("\n")
        assert lines <= 60, (name, lines)
    run = inspect.getsource(IncidentFlow.run)
    assert all(f"self.{step}(" in run for step in ("stop", "facts", "decide", "execute")), run

"""Issue #14: the processor is composed of parts that own their state (the link, the job's first world
for rebuilds, an explicit action table), not assembled from mixin bases; the controller's recovery
strategies are objects in an explicit table."""
from __future__ import annotations

from mindio.ttp.controller.controller import Controller
from mindio.ttp.processor.processor import Processor
from mindio.ttp.controller.strategy import Strategy


def test_the_processor_has_no_mixin_bases():
    assert Processor.__bases__ == (object,)
    assert all(callable(h) for h in Processor.ACTIONS.values())


def test_every_strategy_is_an_object_of_the_strategy_class():
    assert Controller.STRATEGIES and all(isinstance(s, Strategy) for s in Controller.STRATEGIES.values())
    assert all(s.name == name for name, s in Controller.STRATEGIES.items())


def test_the_controller_is_composed_of_parts_and_has_no_base():
    """The parts own their state, the incident flow and the pause too (incident.py, pause.py): no mixin
    base is left, and none comes back."""
    from mindio.ttp.controller.actions import ActionEngine
    from mindio.ttp.controller.elastic_flow import Elastic
    from mindio.ttp.controller.hotswitch import HotSwitch
    from mindio.ttp.controller.incident import IncidentFlow
    from mindio.ttp.controller.pause import PauseFlow
    from mindio.ttp.controller.ranks import RankTable
    from mindio.ttp.controller.recover import Replacements
    from mindio.ttp.controller.stopround import StopRound
    from mindio.ttp.controller.states import StateMachine
    from mindio.ttp.controller.watch import Liveness

    assert Controller.__bases__ == (object,)
    ctl = Controller(0, 4, {"dump"}, b"k" * 32)
    parts = {"ranks": RankTable, "sm": StateMachine, "actions": ActionEngine, "liveness": Liveness,
             "stop_round": StopRound, "replacements": Replacements, "elastic": Elastic, "hot_switch": HotSwitch,
             "incidents": IncidentFlow, "pause": PauseFlow}
    assert {name: type(getattr(ctl, name)) for name in parts} == parts
    assert all(getattr(ctl, name).core is ctl.core for name in ("liveness", "stop_round", "replacements", "elastic",
                                                                "hot_switch", "incidents", "pause"))
    assert all(cls.__bases__ == (object,) for cls in (IncidentFlow, PauseFlow))


def test_every_enum_is_defined_in_the_vocabulary_module():
    """Issue 14: one vocabulary module. No enum class is defined anywhere in mindio/ but mindio/vocab.py
    (modules that use one import it from there)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "mindio"
    found = []
    for path in root.rglob("*.py"):
        if path.name == "vocab.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.split(".")[-1] in ("Enum", "IntEnum", "StrEnum", "Flag", "IntFlag") for b in bases):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}({', '.join(bases)})")
    assert not found, found


def test_one_rebuild_and_one_rollback_in_the_processor():
    """Issue 33: the rank side rebuilds its world in one place (inplace.new_world: retry, recover, hot switch
    and the elastic zit_rebuild call it) and rolls back in one place (inplace.roll_back: the rollback and
    zit_upgrade_rollback handlers); no twin comes back in mindio/ttp/processor/."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "mindio" / "ttp" / "processor"
    rebuilds, rollbacks = [], []
    for path in sorted(root.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, ast.FunctionDef):
                continue
            calls_handler = sets_step = False
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    if node.func.attr in ("init_default_group", "reinit"):
                        rebuilds.append((path.name, fn.name, node.func.attr))
                    calls_handler |= node.func.attr in ("_callback", "callback")
                if isinstance(node, ast.Assign):  # a rollback: a handler, then the rank's step set back
                    attrs = {t.attr for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Attribute)}
                    sets_step |= {"step", "data_status"} <= attrs
            if calls_handler and sets_step:
                rollbacks.append((path.name, fn.name))
    assert rebuilds == [("inplace.py", "new_world", "init_default_group"), ("inplace.py", "new_world", "reinit")]
    assert rollbacks == [("inplace.py", "roll_back")]


def test_main_thread_states_are_named_by_the_enum():
    """Issue 33: a rank's main-thread states are vocab.MainState, written nowhere as string literals."""
    import ast
    from pathlib import Path

    from mindio.vocab import MainState

    root = Path(__file__).resolve().parents[2] / "mindio"
    values = {m.value for m in MainState}
    found = [(str(path.relative_to(root)), node.lineno) for path in sorted(root.rglob("*.py")) if path.name != "vocab.py"
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Constant) and node.value in values]
    assert not found, found


def test_action_names_are_the_enum_on_both_sides_of_the_wire():
    """Issue 33: ACTION names are vocab.ActionName on both sides: the controller sends members
    (``_call``, ``P.Action``, ``Sequence.step``), the processor's tables are keyed by them; no bare
    action-name literal there; every member has a handler, and the wire value is the member's string."""
    import ast
    from pathlib import Path

    from mindio.ttp.processor.processor import Processor
    from mindio.ttp.wire import protocol as P
    from mindio.vocab import ActionName

    assert set(Processor.ACTIONS) | {ActionName.KILL} == set(ActionName)  # kill: answered before any table
    assert all(isinstance(k, ActionName) for k in Processor.ACTIONS)
    body = P.Envelope(P.MsgType.ACTION, P.Action(ActionName.CLEAN, {}), sn=1)
    assert P.pack_body(body) == P.pack_body(P.Envelope(P.MsgType.ACTION, P.Action("clean", {}), sn=1))
    values = {m.value for m in ActionName}
    root = Path(__file__).resolve().parents[2] / "mindio" / "ttp"
    bare = []
    for path in sorted(root.glob("controller/*.py")) + sorted(root.glob("processor/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and node.args:  # sent: ctl._call(name, ..), P.Action(name, ..), seq.step(name, ..)
                f = node.func
                callee = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                first = node.args[0]
                if callee in ("_call", "call", "Action", "step") and isinstance(first, ast.Constant) \
                        and first.value in values:
                    bare.append((path.name, node.lineno, first.value))
            if isinstance(node, ast.Dict):  # dispatched: the ACTIONS tables
                bare += [(path.name, k.lineno, k.value) for k in node.keys
                         if isinstance(k, ast.Constant) and k.value in values and
                         any(isinstance(v, (ast.Name, ast.Attribute)) for v in node.values)]
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "name":
                bare += [(path.name, c.lineno, c.value) for c in node.comparators
                         if isinstance(c, ast.Constant) and c.value in values]
    assert not bare, f"action names written as literals, not vocab.ActionName: {bare}"


def test_action_handlers_reach_the_rank_through_its_state_object():
    """Issue 33: the action handlers outside processor.py get a RankState (rank_state.py) and touch no
    private field of what they are given; only rank_state.py holds the processor."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "mindio" / "ttp" / "processor"
    private = []
    for name in ("inplace.py", "reboot.py", "elastic_rank.py"):
        tree = ast.parse((root / name).read_text(), name)
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.args.args):
            first = fn.args.args[0].arg
            private += [(name, fn.name, n.attr) for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name) and n.value.id in (first, "proc", "p")
                        and n.attr.startswith("_")]
    assert not private, f"handlers reaching into the processor's private fields: {private}"

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
                    calls_handler |= node.func.attr == "_callback"
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

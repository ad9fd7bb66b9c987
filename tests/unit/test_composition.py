"""Issue #14: the processor is composed of parts that own their state (the link, the job's first world
for rebuilds, an explicit action table), not assembled from mixin bases; the controller's recovery
strategies are objects in an explicit table."""
from __future__ import annotations

from mindio.ttp.controller import Controller
from mindio.ttp.processor import Processor
from mindio.ttp.strategy import Strategy


def test_the_processor_has_no_mixin_bases():
    assert Processor.__bases__ == (object,)
    assert all(callable(h) for h in Processor.ACTIONS.values())


def test_every_strategy_is_an_object_of_the_strategy_class():
    assert Controller.STRATEGIES and all(isinstance(s, Strategy) for s in Controller.STRATEGIES.values())
    assert all(s.name == name for name, s in Controller.STRATEGIES.items())


def test_the_controller_is_composed_of_parts_and_has_no_base():
    """The parts own their state, the incident flow and the pause too (incident.py, pause.py): no mixin
    base is left, and none comes back."""
    from mindio.ttp.actions import ActionEngine
    from mindio.ttp.elastic_flow import Elastic
    from mindio.ttp.hotswitch import HotSwitch
    from mindio.ttp.incident import IncidentFlow
    from mindio.ttp.pause import PauseFlow
    from mindio.ttp.ranks import RankTable
    from mindio.ttp.recover import Replacements
    from mindio.ttp.retry import StopRound
    from mindio.ttp.states import StateMachine
    from mindio.ttp.watch import Liveness

    assert Controller.__bases__ == (object,)
    ctl = Controller(0, 4, {"dump"}, b"k" * 32)
    parts = {"ranks": RankTable, "sm": StateMachine, "actions": ActionEngine, "liveness": Liveness,
             "stop_round": StopRound, "replacements": Replacements, "elastic": Elastic, "hot_switch": HotSwitch,
             "incidents": IncidentFlow, "pause": PauseFlow}
    assert {name: type(getattr(ctl, name)) for name in parts} == parts
    assert all(getattr(ctl, name).ctl is ctl for name in ("liveness", "stop_round", "replacements", "elastic",
                                                          "hot_switch", "incidents", "pause"))
    assert all(cls.__bases__ == (object,) for cls in (IncidentFlow, PauseFlow))

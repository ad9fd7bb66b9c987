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

"""The toy jobs' fault plan (tests/_faultplan.py): what a test writes is what the toy reads back, and
the ranks it kills are the ones the exit-code checks expect (tests/_exits.py)."""
import pytest

from tests._faultplan import Fault, FaultPlan


def test_a_plan_reads_back_as_written():
    plan = FaultPlan.of(("raise-uce-update", 1, 7), ("kill", 2, 7), fenced_late=(0, 3), fence_step=7,
                        fail_repair="raise", fail_save=(0, 2), enable_uce=False, declared_replicas=1)
    flag, text = plan.argv()
    assert flag == "--plan" and FaultPlan.loads(text) == plan
    assert plan.tuples() == [("raise-uce-update", 1, 7), ("kill", 2, 7)]
    assert FaultPlan.loads("") == FaultPlan() and FaultPlan().tuples() == []


def test_an_unknown_key_is_refused():
    with pytest.raises(ValueError, match="fail_repiar"):
        FaultPlan.loads('{"fail_repiar": "raise"}')


def test_the_ranks_a_plan_kills():
    assert FaultPlan.of(("raise-uce", 1, 7)).sent() == {}
    assert FaultPlan.of(("kill", 1, 7), ("hang", 2, 7)).sent(also={3: "SIGKILL"}) == {
        1: {"SIGKILL"}, 2: {"SIGKILL"}, 3: {"SIGKILL"}}
    assert FaultPlan(faults=(Fault("kill-node", 2, 7),)).sent(per_node=2) == {2: {"SIGKILL"}, 3: {"SIGKILL"}}

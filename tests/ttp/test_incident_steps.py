"""Issue 34: an incident is stop -> facts -> decide -> execute (incident.IncidentFlow), each step callable
on its own. Here on a real controller's parts (not started: no socket, no thread): the facts of a UCE on
rank 1 after a stop round, the decision made on them, and the decision for a requested dump."""
from __future__ import annotations

from mindio.ttp._enums import Cause, OsStatus, ReportState
from mindio.ttp.controller.controller import Controller
from mindio.ttp.controller.incident import Incident
from mindio.ttp.controller.ranks import RankRecord
from mindio.ttp.controller.states import Result
from mindio.ttp.wire import protocol as P

ENTRY = {"rank_list": [0, 1, 2, 3], "replica_cnt": 2}  # shard j on ranks j and j + 2
U = int(OsStatus.UPDATED)


def _controller(enabled):
    ctl = Controller(0, 4, enabled, b"k" * 32)
    for r in range(4):
        ctl.ranks[r] = RankRecord(r, b"id%d" % r, step=7, data_status=U, replica=[ENTRY], faulty=r == 1)
    ctl.sm.fire(Result.ALL_REGISTERED, ranks=4)
    return ctl


def _stopped(step=7):
    return {r: P.Reply(ok=True, detail={"step": step, "data_status": U, "main": "parked"}) for r in range(4)}


def test_the_facts_and_the_decision_of_a_uce_are_steps_of_their_own():
    ctl = _controller({"retry", "dump"})
    flow = ctl.incidents
    inc = Incident(Cause.FAULT, 1)
    inc.add(1, ReportState.RS_UCE, "UCE ERROR")
    facts = flow.facts(inc, _stopped())
    assert (facts.lock, facts.faulty, facts.repairable, facts.repeated) == (7, [1], True, [])
    assert facts.primary == {1: ReportState.RS_UCE} and facts.plan.possible
    assert facts.feasible == ["retry", "dump", "exit"] and facts.enabled == {"retry", "dump"}
    order = flow.decide(inc, facts)  # no cluster brain registered: the first of the order
    assert order == ["retry", "dump", "exit"]
    assert ctl.last_decision["strategy"] == "retry" and ctl.last_decision["lock_step"] == 7


def test_a_requested_dump_is_decided_without_asking_and_a_repeated_fault_is_not_judged():
    ctl = _controller({"dump"})
    flow = ctl.incidents
    dump = Incident(Cause.DUMP_REQUEST, None)
    facts = flow.facts(dump, _stopped(9))
    assert facts.graceful and facts.lock == 9 and "dump" in facts.enabled
    assert flow.decide(dump, facts)[0] == "dump"
    again = Incident(Cause.FAULT, 2)
    again.add(2, ReportState.RS_REPEATED, "the same exception at the same step")
    facts = flow.facts(again, _stopped())
    assert facts.repeated == [2] and facts.incident is None and facts.feasible == []  # run() ends the job


def test_a_rank_that_dies_while_the_facts_are_gathered_is_judged_faulty():
    """CI, stop 37: rank 3 of a killed node answered the stop, then died during the launcher's check of
    the silent node (up to 1 s); the decision named rank 2 alone and kept rank 3 in the dump plan."""
    ctl = Controller(0, 4, {"recover", "dump"}, b"k" * 32)
    for r in range(4):
        ctl.ranks[r] = RankRecord(r, b"id%d" % r, step=7, data_status=U, replica=[ENTRY])
    ctl.sm.fire(Result.ALL_REGISTERED, ranks=4)
    ctl.declare_dead([2], "pid")

    class Launcher:  # its check of the silent node takes long enough for the pid probe to see rank 3 end
        def possible(self, ranks, strategy):
            ctl.declare_dead([3], "pid")
            return False

    ctl.replacements.attach(Launcher())
    inc = ctl.incidents.current
    facts = ctl.incidents.facts(inc, {r: _stopped()[r] for r in (0, 1, 3)})  # rank 3 replied before it died
    assert facts.faulty == [2, 3] and sorted(facts.incident.dead) == [2, 3]
    assert sorted(facts.plan.ranks) == [0, 1], facts.plan  # nobody plans a save on the dead rank 3

"""The elastic upgrade's stop (elastic_flow.py ``Elastic.run_upgrade``) against a scripted controller: a stop that
catches the survivors at different points around their fence is released (``unhold``) and repeated; a
consistent stop goes on to the scale-out; one that stays inconsistent ends the job after
``UPGRADE_STOP_TRIES`` stops. The end-to-end upgrade runs in tests/megatron/test_elastic_megatron.py; the
race this covers (seen once in a full run) cannot be produced there on purpose. A failed upgrade ends the job
with a dump of the lock step from the survivors when they hold every shard (issue 16: never lose the last
copy), else with EXIT_CODE_FAULT and a line per shard."""
from __future__ import annotations

import threading
import time
import types

from mindio.ttp.wire import protocol as P
from mindio.ttp._enums import EXIT_CODE_DUMPED, EXIT_CODE_FAULT, OsStatus
from mindio.ttp.controller.controller import _Rank
from mindio.ttp.controller.ranks import RankTable
from mindio.ttp.elastic import UPGRADE_STOP_TRIES, Elastic

UPD, UPDATING = int(OsStatus.UPDATED), int(OsStatus.UPDATING)
# DP group {0, 1, 2, 3}, two replicas: shard j on ranks j and j + 2; a downgrade removed ranks 2 and 3
LAYOUT = {r: [{"rank_list": [0, 1, 2, 3], "replica_cnt": 2}] for r in range(4)}


class _SM:
    def __init__(self):
        self.fired = []
        self.state = None

    def fire(self, result, **kw):
        self.fired.append(result.name)

    def can(self, result):
        return True


class Ctl:
    """The parts' collaborators (core.Core) an upgrade reads, with ``call`` answering from a script of stop
    replies."""
    action_limit, misses, interval, world_size = 30.0, 3, 1.0, 4
    provisional_dump = ""  # Controller's: a dump as always (launch/backup.py sets it on provisional backups)

    def __init__(self, stops, failing=()):
        self.stops, self.calls, self.exits, self.failing = list(stops), [], [], set(failing)
        self.elastic, self.gen = Elastic(self), 1
        self.elastic.members, self.elastic.removed, self.elastic.layout = [0, 1], (2, 3), LAYOUT
        self.elastic.standbys = {r: (b"id%d" % r, 100 + r, "h", time.monotonic()) for r in (2, 3)}
        self.elastic.upgrade_wanted = True
        # the incident flow's part an upgrade uses (incident.IncidentFlow): no incident open, the exit order kept
        self.incidents = types.SimpleNamespace(current=None, wakeup=threading.Event(), exit=self.exits.append,
                                               mindx_call=lambda action, *args: None)
        self.lock, self.cond = threading.Lock(), threading.Condition()
        self.ranks = RankTable({r: _Rank(r, b"id%d" % r, step=28) for r in (0, 1)})  # the survivors
        self.liveness = types.SimpleNamespace(seen={})
        self.registered, self.sm, self.mindx = 2, _SM(), {}
        self.brain = types.SimpleNamespace(enabled=lambda asked: asked)

    def job_strategies(self):
        return {"elastic-training", "dump"}

    def call(self, name, params, ranks, timeout, fail_fast=False):
        self.calls.append((name, sorted(ranks)))
        if name == "stop":
            script = self.stops.pop(0)
            return {r: P.Reply(ok=True, detail={"step": s, "data_status": d}) for r, (s, d) in script.items()}
        return {r: P.Reply(ok=name not in self.failing, detail={}) for r in ranks}


def test_a_stop_across_the_fence_is_released_and_repeated():
    # first stop: rank 0 held at its fence of step 29 (still step 28's state), rank 1 already updating 29
    ctl = Ctl([{0: (28, UPD), 1: (29, UPDATING)}, {0: (30, UPD), 1: (30, UPD)}])
    assert ctl.elastic.run_upgrade() is True
    names = [n for n, _ in ctl.calls]
    assert names == ["stop", "unhold", "stop", "clean", "zit_rebuild", "zit_repair", "zit_rollback", "retry"]
    assert ctl.calls[1] == ("unhold", [0, 1])
    assert ctl.exits == [] and ctl.sm.fired[-1] == "OK"
    assert ctl.elastic.members is None and ctl.elastic.removed == () and ctl.gen == 2
    assert sorted(ctl.ranks) == [0, 1, 2, 3] and all(ctl.ranks[r].step == 30 for r in range(4))
    # the new ranks 2 and 3 are fed from their shard's surviving replica (ranks 0 and 1)
    assert ("zit_repair", [0, 1, 2, 3]) in ctl.calls


def test_a_stop_that_stays_inconsistent_ends_the_job_after_the_last_try():
    split = {0: (28, UPD), 1: (29, UPDATING)}
    ctl = Ctl([split] * UPGRADE_STOP_TRIES)
    assert ctl.elastic.run_upgrade() is False
    names = [n for n, _ in ctl.calls]
    assert names.count("stop") == UPGRADE_STOP_TRIES and names.count("unhold") == UPGRADE_STOP_TRIES - 1
    assert "zit_rebuild" not in names and ctl.exits == [EXIT_CODE_FAULT]
    assert ctl.elastic.removed == (2, 3)  # nothing was taken in


def test_a_survivor_that_does_not_answer_the_stop_is_not_released_and_retried():
    # a missing reply (dead or past the deadline) is no timing race: no unhold, the upgrade fails at once
    ctl = Ctl([{0: (30, UPD)}])
    assert ctl.elastic.run_upgrade() is False
    assert [n for n, _ in ctl.calls] == ["stop", "clean"] and ctl.exits == [EXIT_CODE_FAULT]


def test_an_upgrade_failing_after_the_stop_dumps_the_lock_step_from_the_survivors():
    """The new ranks' rebuild fails (a standby's zit_upgrade_rebuild raises): the survivors 0 and 1 stopped at
    step 30 with complete state and hold both shards (the new ranks 2 and 3 hold nothing yet): they save step
    30, rank 0 renames it, and the job exits EXIT_CODE_DUMPED -- not EXIT_CODE_FAULT with nothing saved."""
    ctl = Ctl([{0: (30, UPD), 1: (30, UPD)}], failing={"zit_rebuild"})
    assert ctl.elastic.run_upgrade() is False
    names = [n for n, _ in ctl.calls]
    assert names[:3] == ["stop", "clean", "zit_rebuild"], names
    assert ("save", [0, 1]) in ctl.calls and ("rename", [0]) in ctl.calls
    assert not any(n == "save" and set(r) & {2, 3} for n, r in ctl.calls)  # the new ranks never write
    assert ctl.exits == [EXIT_CODE_DUMPED]


def test_an_upgrade_whose_survivors_cannot_save_ends_with_the_fault_code():
    """Same failure, but every survivor's save answers an error: no holder of either shard can write, so
    the job ends with EXIT_CODE_FAULT (and a line per shard), nothing renamed."""
    ctl = Ctl([{0: (30, UPD), 1: (30, UPD)}], failing={"zit_repair", "save"})
    assert ctl.elastic.run_upgrade() is False
    names = [n for n, _ in ctl.calls]
    assert "save" in names and "rename" not in names and ctl.exits == [EXIT_CODE_FAULT], names

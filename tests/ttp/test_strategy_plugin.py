"""Adding a recovery strategy is one new class plus one registration line (issue #14,
docs/architecture.md "Adding a strategy"): a strategy defined here, registered with one line in
``Controller.STRATEGIES``, is chosen by a real controller for a real fault and run through the shared
recovery sequence (sequence.Sequence) against real processors over loopback, whose "main threads" are
plain threads running a training-shaped loop (no torch.distributed). When one of its steps fails on a
rank (a rollback handler that raises), the incident falls back to the next strategy of its order."""
import pytest

from mindio.ttp.controller.controller import Controller
from mindio.ttp._enums import Action
from mindio.ttp.controller.sequence import Sequence
from mindio.ttp.controller.states import Result, State
from mindio.ttp.controller.strategy import Outcome, Strategy

from ._harness import Loop, start_plane, stop_plane, until as _until

KEY = b"g" * 32


class Reload(Strategy):
    """The worked example of docs/architecture.md: every rank rolls back to the lock step, nothing is
    repaired, nothing is rebuilt (the ranks here have no process group)."""

    name = "reload"

    def feasible(self, core, enabled, facts):
        return self.name in enabled and not facts.dead and bool(facts.states) and facts.in_place_possible

    def run(self, core, ctx):
        seq = Sequence(core, self.name, ctx.t0)
        live = [v.rank for v in ctx.views if v.alive]
        core.sm.fire(Result.RETRY, lock_step=ctx.lock)                  # ABNORMAL -> ENV_CLEAR
        if not seq.step("clean", {"timeout": core.action_limit}, live):
            return self.fall_back(core, ctx)
        core.sm.fire(Result.OK)                                          # ENV_CLEAR -> REPAIR
        if not seq.step("rollback", {"step": ctx.lock}, live, abandon=live):
            return self.fall_back(core, ctx)
        seq.resume(ctx.lock, live)                                      # REPAIR -> NORMAL, retry
        seq.done("every rank trains again", "nothing repaired", ({}, self.name), lock_step=ctx.lock)
        return Outcome.RESUMED


@pytest.fixture
def job(monkeypatch):
    monkeypatch.setitem(Controller.STRATEGIES, "reload", Reload())  # the one registration line
    rolled = []

    def handlers(procs):
        for p in procs:
            p.callbacks["repair"] = (lambda *a: None, None)
            p.callbacks["rollback"] = (lambda step, args, ctx, r=p.rank: rolled.append((r, step)), None)
            p.callbacks["save_ckpt"] = (lambda *a: None, None)
            p.callbacks["rename"] = (lambda *a: None, None)
    ctl, procs, _ = start_plane(2, KEY, misses=10, action_limit=5.0, before_start=handlers)
    ctl.enabled |= {"reload", "dump"}
    loops = []
    yield ctl, procs, loops, rolled
    for lp in loops:
        lp.done.set()
    stop_plane(ctl, procs)


@pytest.mark.timeout(60)
def test_a_strategy_registered_with_one_line_recovers_a_real_fault(job):
    ctl, procs, loops, rolled = job
    loops += [Loop(procs[0], pause=False), Loop(procs[1], fail_at=5, pause=False)]
    for lp in loops:
        lp.start()
    assert _until(lambda: ctl.last_decision.get("strategy") is not None, 30), ctl.sm.state
    lock = ctl.last_decision["lock_step"]
    assert ctl.last_decision["strategy"] == "reload" and ctl.last_decision["order"][0] == "reload"
    assert _until(lambda: all(lp.decisions for lp in loops), 30)
    assert [lp.decisions for lp in loops] == [[(Action.RETRY, 0)], [(Action.RETRY, 0)]]
    assert sorted(rolled) == [(0, lock), (1, lock)]
    assert _until(lambda: all(p.step > lock + 2 for p in procs), 30)  # both ranks train on
    assert ctl.sm.state is State.NORMAL and ctl.incidents.current is None and not ctl.final.is_set()
    assert not any(r.faulty for r in ctl.ranks.values())


@pytest.mark.timeout(60)
def test_a_step_of_the_new_strategy_that_fails_on_a_rank_falls_back(job):
    """Rank 0's rollback handler raises: the sequence abandons (clean on every rank), the strategy
    returns FAILED and the incident runs the next strategy of its order: the dump (both ranks hold the
    one optimizer shard; rank 0 saves it), then exit(75)."""
    ctl, procs, loops, rolled = job
    saved = []

    def broken(step, args, ctx):
        raise OSError("rollback storage unavailable")
    procs[0].callbacks["rollback"] = (broken, None)
    for p in procs:
        p.replica = [{"rank_list": [0, 1], "replica_cnt": 2, "replica_shift": 0}]
        p.callbacks["save_ckpt"] = (lambda step, info, args, ctx, r=p.rank: saved.append((r, step)), None)
        p.send_info()
    assert _until(lambda: all(ctl.ranks[p.rank].replica for p in procs))
    loops += [Loop(procs[0], pause=False), Loop(procs[1], fail_at=5, pause=False)]
    for lp in loops:
        lp.start()
    assert _until(lambda: ctl.final.is_set(), 30), ctl.sm.state
    lock = ctl.last_decision["lock_step"]
    assert ctl.last_decision["strategy"] == "reload" and ctl.last_decision["order"] == ["reload", "dump", "exit"]
    assert rolled == [(1, lock)] and saved == [(0, lock)] and ctl.exit_code == 75
    assert _until(lambda: all(lp.decisions for lp in loops), 30)
    assert [lp.decisions[-1] for lp in loops] == [(Action.EXIT, 75), (Action.EXIT, 75)]

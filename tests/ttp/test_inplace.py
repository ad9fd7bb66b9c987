"""Processor side of the retry actions (inplace.py) without sockets: the fence / FORCE STOP hand-off."""
import threading
import time
import types

import pytest

from mindio.ttp.processor import inplace
from mindio.ttp._enums import Action
from mindio.ttp.controller.brain import Brain
from mindio.ttp.controller.policy import RankView
from mindio.ttp.processor.processor import Processor
from mindio.ttp.controller.ranks import RankTable


@pytest.mark.timeout(30)
def test_clean_force_stops_a_fenced_rank_and_retry_releases_it():
    proc = Processor(0, 1)
    proc._hold = True  # the stop action holds the fence
    seen = {}

    def main():  # what the decorator does around train()
        try:
            proc.start_updating_os(-1)
            seen["error"] = None
        except RuntimeError as exc:
            seen["error"] = str(exc)
        seen["next"] = proc.wait_next_action()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    end = time.monotonic() + 5
    while proc._main != "fenced" and time.monotonic() < end:
        time.sleep(0.01)
    assert proc._main == "fenced"
    assert inplace.clean(proc.state, timeout=5) == {"main": "parked", "destroyed": 0}
    assert seen["error"].startswith("FORCE STOP")
    inplace.retry(proc.state)
    t.join(5)
    assert seen["next"] == (Action.RETRY, 0)
    assert not proc._hold and proc._main == "running"


@pytest.mark.timeout(30)
def test_clean_times_out_on_a_busy_rank():
    proc = Processor(0, 1)  # main thread "running" (e.g. stuck in a long computation)
    with pytest.raises(TimeoutError, match="still running"):
        inplace.clean(proc.state, timeout=0.2)


def test_retry_refuses_a_rank_that_is_not_parked():
    with pytest.raises(RuntimeError, match="not parked"):
        inplace.retry(Processor(0, 1).state)


def _repair_proc(rank: int) -> tuple:
    proc, calls = Processor(rank, 4), []
    proc.callbacks["repair"] = (lambda step, need_rebuild, errs, info, args, ctx:
                                calls.append((need_rebuild, info["repair_type"])), None)
    return proc, calls


@pytest.mark.parametrize("kind,rebuild", [("RT_UCE_LOWLEVEL", False), ("RT_UCE_HIGHLEVEL", True)])
def test_repair_passes_the_controllers_repair_type_and_need_rebuild(kind, rebuild):
    pairs = [{"type": 0, "src": 3, "dst": 1, "repair_type": kind}]
    dst, got = _repair_proc(1)
    assert inplace.repair(dst.state, 6, [1], pairs) == {"done": [kind]}
    assert got == [(rebuild, kind)]
    src, sent = _repair_proc(3)
    inplace.repair(src.state, 6, [1], pairs)
    assert sent == [(False, "RT_SEND")]  # the source sends from its intact state either way


def test_uce_repair_type_follows_the_update_window():
    from mindio.ttp import api
    from mindio.ttp._enums import OsStatus, ReportState
    from mindio.ttp.decorator import classify_exception
    from mindio.ttp.controller.retry import uce_repair_type

    assert uce_repair_type(ReportState.RS_UCE, OsStatus.UPDATED) == "RT_UCE_LOWLEVEL"
    assert uce_repair_type(ReportState.RS_UCE, OsStatus.UPDATING) == "RT_UCE_HIGHLEVEL"
    assert uce_repair_type(ReportState.RS_UCE, OsStatus.COPYING) == "RT_UCE_HIGHLEVEL"
    assert uce_repair_type(ReportState.RS_UCE_CORRUPTED, OsStatus.UPDATED) == "RT_UCE_HIGHLEVEL"
    ecc = RuntimeError("HBM MULTI BIT ECC: uncorrectable")
    try:  # the error time against the window set by tft_set_update_start/end_time (tft_can_do_uce_repair)
        api.tft_set_update_start_time()
        inside = classify_exception(ecc)  # the update started and has not ended: inside the window
        api.tft_set_update_end_time()
        time.sleep(0.001)
        after = classify_exception(ecc)
    finally:
        from mindio.ttp._runtime import state
        state.update_window[:] = [None, None]
    assert inside == ReportState.RS_UCE_CORRUPTED and uce_repair_type(inside, OsStatus.UPDATED) == "RT_UCE_HIGHLEVEL"
    assert after == ReportState.RS_UCE and uce_repair_type(after, OsStatus.UPDATED) == "RT_UCE_LOWLEVEL"


def test_registration_carries_the_enable_flags_and_the_controller_honours_them():
    from mindio.ttp.wire import protocol as P
    from mindio.ttp.controller.controller import Controller, _Rank

    hello = Processor(2, 4, enable_uce=False, enable_arf=True)._hello()
    key = b"k" * 32
    env = P.decode(P.encode(P.Envelope(P.MsgType.REGISTER, hello, rank=2), key), key)
    assert env.body.features == {"uce": False, "arf": True, "zit": False}
    ctl = Controller(0, 4, {"retry", "dump"}, key)
    for r in range(4):
        ctl.ranks[r] = _Rank(r, str(r).encode(), features={"uce": r != 2} if r else {})
    assert ctl.uce_refused() == [2]  # rank 0 sent no flags: allowed (the reference default)
    ctl.ranks[2].alive = False
    assert ctl.uce_refused() == []


def test_stop_round_sends_each_action_once_and_releases_a_rank_blocked_behind_a_fenced_one():
    """One ``stop`` to every rank (each interrupts a step in flight and answers once quiet, at the latest
    after the grace, or after the look when it runs inside a collective); ranks held before an update another rank made: ``advance``;
    a rank still running while another waits at its fence: ``teardown`` to the fenced one (the blocked
    collective fails), then ``wait_quiet`` with the full timeout to the running one. Each action is sent
    once (before: a ``stop`` every STOP_LOOK_S)."""
    from mindio.ttp.wire import protocol as P
    from mindio.ttp.controller.stopround import STOP_GRACE_S, STOP_LOOK_S, StopRound

    class Ctl:
        action_limit = 180.0
        brain = Brain()

        def __init__(self, mains, steps=None):
            self.mains, self.calls, self.steps = mains, [], steps or {}
            self.lock, self.ranks = threading.Lock(), RankTable()  # the rank table: no rank declared dead
            self.incidents = types.SimpleNamespace(views=self.views)  # the incident flow's part StopRound uses

        def job_strategies(self):
            return {"dump", "retry"}  # no recover-in-place: no stuck-rank kill

        def views(self, replies):
            return [RankView(r, True, False, rep.detail["step"], rep.detail["data_status"]) for r, rep in replies.items()]

        def call(self, name, params, ranks, timeout, fail_fast=False):
            self.calls.append((name, dict(params), sorted(ranks)))
            if name in ("teardown", "advance"):  # the blocked rank's collective fails / completes: it parks
                self.mains.update({r: "parked" for r in self.mains if self.mains[r] == "running"})
            if name == "advance":  # the held ranks made their update and parked at their next collective
                self.mains.update({r: "parked" for r in ranks})
                self.steps.update({r: params["step"] for r in ranks})
            return {r: P.Reply(ok=True, detail={"main": self.mains[r], "step": self.steps.get(r, 6),
                                                "data_status": 0}) for r in ranks}

    stop = ("stop", {"timeout": STOP_GRACE_S, "look": STOP_LOOK_S, "stop_clean": False, "interrupt": True})
    ctl = Ctl({0: "fenced", 1: "parked", 2: "running", 3: "parked"})
    replies = StopRound(ctl).run([0, 1, 2, 3], {"timeout": 90.0, "stop_clean": False})
    assert ctl.calls == [stop + ([0, 1, 2, 3],), ("teardown", {}, [0]), ("wait_quiet", {"timeout": 90.0}, [2])]
    assert {r: rep.detail["main"] for r, rep in replies.items()} == {0: "fenced", 1: "parked", 2: "parked",
                                                                     3: "parked"}
    # running but nobody fenced (waiting for the faulty rank's teardown): it gets the full timeout
    waiting = Ctl({1: "parked", 2: "running"})
    StopRound(waiting).run([1, 2], {"timeout": 90.0, "stop_clean": False})
    assert waiting.calls == [stop + ([1, 2],), ("wait_quiet", {"timeout": 90.0}, [2])]
    quiet = Ctl({0: "fenced", 1: "parked"})  # nobody running: one call, nothing torn down
    StopRound(quiet).run([0, 1], {"timeout": 90.0, "stop_clean": False})
    assert quiet.calls == [stop + ([0, 1],)]
    # ranks 0 and 3 held before the update of step 6 that rank 2 made and is still gathering after (blocked
    # with rank 3): they finish it (the reference's prelock), rank 2 completes with them; nothing torn down
    behind = Ctl({0: "fenced", 1: "parked", 2: "running", 3: "fenced"}, steps={0: 5, 3: 5})
    replies = StopRound(behind).run([0, 1, 2, 3], {"timeout": 90.0, "stop_clean": False})
    assert behind.calls == [stop + ([0, 1, 2, 3],), ("advance", {"step": 6, "timeout": STOP_GRACE_S}, [0, 3]),
                            ("wait_quiet", {"timeout": STOP_GRACE_S}, [2])]
    assert {r: (rep.detail["main"], rep.detail["step"]) for r, rep in replies.items()} == {
        0: ("parked", 6), 1: ("parked", 6), 2: ("parked", 6), 3: ("parked", 6)}


def test_stop_answers_early_for_a_main_thread_blocked_in_a_collective():
    """The processor side of the stop round: quiet -> at once; running inside torch.distributed -> after
    ``look``; running elsewhere -> after ``timeout``. The reply says where the main thread is."""
    ns: dict = {}
    # a function whose frame looks like torch.distributed's (Processor._main_in_collective reads the file name)
    exec(compile("def blocked(ev):\n    ev.wait(30)\n", "/site-packages/torch/distributed/fake.py", "exec"), ns)
    p = Processor(0, 1)
    p._main = "parked"
    t0 = time.monotonic()
    assert p._do_stop(timeout=20.0, look=0.2)["main"] == "parked" and time.monotonic() - t0 < 10
    release = threading.Event()
    for target, args, look, expect in ((ns["blocked"], (release,), 0.2, True), (release.wait, (30,), 0.2, False)):
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        p._main_ident, p._main = t.ident, "running"
        t0 = time.monotonic()
        reply = p._do_stop(timeout=1.0 if not expect else 20.0, look=look)
        took = time.monotonic() - t0
        assert reply["main"] == "running" and reply["in_collective"] is expect, reply
        assert (took < 10) if expect else (took >= 1.0)  # inside a collective: answered at the look
        release.set()
        t.join(10)
        release.clear()


def test_an_incidents_stop_interrupts_a_step_in_flight_but_never_an_update():
    """``stop`` with ``interrupt`` (an incident's stop round, stopround.StopRound) calls the framework's
    interrupt hook when the main thread computes outside its optimizer update: the step leaves at its next
    check point and parks, and the stop answers then, not after its timeout. Inside the update window
    (between tft_start_updating_os and tft_end_updating_os), or without ``interrupt`` (elastic's stop), the
    hook is not called and the step runs on."""
    from mindio.ttp._enums import OsStatus

    p = Processor(0, 1)
    calls, left = [], threading.Event()
    p.callbacks["interrupt"] = (lambda args, ctx: (calls.append(args), left.set()), None)

    def step():  # computing until interrupted, then the decorator parks it
        if left.wait(30):
            with p._cond:
                p._main = "parked"
                p._cond.notify_all()

    t = threading.Thread(target=step, daemon=True)
    t.start()
    p._main_ident, p._main = t.ident, "running"
    t0 = time.monotonic()
    assert p._do_stop(timeout=20.0, look=0.2, interrupt=True)["main"] == "parked"
    assert time.monotonic() - t0 < 10 and calls == [None]
    t.join(10)
    for status, interrupt in ((OsStatus.UPDATING, True), (OsStatus.UPDATED, False)):
        p._main, p.data_status, p._hold = "running", status, False
        left.clear()
        t0 = time.monotonic()
        assert p._do_stop(timeout=0.5, look=0.2, interrupt=interrupt)["main"] == "running"
        assert time.monotonic() - t0 >= 0.5 and calls == [None] and not left.is_set()


def test_unhold_lets_a_rank_held_at_its_fence_run_on():
    """elastic.py's upgrade: a stop that caught the survivors at different points is released with
    ``unhold`` (the main thread stays in its step), then the survivors are stopped again."""
    p = Processor(0, 1)
    p._hold = True  # what a stop sets
    t = threading.Thread(target=p.start_updating_os, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while p._main != "fenced" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p._main == "fenced" and t.is_alive()
    assert p._do_unhold() == {"step": 0}
    t.join(10)
    assert not t.is_alive() and p._main == "running" and int(p.data_status) != 0  # it went on into the update


def test_advance_lets_a_rank_held_before_its_update_finish_it():
    """``advance(step)``: a rank the stop held at its fence before the update of ``step`` makes it, then is
    held at its next fence; a rank not held there is left alone (policy.ranks_to_advance)."""
    p = Processor(0, 1)
    p.end_updating_os(4)
    p._hold = True  # what a stop sets

    def main():  # the fence of step 5, the update, the fence of step 6
        p.start_updating_os(-1)
        p.end_updating_os(5)
        p.start_updating_os(-1)

    t = threading.Thread(target=main, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while p._main != "fenced" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p._main == "fenced" and p.step == 4
    reply = p._do_advance(5, timeout=20.0)
    assert (reply["step"], reply["main"], reply["data_status"]) == (5, "fenced", 0) and t.is_alive()
    assert p._do_advance(7, timeout=0.1)["step"] == 5  # not one update behind 7: nothing happens
    p._do_unhold()
    t.join(10)
    assert not t.is_alive()

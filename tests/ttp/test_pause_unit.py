"""Graceful pause in one process over real loopback sockets: controller + processors whose "main threads"
are plain threads running a training-shaped loop (fast; no torch.distributed). The toy and Megatron jobs
are in test_pause_e2e.py and tests/megatron/test_pause_megatron.py."""
import time

import pytest

import mindio.ttp as ttp
from mindio.errors import ConfigError
from mindio.ttp._enums import Action, ReportState
from mindio.ttp.controller.states import State

from ._harness import Loop, start_plane, stop_plane, until as _until

KEY = b"p" * 32


@pytest.fixture
def plane():
    synced = []

    def stream_sync(procs):
        for p in procs:
            p.callbacks["stream_sync"] = (lambda r=p.rank: synced.append((r, procs[r].step)), None)
    ctl, procs, _ = start_plane(3, KEY, misses=10, action_limit=2.0, before_start=stream_sync)
    seen = []
    ctl.mindx["report_stop_complete"] = lambda code, msg, ranks: seen.append(("stopped", code, msg))
    ctl.mindx["report_result"] = lambda code, msg, ranks, strategy: seen.append(("result", code, strategy, msg))
    loops = []
    yield ctl, procs, loops, synced, seen
    for lp in loops:
        lp.done.set()
    for p in procs:
        p.reset_limit_step()
    stop_plane(ctl, procs)


def _states(ctl):
    return [(a.value, r.value, b.value) for a, r, b in ctl.sm.history]


@pytest.mark.timeout(60)
def test_pause_then_continue(plane):
    ctl, procs, loops, synced, seen = plane
    loops += [Loop(p) for p in procs]
    for lp in loops:
        lp.start()
    assert _until(lambda: all(p.step >= 3 for p in procs))
    assert ctl.notify_pause({}, timeout=30) == 0
    assert ctl.notify_pause({}, timeout=30) == 1  # one pause at a time
    assert _until(lambda: seen and seen[0][0] == "stopped")
    steps = {p.step for p in procs}
    assert len(steps) == 1
    step = steps.pop()
    assert sorted(synced) == [(r, step) for r in range(3)]
    time.sleep(0.3)
    assert {p.step for p in procs} == {synced[0][1]}  # nobody moves while paused
    assert ctl.change_strategy("continue") == 0
    assert _until(lambda: all(p.step >= synced[0][1] + 3 for p in procs))
    assert seen == [("stopped", 0, f"training paused at step {synced[0][1]}"),
                    ("result", 0, "continue", "training continued")]
    assert ("NORMAL", "PAUSE", "PAUSE") in _states(ctl) and ctl.sm.state is State.NORMAL


@pytest.mark.timeout(60)
def test_rank_that_cannot_reach_the_step_fails_the_pause_safely(plane):
    ctl, procs, loops, synced, seen = plane
    loops += [Loop(procs[0]), Loop(procs[1]), Loop(procs[2], stall_at=4)]
    for lp in loops:
        lp.start()
    assert _until(lambda: procs[2].step >= 4)
    assert ctl.notify_pause({}, timeout=30) == 0
    assert _until(lambda: seen, 20)
    assert seen[0][:2] == ("stopped", 404) and "failed on ranks [2]" in seen[0][2]
    assert _until(lambda: ctl.sm.state is State.NORMAL)
    before = procs[0].step
    loops[2].done.set()
    assert _until(lambda: procs[0].step > before + 2)  # limits cleared: the others train on
    assert all(p._limit is None for p in procs)


@pytest.mark.timeout(60)
def test_exit_while_paused(plane):
    ctl, procs, loops, synced, seen = plane
    loops += [Loop(p) for p in procs]
    for lp in loops:
        lp.start()
    assert _until(lambda: all(p.step >= 2 for p in procs))
    assert ctl.notify_pause({1: 1}, timeout=30) == 0
    assert _until(lambda: seen)
    ctl.change_strategy("exit")
    assert _until(lambda: ctl.final.is_set())
    assert ctl.exit_code == ttp.EXIT_CODE_FAULT and ("PAUSE", "EXIT", "EXIT") in _states(ctl)
    assert _until(lambda: all(lp.exit == (Action.EXIT, ttp.EXIT_CODE_FAULT) for lp in loops))


@pytest.mark.timeout(60)
def test_pause_timeout_continues(plane):
    ctl, procs, loops, synced, seen = plane
    loops += [Loop(p) for p in procs]
    for lp in loops:
        lp.start()
    assert _until(lambda: all(p.step >= 2 for p in procs))
    t0 = time.monotonic()
    assert ctl.notify_pause({}, timeout=1) == 0
    assert _until(lambda: len(seen) == 2)
    assert time.monotonic() - t0 >= 1.0
    assert seen[1][:3] == ("result", 0, "continue") and "timed out after 1 s" in seen[1][3]
    step = synced[0][1]
    assert _until(lambda: all(p.step > step + 2 for p in procs)) and ctl.sm.state is State.NORMAL


@pytest.mark.timeout(60)
def test_fault_while_paused_becomes_an_incident(plane):
    ctl, procs, loops, synced, seen = plane
    for p in procs:
        p.replica = [{"rank_list": [0, 1, 2], "replica_cnt": 1, "replica_shift": 0}]
        p.send_info()
        p.callbacks["save_ckpt"] = (lambda *a: None, None)
        p.callbacks["rename"] = (lambda *a: None, None)
    loops += [Loop(p) for p in procs]
    for lp in loops:
        lp.start()
    assert _until(lambda: all(p.step >= 2 for p in procs))
    assert ctl.notify_pause({}, timeout=30) == 0
    assert _until(lambda: seen)
    procs[1].report(ReportState.RS_UNKNOWN, "ValueError: broke while paused")
    assert _until(lambda: ctl.final.is_set(), 30)
    assert ("PAUSE", "FAULT", "ABNORMAL") in _states(ctl)
    assert ctl.last_decision["faulty"] == [1] and ctl.last_decision["strategy"] == "exit"  # rank 1's shard: no replica


def test_api_validates_pause_arguments():
    with pytest.raises(ConfigError, match="stop_type 'halt'"):
        ttp.tft_notify_controller_stop_train({}, stop_type="halt")
    with pytest.raises(ConfigError, match="timeout -1"):
        ttp.tft_notify_controller_stop_train({}, stop_type="pause", timeout=-1)
    with pytest.raises(ConfigError, match="errorType"):
        ttp.tft_notify_controller_stop_train({3: 7})
    with pytest.raises(ConfigError, match="must be a dict"):
        ttp.tft_notify_controller_stop_train([3])

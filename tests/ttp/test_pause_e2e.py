"""Graceful pause / continue on the toy job (real processes, real sockets, real gloo).

An external decider (tests/ttp/_decider_proc.py, the controller in its own process) pauses the job
through ``tft_notify_controller_stop_train(stop_type="pause")``: every rank stops at the same step inside
``tft_pause_train`` and runs its stream-sync callback; ``change_strategy("continue")`` (or the pause
timeout) lets training go on, and the result is bitwise equal to an uninterrupted run: no step lost.
"""
import os

import pytest

from ._decider import Decided
from ._harness import assert_bitwise_equal, fault_free_state, final_state

STEPS = 30
ARGS = ["--steps", str(STEPS), "--step-sleep", "0.1"]
ENV = {"MINDIO_HEARTBEAT_INTERVAL": "0.5", "MINDIO_HEARTBEAT_MISSES": "6"}  # steps seen soon; no false deaths under load
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def baseline(fault_free_run):
    return fault_free_state(fault_free_run, STEPS)


def _paused_steps(out):
    steps = []
    for r in range(4):
        with open(os.path.join(out, f"stream_sync_rank{r}")) as f:
            steps.append([int(x) for x in f.read().split()])
    return steps


@pytest.mark.timeout(240)
def test_pause_continue_is_bitwise(baseline, tmp_path):
    out = str(tmp_path / "run")
    d = Decided(out, "pause:1.0", args=ARGS, env=ENV)
    assert d.wait(150) == [0, 0, 0, 0], d.tail()
    calls = d.calls()
    kinds = [c["kind"] for c in calls]
    assert kinds[:4] == ["notify_pause", "report_stop_complete", "change_strategy", "report_result"], calls
    assert calls[0]["rc"] == 0 and calls[1]["code"] == 0 and calls[2]["rc"] == 0
    assert (calls[3]["code"], calls[3]["strategy"]) == (0, "continue")
    paused = _paused_steps(out)
    assert all(len(p) == 1 for p in paused) and len({p[0] for p in paused}) == 1, paused  # same step everywhere
    step = paused[0][0]
    assert 3 <= step < STEPS
    assert f"training paused at step {step}" in calls[1]["msg"]
    # the job really stood still: the decider held the pause for 1 s before continuing
    assert calls[2]["t"] - calls[1]["t"] >= 1.0
    done = calls[-1]
    assert done["kind"] == "done" and ["NORMAL", "PAUSE", "PAUSE"] in done["history"] \
        and ["PAUSE", "CONTINUE", "NORMAL"] in done["history"]
    assert_bitwise_equal(final_state(out, 4), baseline)


@pytest.mark.timeout(240)
def test_pause_timeout_continues_safely(baseline, tmp_path):
    out = str(tmp_path / "run")
    d = Decided(out, "pause-timeout:2", args=ARGS, env=ENV)
    assert d.wait(150) == [0, 0, 0, 0], d.tail()
    calls = d.calls()
    stop = [c for c in calls if c["kind"] == "report_stop_complete"][0]
    res = [c for c in calls if c["kind"] == "report_result"][0]
    assert stop["code"] == 0 and res["strategy"] == "continue" and "timed out after 2 s" in res["msg"]
    assert res["t"] - stop["t"] >= 2.0
    paused = _paused_steps(out)
    assert len({p[0] for p in paused}) == 1, paused
    assert_bitwise_equal(final_state(out, 4), baseline)

"""The controller's exit order is carried out by every rank whose process lives, whenever it comes.

Issue 13: under stress the controller decided ``exit`` at lock step 0 -- a rank declared dead by
heartbeat during a long first step -- and the job hung to the test's bound: the order went only to the
ranks the controller held alive, so the rank declared dead (its process lived: a starved link thread)
was never told; its next collective failed on the peers that had left, it reported to a controller
that ignored reports after its order, and it parked for a decision that never came.

Real processes: the toy job of _toy_train.py (4 ranks, gloo on loopback, the controller in rank 0's
process), through the tft_* API.
"""
import json
import os
import re
import signal

import pytest

from mindio._ports import free_port
from mindio.ttp import EXIT_CODE_FAULT
from tests._faultplan import FaultPlan

from ._harness import ROOT, Job, run_ranks, until

LATE = os.path.join(os.path.dirname(__file__), "_late_main.py")

pytestmark = pytest.mark.slow


def _events(out: str) -> list:
    """The job's events so far (a line being written is skipped)."""
    path = os.path.join(out, "events.jsonl")
    found = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    found.append(json.loads(line))
                except ValueError:
                    pass
    return found


def _log(out: str, rank: int) -> str:
    with open(os.path.join(out, f"rank{rank}.log")) as f:
        return f.read()


@pytest.mark.timeout(200)
def test_a_rank_declared_dead_in_its_first_step_carries_out_the_exit_order(tmp_path):
    """Rank 3 stops (SIGSTOP) at the start of its first iteration, seen only by heartbeats (as on another
    host: MINDIO_PID_PROBE=0), so the controller declares it dead and decides at lock step 0, before any
    rank finished a step: nothing to save (the job's state is what it started from), so ``exit``. The
    test continues rank 3 (SIGCONT) only once that order went out: its process lived all along, so the
    order must reach it too, and it exits with the order's code like the others.

    MINDIO_CONTROLLER_LOST_EXIT=600: only the order can end rank 3 within the test's bound (the old code
    sent it only to the ranks held alive: rank 3 then parked and waited for a controller that had left)."""
    out = str(tmp_path / "run")
    env = {"MINDIO_PID_PROBE": "0", "MINDIO_CONTROLLER_LOST_EXIT": "600"}
    job = Job(out, args=["--steps", "4"], plan=FaultPlan.of(("stop", 3, 0)), env=env, sent={3: "SIGCONT"})
    try:
        ordered = until(lambda: any(e["kind"] == "action" and e.get("action") == "exit" for e in _events(out)), 120)
        assert ordered, job.tail()
    finally:
        job.procs[3].send_signal(signal.SIGCONT)  # also on a failure: the job is reaped, not left stopped
    codes = job.wait(60)
    assert codes == [EXIT_CODE_FAULT] * 4, (codes, job.tail())
    events = _events(out)
    decision = next(e for e in events if e["kind"] == "decision")
    assert (decision["strategy"], decision["lock_step"], decision["faulty"]) == ("exit", 0, [3]), decision
    dead = next(e for e in events if e["kind"] == "rank_dead")
    assert (dead["dead_rank"], dead["cause"]) == (3, "heartbeat"), dead
    exit_action = next(e for e in events if e["kind"] == "action" and e["action"] == "exit")
    assert exit_action["ranks"] == 4, exit_action  # every registered rank was sent the order
    ctl_log = _log(out, 0)
    assert re.search(r"dump at step 0 impossible: nothing to save", ctl_log), ctl_log[-3000:]
    for r in range(4):
        text = _log(out, r)
        assert f"exiting with code {EXIT_CODE_FAULT}" in text, (r, text[-3000:])
        assert "no controller reachable" not in text, (r, text[-3000:])


@pytest.mark.timeout(120)
def test_a_rank_still_setting_up_is_ended_with_the_exit_orders_code(tmp_path):
    """Rank 0 fails before its first step (nothing to save: EXIT(76)) while rank 1 is still outside
    train() (_late_main.py: a 300 s setup). Rank 1 has the order but its main thread reaches no fence and
    does not park: its processor ends it with the order's code after MINDIO_EXIT_ORDER_WAIT s, naming
    where the main thread was, and the job ends with 76 on both ranks."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, TTP_LOG_STDOUT="1", MINDIO_SECRET="s" * 32, OMP_NUM_THREADS="1",
               MINDIO_EXIT_ORDER_WAIT="1", TTP_NORMAL_ACTION_TIME_LIMIT="30")  # both: the least allowed
    codes, outs = run_ranks(LATE, [[r, port, tmp_path] for r in range(2)], env, 90)
    assert codes == [EXIT_CODE_FAULT] * 2, (codes, outs[0][-3000:], outs[1][-3000:])
    assert "dump at step 0 impossible: nothing to save" in outs[0], outs[0][-3000:]
    assert re.search(r"the controller ordered EXIT\(76\) 1 s ago, but this rank's main thread has not carried it "
                     r"out: .* \(it runs at .*_late_main\.py:\d+ in main\); ending the process with 76 "
                     r"\(MINDIO_EXIT_ORDER_WAIT\)", outs[1]), outs[1][-3000:]

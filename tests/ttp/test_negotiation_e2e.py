"""A full negotiation with an external decider through the reference API, on the toy job (real processes,
real sockets): tft_register_mindx_callback(report_fault_ranks | report_stop_complete | report_strategies |
report_result) + tft_notify_controller_change_strategy / _dump, the controller in the decider's process."""
import os

import pytest

from mindio.ttp import EXIT_CODE_DUMPED
from tests._faultplan import FaultPlan

from ._decider import Decided
from ._harness import Job, assert_bitwise_equal, fault_free_state, final_state

STEPS, FAULT_IT = 8, 4
ENV = {"HIGH_AVAILABILITY": "retry,dump", "MINDIO_HEARTBEAT_INTERVAL": "0.5", "MINDIO_HEARTBEAT_MISSES": "6"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def baseline(fault_free_run):
    return fault_free_state(fault_free_run, 30)


def _resume_is_bitwise(out, tmp_path, expect, steps):
    out2 = str(tmp_path / "resumed")
    job = Job(out2, args=["--steps", str(steps), "--resume", os.path.join(out, "ckpt")])
    assert job.wait(120) == [0, 0, 0, 0], job.tail()
    assert_bitwise_equal(final_state(out2, 4), expect)


def _kinds(calls):
    return [c["kind"] for c in calls]


@pytest.mark.timeout(300)
def test_decider_chooses_dump_over_builtin_retry(fault_free_run, tmp_path):
    out = str(tmp_path / "run")
    d = Decided(out, "choose:dump", args=["--steps", str(STEPS)],
                plan=FaultPlan.of(("raise-uce", 1, FAULT_IT)), env=ENV)
    assert d.wait(150) == [EXIT_CODE_DUMPED] * 4, d.tail()
    calls = d.calls()
    assert _kinds(calls)[:5] == ["report_fault_ranks", "report_stop_complete", "report_strategies",
                                 "change_strategy", "report_result"], calls
    assert calls[0]["ranks"] == {"1": 0} and calls[1]["code"] == 0
    assert calls[2]["options"] == ["retry", "dump", "exit"]  # the built-in policy would have retried
    assert calls[3]["rc"] == 0 and (calls[4]["code"], calls[4]["strategy"]) == (0, "dump")
    with open(os.path.join(out, "ckpt", "latest")) as f:
        assert int(f.read()) == FAULT_IT
    _resume_is_bitwise(out, tmp_path, fault_free_state(fault_free_run, STEPS), STEPS)


@pytest.mark.timeout(300)
def test_silent_decider_builtin_policy_takes_over(baseline, tmp_path):
    out = str(tmp_path / "run")
    d = Decided(out, "silent", args=["--steps", "30"], plan=FaultPlan.of(("raise-uce", 1, FAULT_IT)),
                env=dict(ENV, MINDIO_WAIT_MINDX_TIME="1"))
    assert d.wait(150) == [0, 0, 0, 0], d.tail()  # retried in place: the same processes finish the job
    calls = d.calls()
    assert _kinds(calls)[:4] == ["report_fault_ranks", "report_stop_complete", "report_strategies",
                                 "report_result"], calls
    assert calls[2]["options"] == ["retry", "dump", "exit"]
    assert (calls[3]["code"], calls[3]["strategy"]) == (0, "retry")
    assert calls[3]["t"] - calls[2]["t"] >= 1.0  # waited MINDIO_WAIT_MINDX_TIME for the decider
    assert_bitwise_equal(final_state(out, 4), baseline)


@pytest.mark.timeout(300)
def test_failed_retry_reports_406_then_dumps(baseline, tmp_path):
    out = str(tmp_path / "run")
    d = Decided(out, "choose:retry", args=["--steps", str(STEPS)],
                plan=FaultPlan.of(("raise-uce", 1, FAULT_IT), fail_repair="raise"), env=ENV)
    assert d.wait(150) == [EXIT_CODE_DUMPED] * 4, d.tail()
    results = [(c["code"], c["strategy"]) for c in d.calls() if c["kind"] == "report_result"]
    assert results == [(406, "retry"), (0, "dump")]  # retry failed; dump or exit remained; dump done


@pytest.mark.timeout(300)
def test_graceful_dump_on_request(baseline, tmp_path):
    """tft_notify_controller_dump: every rank stops at one step, dumps, the job exits with EXIT_CODE_DUMPED
    (reference: stop training, dump, exit); the relaunch continues bitwise."""
    out = str(tmp_path / "run")
    d = Decided(out, "dump", args=["--steps", "30", "--step-sleep", "0.1"], env=ENV)
    assert d.wait(150) == [EXIT_CODE_DUMPED] * 4, d.tail()
    calls = d.calls()
    assert _kinds(calls)[:4] == ["notify_dump", "report_fault_ranks", "report_stop_complete", "report_result"]
    assert calls[0]["rc"] == 0 and calls[1]["ranks"] == {} and (calls[3]["code"], calls[3]["strategy"]) == (0, "dump")
    with open(os.path.join(out, "ckpt", "latest")) as f:
        step = int(f.read())
    assert 3 <= step < 30
    _resume_is_bitwise(out, tmp_path, baseline, 30)

"""mindio-run with the controller in the launcher (--high-availability), on the toy job of
tests/recovery/_recover_toy.py (4 ranks, DP=4, ZeRO-1 Adam over 2 replica halves, real gloo):

* the launcher enables what the ranks registered for: worker reboot (``enable_arf``) under
  ``--high-availability dump`` alone recovers a SIGKILLed rank in place, bitwise;
* a planned dump + relaunch is reported as such, naming the fault that caused it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recovery"))
from test_recover_inplace import FAULT_IT, digest, fault_free_digest, run  # noqa: E402 (the toy's runner)

from tests._faultplan import FaultPlan  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_worker_reboot_registered_by_the_ranks_is_enabled_by_the_launcher(fault_free_run, tmp_path):
    code, text, events = run(tmp_path / "run", FaultPlan.of(("kill", 1, FAULT_IT), enable_arf=True), strategies="dump")
    assert code == 0, text[-6000:]
    adopted = [e for e in events if e["kind"] == "strategies_adopted"]
    assert adopted and set(adopted[0]["added"]) == {"recover-in-place", "recover"}, adopted
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "recover-in-place" and done[0]["replaced"] == [1], text[-6000:]
    assert digest(text) == fault_free_digest(fault_free_run)


@pytest.mark.timeout(300)
def test_a_dump_and_relaunch_is_reported_as_planned(tmp_path):
    # enable_uce=False: the ranks allow no retry (else this generic exception would be retried)
    code, text, _ = run(tmp_path / "run", FaultPlan.of(("raise-unknown", 1, 5), enable_uce=False), strategies="dump",
                        extra=["--max-restarts", "1"])
    assert code == 0, text[-6000:]
    line = next(ln for ln in text.splitlines() if ln.startswith("mindio-run: round 0"))
    print("\n" + line)
    assert "a last-words checkpoint was written (workers exited 75) after: rank 1 (node 0, " in line, line
    assert "ValueError: injected unknown error" in line, line
    assert line.endswith("relaunching every worker to resume from it (restart 1 of 1)"), line
    assert "restarting every worker" not in text and "round 0 failed" not in text


@pytest.mark.timeout(300)
def test_a_deterministic_exception_is_retried_once_dumped_once_and_not_relaunched_again(tmp_path):
    """Issue 33: rank 1 raises the same generic exception whenever it computes step 6 (a bug). Round 0:
    it is retried once (the step's work rolled back, no repair), raised again at the same step -> the dump
    (every worker exits 75). The relaunch resumes from that dump, meets the exception at step 6 again on
    rank 1: one line names the step, the rank and the exception, every worker exits 79 and mindio-run does
    not relaunch again although restarts remain."""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("raise-always", 1, 5)), strategies="dump",
                             extra=["--max-restarts", "2"], env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert code == 1, text[-6000:]
    assert text.count("[rank 1] injecting raise-always at step 5") == 3, text[-6000:]  # twice, then once relaunched
    decisions = [(e["strategy"], e["lock_step"]) for e in events if e["kind"] == "decision"]
    assert decisions == [("retry", 5), ("dump", 5)], decisions  # the relaunch decides nothing: it ends
    done = [e for e in events if e["kind"] == "retry_done"]
    assert len(done) == 1 and done[0]["repaired"] == [], done
    assert [e["step"] for e in events if e["kind"] == "retry_repeated"] == [6]
    line = next(ln for ln in text.splitlines() if ln.startswith("mindio-run: round 0"))
    assert "(workers exited 75) after: rank 1 (node 0" in line and "injected deterministic error" in line, line
    assert line.endswith("relaunching every worker to resume from it (restart 1 of 2)"), line
    repeated = [e for e in events if e["kind"] == "fault_repeated"]
    assert [(e["rank"], e["step"]) for e in repeated] == [(1, 6)], repeated
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("mindio-run: job failed: rank 1 (node 0, ") and "exited with exit code 79: ValueError: " \
        "injected deterministic error (rank 1, iteration 5) -- rank 1 raised it again at step 6" in last, last
    assert last.endswith("(restarts used: 1 of 2; not restarted: workers exited 79, a deterministic fault)"), last
    assert "round 1 failed" not in text and "restart 2 of 2" not in text
    # rank 1's record stays (a relaunch by hand meets the same answer), private, in its runtime directory
    records = list((tmp_path / f"mindio-faults-{os.geteuid()}").iterdir())
    assert [r.name.endswith(".rank1.json") for r in records] == [True], records

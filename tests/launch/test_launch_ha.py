"""mindio-run with the controller in the launcher (--high-availability), on the toy job of
tests/recovery/_recover_toy.py (4 ranks, DP=4, ZeRO-1 Adam over 2 replica halves, real gloo):

* the launcher enables what the ranks registered for: worker reboot (``enable_arf``) under
  ``--high-availability dump`` alone recovers a SIGKILLed rank in place, bitwise;
* a planned dump + relaunch is reported as such, naming the fault that caused it.
"""
from __future__ import annotations

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
    code, text, _ = run(tmp_path / "run", FaultPlan.of(("raise-unknown", 1, 5)), strategies="dump",
                        extra=["--max-restarts", "1"])
    assert code == 0, text[-6000:]
    line = next(ln for ln in text.splitlines() if ln.startswith("mindio-run: round 0"))
    print("\n" + line)
    assert "a last-words checkpoint was written (workers exited 75) after: rank 1 (node 0, " in line, line
    assert "ValueError: injected unknown error" in line, line
    assert line.endswith("relaunching every worker to resume from it (restart 1 of 1)"), line
    assert "restarting every worker" not in text and "round 0 failed" not in text

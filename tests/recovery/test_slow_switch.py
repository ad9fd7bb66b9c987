"""Issue #31, acting on a slow rank: with MINDIO_SLOW_ACTION=switch a rank named slow (sub-healthy) is
hot-switched to a new process by the controller itself, as a cluster brain would ask (docs/recovery.md,
"Slow ranks" and "hot switch"). Real processes under mindio-run (tests/recovery/_recover_toy.py, 4 ranks, gloo);
the test slows rank 1 from OUTSIDE (SIGSTOP 30 ms of every 100 ms on its process, nothing of mindio's
internals) from step 3 on: it is named, its process is replaced at a step boundary with no step lost, the
end state is bitwise equal to a fault-free run, and the step time is back within 10 % of the fault-free one."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_recover_inplace import _port, digest

from tests._exits import assert_no_signal_deaths, check_codes
from tests._outside import read_pulsed

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS = 30
pytestmark = pytest.mark.slow


def _job(out: Path, slow_rank: int = -1, from_step: int = 3):
    """One mindio-run job of the toy, 0.15 s steps; with ``slow_rank`` that rank's process is pulsed from
    ``from_step`` on (until it exits). Returns (output, events, {step: time rank 0 logged it})."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}", OMP_NUM_THREADS="1", TTP_LOG_STDOUT="1",
               MINDIO_EVENT_LOG=str(out / "events.jsonl"), MINDIO_SLOW_WINDOW="2", MINDIO_SLOW_K="2",
               MINDIO_SLOW_ACTION="switch")
    cmd = [sys.executable, "-m", "mindio.launch.cli", "--nproc-per-node", "4", "--master-port", str(_port()),
           "--high-availability", "recover-in-place,dump", str(HERE / "_recover_toy.py"), "--out", str(out),
           "--steps", str(STEPS), "--step-sleep", "0.15"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    at, pulsed = {}, []

    def pulse_from(line, lines):
        m = re.search(r"\[rank 0\] iteration (\d+)", line)
        if m:
            at[int(m.group(1))] = time.monotonic()
        if slow_rank >= 0 and not pulsed and m and int(m.group(1)) >= from_step:
            pids = [e["pid"] for e in _events(out) if e.get("rank") == slow_rank and "pid" in e]
            assert pids, "".join(lines[-40:])
            pulsed.append(pids[0])
            return pids[0]
        return None

    lines = read_pulsed(p, time.monotonic() + 120, pulse_from)
    text = "".join(lines)
    check_codes({"mindio-run": p.returncode}, what="process", context=text[-6000:])
    assert_no_signal_deaths(text)
    return text, _events(out), at


def _every_step_once(text: str) -> None:
    for r in range(4):  # workers share one pipe: a line may run into the next one's "[rank" or a timestamp
        its = [int(i) for i in re.findall(rf"\[rank {r}\] iteration (\d+?)(?=\[|\r?\n|\d{{4}}-\d\d-\d\d |$)", text)]
        assert sorted(its) == list(range(1, STEPS + 1)), (r, its)  # each step exactly once: none lost or redone


def _events(out: Path) -> list:
    f = out / "events.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def _step_s(at: dict, steps) -> float:
    return statistics.median(at[s] - at[s - 1] for s in steps if s in at and s - 1 in at)


@pytest.mark.timeout(300)
def test_a_rank_slowed_from_outside_is_hot_switched_out_with_no_step_lost(tmp_path):
    ref_text, _, ref_at = _job(tmp_path / "ref")
    text, events, at = _job(tmp_path / "slow", slow_rank=1)
    named = [e for e in events if e["kind"] == "rank_slow"]
    # the first named: rank 1's compute (a "communication" event names a group: no slow_rank)
    assert [(e.get("slow_rank"), e["cause"]) for e in named][:1] == [(1, "compute")], (named[:3], text[-6000:])
    assert [e["slow_rank"] for e in events if e["kind"] == "slow_switch" and e["accepted"]] == [1], text[-6000:]
    out = next(e for e in events if e["kind"] == "switched_out")
    assert out["ranks"] == [1], out
    _every_step_once(text)  # no step lost or redone
    assert digest(text) == digest(ref_text)  # bitwise equal to the fault-free run
    after = range(out["step"] + 3, STEPS + 1)  # steps after the switch (the backup trains at full speed)
    assert _step_s(at, after) <= 1.1 * _step_s(ref_at, after), (_step_s(at, after), _step_s(ref_at, after))

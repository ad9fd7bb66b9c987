"""recover-in-place end to end under mindio-run: a SIGKILLed rank is replaced alone, the job goes on.

Real processes: one mindio-run agent (node 0) hosting the controller as rank -1, 4 workers of the toy
job (_recover_toy.py: DP=4, ZeRO-1 Adam over 2 replica halves), gloo on loopback. A ``kill`` fault
SIGKILLs one rank while it computes a step; the agent sees the exit at once and tells the controller;
the survivors are cleaned and rebuild their groups in generation 1 together with a replacement that a
warm spare interpreter became; the replacement's shard comes from its replica; every rank rolls back
to the lock step and trains on. The job ends with exit 0 and the digest of the fault-free run.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindio._ports import free_port as _port  # outside the ephemeral range (mindio/_ports.py)
from tests._exits import assert_no_signal_deaths, check_codes
from tests._faultplan import FaultPlan
from mindio.ttp.wire import protocol as P
from mindio.ttp.controller.controller import Controller

HERE = Path(__file__).resolve().parent
TOY = HERE / "_recover_toy.py"
REPO = HERE.parents[1]
STEPS, FAULT_IT = 10, 7
pytestmark = pytest.mark.slow


def run(out: Path, plan: FaultPlan = FaultPlan(), strategies: str = "recover-in-place,dump", env=None, timeout=150,
        extra=(), sent=None):
    """One mindio-run job of the toy with the faults of ``plan`` (``extra``: more mindio-run flags);
    returns (exit code, output, events). Fails if a worker died by a signal neither ``plan`` nor
    ``sent`` ({rank: signal name}) explains (tests/_exits.py)."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.jsonl"
    e = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_LOG_STDOUT="1",
             MINDIO_EVENT_LOG=str(events), **(env or {}))
    cmd = [sys.executable, "-m", "mindio.launch.cli", "--nproc-per-node", "4", "--master-port", str(_port()),
           "--high-availability", strategies, *extra, str(TOY), "--out", str(out), "--steps", str(STEPS),
           *plan.argv()]
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # the agent's session: it and every worker it started
        text, _ = p.communicate()
        raise AssertionError(f"job did not end within {timeout} s (a hang):\n{text[-6000:]}")
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()] if events.exists() else []
    check_codes({"mindio-run": p.returncode}, what="process", context=text[-6000:])
    assert_no_signal_deaths(text, plan.sent(also=sent))
    return p.returncode, text, evs


def digest(text: str) -> str:
    found = re.findall(r"state-digest: ([0-9a-f]{64})", text)
    assert len(found) == 1, text[-4000:]
    return found[0]


def fault_free_digest(fault_free_run) -> str:
    """The digest of ``run(dir)`` without a fault: one run per session, shared with test_recover_node
    (same command line and environment)."""
    def ref(out):
        code, text, _ = run(out)
        assert code == 0, text[-4000:]
        return digest(text)
    return fault_free_run((str(TOY), "mindio.launch.cli", STEPS, "recover-in-place,dump"), ref)


@pytest.fixture(scope="module")
def reference(fault_free_run):
    # bounded by run()'s own timeout; the tests' pytest timeouts count only their own body (func_only):
    # counted with this setup, the first test to ask for it got 200 s for up to 150 s of reference + its job
    return fault_free_digest(fault_free_run)


@pytest.mark.timeout(200, func_only=True)  # the shared reference run has its own bound (run())
@pytest.mark.parametrize("victim", [1, 0])  # rank 0 too: the controller lives in the agent, not in it
def test_killed_rank_is_replaced_alone_and_bitwise(reference, tmp_path, victim):
    code, text, events = run(tmp_path / "run", FaultPlan.of(("kill", victim, FAULT_IT)))
    assert code == 0, text[-6000:]
    assert digest(text) == reference  # nothing lost, nothing corrupted
    kinds = [e["kind"] for e in events]
    dead = [e for e in events if e["kind"] == "rank_dead"]
    # declared dead by the launcher agent (it saw the exit) or the controller's same-host pid probe,
    # whichever is first -- not after missed heartbeats
    assert dead and dead[0]["dead_rank"] == victim and dead[0]["cause"] in ("agent", "pid"), dead
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["replaced"] == [victim] and done[0]["lock_step"] == FAULT_IT
    assert done[0]["strategy"] == "recover-in-place" and done[0]["gen"] == 1
    assert "round_failed" not in kinds  # no whole-job restart
    # the survivors kept their processes: every survivor's events come from one pid each
    pids = {}
    for e in events:
        if isinstance(e.get("rank"), int) and e["rank"] >= 0 and "pid" in e:
            pids.setdefault(e["rank"], set()).add(e["pid"])
    assert all(len(pids[r]) == 1 for r in range(4) if r != victim), pids
    assert len(pids[victim]) == 2, pids
    # no step lost: every step 1..STEPS completed on every rank, the replacement starting after the lock step
    for r in range(4):
        its = [int(i) for i in re.findall(rf"\[rank {r}\] iteration (\d+?)(?=\[|\r?\n|\d{{4}}-\d\d-\d\d |$)", text)]
        assert sorted(set(its)) == list(range(1, STEPS + 1)), (r, its)
    fault_t = next(e["t"] for e in events if e["kind"] == "fault_injected")
    assert dead[0]["t"] - fault_t < 1.5, dead[0]["t"] - fault_t  # heartbeats would take >= 3 s
    resumed = max(e["t"] for e in events if e["kind"] == "train_resumed")
    print(f"\nkill rank {victim}: fault -> every rank training again {resumed - fault_t:.3f} s; "
          f"{ {k: v for k, v in done[0].items() if k.endswith('_s')} }")
    assert resumed - fault_t < 30  # bounded, never the process-group timeout; the 2 s target: bench/


@pytest.mark.timeout(200, func_only=True)  # the shared reference run has its own bound (run())
def test_rank_stuck_after_the_stop_is_killed_and_replaced(reference, tmp_path):
    """Rank 1 is SIGKILLed while rank 2 hangs in the same step outside any collective: ranks 0 and 3
    are released and stop, rank 2 never does. MINDIO_STOP_STUCK_S (2 s here) after every other rank
    stopped, the controller SIGKILLs it, and recover-in-place replaces both; the run stays bitwise.
    Before, the stop gave rank 2 its full timeout and the recovery then failed."""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("kill", 1, FAULT_IT), ("hang", 2, FAULT_IT)),
                             env={"MINDIO_STOP_STUCK_S": "2"})
    assert code == 0, text[-6000:]
    stuck = [e for e in events if e["kind"] == "stop_stuck_killed"]
    assert [e["ranks"] for e in stuck] == [[2]], stuck
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and sorted(done[0]["replaced"]) == [1, 2] and done[0]["lock_step"] == FAULT_IT, done
    assert digest(text) == reference


@pytest.mark.timeout(200, func_only=True)  # the shared reference run has its own bound (run())
def test_survivors_held_before_an_update_another_made_finish_it_before_the_replacement(reference, tmp_path):
    """Rank 1 is SIGKILLed inside its optimizer update of iteration FAULT_IT while ranks 0 and 3 are late
    to their fence (the stop holds them there: state of step FAULT_IT) and rank 2 has already updated to
    step FAULT_IT + 1. Ranks 0 and 3 finish that update (``advance``, the reference's prelock; rank 2's
    all-gather completes with rank 3), so the lock step is FAULT_IT + 1 with nothing stale, and the
    replacement of rank 1 gets that step's shard from rank 3. (Before the prelock: lock step FAULT_IT,
    rank 2 repaired back to it.)"""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("kill-update", 1, FAULT_IT), fenced_late=(0, 3),
                                                         fence_step=FAULT_IT))
    assert code == 0, text[-6000:]
    assert digest(text) == reference  # nothing lost, nothing corrupted
    advanced = [e for e in events if e["kind"] == "advance"]
    assert [(a["step"], a["ranks"]) for a in advanced] == [(FAULT_IT + 1, [0, 3])], text[-6000:]
    assert not [e for e in events if e["kind"] == "mixed_steps"]
    done = [e for e in events if e["kind"] == "recover_done"]
    assert [(d["replaced"], d["stale"], d["lock_step"]) for d in done] == [([1], [], FAULT_IT + 1)], text[-6000:]


@pytest.mark.timeout(200)
def test_replica_killed_during_repair_falls_back_without_hang(tmp_path):
    """Cascading fault: the replica sending rank 1's shard dies in the middle of the repair. Both copies
    of that shard are gone, so neither recover nor a dump is possible: the job exits with a log line."""
    t0 = time.monotonic()
    code, text, events = run(tmp_path / "run", FaultPlan.of(("kill", 1, FAULT_IT), fail_repair="kill"),
                             sent={3: "SIGKILL"})  # the repair source (rank 1's replica) kills itself
    assert code != 0
    assert "recover failed at repair" in text, text[-6000:]
    fallback = [e for e in events if e["kind"] == "fallback"]
    assert fallback and fallback[0]["src"] == "recover-in-place", fallback
    assert time.monotonic() - t0 < 120


@pytest.mark.timeout(200)
def test_a_repair_handler_that_raises_falls_back_to_a_dump(tmp_path):
    """A faulty real object: the replica's repair handler (tft_register_repair_handler) raises while it
    should send rank 1's shard to the replacement. The sequence abandons (the new generation's groups
    are destroyed, so the replacement waiting to receive is released), recover-in-place returns FAILED
    and the controller falls back to the dump: rank 1's shard is still on rank 3, so the lock step is
    saved and every rank exits 75."""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("kill", 1, FAULT_IT), fail_repair="raise"))
    assert code != 0
    assert "exiting with code 75" in text, text[-6000:]  # dumped
    failed = [e for e in events if e["kind"] == "recover_failed"]
    assert failed and failed[0]["step_name"] == "repair", failed
    fallback = [e for e in events if e["kind"] == "fallback"]
    assert fallback and fallback[0]["src"] == "recover-in-place" and fallback[0]["dst"] == "dump", fallback
    lock = next(e for e in events if e["kind"] == "decision")["lock_step"]
    assert (tmp_path / "run" / "ckpt" / "latest").read_text() == str(lock)  # the lock step, complete


@pytest.mark.timeout(200)
def test_replacement_dying_at_start_falls_back_at_once(tmp_path):
    """The spare that takes the dead rank fails before joining: the survivors waiting in the rebuild are
    cleaned and the job falls back to a dump at once, not after the recover timeout (60 s)."""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("kill", 1, FAULT_IT), replacement_fails="start"))
    assert code != 0
    assert "exiting with code 75" in text, text[-6000:]  # dumped: rank 1's shard is on rank 3
    died = [e for e in events if e["kind"] == "replacement_died"]
    assert died and died[0]["dead_rank"] == 1, text[-4000:]
    failed = [e for e in events if e["kind"] == "recover_failed"]
    fallback = [e for e in events if e["kind"] == "fallback"]
    assert failed and fallback and fallback[0]["src"] == "recover-in-place" and fallback[0]["dst"] == "dump"
    assert failed[0]["t"] - died[0]["t"] < 5  # at once, not at the 60 s deadline


def test_stale_generation_is_refused():
    """A frame from a replaced rank's old process (older generation) is dropped and counted."""
    ctl = Controller(rank=-1, world_size=4, enabled={"recover-in-place"}, key=b"k" * 32)

    class Replacer:
        def possible(self, ranks, strategy):
            return True

    ctl.attach_replacer(Replacer())
    rep = ctl.replacements
    rep.replaced[1] = 2  # rank 1 was replaced in generation 2
    old = P.Envelope(P.MsgType.HEARTBEAT, P.Heartbeat(step=3, data_status=0), rank=1, gen=1)
    new = P.Envelope(P.MsgType.HEARTBEAT, P.Heartbeat(step=3, data_status=0), rank=1, gen=2)
    other = P.Envelope(P.MsgType.HEARTBEAT, P.Heartbeat(step=3, data_status=0), rank=2, gen=0)
    assert rep.refuse_stale(old) and rep.stale_refused == 1
    assert not rep.refuse_stale(new) and not rep.refuse_stale(other)
    reg = P.Envelope(P.MsgType.REGISTER, P.Register(world_size=4, pid=1, host="h"), rank=1, gen=0)
    assert rep.refuse_stale(reg) and rep.stale_refused == 2


def test_replacement_process_fires_no_drill_without_a_shared_dir(tmp_path):
    """A replacement re-runs the step its predecessor faulted at: without MINDIO_DRILL_DIR it must not
    fire the fault again (a kill loop); with the directory, the marker decides."""
    from mindio.drill import Drill

    Drill("raise:rank=1,step=7", environ={"MINDIO_REBOOT_GEN": "1"}).maybe_fire(7, 1)  # nothing raised
    with pytest.raises(RuntimeError, match="injected fault"):
        Drill("raise:rank=1,step=7", environ={}).maybe_fire(7, 1)
    env = {"MINDIO_REBOOT_GEN": "1", "MINDIO_DRILL_DIR": str(tmp_path)}
    with pytest.raises(RuntimeError, match="injected fault"):
        Drill("raise:rank=1,step=7", environ=env).maybe_fire(7, 1)  # not fired yet in this job
    Drill("raise:rank=1,step=7", environ=env).maybe_fire(7, 1)  # fired already: nothing

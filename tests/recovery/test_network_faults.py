"""Network faults on one host: a peer gone without a reset, the hang detector after a recovery.

A host that dies silently (power, panic, NIC) or drops off the network sends no TCP reset: its peers
stay blocked in gloo until the group timeout (the toy's: 120 s). On one host a SIGSTOPped process is
that peer (its sockets stay open), with MINDIO_PID_PROBE=0 so that only heartbeats can find it: the
controller declares it dead after MINDIO_HEARTBEAT_MISSES x MINDIO_HEARTBEAT_INTERVAL s (3 s), and the
survivors blocked in a collective with it are released by mindio (processor ``unblock``: they shut
their own collective connections down), never SIGKILLed while they hold the only copy of a shard.

Real processes: mindio-run agents, the toy job of _recover_toy.py (DP=4, ZeRO-1 Adam over 2 replica
halves; shard k on ranks k and k+2), gloo on loopback.
"""
from __future__ import annotations

import pytest

from test_recover_inplace import STEPS, FAULT_IT, digest, fault_free_digest, run
from _two_nodes import two_nodes

from tests._exits import assert_no_signal_deaths, check_codes
from tests._faultplan import FaultPlan

pytestmark = pytest.mark.slow
SILENT = {"MINDIO_PID_PROBE": "0"}  # only heartbeats see the stopped rank: as from another host


@pytest.fixture(scope="module")
def reference(fault_free_run):
    return fault_free_digest(fault_free_run)


def _first(events, kind, **match):
    return next((e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())), None)


@pytest.mark.timeout(200)
def test_silent_death_releases_survivors_and_recovers_in_place(reference, tmp_path):
    """Rank 3 freezes (SIGSTOP) at step FAULT_IT; ranks 0-2 block in the gradient all-reduce with it.
    Heartbeats declare it dead; the survivors are released from the collective by ``unblock`` (not by
    the gloo timeout, not SIGKILLed as "stuck": rank 1 holds the only live copy of shard 1), the agent
    kills the frozen process and recover-in-place replaces it; the run stays bitwise."""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("stop", 3, FAULT_IT)), env=SILENT)
    assert code == 0, text[-6000:]
    assert digest(text) == reference
    dead = _first(events, "rank_dead")
    assert dead and dead["dead_rank"] == 3 and dead["cause"] == "heartbeat", dead
    unblocked = _first(events, "stop_unblocked")
    assert unblocked and unblocked["still"] == [] and set(unblocked["ranks"]) <= {0, 1, 2}, unblocked
    assert not [e for e in events if e["kind"] in ("stop_stuck_killed", "killed_as_hung")], text[-6000:]
    done = [e for e in events if e["kind"] == "recover_done"]
    assert [(d["strategy"], d["replaced"]) for d in done] == [("recover-in-place", [3])], done
    fault_t = _first(events, "fault_injected")["t"]
    resumed = max(e["t"] for e in events if e["kind"] == "train_resumed")
    print(f"\nsilent death of rank 3: declared dead {dead['t'] - fault_t:.2f} s after the freeze, survivors "
          f"released {unblocked['t'] - fault_t:.2f} s after, training again {resumed - fault_t:.2f} s after")
    assert unblocked["t"] - fault_t < 60  # released by mindio, long before the toy's 120 s gloo timeout


@pytest.mark.timeout(200)
def test_hang_detector_after_a_recovery_blames_nobody_else(reference, tmp_path):
    """MINDIO_HANG_TIMEOUT=5: rank 1 hangs outside any collective at step FAULT_IT, is declared hung
    and SIGKILLed, and recover-in-place replaces it. The survivors were parked by the recovery for
    longer than the timeout; once training resumes none of them is hung (the progress clock restarts
    when the controller is NORMAL again). Before: they were declared hung 0.2 s after the resume."""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("hang", 1, FAULT_IT)), env={"MINDIO_HANG_TIMEOUT": "5"})
    assert code == 0, text[-6000:]
    assert [e["hung_rank"] for e in events if e["kind"] == "rank_hung"] == [1], text[-6000:]
    done = [e for e in events if e["kind"] == "recover_done"]
    assert [(d["strategy"], d["replaced"]) for d in done] == [("recover-in-place", [1])], done
    assert digest(text) == reference


@pytest.mark.timeout(200)
def test_partitioned_node_ends_in_a_dump_from_the_survivors(tmp_path):
    """Two agents (2 ranks each), no standby. Rank 2 freezes its whole node at step FAULT_IT (SIGSTOP
    of node 1's process group: agent and workers), which node 0 sees as a partition that does not heal.
    No rank can be replaced (node 1's agent is silent, no standby), so the controller's node-0 ranks,
    blocked in a collective with node 1 and holding a copy of every shard, are released and dump:
    exit 75 and a complete checkpoint -- never exit 76 with nothing saved."""
    out = tmp_path / "run"
    codes, texts, evs = two_nodes(out, ["--steps", str(STEPS), "--step-sleep", "0.1",
                                        *FaultPlan.of(("stop-node", 2, FAULT_IT)).argv()],
                                  "recover-in-place,recover,dump", SILENT, wait_for="node0")
    text0 = texts["node0"]
    check_codes(codes, {"node1": "SIGKILL"}, what="agent", context=text0[-6000:])
    assert_no_signal_deaths(text0, {})
    assert codes["node0"] == 75, text0[-6000:]  # EXIT_CODE_DUMPED: the last words were saved
    ckpt = out / "ckpt"
    step = int((ckpt / "latest").read_text())
    assert step == FAULT_IT and sorted(p.name for p in (ckpt / f"iter_{step:07d}").iterdir()) == \
        ["shard0.pt", "shard1.pt"], text0[-6000:]
    assert not [e for e in evs if e["kind"] in ("stop_stuck_killed", "killed_as_hung")], text0[-6000:]
    unblocked = _first(evs, "stop_unblocked")
    assert unblocked and unblocked["still"] == [] and set(unblocked["ranks"]) <= {0, 1}, unblocked
    fault_t = _first(evs, "fault_injected")["t"]
    saved = _first(evs, "transition", dst="EXIT")
    print(f"\nnode 1 frozen: survivors released {unblocked['t'] - fault_t:.2f} s, dump complete "
          f"{saved['t'] - fault_t:.2f} s after the freeze")


@pytest.mark.timeout(200)
def test_outage_within_the_tolerance_is_no_death(reference, tmp_path):
    """Rank 3 is frozen for 3 s (SIGSTOP, then SIGCONT): longer than the default tolerance (3 missed
    1 s beats, counting the beat interval before the freeze), inside the one the job set with
    MINDIO_HEARTBEAT_MISSES=6 (6 s). Nobody is declared dead, nothing recovers, the run is bitwise."""
    code, text, events = run(tmp_path / "run", FaultPlan.of(("freeze", 3, FAULT_IT), freeze_s=3),
                             env={**SILENT, "MINDIO_HEARTBEAT_MISSES": "6"})
    assert code == 0, text[-6000:]
    assert _first(events, "fault_injected"), text[-4000:]
    assert not [e for e in events if e["kind"] in ("rank_dead", "rank_hung", "decision")], text[-6000:]
    assert digest(text) == reference

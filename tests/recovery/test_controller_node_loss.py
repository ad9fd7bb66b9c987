"""Node 0 lost (its agent, the controller it hosts, both stores and its ranks): the backup controller in
node 1's agent (MINDIO_BACKUP_CONTROLLERS=1) takes over and ends the job with a last-words checkpoint
from the surviving replicas, one line on node 1's console, exit 75. Without that knob the backup is
provisional (node 0's TCPStore: a partition cannot be told from node 0's loss): the same dump, never made
the latest.

Real processes on one host: two mindio-run agents (2 ranks each) of the toy job (_recover_toy.py: DP=4,
ZeRO-1 Adam over 2 replica halves; shard k on ranks k and k+2, so node 1 holds a copy of every shard),
gloo on loopback. Rank 0 SIGKILLs its own agent at step FAULT_IT (``kill-node``; node 0's workers die
with it): node 1's store connections and gloo connections are reset, as when a host dies with its kernel
still sending resets (scripts/drills.sh does the same across network namespaces).
"""
from __future__ import annotations

import re
import signal

import pytest

from _two_nodes import two_nodes

from tests._exits import check_codes
from tests._faultplan import FaultPlan

pytestmark = pytest.mark.slow
STEPS, FAULT_IT = 40, 12


def _run(out, strategies="retry,recover-in-place,recover,dump", env=None, **settings):
    """Node 0's agent is SIGKILLed by its own rank 0 (the fault); node 1's ends by itself. ``settings``:
    more of the toy's fault plan (tests/_faultplan.py); ``env``: the agents' (default: a full backup)."""
    plan = FaultPlan.of(("kill-node", 0, FAULT_IT), **settings)
    codes, texts, evs = two_nodes(out, ["--steps", str(STEPS), "--step-sleep", "0.1", *plan.argv()], strategies,
                                  {"MINDIO_BACKUP_CONTROLLERS": "1"} if env is None else env, wait_for="node1")
    check_codes(codes, {"node0": "SIGKILL"}, what="agent", context=texts["node1"][-6000:])
    assert codes["node0"] == -signal.SIGKILL, texts["node0"][-3000:]
    return codes["node1"], texts["node1"], texts["node0"], evs


def _first(events, kind, **match):
    return next((e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())), None)


@pytest.mark.timeout(200)
def test_node0_lost_backup_controller_dumps_from_node1(tmp_path):
    """Every shard has a copy on node 1: the backup takes over, ranks 2 and 3 save step FAULT_IT, node 1's
    agent says so in one line and exits 75; workers 2 and 3 exited 75 (not stopped by the agent)."""
    out = tmp_path / "run"
    code, text1, text0, evs = _run(out)
    assert code == 75, text1[-6000:]
    said = re.findall(r"^mindio-run: node 0 lost.*$", text1, re.M)
    assert len(said) == 1 and "saved a last-words checkpoint at step" in said[0], text1[-6000:]
    assert "Traceback" not in text1, text1[-6000:]
    ckpt = out / "ckpt"
    step = int((ckpt / "latest").read_text())
    assert step >= FAULT_IT - 1, text1[-6000:]
    assert sorted(p.name for p in (ckpt / f"iter_{step:07d}").iterdir()) == ["shard0.pt", "shard1.pt"]
    took = _first(evs, "backup_takeover")
    assert took and took["ranks"] == 2, text1[-6000:]
    # the workers ended by themselves (the backup's exit order after the dump), not stopped by their agent
    assert re.search(r"workers' exit codes: rank 2: exit code 75, rank 3: exit code 75\n", text1), text1[-6000:]
    fault_t = _first(evs, "fault_injected")["t"]
    dumped = _first(evs, "backup_dumped")
    print(f"\nnode 0 killed: backup took over {took['t'] - fault_t:.2f} s, checkpoint of step {step} complete "
          f"and node 1's agent done {dumped['t'] - fault_t:.2f} s after the kill")


@pytest.mark.timeout(200)
def test_node0_lost_without_a_surviving_copy_saves_nothing(tmp_path):
    """The job declares no replica (declared_replicas=1: each rank holds the only copy of its shard, as
    in a job without replicas): node 0's loss takes shards 0 and 1 with it. The backup takes over, finds
    no surviving copy of them and ends the job without a checkpoint: one line says so, nothing is made
    the latest checkpoint, ranks 2 and 3 exit 76, node 1's agent exits 1."""
    out = tmp_path / "run"
    code, text1, text0, evs = _run(out, declared_replicas=1)
    assert code == 1, text1[-6000:]
    said = re.findall(r"^mindio-run: node 0 lost.*$", text1, re.M)
    assert len(said) == 1 and "no surviving copy of shard" in said[0] and "nothing was saved" in said[0], text1[-6000:]
    assert not (out / "ckpt" / "latest").exists(), text1[-6000:]
    assert re.search(r"workers' exit codes: rank 2: exit code 76, rank 3: exit code 76", text1), text1[-6000:]


@pytest.mark.timeout(200)
def test_node0_lost_by_default_a_provisional_dump_never_the_latest(tmp_path, monkeypatch):
    """No MINDIO_BACKUP_CONTROLLERS: on node 0's TCPStore node 1 hosts a provisional backup (it cannot tell
    node 0's loss from being cut off from it: launch/backup.py). It takes over and ranks 2, 3 save step
    FAULT_IT's state from the surviving replicas as always, but the toy's rename handler -- which would make
    it the latest -- is not run: the shards stay in iter_<step>.tmp, no ``latest``; one line says so, exit 75."""
    monkeypatch.delenv("MINDIO_BACKUP_CONTROLLERS", raising=False)
    out = tmp_path / "run"
    code, text1, text0, evs = _run(out, env={})
    assert code == 75, text1[-6000:]
    said = re.findall(r"^mindio-run: node 0 lost.*$", text1, re.M)
    assert len(said) == 1 and "saved a provisional last-words checkpoint at step" in said[0], text1[-6000:]
    assert "the rename handler, which would make it the latest, was not run" in said[0], said[0]
    assert "dump of step" in text1 and "the rename handler is not run" in text1, text1[-6000:]
    ckpt = out / "ckpt"
    assert not (ckpt / "latest").exists(), text1[-6000:]
    written = sorted(p.name for p in ckpt.iterdir())
    assert len(written) == 1 and written[0].endswith(".tmp"), written
    assert int(written[0][len("iter_"):-len(".tmp")]) >= FAULT_IT - 1, written
    assert sorted(p.name for p in (ckpt / written[0]).iterdir()) == ["shard0.pt", "shard1.pt"]
    assert [e.get("provisional") for e in evs if e["kind"] == "backup_dumped"] == [True], text1[-4000:]

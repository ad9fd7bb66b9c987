"""recover-in-place on the Megatron example (examples/megatron/pretrain_gpt.py) under mindio-run.

4 ranks on CPU/gloo, distributed optimizer with replicas (DP=4, R=2; and TP=2 x DP=2, R=2). Node 0's
agent hosts the controller (``--high-availability recover-in-place,dump``); ``--inject
kill:rank=1,step=7`` SIGKILLs rank 1 while it computes step 7. Only rank 1 is started again (a warm
spare; it skips ``--load``, builds its model and optimizer with Megatron's normal init order on the
survivors' new generation, parks); its optimizer shard and scalar state come from its DP replica; every
rank rolls back to step 6 and re-enters train(). The job exits 0 with the digest of the same run
without the fault: parameters and optimizer state bitwise equal, no step lost.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from _mgt_launch import (PRETRAIN, assert_relaunch_reproduces, assert_steps_logged_once, digests,  # noqa: E402
                         ha_reference, losses, torchrun, SLOW_MEGATRON)
from test_recover_node import run_nodes  # noqa: E402

from tests._faultplan import FaultPlan  # noqa: E402
from tests._samples import assert_data_order  # noqa: E402

pytestmark = SLOW_MEGATRON

ITERS = 10
FAULTY = Path(__file__).resolve().parents[1] / "megatron" / "_faulty_handlers.py"
BASE = ["--use-distributed-optimizer", "--enable-high-availability", "--no-dump", "--train-iters", ITERS,
        "--seed", 1234]
LAUNCH = "mindio.launch.cli"


def _run(args, tmp_path, name, env=None):
    events = tmp_path / f"{name}.jsonl"
    out = torchrun(PRETRAIN, args, timeout=330, launcher=LAUNCH,
                   env={"HIGH_AVAILABILITY": "recover-in-place,dump", "MINDIO_EVENT_LOG": str(events),
                        "MINDIO_DRILL_DIR": str(tmp_path), "TTP_LOG_PATH": str(tmp_path / "logs"), **(env or {})})
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()] if events.exists() else []
    return out, evs


def _reference(fault_free_run, layout):
    """Output of the fault-free run of ``BASE + layout``: one per layout and session, shared by the
    recover-in-place and recover tests, and by test_retry_megatron.py (_mgt_launch.ha_reference)."""
    return ha_reference(fault_free_run, BASE + layout)


@pytest.mark.timeout(800)
@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", 2, "--replica-cnt", 2]],
                         ids=["dp4", "tp2xdp2"])
def test_megatron_recover_in_place_is_bitwise(tmp_path, layout, fault_free_run):
    ref = _reference(fault_free_run, layout)
    out, evs = _run(BASE + layout + ["--inject", "kill:rank=1,step=7", "--log-samples", tmp_path / "s"],
                    tmp_path, "run")
    assert "injecting kill at step 7" in out
    done = [e for e in evs if e["kind"] == "recover_done"]
    assert len(done) == 1, out[-6000:]
    assert done[0]["strategy"] == "recover-in-place" and done[0]["replaced"] == [1]
    assert done[0]["lock_step"] == 6
    assert not [e for e in evs if e["kind"] == "round_failed"]  # no whole-job restart
    assert sorted(losses(out)) == list(range(1, ITERS + 1))  # no step lost (rank 0 prints each once)
    fault_t = next(e["t"] for e in evs if e["kind"] == "fault_injected")
    resumed = max(e["t"] for e in evs if e["kind"] == "train_resumed")
    print(f"\nmegatron {layout or 'dp4'}: kill -> every rank training again {resumed - fault_t:.3f} s; "
          f"{ {k: v for k, v in done[0].items() if k.endswith('_s')} }")
    assert digests(out)[-1] == digests(ref)[-1]
    assert_data_order(tmp_path / "s", ref.samples, ITERS)  # the replacement logs into the killed rank's file


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", 2, "--replica-cnt", 2]],
                         ids=["dp4", "tp2xdp2"])
def test_megatron_recover_node_is_bitwise(tmp_path, layout, fault_free_run):
    """recover: nodes of 2 ranks + a standby; node 1 (ranks 2, 3) is killed at step 7; the standby takes
    its ranks in the running round, repaired from their replicas on node 0 (DP=4 R=2: shards of 2, 3
    live on 0, 1; TP=2 x DP=2: ranks 2, 3 are DP replicas of 0, 1)."""
    ref = _reference(fault_free_run, layout)
    tail = [str(PRETRAIN), *map(str, BASE + layout), "--inject", "kill-node:node=1,step=7",
            "--log-samples", str(tmp_path / "s")]
    res, evs = run_nodes(tmp_path / "run", FaultPlan(), "recover,dump", timeout=600, tail=tail,
                         env={"MINDIO_DRILL_DIR": str(tmp_path), "MINDIO_ACP_IDLE_EXIT": "20"})
    code0, out = res["node0"]
    assert code0 == 0, out[-6000:]
    done = [e for e in evs if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "recover" and done[0]["replaced"] == [2, 3], out[-4000:]
    assert done[0]["lock_step"] == 6
    assert not [e for e in evs if e["kind"] == "round_failed"]
    assert_steps_logged_once(out, ITERS, node_lost_at=6)  # the lock step's line may be cut by the node loss
    fault_t = next(e["t"] for e in evs if e["kind"] == "fault_injected")
    resumed = max(e["t"] for e in evs if e["kind"] == "train_resumed")
    print(f"\nmegatron {layout or 'dp4'}: kill node 1 -> every rank training again {resumed - fault_t:.3f} s; "
          f"{ {k: v for k, v in done[0].items() if k.endswith('_s')} }")
    assert digests(out)[-1] == digests(ref)[-1]
    assert_data_order(tmp_path / "s", ref.samples, ITERS)


@pytest.mark.timeout(900)
def test_dump_after_a_failed_recover_in_place_comes_from_the_replica_not_the_replacement(tmp_path, fault_free_run):
    """recover-in-place that fails after the replacement's rebuild falls back to a dump, which must cover the
    killed rank's shard from its replica: the replacement holds no trained state (its params are not set
    until a rollback; mindio.megatron.checkpoint.save_dump refuses on it), the replica does (the state dict
    its clean() kept at the fault). DP=4 R=2: rank 0 (shard 0, the lowest rank, the one that would write
    common.pt and rename) is SIGKILLed at step 7; its replacement joins, rebuilds and parks; rank 2 -- rank
    0's replica, the repair source -- has a repair handler that raises (_faulty_handlers.py), so the repair
    fails, every rank is cleaned again and the controller dumps step 6 by ranks 1 and 2. Every process
    exits as expected, the dump is complete, and a --load relaunch from it ends bitwise equal to the
    fault-free run."""
    ref = _reference(fault_free_run, [])
    ckpt = tmp_path / "ckpt"
    args = [a for a in BASE if a != "--no-dump"] + ["--save", ckpt, "--inject", "kill:rank=0,step=7",
                                                    "--log-samples", tmp_path / "s"]
    events = tmp_path / "run.jsonl"
    code, out = torchrun(FAULTY, args, timeout=330, launcher=LAUNCH, check=False,
                         env={"HIGH_AVAILABILITY": "recover-in-place,dump", "MINDIO_EVENT_LOG": str(events),
                              "MINDIO_DRILL_DIR": str(tmp_path), "TTP_LOG_PATH": str(tmp_path / "logs"),
                              "FAULTY_HANDLERS": "repair@2"})
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    assert code == 75, out[-6000:]  # mindio-run: the job stopped with a last-words checkpoint
    # every worker: the original rank 0 by the injected SIGKILL, then its replacement and ranks 1-3 by the
    # controller's exit order (none stopped by the agent)
    exits = [(e["dead_rank"], e["code"]) for e in evs if e["kind"] == "worker_exited"]
    assert exits[:1] == [(0, -9)] and all(c == 75 for _r, c in exits[1:]), (exits, out[-6000:])
    agent_log = "".join(p.read_text() for p in (tmp_path / "logs").glob("ttp_log.log*"))  # TTP_LOG_PATH, INFO
    assert ("workers' exit codes: rank 0: exit code 75, rank 1: exit code 75, rank 2: exit code 75, "
            "rank 3: exit code 75\n") in agent_log, out[-6000:]
    assert [e["step_name"] for e in evs if e["kind"] == "recover_failed"] == ["repair"], out[-6000:]
    assert ("recover-in-place", "dump") in [(e["src"], e["dst"]) for e in evs if e["kind"] == "fallback"]
    assert not [e for e in evs if e["kind"] in ("recover_done", "dump_replanned", "dump_impossible")]
    decision = next(e for e in evs if e["kind"] == "decision")
    assert decision["lock_step"] == 6 and decision["save_info"] == [{"type": 0, "ranks": [1, 2]}], decision
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    # written by the replica of rank 0's shard (rank 2, with the model weights) and by rank 1, never by the
    # replacement
    pieces = sorted(p.name for p in (ckpt / "iter_0000006").glob("__*.mindio.json"))
    assert pieces == ["__1.mindio.json", "__2.mindio.json"], pieces
    assert_relaunch_reproduces(ckpt, 6, BASE, ref, tmp_path, ITERS, samples=tmp_path / "s")
    assert_data_order(tmp_path / "s", ref.samples, ITERS)  # steps 1-6 before the dump, 7-10 after the relaunch


@pytest.mark.timeout(600)
def test_node0_lost_on_its_tcpstore_leaves_a_provisional_checkpoint_that_resumes_bitwise(tmp_path, fault_free_run):
    """Node 0 (controller, both stores, ranks 0 and 1) SIGKILLed at step 7, no standby, no
    MINDIO_BACKUP_CONTROLLERS: node 1's agent hosts a provisional backup controller (launch/backup.py: on node
    0's TCPStore it cannot tell node 0's loss from being cut off). It takes over and ranks 2, 3 -- DP=4 R=2:
    a copy of every shard -- dump step 6 through the Megatron adapter under <save>/mindio-provisional, a
    complete checkpoint with its own tracker file, never the job's latest; node 1's line says so. A --load
    of that directory ends bitwise equal to the fault-free run."""
    ref = _reference(fault_free_run, [])
    ckpt = tmp_path / "ckpt"
    args = [a for a in BASE if a != "--no-dump"] + ["--save", ckpt, "--inject", "kill-node:node=0,step=7"]
    res, evs = run_nodes(tmp_path / "run", FaultPlan(), "recover-in-place,recover,dump", timeout=400,
                         tail=[str(PRETRAIN), *map(str, args)], standby=False, killed={"node0": "SIGKILL"},
                         env={"MINDIO_DRILL_DIR": str(tmp_path), "MINDIO_ACP_IDLE_EXIT": "20"})
    code1, out1 = res["node1"]
    assert code1 == 75, out1[-6000:]
    said = re.findall(r"^mindio-run: node 0 lost.*$", out1, re.M)
    assert len(said) == 1 and "saved a provisional last-words checkpoint at step 6" in said[0], out1[-6000:]
    assert "the checkpoint directory mindio-provisional/ inside the job's own" in said[0], said[0]
    assert [e["provisional"] for e in evs if e["kind"] == "backup_dumped"] == [True], out1[-4000:]
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists() and not list(ckpt.glob("iter_*"))
    provisional = ckpt / "mindio-provisional"
    assert (provisional / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert_relaunch_reproduces(provisional, 6, BASE, ref, tmp_path, ITERS)

"""Elastic training (downgrade / upgrade) on the Megatron example, real processes on gloo.

DP=4 with optimizer replicas (2 instances: ranks [0,1] and [2,3], each a full sharded copy). The drill
SIGKILLs rank 3 at step 7 and no standby exists: the controller removes the instance [2,3] (rank 2 exits
77), rebuilds a 2-rank world and training goes on at DP=2 with 2 micro-batches per step (same global
batch; each step paced by _elastic_paced.py while downgraded, up to 4 s and cut short at the upgrade's
fence: unpaced, the 54 remaining steps took ~1.5 s and the job could end before the standbys came up on
a loaded machine). Two standby processes, started by the test at the beginning (warm, like spares) and
released once the downgrade is done ("a node came back"), register for ranks 2 and 3: the controller pauses the
survivors at a step, rebuilds the 4-rank world, repairs the new ranks from their replicas, rolls back and
training goes on at DP=4; ``--check-replicas`` checks after every step that every replica of every
optimizer shard is bitwise identical (digests all-gathered across each replica pair). With
MINDIO_DUMP_AFTER_UPGRADE=1 the controller writes a checkpoint right after the scale-out; relaunched
(DP=4) it reproduces the continuing run bit for bit (every later loss, the final digest).

Loss bound ("normal run-to-run noise"): the fault-free run with another seed (init and data order) is the
noise scale; the elastic run must stay much closer to the same-seed fault-free run than that: mean
|delta loss| over the steps after the fault <= 10 % of the seed-to-seed mean, and every step's relative
difference < 1 %. (Mathematically the DP=2 x 2 micro-batch gradient equals the DP=4 one; only the fp32
summation order differs, so the curves agree to ~1e-6 until the scale-out and drift only by rounding.)
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _mgt_launch import (PRETRAIN, REPO, LAYOUT_ITERS, _kill_tree, free_port, layout_args, layout_reference,
                         losses, reference_run, assert_relaunch_reproduces, SLOW_MEGATRON)

from mindio.launch import forkserver
from tests._exits import check_codes, injected, sent_by_faults
from tests._samples import assert_data_order

pytestmark = SLOW_MEGATRON

ITERS = 60
ARGS = ["--use-distributed-optimizer", "--enable-elastic-training", "--train-iters", ITERS]
STANDBY = Path(__file__).resolve().parent / "_elastic_standby.py"
PACED = Path(__file__).resolve().parent / "_elastic_paced.py"
FAILING = Path(__file__).resolve().parent / "_elastic_failing.py"


def _events(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _launch_elastic(tmp: Path, args: list, timeout: float = 420, standbys=(2, 3), script: Path = PRETRAIN,
                    env_extra=None) -> dict:
    """4 ranks of ``script`` started directly (torchrun would stop the survivors when rank 3 dies) + a
    standby for each rank of ``standbys`` (the ranks the downgrade removes).

    The ranks are forked by a fork server of mindio-run's (mindio/launch/forkserver.py), the standbys by
    another: one interpreter per script imports torch and megatron-core (~3 CPU-s) instead of each of the
    4-6 processes; each child then runs its script as ``__main__`` with its rank's environment, as
    mindio-run starts its workers (tests/ttp/_harness.py does the same for the toy job). Where it cannot
    fork, each process is exec'd as before. With the fork-server host of tests/conftest.py the servers are
    forked from it, warm: their environment sets nothing the host's lacks that imports read (a PYTHONWARNINGS
    here made the host refuse both, ~3 CPU-s each; a worker's warnings go to its .out file, as under mindio-run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TTP_PORT": str(free_port()), "WORLD_SIZE": "4",
           "LOCAL_WORLD_SIZE": "4", "HIGH_AVAILABILITY": "elastic-training,dump", "MINDIO_ACP_IDLE_EXIT": "20",
           "MINDIO_EVENT_LOG": str(tmp / "events.jsonl"), "TTP_LOG_PATH": str(tmp / "logs"),
           "ELASTIC_TEST_GO": str(tmp / "go"), "MINDIO_DUMP_AFTER_UPGRADE": "1",
           "MINDIO_DRILL_DIR": str(tmp),
           "MINDIO_PRELOAD": "mindio.megatron", **(env_extra or {})}  # each --inject fault fires once per job
    servers: list = []

    def start(target: Path, rank: int, name: str):
        out = str(tmp / f"{name}.out")
        server = next((s for s in servers if s.args[-1] == str(target)), None)
        if server is None and not forkserver.unusable(env):
            server = forkserver.ForkServer([str(target)], env)
            servers.append(server)
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        worker = server and server.take({"env": rank_env, "argv": list(map(str, args)), "stdout": out,
                                         "stderr": out})
        if worker is None:  # no fork server, or it cannot fork here: exec the process
            worker = subprocess.Popen([sys.executable, "-W", "ignore", str(target), *map(str, args)],
                                      stdout=open(out, "w"), stderr=subprocess.STDOUT,
                                      env={**env, **rank_env}, start_new_session=True)
        return worker

    procs, sbs = [], []
    try:
        for r in range(4):
            procs.append(start(script, r, f"rank{r}"))
        for r in standbys:
            sbs.append(start(STANDBY, r, f"standby{r}"))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not (tmp / "go").exists() and any(e["kind"] == "downgrade_done" for e in _events(tmp / "events.jsonl")):
                (tmp / "go").touch()  # the removed ranks' resources are back: the standbys register
            if all(p.poll() is not None for p in procs + sbs):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"elastic job timed out after {timeout} s:\n" + (tmp / "rank0.out").read_text()[-6000:])
    finally:
        for p in procs + sbs:
            if p.poll() is None:
                _kill_tree(p)
        server_codes = [_close(s) for s in servers]
    out = (tmp / "rank0.out").read_text()
    check_codes([p.returncode for p in procs], sent_by_faults(injected(args)), context=out[-4000:])
    check_codes([p.returncode for p in sbs], what="standby", context=out[-4000:])
    assert server_codes == [0] * len(servers), (server_codes, out[-4000:])  # they exit once their children did
    return {"rc": [p.returncode for p in procs], "standby_rc": [p.returncode for p in sbs],
            "out": out, "events": _events(tmp / "events.jsonl")}


def _close(server) -> int:
    """The fork server's exit code once every child it forked ended (it exits then; killed after 60 s)."""
    server.close(60.0)
    return server.proc.returncode


@pytest.mark.timeout(1500)
def test_downgrade_then_upgrade_then_relaunch_from_dump(tmp_path):
    ref_out = reference_run(PRETRAIN, ARGS + ["--seed", 1234, "--no-dump", "--log-samples", tmp_path / "ref"])
    other_out = reference_run(PRETRAIN, ARGS + ["--seed", 1235, "--no-dump"])
    ref, other = losses(ref_out), losses(other_out)

    ckpt = tmp_path / "ckpt"
    run = _launch_elastic(tmp_path, ARGS + ["--seed", 1234, "--check-replicas", "--inject", "kill:rank=3,step=7",
                                            "--save", ckpt, "--log-samples", tmp_path / "s"],
                          script=PACED, env_extra={"ELASTIC_TEST_PACE": "4"})
    out, evs = run["out"], run["events"]
    assert run["rc"] == [0, 0, 77, -9] and run["standby_rc"] == [0, 0], (run["rc"], run["standby_rc"], out[-4000:])
    down = [e for e in evs if e["kind"] == "downgrade_done"]
    up = [e for e in evs if e["kind"] == "upgrade_done"]
    assert len(down) == 1 and down[0]["lock_step"] == 6 and down[0]["removed"] == [2, 3] and down[0]["world"] == 2
    assert down[0]["table"] == down[0]["members"] == [0, 1]  # the controller's world: removed, not dead
    assert len(up) == 1 and up[0]["added"] == [2, 3] and up[0]["world"] == 4
    assert up[0]["table"] == up[0]["members"] == [0, 1, 2, 3]
    u = up[0]["lock_step"]
    assert 6 <= u < ITERS - 2, u
    assert [e["step"] for e in evs if e["kind"] == "upgrade_dump"] == [u]

    # every step trained once, at DP=2 between the fault and the scale-out, replicas identical at DP=4
    got = losses(out)
    assert sorted(got) == list(range(1, ITERS + 1))
    checked = {int(m) for m in re.findall(r"replicas-identical: iteration (\d+)", out)}
    assert checked == set(range(1, 7)) | set(range(u + 1, ITERS + 1)), sorted(checked)

    # loss curve vs run-to-run noise
    after = range(7, ITERS + 1)
    d_elastic = [abs(got[i] - ref[i]) for i in after]
    d_seed = [abs(other[i] - ref[i]) for i in after]
    mean_e, mean_s = sum(d_elastic) / len(after), sum(d_seed) / len(after)
    worst = max(d / ref[i] for d, i in zip(d_elastic, after))
    fault_t = min(e["t"] for e in evs if e["kind"] == "fault_seen")
    kill_t = min(e["t"] for e in evs if e["kind"] == "fault_injected")
    resumed = [e["t"] for e in evs if e["kind"] == "train_resumed" and e["t"] > fault_t]
    parts = {k: v for k, v in down[0].items() if k.endswith("_s")}
    print(f"\nelastic: mean |dloss| vs fault-free {mean_e:.2e} (seed-to-seed {mean_s:.2e}), worst relative "
          f"{worst:.2e}; losses at DP=2 steps 7..{u}: max |d| {max(d_elastic[:u - 6] or [0]):.2e}\n"
          f"downgrade: SIGKILL -> DP=2 training {min(resumed) - kill_t:.3f} s, first fault report -> DP=2 training "
          f"{min(resumed) - fault_t:.3f} s "
          f"(controller: {down[0]['total_s']:.3f} s, {parts}); "
          f"upgrade {up[0]['total_s']:.3f} s at step {u}")
    assert mean_e <= 0.1 * mean_s and worst < 0.01, (mean_e, mean_s, worst)

    # every global batch (DP=4, DP=2 x 2 micro-batches, DP=4 again) holds the fault-free run's samples
    assert_data_order(tmp_path / "s", tmp_path / "ref", ITERS)
    # the dump right after the scale-out, relaunched, reproduces the continuing run bit for bit
    assert_relaunch_reproduces(ckpt, u, ARGS + ["--seed", 1234, "--no-dump"], out, tmp_path, ITERS,
                               samples=tmp_path / "s")
    assert_data_order(tmp_path / "s", tmp_path / "ref", ITERS)  # the relaunch's steps u+1.. supersede, same samples


@pytest.mark.timeout(600)
def test_a_downgrade_rebuild_handler_that_raises_falls_back_to_a_dump(tmp_path):
    """A faulty real object under the downgrade: rank 3 is SIGKILLed at step 7, no standby, so the
    controller removes the instance [2, 3] (rank 2 exits 77) and rebuilds a 2-rank world, where rank 0's
    zit_downgrade_rebuild handler raises (_elastic_failing.py). The sequence abandons, the downgrade returns
    FAILED and the controller falls back to the dump: ranks 0 and 1 hold a whole copy of the optimizer state,
    so the lock step is saved (rank 1 from the state kept before its rebuild) and they exit 75."""
    ckpt = tmp_path / "ckpt"
    args = ARGS[:-1] + [12, "--save", ckpt, "--inject", "kill:rank=3,step=7"]
    run = _launch_elastic(tmp_path, args, standbys=(), script=FAILING)
    out, evs = run["out"], run["events"]
    assert run["rc"] == [75, 75, 77, -9], (run["rc"], out[-4000:])
    failed = [e for e in evs if e["kind"] == "retry_failed"]  # the downgrade's steps log as "retry" (elastic_flow.py)
    assert failed and failed[0]["step_name"] == "zit_rebuild", failed
    assert ("downgrade", "dump") in [(e["src"], e["dst"]) for e in evs if e["kind"] == "fallback"], evs
    assert not [e for e in evs if e["kind"] == "downgrade_done"]
    lock = next(e for e in evs if e["kind"] == "decision")["lock_step"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(lock)


@pytest.mark.timeout(600)
def test_an_upgrade_rebuild_handler_that_raises_ends_with_a_dump_from_the_survivors(tmp_path):
    """A faulty real object under the upgrade: rank 3 is SIGKILLed at step 7, the instance [2, 3] removed
    (rank 2 exits 77), training goes on at DP=2; the standbys for ranks 2 and 3 register and the scale-out
    begins, where rank 0's zit_upgrade_rebuild handler raises (_elastic_failing.py). The survivors 0 and 1
    are the only copies of the optimizer state (the standbys hold nothing yet): the controller dumps the
    upgrade's lock step from them before ending the job -- ranks and standbys exit 75 -- instead of exiting
    76 with nothing saved (issue 16). The checkpoint is megatron's and names that step."""
    ckpt = tmp_path / "ckpt"
    args = ARGS[:-1] + [40, "--save", ckpt, "--inject", "kill:rank=3,step=7"]
    run = _launch_elastic(tmp_path, args, script=FAILING, env_extra={"ELASTIC_FAILING": "upgrade",
                                                                       "ELASTIC_TEST_PACE": "4"})
    out, evs = run["out"], run["events"]
    assert run["rc"] == [75, 75, 77, -9] and run["standby_rc"] == [75, 75], (run["rc"], run["standby_rc"], out[-4000:])
    assert len([e for e in evs if e["kind"] == "downgrade_done"]) == 1 and not [e for e in evs if e["kind"] == "upgrade_done"]
    dumped = [e for e in evs if e["kind"] == "upgrade_failed_dump"]
    assert len(dumped) == 1 and sorted(dumped[0]["ranks"]) == [0, 1], dumped
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(dumped[0]["step"])


@pytest.mark.timeout(900)
def test_two_downgrades_4_to_3_to_2_with_renumbered_ranks(tmp_path):
    """DP=4 with 4 replicas (every rank a full copy), global batch 24: SIGKILL of rank 3 -> DP=3 (4
    micro-batches per step), then an error on rank 1 -> DP=2 (6 micro-batches) with the survivors [0, 2]:
    job rank 2 is torch rank 1 in the new world. Replicas stay identical after every step; the loss stays
    within 1 % of the fault-free run with the same global batch."""
    args = ARGS[:-1] + [20, "--seed", 1234, "--no-dump", "--replica-cnt", 4, "--global-batch-size", 24]
    run = _launch_elastic(tmp_path, args + ["--check-replicas", "--inject", "kill:rank=3,step=7; raise:rank=1,step=12",
                                            "--log-samples", tmp_path / "s"], standbys=())
    out, evs = run["out"], run["events"]
    assert run["rc"] == [0, 77, 0, -9], (run["rc"], out[-4000:])
    down = [e for e in evs if e["kind"] == "downgrade_done"]
    assert [(e["lock_step"], e["removed"], e["members"]) for e in down] == [(6, [3], [0, 1, 2]), (11, [1], [0, 2])]
    got = losses(out)
    assert sorted(got) == list(range(1, 21))
    checked = {int(m) for m in re.findall(r"replicas-identical: iteration (\d+)", out)}
    assert checked == set(range(1, 21))
    ref = losses(reference_run(PRETRAIN, args + ["--log-samples", tmp_path / "ref"]))
    assert_data_order(tmp_path / "s", tmp_path / "ref", 20)  # DP 4 -> 3 -> 2: each global batch the same 24 samples
    worst = max(abs(got[i] - ref[i]) / ref[i] for i in range(1, 21))
    print(f"\ntwo downgrades: worst relative loss difference vs fault-free {worst:.2e}")
    assert worst < 0.01


@pytest.mark.timeout(900)
def test_pipeline_parallel_downgrade_then_upgrade(tmp_path, fault_free_run):
    """TP1 x PP2 x DP2 with 2 optimizer instances (DP positions 0 and 1 of each stage): SIGKILL of rank 3
    (stage 1, DP position 1) at step 7 removes instance 1 from *both* stages' DP groups (ranks 1 and 3;
    rank 1 exits 77), so a 2-rank PP2 x DP1 world trains on with 2x the micro-batches per step (same
    global batch). Standbys for ranks 1 and 3 bring it back to PP2 x DP2 (repaired from the survivors,
    every replica bitwise identical after every later step); every step trained once and each loss within
    1 % of the fault-free run of the layout. While downgraded each step is paced (_elastic_paced.py, up to
    4 s, cut short at the upgrade's fence) so that the standbys come up in time on a loaded machine."""
    args = layout_args("tp1pp2dp2", "--enable-elastic-training")
    ref_run = layout_reference(fault_free_run, "tp1pp2dp2")
    ref = losses(ref_run)
    run = _launch_elastic(tmp_path, args + ["--check-replicas", "--inject", "kill:rank=3,step=7",
                                            "--log-samples", tmp_path / "s"], standbys=(1, 3),
                          script=PACED, env_extra={"ELASTIC_TEST_PACE": "4", "MINDIO_DUMP_AFTER_UPGRADE": "0"})
    out, evs = run["out"], run["events"]
    assert run["rc"] == [0, 77, 0, -9] and run["standby_rc"] == [0, 0], (run["rc"], run["standby_rc"], out[-4000:])
    down = [e for e in evs if e["kind"] == "downgrade_done"]
    up = [e for e in evs if e["kind"] == "upgrade_done"]
    assert [(e["lock_step"], e["removed"], e["members"]) for e in down] == [(6, [1, 3], [0, 2])]
    assert [(e["added"], e["members"]) for e in up] == [([1, 3], [0, 1, 2, 3])]
    u = up[0]["lock_step"]
    assert 6 <= u < LAYOUT_ITERS, u
    got = losses(out)
    assert sorted(got) == list(range(1, LAYOUT_ITERS + 1))
    checked = {int(m) for m in re.findall(r"replicas-identical: iteration (\d+)", out)}
    assert checked == set(range(1, 7)) | set(range(u + 1, LAYOUT_ITERS + 1)), sorted(checked)
    assert_data_order(tmp_path / "s", ref_run.samples, LAYOUT_ITERS)  # PP stages of a DP rank agree, too
    worst = max(abs(got[i] - ref[i]) / ref[i] for i in got)
    print(f"\nPP2 elastic: DP2 -> DP1 at step 6 ({down[0]['total_s']:.3f} s), back to DP2 at step {u} "
          f"({up[0]['total_s']:.3f} s); worst relative loss difference vs fault-free {worst:.2e}")
    assert worst < 0.01

"""The fault rows of issue 35 as tests against a real Slurm (tests/slurm/_cluster.py: slurmctld and 3
slurmd "hosts" in network namespaces), each a job of examples/slurm/pretrain_gpt.sbatch running the toy of
tests/recovery/_recover_toy.py (2 nodes x 2 ranks; 16 steps), its end bitwise equal to one fault-free plain
mindio-run of the same command (one per module, as the cluster):

* a worker SIGKILLed: recovered in place by mindio, no requeue;
* ``scancel --signal=TERM``: a last-words checkpoint, exit 75, requeued, resumed from it;
* node n1 lost (every process in its namespace SIGKILLed: slurmd, mindio-run, workers), no spare: a
  last-words checkpoint from the survivors' replicas, requeued with n1 excluded, resumed (<= 1 step lost);
* the same with a spare node (SPARES=1): the spare takes over in place, no requeue.

The whole set costs ~2 min of wall (measured on a 2-core host: the cluster and the reference ~10 s, the
rows ~13, ~29, ~41 and ~25 s): the two cheapest (the worker, the spare) run in the default suite; the two
that requeue (``scancel``; a lost node without a spare, which waits ``LOST_GRACE`` too) only with
``MINDIO_SLURM_DRILLS=1``. The time-limit row stays in
scripts/slurm_drills.sh: Slurm's ``--time`` counts whole minutes, a test of it would take minutes.
Root, Slurm and munge needed (scripts/install.sh); elsewhere skipped with the reason.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _cluster import Cluster, can_run  # noqa: E402
from tests._faultplan import FaultPlan  # noqa: E402

TOY = Path(__file__).resolve().parents[1] / "recovery" / "_recover_toy.py"
STEPS, FAULT_STEP = 16, 6
ITER0 = re.compile(r"^\[rank 0\] iteration (\d+)$", re.M)  # the toy's rank-0 iteration lines
WHY = can_run()
DRILLS = os.environ.get("MINDIO_SLURM_DRILLS") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY), reason=f"no Slurm cluster here: {WHY}")]
drills_only = pytest.mark.skipif(not DRILLS, reason="a requeue row (the requeued job waits for Slurm's scheduling "
                                 "pass and a restart: ~30-40 s each): set MINDIO_SLURM_DRILLS=1 to run it")


def toy(out: Path, plan: FaultPlan = FaultPlan()) -> list:
    out.mkdir(parents=True, exist_ok=True)
    return [str(TOY), "--out", str(out), "--steps", str(STEPS), "--step-sleep", "0.3", "--step-sleep-from",
            str(FAULT_STEP - 2), *plan.argv()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("slurm"), 3)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import slurm_drills

    work = tmp_path_factory.mktemp("ref")
    ref = slurm_drills.reference(work / "ref", 0, timeout=300, command=toy(work / "out"))
    assert ref, (work / "ref" / "ref.log").read_text()[-3000:]
    return ref


def drill(cluster, tmp_path, row, plan: FaultPlan = FaultPlan()) -> tuple[dict, str]:
    import slurm_drills

    r = slurm_drills.Drill(cluster, row, tmp_path / "job", 0, FAULT_STEP, timeout=300, time_signal=0,
                           command=toy(tmp_path / "out", plan), iter_re=ITER0).run()
    return r, (tmp_path / "job" / "job.out").read_text(errors="replace")


def exits(out: str) -> list:
    return re.findall(r"pretrain_gpt\.sbatch: exit (\d+)", out)


def test_worker_sigkilled_is_recovered_in_place_without_requeue(cluster, reference, tmp_path):
    import slurm_drills

    r, out = drill(cluster, tmp_path, slurm_drills.Row("worker SIGKILLed (rank 3)"),
                   FaultPlan.of(("kill", 3, FAULT_STEP)))
    assert r["hung"] == "no" and r["outcome"].startswith("COMPLETED, exits 0, recovered in place"), out[-4000:]
    assert r["requeues"] == "0" and exits(out) == ["0"], out[-4000:]
    assert "[rank 3] injecting kill" in out, out[-4000:]
    assert r["digest"] == reference, out[-4000:]


@drills_only
def test_scancel_term_checkpoints_exits_75_and_resumes_after_requeue(cluster, reference, tmp_path):
    import slurm_drills

    r, out = drill(cluster, tmp_path, slurm_drills.Row("scancel --signal=TERM", "scancel"))
    assert r["hung"] == "no" and r["outcome"] == "COMPLETED, exits 75/0", out[-4000:]
    assert r["requeues"] == "1" and "(restart 1)" in out, out[-4000:]
    assert re.search(r"\[rank 0\] loaded checkpoint iteration \d+", out), out[-4000:]
    assert r["lost"] in ("0", "1"), (r, out[-4000:])
    assert r["digest"] == reference, out[-4000:]


@drills_only
@pytest.mark.parametrize("down_lost", ["1", "0"])  # 0: the path of a user without operator rights
def test_node_lost_without_spare_requeues_excluding_it_and_resumes(cluster, reference, tmp_path, down_lost):
    import slurm_drills

    row = slurm_drills.Row("node n1 lost, no spare", "kill-node", env={"DOWN_LOST": down_lost})
    try:
        r, out = drill(cluster, tmp_path, row)
        excluded, reason = cluster.job(r["job"]).get("ExcNodeList"), cluster.node("n1").get("Reason", "")
    finally:
        cluster.revive(1)
    assert r["hung"] == "no" and r["outcome"] == "COMPLETED, exits 75/0", out[-4000:]
    assert r["requeues"] == "1" and r["down"] == "n1", out[-4000:]
    assert "requeue, excluding n1" in out and excluded == "n1", (excluded, out[-4000:])
    assert reason.startswith("mindio:") == (down_lost == "1"), reason  # set DOWN by the script, or not
    second = out.split("(restart 1)", 1)[1]
    assert "n1" not in second.splitlines()[0], out[-4000:]  # the requeued job's node list
    assert r["lost"] in ("0", "1"), (r, out[-4000:])
    assert r["digest"] == reference, out[-4000:]


def test_node_lost_with_a_spare_is_taken_over_in_place(cluster, reference, tmp_path):
    import slurm_drills

    try:
        r, out = drill(cluster, tmp_path, slurm_drills.Row("node n1 lost, a spare node", "kill-node", spares=1))
    finally:
        cluster.revive(1)
    assert r["hung"] == "no" and "recovered in place" in r["outcome"], out[-4000:]
    assert r["requeues"] == "0" and "(restart 1)" not in out, out[-4000:]
    assert r["digest"] == reference, out[-4000:]

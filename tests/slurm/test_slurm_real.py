"""mindio on a real Slurm cluster (tests/slurm/_cluster.py: slurmctld and 3 slurmd "hosts" in network
namespaces, munge): the recipe examples/slurm/pretrain_gpt.sbatch runs the Megatron example as a 2-node job
(2 ranks a node) whose mindio-run agents take their node ranks and node 0's endpoint from Slurm, and it
trains to the end bit for bit as plain mindio-run does. Root, Slurm and munge needed (scripts/install.sh);
elsewhere skipped with the reason. The fault rows with the toy are tests/slurm/test_slurm_faults.py; with the
Megatron example (and the time limit) scripts/slurm_drills.sh's table: each takes a minute or more."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _cluster import Cluster, can_run  # noqa: E402

TOY = Path(__file__).resolve().parents[1] / "recovery" / "_recover_toy.py"
WHY = can_run()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"no Slurm cluster here: {WHY}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("slurm"), 3)
    yield c
    c.close()


def test_scontrol_expands_host_lists_as_mindio_does(cluster):
    from mindio.launch.slurm import expand_nodelist

    # (Slurm 22.05 refuses a suffix after a range, n[1-2]-ib, which the parser accepts)
    for text in ("node[1-3,5]", "rack[1-2]-node[01-03],x[9-10]", "gpu-[009-011],login", "a[08-11],b[1,3]"):
        r = cluster.run("scontrol", "show", "hostnames", text)
        assert expand_nodelist(text) == r.stdout.split(), text


@pytest.mark.slow
def test_two_node_sbatch_job_trains_bitwise_like_plain_mindio_run(cluster, tmp_path):
    """The recipe with another training script (its arguments follow the batch script's name): the toy
    job of tests/recovery/_recover_toy.py (the Megatron example's rows: scripts/slurm_drills.sh)."""
    import slurm_drills as drills

    def toy(out):
        out.mkdir(parents=True, exist_ok=True)
        return [str(TOY), "--out", str(out), "--steps", "10"]

    refs = []  # the plain mindio-run reference runs beside the Slurm job (on this host, not in the namespaces)
    t = threading.Thread(target=lambda: refs.append(drills.reference(tmp_path / "ref", 0, timeout=300,
                                                                     command=toy(tmp_path / "ref-out"))))
    t.start()
    r = drills.Drill(cluster, drills.ROWS[0], tmp_path / "job", 0, 0, timeout=300, time_signal=0,
                     command=toy(tmp_path / "job-out")).run()
    t.join(330)
    ref = refs[0] if refs else None
    assert ref, (tmp_path / "ref" / "ref.log").read_text()[-3000:]
    out = (tmp_path / "job" / "job.out").read_text(errors="replace")
    assert r["hung"] == "no" and r["outcome"] == "COMPLETED, exits 0", out[-3000:]
    # every node's mindio-run took its rank and node 0's endpoint from Slurm; both agents exited 0
    assert "mindio-run: slurm job" in out and "node n0 (1 of 2): --node-rank 0" in out, out[-3000:]
    assert "node n1 (2 of 2): --node-rank 1" in out, out[-3000:]
    assert sorted(os.listdir(tmp_path / "job" / "run")) == ["n0", "n1"]
    assert [(tmp_path / "job" / "run" / n).read_text().strip() for n in ("n0", "n1")] == ["0", "0"]
    assert r["digest"] == ref, out[-3000:]
    assert subprocess.run(["ip", "netns", "pids", cluster.net.hosts[1]], capture_output=True, text=True).stdout \
        .split() == [str(cluster.daemons["slurmd-n1"].pid)]  # the job left nothing behind on n1 but slurmd

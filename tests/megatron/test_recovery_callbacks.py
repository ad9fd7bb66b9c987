"""MegatronAdapter's recovery callbacks, driven by hand the way mindio.ttp drives them (4 gloo ranks,
DP=4, two replicas per shard). Every scenario must end bit-identical to an uninterrupted run.

- repair: rank 1's optimizer shard, params and counters are destroyed at step 6; stop, clean (all
  groups dropped), a new generation-1 world, rebuild groups, repair (rank 3 sends its replica of
  the shard + scalar state to rank 1), rollback to step 6, train on to 12.
- high availability end to end (when mindio.ttp is available): a fault injected on rank 1 at step 7
  makes mindio's controller order a dump at lock step 6 (our save + rename callbacks), the job
  exits with code 75, and ``--load`` continues from that dump bit for bit.
- dump: at step 6 ranks 0 and 3 write one copy of each shard without collectives (Megatron's torch_dist
  format), rank 0 renames; ``pretrain_gpt.py --load`` continues from it to 12.
"""

import re

import pytest

from _mgt_launch import PRETRAIN, REFERENCE_LAUNCHER, REPO, digests, reference_run, torchrun, SLOW_MEGATRON

pytestmark = SLOW_MEGATRON

WORKER = REPO / "tests" / "megatron" / "_recovery_worker.py"
# The runs whose launcher is not what they test (the hand-driven worker, the resumed runs) start their 4 ranks
# through mindio-run's fork server: one interpreter imports torch and megatron-core for all of them (~9 CPU-s
# less than torchrun's 4 imports on this 2-core CI machine). The launcher changes no number
# (test_pretrain_gpt.py::test_runs_under_mindio_run). The runs whose controller sits in rank 0 under
# torchrun (and whose "exitcode  : 75" is torchrun's summary) stay under torchrun.
LAUNCH = REFERENCE_LAUNCHER
FAULTY = REPO / "tests" / "megatron" / "_faulty_handlers.py"
EXITCODES = re.compile(r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


@pytest.fixture(scope="module")
def reference_digest():
    return digests(reference_run(WORKER, ["none", 12], timeout=150))[-1]


@pytest.mark.timeout(200)
def test_repair_from_replica_is_bitwise(reference_digest):
    out = torchrun(WORKER, ["repair", 12, 6], timeout=150, launcher=LAUNCH)
    assert out.count("repaired") == 4
    assert digests(out)[-1] == reference_digest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["dump", "rebuiltdump"])
def test_dump_then_load_is_bitwise(reference_digest, tmp_path, scenario):
    """``rebuiltdump``: the dump comes after a rebuild whose rollback never ran (a flow that failed after
    rebuilding falls back to a dump): the rebuilt model's params are not the trained ones. Rank 1 was cleaned
    as a UCE rank (no state dict kept): asked to dump, it refuses with an error saying another holder must
    write its shard, and writes nothing (the controller then takes that holder: tests/ttp/test_dump_e2e.py)."""
    ckpt = tmp_path / "dump"
    out = torchrun(WORKER, [scenario, 12, 6, ckpt], timeout=150, launcher=LAUNCH)
    assert "dumped step 6" in out
    if scenario == "rebuiltdump":
        assert ("rank 1 refused: dump of step 6: rank 1's model was built again (rebuild) and not rolled back"
                in out and "another holder of its shard must write it" in out), out[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    # Megatron's torch_dist layout; only the two dumping ranks (one per shard) wrote data
    assert sorted(p.name for p in (ckpt / "iter_0000006").iterdir()) == [
        ".metadata", "__0.mindio.json", "__0_0.distcp", "__3.mindio.json", "__3_0.distcp", "common.mindio.json",
        "common.pt", "metadata.json"]
    resumed = torchrun(PRETRAIN, ["--use-distributed-optimizer", "--replica-cnt", 2,
                                  "--train-iters", 12, "--load", ckpt], timeout=150, launcher=LAUNCH)
    assert "loaded checkpoint iteration 6" in resumed
    assert digests(resumed)[-1] == reference_digest


def _ttp_available() -> bool:
    try:
        from mindio import ttp

        return hasattr(ttp, "tft_init_processor")
    except ImportError:
        return False


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _ttp_available(), reason="mindio.ttp is not available")
def test_controller_dump_after_fault_loads_bitwise(reference_digest, tmp_path):
    ckpt = tmp_path / "ha"
    common = ["--use-distributed-optimizer", "--enable-high-availability", "--train-iters", 12]
    rc, out = torchrun(PRETRAIN, common + ["--save", ckpt, "--inject", "raise:rank=1,step=7"],
                       timeout=150, env={"TTP_NORMAL_ACTION_TIME_LIMIT": "60"}, check=False)
    assert rc != 0 and "exitcode  : 75" in out, out[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    resumed = torchrun(PRETRAIN, common + ["--no-dump", "--load", ckpt], timeout=150, launcher=LAUNCH)
    assert "loaded checkpoint iteration 6" in resumed
    assert digests(resumed)[-1] == reference_digest


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _ttp_available(), reason="mindio.ttp is not available")
def test_a_dump_writer_that_fails_is_replaced_by_its_replica(reference_digest, tmp_path):
    """Rank 1 raises at step 7: the controller picks ranks 0 and 3 to dump step 6, but rank 0's save raises
    (_faulty_handlers.py: as a rank with no trained state refuses, or a failing disk): the controller saves
    again by rank 0's replica, rank 2, and rank 3. Every rank exits 75, the dump holds the pieces of ranks 2
    and 3 only and a --load relaunch from it ends bitwise equal to the uninterrupted run."""
    ckpt = tmp_path / "ha"
    common = ["--use-distributed-optimizer", "--enable-high-availability", "--train-iters", 12]
    rc, out = torchrun(FAULTY, common + ["--save", ckpt, "--inject", "raise:rank=1,step=7"], timeout=150,
                       env={"TTP_NORMAL_ACTION_TIME_LIMIT": "60", "FAULTY_HANDLERS": "save@0"}, check=False)
    codes = {int(r): int(c) for r, c in EXITCODES.findall(out)}  # torchrun's failure summary
    assert rc != 0 and codes == {0: 75, 1: 75, 2: 75, 3: 75}, (codes, out[-4000:])
    assert "ranks [0] could not write their shards; their replicas write instead (new writers [2, 3])" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert sorted(p.name for p in (ckpt / "iter_0000006").glob("__*")) == [
        "__2.mindio.json", "__2_0.distcp", "__3.mindio.json", "__3_0.distcp"]
    resumed = torchrun(PRETRAIN, common + ["--no-dump", "--load", ckpt], timeout=150, launcher=LAUNCH)
    assert "loaded checkpoint iteration 6" in resumed
    assert digests(resumed)[-1] == reference_digest


@pytest.mark.timeout(300)
def test_no_replica_falls_back_to_periodic_checkpoint(tmp_path):
    """R=1: nothing to repair from; every rank loads the step-4 checkpoint and rolls back to it."""
    reference = digests(reference_run(WORKER, ["none", 12], timeout=150, env={"REPLICAS": "1"}))[-1]
    out = torchrun(WORKER, ["loadckpt", 12, 6, tmp_path / "ckpt"], timeout=150, launcher=LAUNCH)
    assert out.count("reloaded at iteration 4") == 4
    assert digests(out)[-1] == reference


@pytest.mark.timeout(400)
@pytest.mark.skipif(not _ttp_available(), reason="mindio.ttp is not available")
def test_controller_dump_tp2_dp2_loads_bitwise(tmp_path):
    """TP=2 x DP=2: the dump holds one file per (TP rank, shard) and resumes bit for bit."""
    ckpt = tmp_path / "tp"
    common = ["--use-distributed-optimizer", "--enable-high-availability",
              "--tensor-model-parallel-size", 2, "--train-iters", 10]
    reference = digests(reference_run(PRETRAIN, common + ["--no-dump"], timeout=150))[-1]
    rc, out = torchrun(PRETRAIN, common + ["--save", ckpt, "--inject", "raise:rank=1,step=6"],
                       timeout=150, env={"TTP_NORMAL_ACTION_TIME_LIMIT": "60"}, check=False)
    assert rc != 0 and "exitcode  : 75" in out, out[-3000:]
    # DP groups {0, 2} and {1, 3}: rank 1 failed, so ranks 0 and 3 hold a usable copy of every shard
    assert sorted(p.name for p in (ckpt / "iter_0000005").glob("*.distcp")) == ["__0_0.distcp", "__3_0.distcp"]
    resumed = torchrun(PRETRAIN, common + ["--no-dump", "--load", ckpt], timeout=150, launcher=LAUNCH)
    assert digests(resumed)[-1] == reference


def _flip_byte(path, at: float = 0.5) -> None:
    """Change one byte of ``path`` on disk (at a fraction ``at`` of its length), from outside the job."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def _restart_store() -> None:
    """Stop this test process's checkpoint-store daemon (it persists what it holds first): its pool still
    holds the bytes the jobs wrote, and a relaunch reads the pool before storage. The next job starts a
    fresh one, which reads what is on disk."""
    import os

    from tests.acp.conftest import stop_daemon

    stop_daemon(os.environ["MINDIO_ACP_DIR"])


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _ttp_available(), reason="mindio.ttp is not available")
def test_corrupt_checkpoints_are_never_trained_from(reference_digest, tmp_path):
    """Periodic checkpoints at 2 and 4, a last-words dump of step 5 after a fault at 6. One byte changed on
    disk in the dump (in a shard only ranks 1 and 3 read: every rank must still agree) and one in the
    periodic checkpoint of 4 (common.pt, which every rank reads). The relaunch (mindio-run) logs one line
    per corrupt checkpoint naming its file, resumes from iteration 2 and ends with the uninterrupted run's
    digest: no restart, no loop."""
    ckpt = tmp_path / "ha"
    common = ["--use-distributed-optimizer", "--enable-high-availability", "--train-iters", 12]
    rc, out = torchrun(PRETRAIN, common + ["--save", ckpt, "--save-interval", 2, "--inject", "raise:rank=1,step=6"],
                       timeout=150, env={"TTP_NORMAL_ACTION_TIME_LIMIT": "60"}, check=False)
    assert rc != 0 and "exitcode  : 75" in out, out[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"  # the dump
    _restart_store()
    _flip_byte(ckpt / "iter_0000005" / "__3_0.distcp")
    _flip_byte(ckpt / "iter_0000004" / "common.pt")
    resumed = torchrun(PRETRAIN, common + ["--no-dump", "--load", ckpt], timeout=200, launcher="mindio.launch.cli")
    lines = re.findall(r".*failed verification.*", resumed)
    assert len(lines) == 2, resumed[-4000:]
    assert "checkpoint iteration 5 is not trained from" in lines[0] and "iter_0000005/__3_0.distcp" in lines[0]
    assert "previous complete checkpoint, iteration 4" in lines[0]
    assert "checkpoint iteration 4 is not trained from" in lines[1] and "iter_0000004/common.pt" in lines[1]
    assert "previous complete checkpoint, iteration 2" in lines[1]
    assert re.findall(r"loaded checkpoint iteration \d+", resumed) == ["loaded checkpoint iteration 2"]
    assert digests(resumed)[-1] == reference_digest

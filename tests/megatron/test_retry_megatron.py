"""The retry strategy on the Megatron example (4 ranks, DP=4, replicas R=2), enabled by script flags only.

``--enable-hbmfault-repair`` and nothing else -- no launcher flag, no ``HIGH_AVAILABILITY``: the
processors register with enable_uce, which is what asks the controller (in rank 0, under torchrun and
under mindio-run alike) for retry. ``--inject uce:rank=1,step=7``: rank 1's optimizer shard is
destroyed (NaN) and it raises "UCE ERROR"; the controller cleans, rebuilds the groups in the same
processes (generation 1), repairs rank 1 from its replica (rank 3), rolls every rank back to step 6 and
re-enters train(). The job exits 0 with the digest of the uninterrupted run: no process restarted, no
step lost. ``raise:`` (a generic exception in forward, outside the optimizer update window) retries
without a repair (the step's gradients, grad buffers and data position are rolled back), same check; under mindio-run a
second UCE is retried too; TP=2 x DP=2 with replicas repairs rank 1 from its DP replica, same check.
``--enable-worker-reboot`` under mindio-run without ``--high-availability`` fails at start, naming it.
"""
import json
import os

import pytest

from _mgt_launch import PRETRAIN, digests, ha_reference, torchrun, SLOW_MEGATRON
from tests._samples import assert_data_order

pytestmark = SLOW_MEGATRON

ITERS = 10
BASE = ["--use-distributed-optimizer", "--enable-high-availability", "--no-dump", "--train-iters", ITERS,
        "--seed", 1234]


@pytest.fixture(scope="module")
def reference(fault_free_run):
    """The fault-free run (the same as test_recover_megatron.py's: one run per session)."""
    return ha_reference(fault_free_run, BASE)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher,inject,retries", [
    ("torch.distributed.run", "uce:rank=1,step=7", [([1], 6)]),
    ("torch.distributed.run", "raise:rank=1,step=7", [([], 6)]),  # a generic exception in forward: no repair
    ("mindio.launch.cli", "uce:rank=1,step=4; uce:rank=2,step=7", [([1], 3), ([2], 6)]),
])
def test_retry_in_place_is_bitwise(reference, tmp_path, launcher, inject, retries):
    assert "HIGH_AVAILABILITY" not in os.environ  # script flags only
    events = tmp_path / "events.jsonl"
    out = torchrun(PRETRAIN, BASE + ["--enable-hbmfault-repair", "--inject", inject, "--log-samples", tmp_path / "s"],
                   timeout=300, launcher=launcher,
                   env={"MINDIO_EVENT_LOG": str(events), "TTP_LOG_PATH": str(tmp_path / "logs")})
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    done = [e for e in evs if e["kind"] == "retry_done"]
    assert [(d["repaired"], d["lock_step"]) for d in done] == retries, out[-4000:]
    resumed = [e for e in evs if e["kind"] == "train_resumed"]
    assert sorted(e["rank"] for e in resumed) == sorted(list(range(4)) * len(retries))
    assert len({e["pid"] for e in evs if e["kind"] == "fault_seen"} | {e["pid"] for e in resumed}) == 4
    took = max(e["t"] for e in resumed[:4]) - min(e["t"] for e in evs if e["kind"] == "fault_seen")
    print(f"\nmegatron {inject} ({launcher}): error -> every rank training again {took:.3f} s; "
          f"{ {k: v for k, v in done[0].items() if k.endswith('_s')} }")
    assert digests(out)[-1] == digests(reference)[-1]
    assert_data_order(tmp_path / "s", reference.samples, ITERS)  # the step retried on the same samples


@pytest.mark.timeout(500)
def test_retry_tp2_dp2_is_bitwise(tmp_path, fault_free_run):
    """TP=2 x DP=2 with replicas: a UCE on rank 1 is repaired from its DP replica in place."""
    tp = ["--tensor-model-parallel-size", 2, "--replica-cnt", 2]
    ref = digests(ha_reference(fault_free_run, BASE + tp))[-1]
    events = tmp_path / "events.jsonl"
    out = torchrun(PRETRAIN, BASE + tp + ["--enable-hbmfault-repair", "--inject", "uce:rank=1,step=7"],
                   timeout=300, env={"MINDIO_EVENT_LOG": str(events), "TTP_LOG_PATH": str(tmp_path / "logs")})
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    done = [e for e in evs if e["kind"] == "retry_done"]
    assert len(done) == 1 and done[0]["repaired"] == [1], out[-4000:]
    assert digests(out)[-1] == ref

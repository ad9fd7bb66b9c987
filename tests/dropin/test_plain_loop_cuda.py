"""The plain ``tft_*`` loop on a GPU: NCCL's stop, teardown and rebuild, run for real (where CUDA is).

The same user loop as test_plain_loop.py (``plain_loop.py --device cuda``: model, Adam state and
batches on ``cuda:0``, the default group on NCCL bound to it), one rank under torchrun, since NCCL
refuses two ranks of one communicator on one GPU and these tests must fit a one-GPU machine. What a
GPU adds to the gloo tests: mindio's NCCL path (``device.NcclBackend``: ``_abort_process_group`` on
every group, destroy, ``torch.cuda.synchronize`` / ``empty_cache``, the rebuilt group bound to the same
device) runs, and every process still ends by itself with the expected code (no SIGABRT from NCCL's
watchdog or at interpreter exit). Skipped where no CUDA device or no NCCL is present.
"""
from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist

from test_plain_loop import STEPS, Run

FAULT_STEP = 6
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="no CUDA device or no NCCL in this torch: the NCCL path is tested where a GPU is present")]


def run(tmp_path, name, *args) -> Run:
    return Run(tmp_path / name, ["--device", "cuda", "--repair", *args], timeout=150, nproc=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    r = run(tmp_path_factory.mktemp("cuda_ref"), "run")
    assert r.code == 0, r.tail()
    return r.final()


def assert_bitwise(got: list, want: list) -> None:
    (a,), (b,) = got, want
    assert a["step"] == b["step"] == STEPS, (a["step"], b["step"])
    params = a["tensors"][:4]  # the 2 linear layers' weights and biases (Adam's step counters stay on the CPU)
    assert all(t.is_cuda for t in params), "the loop's state was not on the GPU"
    for i, (x, y) in enumerate(zip(a["tensors"], b["tensors"])):
        assert torch.equal(x.cpu(), y.cpu()), f"tensor {i} differs from the fault-free run"


@pytest.mark.timeout(200)
def test_fault_free_nccl_run_ends_by_itself(reference, tmp_path):
    """A fault-free run on NCCL ends with 0 (the launcher's code), no worker by a signal, within the
    test's bound: tft_destroy_processor / destroy_process_group tear NCCL down before interpreter exit."""
    r = run(tmp_path, "again")
    assert r.code == 0 and not r.worker_codes(), r.tail()
    assert_bitwise(r.final(), reference)


@pytest.mark.timeout(200)
def test_network_error_is_retried_on_a_rebuilt_nccl_group_bitwise(reference, tmp_path):
    """A network-class error (``HCCL OP RETRY FAILED``) at step 6: retry -- the NCCL groups aborted and
    destroyed, generation 1 of the default group built on NCCL (same device), the step redone -- and
    the run ends at step 10 bitwise equal to the fault-free one, exit 0."""
    r = run(tmp_path, "retry", "--fault", f"network:0:{FAULT_STEP}")
    assert r.code == 0 and not r.worker_codes(), r.tail()
    done = r.events("retry_done")
    assert len(done) == 1 and done[0]["lock_step"] == FAULT_STEP - 1 and done[0]["gen"] == 1, done
    teardown = r.events("teardown")
    assert teardown and all(e.get("backend") == "nccl" for e in teardown), teardown
    assert_bitwise(r.final(), reference)
    print("\nNCCL retry: every rank trains again %.3f s after it began (clean %.3f s, rebuild %.3f s); "
          "teardown %s" % (done[0]["total_s"], done[0]["clean_s"], done[0]["rebuild_s"], teardown))


@pytest.mark.timeout(200)
def test_unknown_error_on_nccl_ends_with_76_and_no_signal(tmp_path):
    """An unknown error at step 6 on the only rank: its state is not trusted and no replica exists, so
    no dump is possible: the rank exits 76 by itself after the NCCL stop and teardown (no SIGABRT), and
    the log says why."""
    r = run(tmp_path, "unknown", "--fault", f"unknown:0:{FAULT_STEP}")
    assert r.code != 0 and r.worker_codes() == {0: 76}, (r.worker_codes(), r.tail())
    assert "no rank can write shard 0" in r.text and -signal.SIGABRT not in r.worker_codes().values(), r.tail()

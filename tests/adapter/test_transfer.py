"""mindio.adapter.transfer on 2 real gloo processes: bitwise in-place receive, scalars as JSON,
and a clear StateMismatch (not silent corruption) when the sender is not a replica."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mindio.adapter import StateMismatch, capture_rng, recv_state, restore_rng, send_state


def _worker(rank, port, mismatch, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(7)
        src = [torch.randn(1000, generator=g), torch.randn(3, 5, generator=g).t(),  # non-contiguous
               torch.tensor([42.0])]
        if rank == 0:
            torch.manual_seed(3)
            tensors = src[:2] if mismatch else src
            try:
                send_state(tensors, {"iteration": 9, "rng": capture_rng()}, dst=1)
                results[0] = "sent"
            except StateMismatch as exc:
                results[0] = f"mismatch: {exc}"
        else:
            mine = [torch.zeros(1000), torch.zeros(3, 5).t(), torch.zeros(1)]
            try:
                scalars = recv_state(mine, src=0)
            except StateMismatch as exc:
                results[1] = f"mismatch: {exc}"
                return
            restore_rng(scalars["rng"])
            same = all(torch.equal(a, b) for a, b in zip(mine, src))
            torch.manual_seed(3)
            expected = torch.rand(4)
            restore_rng(scalars["rng"])
            results[1] = f"equal={same} iteration={scalars['iteration']} " \
                         f"rng={torch.equal(torch.rand(4), expected)}"
    finally:
        dist.destroy_process_group()


def _spawn(mismatch):
    from mindio._ports import free_port

    port = free_port()  # outside the ephemeral range (see mindio/_ports.py)
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(port, mismatch, results), nprocs=2, join=True)
    return dict(results)


@pytest.mark.timeout(120)
def test_state_arrives_bitwise_in_place():
    assert _spawn(False)[1] == "equal=True iteration=9 rng=True"


@pytest.mark.timeout(120)
def test_layout_mismatch_is_an_error():
    res = _spawn(True)
    assert res[1].startswith("mismatch: rank 0 sends 2 state tensors, this rank expects 3")
    assert res[0].startswith("mismatch: rank 1 refused the repair stream")

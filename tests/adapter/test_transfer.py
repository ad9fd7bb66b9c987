"""mindio.adapter.transfer on 2 real gloo processes: bitwise in-place receive, scalars as JSON,
a clear StateMismatch (not silent corruption) when the sender is not a replica, and bytes changed on the
way (a bit flipped in what the sender's link carries, ``flips`` times) sent again, or RepairCorrupt."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mindio.adapter import StateMismatch, capture_rng, recv_state, restore_rng, send_state
from mindio.adapter.transfer import RESENDS, RepairCorrupt


_REAL_SEND = dist.send


def _flip_on_the_wire(times: int) -> None:
    """This process's link flips one bit of the first ``times`` 1000-element tensors it carries (the
    tensor itself is untouched: the bytes change between the two ends)."""
    real, left = _REAL_SEND, [times]

    def send(tensor, dst, group=None, tag=0):
        if tensor.numel() == 1000 and left[0] > 0:
            left[0] -= 1
            tensor = tensor.clone()
            tensor.view(torch.int32)[123] ^= 1 << 4
        return real(tensor, dst, group=group, tag=tag)

    dist.send = send


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
            except (StateMismatch, RepairCorrupt) as exc:
                results[0] = f"{type(exc).__name__}: {exc}"
        else:
            mine = [torch.zeros(1000), torch.zeros(3, 5).t(), torch.zeros(1)]
            try:
                scalars = recv_state(mine, src=0)
            except (StateMismatch, RepairCorrupt) as exc:
                results[1] = f"{type(exc).__name__}: {exc}"
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
    assert res[1].startswith("StateMismatch: rank 0 sends 2 state tensors, this rank expects 3")
    assert res[0].startswith("StateMismatch: rank 1 refused the repair stream")


def _wire_worker(rank, port, results):
    """Two repairs in one world: a link that changes RESENDS transfers (sent again: equal), then one that
    changes every transfer (RepairCorrupt on both sides)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        src = [torch.randn(1000, generator=torch.Generator().manual_seed(7)), torch.tensor([42.0])]
        for n, flips in enumerate((RESENDS, RESENDS + 1)):
            try:
                if rank == 0:
                    _flip_on_the_wire(flips)
                    send_state(src, {"iteration": n}, dst=1)
                    results[(n, 0)] = "sent"
                else:
                    mine = [torch.zeros(1000), torch.zeros(1)]
                    scalars = recv_state(mine, src=0)
                    results[(n, 1)] = f"equal={all(torch.equal(a, b) for a, b in zip(mine, src))} {scalars}"
            except RepairCorrupt as exc:
                results[(n, rank)] = f"RepairCorrupt: {exc}"
            finally:
                dist.send = _REAL_SEND
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_bytes_changed_on_the_way_are_sent_again_or_fail_the_repair():
    from mindio._ports import free_port

    results = mp.Manager().dict()
    mp.spawn(_wire_worker, args=(free_port(), results), nprocs=2, join=True)
    res = dict(results)
    assert res[(0, 0)] == "sent" and res[(0, 1)] == "equal=True {'iteration': 0}", res
    assert res[(1, 1)] == (f"RepairCorrupt: repair from rank 0: tensor 0 (of 2 tensors) arrived changed (XXH3-64) "
                           f"{RESENDS + 1} times; this rank's state is not repaired")
    assert res[(1, 0)] == (f"RepairCorrupt: rank 1 received tensor 0 (of 2 tensors) changed (XXH3-64) {RESENDS + 1} "
                           "times: the repair from this rank failed")

"""megatron's bucket collectives over a one-rank group, skipped (they change nothing).

With replicas the ZeRO-1 shards are cut inside an optimizer *instance* of d/R ranks; at d = R (e.g. PP2 x
DP2 with R = 2) an instance is one rank, and megatron still runs, every step and for every bucket, a
reduce-scatter of the grad buffer into itself (in start_grad_sync, before the replicas' all-reduce across
instances) and an all-gather of the param buffer from itself (start_param_sync), each through c10d's
coalescing manager. Over one rank both are the identity on the same memory -- a sum or an average over one
value, a gather of one shard that is the whole buffer -- so :func:`install` makes megatron's two module
functions skip them in exactly that case: a group of size 1, output and input the same memory, a
synchronous call. Everything else (real groups, asynchronous calls with their handles) goes to
torch.distributed unchanged. bench/ha_cpu.py measures the two (``reduce_scatter``, ``all_gather``).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["install"]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
            and a.device == b.device)


def _skip_on_one_rank(collective):
    """``collective(output, input, ..., group=, async_op=)`` that does nothing when it is the identity."""
    if getattr(collective, "_mindio_one_rank", False):
        return collective

    @functools.wraps(collective)
    def wrapper(output, input, *args, group=None, async_op=False, **kwargs):
        if (not async_op and group is not None and group.size() == 1 and _same_memory(output, input)):
            return None  # what a synchronous collective returns
        return collective(output, input, *args, group=group, async_op=async_op, **kwargs)

    wrapper._mindio_one_rank = True
    return wrapper


def install() -> None:
    """Wrap megatron's ``dist_reduce_scatter_func`` / ``dist_all_gather_func`` (param_and_grad_buffer)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    pgb.dist_reduce_scatter_func = _skip_on_one_rank(pgb.dist_reduce_scatter_func)
    pgb.dist_all_gather_func = _skip_on_one_rank(pgb.dist_all_gather_func)

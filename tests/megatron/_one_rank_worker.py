"""Worker of test_one_rank.py (mindio-run, 2 gloo ranks): megatron's bucket collectives after
mindio.megatron._one_rank.install(), on a one-rank group and on the two-rank world. Prints
``RESULT<rank> <json>`` of named checks."""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core.distributed import param_and_grad_buffer as pgb
from torch.distributed import _coalescing_manager

from mindio.megatron import _one_rank

dist.init_process_group("gloo")
rank = dist.get_rank()
calls = []


def counted(collective):
    """The real torch collective, counting its calls (what the wrapper let through)."""
    def run(*args, **kwargs):
        calls.append(collective.__name__)
        return collective(*args, **kwargs)
    return run


pgb.dist_reduce_scatter_func = counted(dist.reduce_scatter_tensor)
pgb.dist_all_gather_func = counted(dist.all_gather_into_tensor)
_one_rank.install()
first = pgb.dist_reduce_scatter_func
_one_rank.install()  # a second install (a rebuild) wraps nothing twice
solo = [dist.new_group([r]) for r in range(2)][rank]  # collective: every rank creates every group
out = {"installed_once": pgb.dist_reduce_scatter_func is first}

# the identity that is skipped: torch's in-place reduce-scatter over one rank changes no bit, also for
# NaN, -0.0, inf and subnormals, alone or in c10d's coalescing manager (megatron's call)
special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.0, -2.5, 0.1])
for name, coalesced in (("plain", False), ("coalesced", True)):
    z = special.clone()
    if coalesced:
        with _coalescing_manager(solo, async_ops=False):
            dist.reduce_scatter_tensor(z, z, group=solo)
    else:
        dist.reduce_scatter_tensor(z, z, group=solo)
    out[f"torch_one_rank_identity_{name}"] = z.view(torch.int32).tolist() == special.view(torch.int32).tolist()

# one rank, the same memory, synchronous: skipped, the buffer untouched
x = special.clone()
n = len(calls)
ret = pgb.dist_reduce_scatter_func(x, x, group=solo, async_op=False)
ret2 = pgb.dist_all_gather_func(x, x, group=solo)
out["one_rank_skipped"] = len(calls) == n and ret is None and ret2 is None
out["one_rank_untouched"] = x.view(torch.int32).tolist() == special.view(torch.int32).tolist()

# one rank, other memory: runs (the output gets the input)
y = torch.zeros(8)
n = len(calls)
pgb.dist_reduce_scatter_func(y, torch.arange(8.0), group=solo)
out["one_rank_other_memory_runs"] = len(calls) == n + 1 and torch.equal(y, torch.arange(8.0))

# one rank, asynchronous: runs and returns its handle
n = len(calls)
work = pgb.dist_reduce_scatter_func(x, x, group=solo, async_op=True)
work.wait()
out["one_rank_async_runs"] = len(calls) == n + 1 and work is not None

# two ranks, in place as megatron calls them: run, with the reduced / gathered values
buf = torch.arange(8.0) * (rank + 1)
n = len(calls)
pgb.dist_reduce_scatter_func(buf[rank * 4:(rank + 1) * 4], buf, group=dist.group.WORLD)
out["two_ranks_reduce_scatter"] = torch.equal(buf[rank * 4:(rank + 1) * 4], torch.arange(8.0)[rank * 4:(rank + 1) * 4] * 3)
pgb.dist_all_gather_func(buf, buf[rank * 4:(rank + 1) * 4], group=dist.group.WORLD)
out["two_ranks_all_gather"] = torch.equal(buf, torch.arange(8.0) * 3)
out["two_ranks_run"] = len(calls) == n + 2

sys.stdout.write(f"RESULT{rank} {json.dumps(out)}\n")  # one write: print() writes the line and its end apart, and the other rank's output can land between them
sys.stdout.flush()
dist.destroy_process_group()

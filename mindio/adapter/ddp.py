"""DistributedDataParallel whose gradient buckets never change: a recovered run stays bitwise.

torch's DDP reduces gradients bucket by bucket, and a bucket is one flat buffer: which element sits where
in it decides, for gloo's ring all-reduce with more than 2 ranks, in which order the ranks' values of that
element are added (float addition is not associative). A new DDP wrapper starts with one layout (its
parameters in reverse order, ``bucket_cap_mb``) and after its first backward *rebuilds* it from the order
in which the gradients became ready (the reducer's ``_rebuild_buckets``, at the next forward). A recovery
re-creates the wrapper (mindio destroyed the process group the old one reduced over): its first step
after the recovery runs on the initial layout where the uninterrupted run had the rebuilt one, and the two
runs part at the last bit. A replacement process (recover-in-place) has only a new wrapper, so keeping the
old one on the survivors would not do either.

:func:`wrap` builds the wrapper and fixes its layout at once: it hands the reducer every parameter (in
the module's parameter order, the order DDP's static-graph mode uses) and rebuilds the buckets from that
before any step. The rebuild happens once per wrapper, so every wrapper -- the first one, one re-created
after a retry, one in a replacement process -- reduces with the same buckets at every step, and a
recovered run ends bitwise equal to the uninterrupted one. The price: bucket 0 (the first parameters) is
the last one whose gradients are ready, so with several buckets less of the all-reduce overlaps the
backward pass (one bucket, the common case below ``bucket_cap_mb``, loses nothing).

The rebuild agrees on the layout with rank 0 (one broadcast on the wrapper's group), so every rank calls
:func:`wrap` at the same point: where the script builds its model, and in its rebuild handler
(``tft_register_rebuild_group_handler``), which runs on the survivors while a replacement process builds
its model. ``init_sync`` defaults to False (a re-created wrapper must not broadcast rank 0's parameters,
which a memory error may just have destroyed, before the repair): build the same initial model on every
rank (the same seed), or pass ``init_sync=True`` for the first wrapper only.
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["wrap"]


def wrap(module: torch.nn.Module, **kwargs) -> DistributedDataParallel:
    """``DistributedDataParallel(module, **kwargs)`` (``init_sync=False`` unless given) with its bucket
    layout fixed now, the same on every rank and in every wrapper of ``module`` (module docstring).
    A collective on the wrapper's process group: every rank calls it at the same point."""
    kwargs.setdefault("init_sync", False)
    ddp = DistributedDataParallel(module, **kwargs)
    ddp.reducer._push_all_rebuilt_params()
    # (with find_unused_parameters the reducer never rebuilds: both calls do nothing, its initial layout stays)
    ddp._has_rebuilt_buckets = ddp.reducer._rebuild_buckets()
    return ddp

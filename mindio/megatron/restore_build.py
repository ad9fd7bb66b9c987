"""Model/optimizer builds whose weights are about to be overwritten: no weight initialisation.

A recovery builds the model and optimizer again (the survivors in ``rebuild_groups``, a replacement
process at its start), then puts the state back: the fp32 main shards (kept by ``clean``, or received
by the repair), and at the rollback every model param from them (``params_from_main``: copy, then the
param all-gather). Whatever the build initialised the weights to is overwritten, so megatron's random
initialisation (a full-size master weight drawn per layer on CPU, then copied: about a third of a
build; measured at 128m in issue 18) is skipped for these builds: megatron-core's own
``perform_initialization=False``, set on every config created while :func:`uninitialised_weights`
is active.

That holds only when every model param is restored by the rollback: every param is trainable (in a
distributed optimizer's buffers). :func:`build_for_restore` checks it after the build and, when some
param is not (a frozen embedding keeps its initial value, which nothing restores), builds again with
the initialisation: the result is always the same as a full build's once the rollback ran.

Memory. On CPU, most of such a build's time is not computation but fresh memory: megatron's DDP
allocates its param and grad buffers with ``torch.zeros`` (4 B x P each), and every page of a fresh
allocation is faulted in and zeroed by the kernel (measured at 1g, issue 18: ``torch.zeros`` was
0.7-2.9 of the 1.6-3.7 CPU seconds of a survivor's rebuild, 4 ranks on 2 cores). The previous
model's grad buffers hold nothing a recovery needs (the next step zeroes them), so ``clean`` keeps
them (:func:`spare_buffers`) instead of giving them back to the system, and the rebuild's DDP takes
them again (:func:`recycled_buffers`): a kept buffer of exactly the size and dtype asked for is
zeroed in place (already mapped: a memset) and handed out instead of a new one. The result is the
same zeros; only the memory is reused. Other devices keep their own caching allocators and are left
alone.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["uninitialised_weights", "build_for_restore", "restorable", "spare_buffers", "recycled_buffers"]

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def uninitialised_weights():
    """megatron-core configs created inside have ``perform_initialization=False`` (weights allocated,
    not drawn). For the builder's own thread: the recovery actions run while training is parked."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    original = ModelParallelConfig.__post_init__

    def post_init(self):
        original(self)
        self.perform_initialization = False

    ModelParallelConfig.__post_init__ = post_init
    try:
        yield
    finally:
        ModelParallelConfig.__post_init__ = original


def _storages(obj, out: set) -> set:
    """Data pointers of the storages of every tensor in ``obj`` (nested dicts, lists, tuples; objects
    with a tensor ``data``, as megatron's ShardedTensor)."""
    import torch

    if torch.is_tensor(obj):
        out.add(obj.untyped_storage().data_ptr())
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, out)
    elif torch.is_tensor(getattr(obj, "data", None)):
        out.add(obj.data.untyped_storage().data_ptr())
    return out


def spare_buffers(model, kept: Any = None) -> List[Any]:
    """The CPU grad buffers of megatron DDP chunks ``model`` (flat, one per buffer), for a rebuild to
    take again (:func:`recycled_buffers`); none that shares memory with its param buffer or with a
    tensor of ``kept`` (what clean() keeps)."""
    import torch

    out, taken = [], _storages(kept, set())
    for chunk in model or ():
        for buf in list(getattr(chunk, "buffers", ())) + list(getattr(chunk, "expert_parallel_buffers", ())):
            grad, param = getattr(buf, "grad_data", None), getattr(buf, "param_data", None)
            if not torch.is_tensor(grad) or grad.device.type != "cpu" or grad.dim() != 1:
                continue
            ptr = grad.untyped_storage().data_ptr()
            if ptr in taken or torch.is_tensor(param) and param.untyped_storage().data_ptr() == ptr:
                continue  # megatron's shared param/grad buffer (MXFP8), or memory clean() keeps
            out.append(grad.detach())
    return out


@contextlib.contextmanager
def recycled_buffers(spares: List[Any]):
    """Inside, ``torch.zeros(n, dtype=, device=cpu)`` -- how megatron's DDP allocates its buffers --
    returns a tensor of ``spares`` with ``n`` elements of that dtype, zeroed in place, instead of new
    memory (each spare once); every other call is unchanged. The patch is process-wide while inside, like
    :func:`uninitialised_weights`'s: a matching call from another thread meanwhile may take a spare too
    (it gets the same zeros; DDP then allocates fresh memory). ``spares`` is emptied: what was not taken
    is dropped."""
    import torch

    pool, original = list(spares), torch.zeros
    spares.clear()

    def zeros(*size, **kwargs):
        if pool and len(size) == 1 and isinstance(size[0], int) and set(kwargs) <= {"dtype", "device", "requires_grad"}:
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "cpu":
                for i, t in enumerate(pool):
                    if t.numel() == size[0] and t.dtype == dtype:
                        del pool[i]
                        return t.zero_().requires_grad_(bool(kwargs.get("requires_grad", False)))
        return original(*size, **kwargs)

    torch.zeros = zeros
    try:
        yield
    finally:
        torch.zeros = original
        pool.clear()


def restorable(model, optimizer) -> bool:
    """Every param of ``model`` is restored by the rollback: there is a distributed optimizer and
    every param is trainable (megatron's DDP puts exactly the trainable params into the buffers the
    optimizer's shards and the param all-gather cover)."""
    from .optimizer import distributed_optimizers

    try:
        if not distributed_optimizers(optimizer):
            return False
    except TypeError:  # not a ReplicaDistributedOptimizer: no params_from_main at the rollback
        return False
    return all(p.requires_grad for chunk in model or () for p in chunk.parameters())


def build_for_restore(build: Callable[[], Tuple[Any, Any, Any]], why: str,
                      spares: Optional[List[Any]] = None) -> Tuple[Any, Any, Any]:
    """``build()`` without weight initialisation, for a rank whose params the rollback restores
    (``why`` names the caller in the log); a full ``build()`` again if some param would not be.
    ``spares``: buffers of the previous build its DDP may take again (:func:`recycled_buffers`; emptied)."""
    t0 = time.monotonic()
    with uninitialised_weights(), recycled_buffers(spares if spares is not None else []):
        model, optimizer, scheduler = build()
    if restorable(model, optimizer):
        _log.info("%s: model and optimizer built in %.3f s without weight initialisation (every param is "
                  "restored from the optimizer's fp32 shards at the rollback)", why, time.monotonic() - t0)
        return model, optimizer, scheduler
    _log.warning("%s: some model param is frozen or outside a distributed optimizer, so the rollback would "
                 "not restore it: building again with the weight initialisation (%.3f s spent)",
                 why, time.monotonic() - t0)
    del model, optimizer, scheduler
    return build()

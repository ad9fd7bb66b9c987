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
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Tuple

__all__ = ["uninitialised_weights", "build_for_restore", "restorable"]

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


def build_for_restore(build: Callable[[], Tuple[Any, Any, Any]], why: str) -> Tuple[Any, Any, Any]:
    """``build()`` without weight initialisation, for a rank whose params the rollback restores
    (``why`` names the caller in the log); a full ``build()`` again if some param would not be."""
    t0 = time.monotonic()
    with uninitialised_weights():
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

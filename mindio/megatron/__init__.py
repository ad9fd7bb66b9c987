"""Megatron (megatron-core) adapter for mindio: replica optimizer, recovery callbacks, checkpoints.

Importing this package imports megatron-core but changes nothing: the CPU patches are applied
only by :func:`setup_cpu` (``mindio.megatron._cpu_compat.apply``) in CPU-only processes.
See docs/megatron.md for the integration points.
"""
from .._extras import require as _require
from .._lazy_compile import deferred_compile as _deferred_compile

with _deferred_compile():  # megatron-core's torch.compile decorations cost nothing until used (_lazy_compile.py)
    _require("megatron.core", "megatron")  # a missing extra names its pip command, under any launcher

from . import checkpoint, replica  # noqa: E402
from .adapter import MegatronAdapter, TrainingContext
from mindio.adapter import register

from .arguments import add_high_availability_args, replica_count, resolve_high_availability, wants_dump
from .digest import state_digest
from .optimizer import ReplicaDistributedOptimizer, distributed_optimizers, install


def setup_cpu() -> bool:
    """Apply the CPU compatibility patches when no CUDA device exists. Returns whether applied."""
    import torch

    if torch.cuda.is_available():
        return False
    from . import _cpu_compat

    _cpu_compat.apply()
    return True


__all__ = [
    "MegatronAdapter",
    "TrainingContext",
    "ReplicaDistributedOptimizer",
    "install",
    "distributed_optimizers",
    "state_digest",
    "setup_cpu",
    "add_high_availability_args",
    "resolve_high_availability",
    "wants_dump",
    "replica_count",
    "register",
    "checkpoint",
    "replica",
]

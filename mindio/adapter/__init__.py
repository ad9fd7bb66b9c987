"""Framework-neutral adapter interface: the callbacks a training framework gives mindio.

See :mod:`mindio.adapter.interface` for the protocol and docs/adapter.md for a walk-through.
Imports torch, never megatron.
"""

from .ddp import wrap as wrap_ddp
from .digest import global_digest, local_digest
from .interface import FrameworkAdapter, RepairRole, register, repair_pairs
from .transfer import StateMismatch, capture_rng, recv_state, restore_rng, send_state

__all__ = [
    "FrameworkAdapter",
    "RepairRole",
    "register",
    "repair_pairs",
    "send_state",
    "recv_state",
    "capture_rng",
    "restore_rng",
    "StateMismatch",
    "local_digest",
    "global_digest",
    "wrap_ddp",
]

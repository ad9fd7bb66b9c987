"""torch._dynamo before ``init_process_group``: the SIGABRT window at exit (issue 13).

In torch 2.13, torch._dynamo imported *after* ``init_process_group`` keeps the default process group
alive past ``destroy_process_group``: its gloo worker threads still run when the interpreter shuts down,
which can then abort with SIGABRT (pytorch/pytorch#190489; mindio/ttp/shutdown.py names it at exit).
Every torch optimizer's constructor imports it (``torch.optim.Adam(...)``: 1.06 CPU-s, measured here),
and so does DistributedDataParallel's -- most training scripts build one after ``init_process_group``.

Imported before the group exists it costs such a script nothing more (and a fork server's children
nothing at all: mindio-run's fork server imports it once for every rank of the node). A script that
never imports it would pay ~1 CPU-s per process for nothing, so it is imported early only for a script
whose source names what imports it (:func:`wanted`): a torch optimizer, DistributedDataParallel /
FullyShardedDataParallel, torch.compile, or megatron (whose optimizer is a torch one). A script it
misses still works; its exit may warn.
"""
from __future__ import annotations

import re
import sys

__all__ = ["wanted", "import_early"]

_NAMES = re.compile(rb"\boptim\b|DistributedDataParallel|FullyShardedDataParallel|torch\.compile|\bmegatron\b")


def wanted(path: str | None) -> bool:
    """Whether the script at ``path`` names something that imports torch._dynamo (a torch optimizer, DDP,
    FSDP, torch.compile, megatron); False when it cannot be read."""
    if not path:
        return False
    try:
        with open(path, "rb") as f:
            return _NAMES.search(f.read(1 << 22)) is not None
    except OSError:
        return False


def import_early(path: str | None) -> None:
    """Import torch._dynamo now if the script at ``path`` wants it (:func:`wanted`), torch is imported and
    no process group exists yet (too late otherwise: the exit says so)."""
    if "torch" not in sys.modules or "torch._dynamo" in sys.modules or not wanted(path):
        return
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            import torch._dynamo  # noqa: F401
    except Exception:  # a torch without it, or a broken install: the script meets the same error itself
        pass

"""``state-digest``: one sha256 over the training state of every rank, to compare runs bit for bit.

Every rank hashes the tensors it is responsible for (the caller decides: e.g. model params on one
DP rank per model-parallel slice, optimizer shards on one replica), the 32-byte digests are
all-gathered (a fixed-size uint8 tensor: no pickle) and hashed in global rank order. Every rank
gets the same hex string.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Tuple

import torch
import torch.distributed as dist

__all__ = ["local_digest", "global_digest"]


def local_digest(named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> bytes:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in the given order."""
    h = hashlib.sha256()
    for name, t in named_tensors:
        t = t.detach().reshape(-1).contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def global_digest(local: bytes, group=None) -> str:
    """Combine every rank's ``local`` digest (rank order) into one hex string, on every rank."""
    mine = torch.frombuffer(bytearray(local), dtype=torch.uint8).clone()
    if not (dist.is_available() and dist.is_initialized()):
        return hashlib.sha256(local).hexdigest()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    h = hashlib.sha256()
    for p in parts:
        h.update(bytes(p.tolist()))
    return h.hexdigest()

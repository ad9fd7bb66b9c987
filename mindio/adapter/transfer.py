"""Point-to-point transfer of training state for repair, framework-neutral.

Protocol (one repair pair, both sides agree on the tensor list from their identical layouts):

1. sender: ``send_state(tensors, scalars, dst)``; receiver: ``recv_state(tensors, src)``.
2. First a fixed 16-byte header (magic, version, tensor count, scalar-blob length) so a layout
   mismatch fails loudly instead of corrupting memory; then the JSON scalar blob (iteration,
   consumed samples, scheduler, loss scale, RNG states: no pickle); then every tensor in order,
   received in place into the receiver's own (live) tensors.

Uses ``torch.distributed.send/recv`` on ``group`` (the world by default), with global ranks.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["send_state", "recv_state", "capture_rng", "restore_rng", "StateMismatch"]

_MAGIC = b"MIOR"
_VERSION = 1


class StateMismatch(RuntimeError):
    """The sender's and receiver's shard layouts differ: repair cannot be done from this source."""


def _header(n_tensors: int, blob_len: int) -> torch.Tensor:
    raw = _MAGIC + struct.pack("<HHQ", _VERSION, 0, blob_len) + struct.pack("<I", n_tensors)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def send_state(
    tensors: List[torch.Tensor], scalars: Dict[str, Any], dst: int, group=None
) -> int:
    """Send ``scalars`` (JSON-able) and ``tensors`` to global rank ``dst``. Returns bytes sent."""
    blob = json.dumps(scalars, sort_keys=True).encode()
    dist.send(_header(len(tensors), len(blob)), dst, group=group)
    if blob:
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=group)
    total = len(blob)
    for t in tensors:
        dist.send(t.detach().contiguous(), dst, group=group)
        total += t.numel() * t.element_size()
    return total


def recv_state(tensors: List[torch.Tensor], src: int, group=None) -> Dict[str, Any]:
    """Receive into ``tensors`` (in place, same order and shapes as the sender's) from ``src``.

    Returns the scalar state. Raises :class:`StateMismatch` when the sender's tensor count differs.
    """
    header = torch.empty(20, dtype=torch.uint8)
    dist.recv(header, src, group=group)
    raw = bytes(header.tolist())
    if raw[:4] != _MAGIC:
        raise StateMismatch(f"repair stream from rank {src} has a bad magic {raw[:4]!r}")
    version, _, blob_len = struct.unpack("<HHQ", raw[4:16])
    (n_tensors,) = struct.unpack("<I", raw[16:20])
    if version != _VERSION:
        raise StateMismatch(f"repair stream version {version} from rank {src}, expected {_VERSION}")
    scalars: Dict[str, Any] = {}
    if blob_len:
        buf = torch.empty(blob_len, dtype=torch.uint8)
        dist.recv(buf, src, group=group)
        scalars = json.loads(bytes(buf.tolist()).decode())
    if n_tensors != len(tensors):
        raise StateMismatch(
            f"rank {src} sends {n_tensors} state tensors, this rank expects {len(tensors)}: "
            "the sender is not a replica of this rank (layout or model differ)"
        )
    for t in tensors:
        if t.is_contiguous():
            dist.recv(t, src, group=group)
        else:
            tmp = torch.empty_like(t, memory_format=torch.contiguous_format)
            dist.recv(tmp, src, group=group)
            with torch.no_grad():
                t.copy_(tmp)
    return scalars


def capture_rng(extra: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, Any]:
    """Python, numpy and torch CPU RNG states (plus named generator states) as JSON-able data."""
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if extra:
        out["extra"] = {k: v.tolist() for k, v in extra.items()}
    return out


def restore_rng(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`capture_rng`; returns the named extra generator states as tensors."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    return {k: torch.tensor(v, dtype=torch.uint8) for k, v in state.get("extra", {}).items()}

"""Point-to-point transfer of training state for repair, framework-neutral.

Protocol (one repair pair, both sides agree on the tensor list from their identical layouts):

1. sender: ``send_state(tensors, scalars, dst)``; receiver: ``recv_state(tensors, src)``.
2. sender -> receiver: a fixed 28-byte header (magic, version, scalar-blob length, tensor count,
   8 bytes of sha256 over every tensor's dtype and shape).
3. receiver -> sender: a one-byte verdict (1 = same layout). On 0 both sides raise
   :class:`StateMismatch` and nothing else is sent: a non-replica never overwrites memory.
4. sender -> receiver: the JSON scalar blob (iteration, consumed samples, scheduler, loss scale,
   RNG states: no pickle), then every tensor in order, received in place into the receiver's
   own (live) tensors.

Uses ``torch.distributed.send/recv`` on ``group`` (the world by default), with global ranks.
"""

from __future__ import annotations

import hashlib
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


_HEADER_LEN = 28


def _layout(tensors: List[torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
    return h.digest()[:8]


def _header(n_tensors: int, blob_len: int, layout: bytes) -> torch.Tensor:
    raw = _MAGIC + struct.pack("<HHQI", _VERSION, 0, blob_len, n_tensors) + layout
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _recv(t: torch.Tensor, src: int, group, what: str) -> None:
    """``dist.recv`` from ``src``, bounded by the group's timeout; a failure names what was awaited."""
    try:
        dist.recv(t, src, group=group)
    except RuntimeError as exc:  # gloo: timeout or connection closed; nccl/hccl: communicator error
        raise RuntimeError(f"repair: waiting for the {what} from rank {src} failed ({exc}); the wait is "
                           "bounded by the process group's timeout (init_process_group(timeout=...) of the "
                           "framework; MINDIO_PG_TIMEOUT in a replacement process)") from exc


def send_state(
    tensors: List[torch.Tensor], scalars: Dict[str, Any], dst: int, group=None
) -> int:
    """Send ``scalars`` (JSON-able) and ``tensors`` to global rank ``dst``. Returns bytes sent.

    Raises :class:`StateMismatch` when the receiver's layout differs (nothing is sent then).
    """
    blob = json.dumps(scalars, sort_keys=True).encode()
    dist.send(_header(len(tensors), len(blob), _layout(tensors)), dst, group=group)
    verdict = torch.zeros(1, dtype=torch.uint8)
    _recv(verdict, dst, group, "receiver's layout verdict")
    if verdict.item() != 1:
        raise StateMismatch(f"rank {dst} refused the repair stream: its optimizer-state layout "
                            f"differs from this rank's ({len(tensors)} tensors)")
    if blob:
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=group)
    total = len(blob)
    for t in tensors:
        dist.send(t.detach().contiguous(), dst, group=group)
        total += t.numel() * t.element_size()
    return total


def recv_state(tensors: List[torch.Tensor], src: int, group=None) -> Dict[str, Any]:
    """Receive into ``tensors`` (in place, same order, dtypes and shapes as the sender's).

    Returns the scalar state. Raises :class:`StateMismatch` (after telling the sender) when the
    sender's tensor count, dtypes or shapes differ, or the stream is not a repair stream.
    """
    header = torch.empty(_HEADER_LEN, dtype=torch.uint8)
    _recv(header, src, group, "repair stream header")
    raw = bytes(header.tolist())
    version, _, blob_len, n_tensors = struct.unpack("<HHQI", raw[4:20])
    problem = None
    if raw[:4] != _MAGIC:
        problem = f"repair stream from rank {src} has a bad magic {raw[:4]!r}"
    elif version != _VERSION:
        problem = f"repair stream version {version} from rank {src}, expected {_VERSION}"
    elif n_tensors != len(tensors) or raw[20:28] != _layout(tensors):
        problem = (f"rank {src} sends {n_tensors} state tensors, this rank expects "
                   f"{len(tensors)} (or their dtypes/shapes differ): the sender is not a "
                   "replica of this rank (layout or model differ)")
    dist.send(torch.tensor([0 if problem else 1], dtype=torch.uint8), src, group=group)
    if problem:
        raise StateMismatch(problem)
    scalars: Dict[str, Any] = {}
    if blob_len:
        buf = torch.empty(blob_len, dtype=torch.uint8)
        _recv(buf, src, group, "scalar state")
        scalars = json.loads(bytes(buf.tolist()).decode())
    for t in tensors:
        if t.is_contiguous():
            _recv(t, src, group, "optimizer state")
        else:
            tmp = torch.empty_like(t, memory_format=torch.contiguous_format)
            _recv(tmp, src, group, "optimizer state")
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

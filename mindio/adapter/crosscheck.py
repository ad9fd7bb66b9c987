"""Replica cross-check: the holders of one optimizer shard compare hashes of it every N steps.

mindio keeps every optimizer shard on ``R`` ranks (the replicas), bit-identical as long as nothing
corrupts one: a flipped bit in memory or a wrong result of a defective unit raises nothing and spreads
through the next steps. Every ``N`` steps (``MINDIO_CROSSCHECK_STEPS``) each holder hashes its whole shard
(the shard's tensors as one byte string) as ``N`` contiguous slices (:func:`slice_bounds`,
:func:`slice_hashes`: one pass over the bytes), the holders of each shard all-gather their slices' hashes
among themselves (R rows of N + 2 int64), and every rank all-gathers one row ``(step, holders, shard,
first differing slice, its bounds, this holder's hash of it)`` (7 int64) over the world, so that every
rank knows of a mismatch anywhere at the same step (an undo is job-wide) and which bytes differ. A flip
is found at the next multiple of N: within N steps.

Why every N steps and not a slice every step: the verified copy kept at each multiple of N
(mindio.megatron.verified) must be checked in full across the holders anyway, so hashing a slice every
step as well hashed every byte twice per N steps, and its all-gather every step cost more than the hash
(at 1 GiB per rank on a 2-core machine, 103 ms of all-gathers per step against 75 ms of hashing and
copying: docs/benchmarks.md).

The hash is XXH3-64 (the ``xxhash`` package: ~30 GB/s on one core here, 4x the CRC-32 this check used
before, ~7.5 GB/s on this machine's current host); two different byte strings hash alike with probability
about 2^-64. Any difference between holders is a mismatch: :func:`compare` returns the incidents
(``kind: "replica_mismatch"``, the holders, the first slice that differs, each holder's hash of it).
:func:`slice_hashes` with one slice is also what repairs check their bytes with (mindio.adapter.transfer).

Framework-neutral: the caller supplies the tensors (``step`` must be the same on every holder: the
optimizer's own step count, part of the replicated state) and the groups; mindio.megatron.optimizer
and mindio.megatron.verified run it.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import xxhash

__all__ = ["slice_bounds", "slice_hashes", "shard_bytes", "compare", "ReplicaMismatch", "COST"]

#: what the cross-check cost this rank since the last verified copy (mindio.megatron.verified reports it,
#: event ``crosscheck_cost``, then zeroes it): seconds hashing and copying (``work_s``), seconds in its
#: all-gathers (``gather_s``: the exchange, plus any wait for a rank that arrives later), steps since
COST = {"work_s": 0.0, "gather_s": 0.0, "steps": 0}


class ReplicaMismatch(RuntimeError):
    """Two holders of one optimizer shard hold different bytes: silent corruption on one of them."""

    def __init__(self, incident: Dict):
        h = incident["hashes"]
        super().__init__(
            f"replica mismatch at step {incident['step']}: optimizer shard {incident['shard']} differs between "
            f"its holders, ranks {' and '.join(map(str, incident['holders']))}, in bytes "
            f"{incident['slice'][0]}..{incident['slice'][1]} (XXH3-64 "
            + ", ".join(f"rank {r}: {c & (1 << 64) - 1:016x}" for r, c in sorted(h.items()))
            + f"); every byte is checked once every {incident['every']} steps (MINDIO_CROSSCHECK_STEPS)")
        self.incident = incident


def slice_bounds(total: int, every: int, step: int) -> Tuple[int, int]:
    """Bytes ``[lo, hi)`` of slice ``step mod every`` of a ``total``-byte shard: ``every`` contiguous
    slices of ``ceil(total / every)`` bytes (the last may be shorter or empty). The slices of any
    ``every`` consecutive steps are all of them: every byte once."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    size = -(-total // every)
    lo = min((step % every) * size, total)
    return lo, min(lo + size, total)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_nbytes(t) for t in tensors)


def _raw(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.is_contiguous() else flat.contiguous().view(torch.uint8)


def slice_hashes(tensors: Sequence[torch.Tensor], every: int) -> List[int]:
    """The XXH3-64 of each of the ``every`` slices of the shard (:func:`slice_bounds`), as signed int64
    (what a tensor row carries), in one pass over its bytes: slice ``i``'s is the hash of bytes
    ``slice_bounds(shard_bytes(tensors), every, i)`` of the tensors' bytes end to end."""
    total = shard_bytes(tensors)
    bounds = [slice_bounds(total, every, i) for i in range(every)]
    hashers = [xxhash.xxh3_64() for _ in range(every)]
    offset, first = 0, 0
    for t in tensors:
        n = _nbytes(t)
        if n:
            raw = _raw(t)
            while bounds[first][1] <= offset:  # slices that end before this tensor
                first += 1
            i = first
            while i < every and bounds[i][0] < offset + n:
                a, b = max(bounds[i][0], offset), min(bounds[i][1], offset + n)
                if a < b:
                    part = raw[a - offset:b - offset]
                    hashers[i].update(part.cpu().numpy() if part.device.type != "cpu" else part.numpy())
                i += 1
        offset += n
    return [_signed(h.intdigest()) for h in hashers]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def compare(tensors: Sequence[torch.Tensor], step: int, every: int, key: int, shard: int,
            holders=None, device: Optional[torch.device] = None, hashes: Optional[List[int]] = None,
            group=None) -> List[Dict]:
    """Compare this rank's shard with the other holders': its ``every`` slices' hashes (``hashes``, when the
    caller has them: :func:`slice_hashes`) all-gathered over ``holders`` (the group of this shard's holders;
    collective on it), then one row per rank over ``group`` (default the world; collective on it). ``key``
    names this rank's holders (e.g. the lowest rank among them): rows with the same key must be equal;
    ``shard``: which shard they hold (for the message). Returns the incidents, the same list on every rank
    of ``group``: for each shard whose holders differ, the first slice that differs and each holder's hash
    of it."""
    t0 = time.perf_counter()
    total = shard_bytes(tensors)
    hashes = slice_hashes(tensors, every) if hashes is None else hashes
    mine = torch.tensor([step, total, *hashes], dtype=torch.int64, device=device)
    peers = dist.get_process_group_ranks(holders) if holders is not None else [dist.get_rank()]
    rows = [torch.empty_like(mine) for _ in peers]
    t1 = time.perf_counter()
    if holders is not None:
        dist.all_gather(rows, mine, group=holders)
    else:
        rows = [mine]
    t2 = time.perf_counter()
    rows = [r.tolist() for r in rows]
    if all(r == rows[0] for r in rows):
        diff, lo, hi = -1, 0, 0
    else:  # the first slice some holder hashed otherwise; a different step or size: the whole shard
        same = all(r[:2] == rows[0][:2] for r in rows)
        diff = next((i for i in range(every) if len({r[2 + i] for r in rows}) > 1), 0) if same else 0
        lo, hi = slice_bounds(total, every, diff) if same else (0, total)
    mine = torch.tensor([step, key, shard, diff, lo, hi, hashes[diff] if diff >= 0 else 0],
                        dtype=torch.int64, device=device)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    parts = [torch.empty_like(mine) for _ in ranks]
    t3 = time.perf_counter()
    dist.all_gather(parts, mine, group=group)
    COST["work_s"] += (t1 - t0) + (t3 - t2)
    COST["gather_s"] += (t2 - t1) + (time.perf_counter() - t3)
    found: Dict[Tuple[int, int], List[Tuple[int, List[int]]]] = {}
    for r, p in zip(ranks, parts):
        row = p.tolist()
        if row[3] >= 0:
            found.setdefault((row[1], row[2]), []).append((r, row))
    return [{"kind": "replica_mismatch", "step": rows_[0][1][0], "shard": shard_index,
             "holders": [r for r, _ in rows_], "slice": rows_[0][1][4:6], "every": every,
             "hashes": {r: row[6] for r, row in rows_}} for (_, shard_index), rows_ in found.items()]

"""The daemon's block allocator: contiguous runs of fixed-size blocks in one pool file (pure logic).

A region is ``(offset, length)`` in bytes, block aligned. First fit from the low end, so that early
saves land in the part of the pool that was pre-faulted first.
"""
from __future__ import annotations

__all__ = ["BlockAllocator"]


class BlockAllocator:
    def __init__(self, pool_bytes: int, block_bytes: int):
        if block_bytes <= 0 or pool_bytes < block_bytes:
            raise ValueError(f"pool of {pool_bytes} bytes cannot hold one {block_bytes}-byte block")
        self.block = block_bytes
        self.nblocks = pool_bytes // block_bytes
        self._used = bytearray(self.nblocks)

    def grow(self, pool_bytes: int) -> None:
        """Extend the pool to ``pool_bytes`` (never shrinks): new blocks are free."""
        self._used.extend(bytes(max(0, pool_bytes // self.block - self.nblocks)))
        self.nblocks = len(self._used)

    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block))

    def allocate(self, nbytes: int):
        """Offset of a free run big enough for ``nbytes``, or None when no run fits."""
        need = self.blocks_for(nbytes)
        run = 0
        for i in range(self.nblocks):
            run = run + 1 if not self._used[i] else 0
            if run == need:
                start = i - need + 1
                self._used[start: i + 1] = b"\1" * need
                return start * self.block
        return None

    def free(self, offset: int, nbytes: int) -> None:
        start, need = offset // self.block, self.blocks_for(nbytes)
        if offset % self.block or not all(self._used[start: start + need]):
            raise ValueError(f"free of region ({offset}, {nbytes}) that is not allocated")
        self._used[start: start + need] = bytes(need)

    def free_bytes(self) -> int:
        return self._used.count(0) * self.block

    def largest_free(self) -> int:
        best = run = 0
        for used in self._used:
            run = 0 if used else run + 1
            best = max(best, run)
        return best * self.block

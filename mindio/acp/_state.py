"""The daemon's in-memory namespace: regions of the pool, entries (one saved version of a path), leases.

Rules (all under the daemon's one lock):
- A region is freed only when no entry references it and no client holds a lease on it, so a
  client's zero-copy view of a loaded checkpoint can never see its bytes reused.
- The newest committed entry of a path is the one ``lookup`` returns. A pending older entry is
  dropped when a newer one commits (the path will hold the newer data); one already being written
  finishes first and the newer rename lands after it.
- Eviction removes only persisted, unleased entries, least recently used first. Entries whose data
  is only in memory (pending, persisting, failed) are never evicted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Region", "Entry", "PENDING", "PERSISTING", "PERSISTED", "FAILED", "SUPERSEDED", "LIVE"]

PENDING, PERSISTING, PERSISTED, FAILED, SUPERSEDED = "pending", "persisting", "persisted", "failed", "superseded"
LIVE = (PENDING, PERSISTING, FAILED)  # data exists only in memory


@dataclass(eq=False)
class Region:
    file: str            # pool file holding the bytes (the current pool, or a recovered old one)
    offset: int
    size: int
    view: memoryview     # the daemon's view of exactly these bytes
    padded: memoryview   # the same bytes rounded up to whole pages (O_DIRECT writes; the slack is ours)
    release: object      # callable(region) returning the bytes to their allocator
    refs: int = 0
    leases: int = 0

    def maybe_free(self) -> bool:
        if self.refs == 0 and self.leases == 0 and self.release is not None:
            release, self.release = self.release, None
            release(self)
            return True
        return False


@dataclass(eq=False)
class Entry:
    seq: int
    path: str
    region: Region
    kind: str            # "acp" (mindio container), "raw" (create_file bytes), "cache" (preload, never written)
    mode: int = 0o644
    state: str = PENDING
    attempts: int = 0
    not_before: float = 0.0
    error: str = ""
    stat: list | None = None   # [st_ino, st_mtime_ns, st_size] of the persisted file
    last_used: float = field(default_factory=time.monotonic)
    deleted: bool = False      # dropped by the user while being written: unlink after the rename

    def wire(self) -> dict:
        return {"seq": self.seq, "path": self.path, "state": self.state, "error": self.error}

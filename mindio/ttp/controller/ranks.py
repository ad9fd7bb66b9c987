"""Controller side: what the controller knows of one rank (its row of the rank table) and the table.

The record is shared by the registration (controller.py) and the flows that add ranks to the table
(elastic_flow.py's upgrade, recover.py's replacements); it lives here so that none of them imports the
controller.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankRecord", "RankTable", "infer_layout"]


@dataclass
class RankRecord:
    rank: int
    ident: bytes
    pid: int = 0
    host: str = ""
    last_seen: float = 0.0
    step: int = 0
    data_status: int = 0
    in_collective: bool = False
    progress_age: float = -1.0
    coll_seq: dict = field(default_factory=dict)  # {group name: last collective entered} (processor/collectives.py)
    idle_age: float = -1.0  # seconds since its main thread last ran or waited on storage (controller/hangs.py)
    step_p99: float = -1.0  # p99 of the rank's recent step times, -1 until known (controller/hangs.py)
    replica: list = field(default_factory=list)
    dp_group: list = field(default_factory=list)
    alive: bool = True
    faulty: bool = False
    registered: bool = True
    features: dict = field(default_factory=dict)  # the processor's enable flags (uce/arf/zit); retry.py
    gen: int = 0  # generation the rank's process registered in (a replacement: the recovery's)
    left: bool = False  # said BYE: its late heartbeats are answered "BYE", never "register again"


class RankTable(dict):
    """The controller's rank table, ``{rank: RankRecord}``; call its queries under the controller's lock
    (the I/O thread changes the records)."""

    def live(self) -> list[int]:
        """The live ranks, sorted."""
        return sorted(r.rank for r in self.values() if r.alive)

    def dead(self) -> list[int]:
        """The dead ranks (known to the table), sorted."""
        return sorted(r.rank for r in self.values() if not r.alive)


def infer_layout(rank: int, records) -> tuple[list, list]:
    """(replica, dp_group) of ``rank`` as the other ranks' records tell it: a DP group's replica entry
    ({rank_list, replica_cnt}) is the same on every member, so a rank that never registered here (a
    backup controller taking over after the primary's node died with it) gets the entry of any member
    that did, per optimizer type. Empty when no record names ``rank``."""
    replica: dict = {}
    dp_group: list = []
    for r in records:
        if not r.registered:
            continue
        for t, entry in enumerate(r.replica or ()):
            if entry and rank in entry.get("rank_list", ()):
                replica.setdefault(t, dict(entry))
        if not dp_group and rank in (r.dp_group or ()):
            dp_group = list(r.dp_group)
    return [replica.get(t, {}) for t in range(max(replica) + 1)] if replica else [], dp_group

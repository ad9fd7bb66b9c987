"""Elastic training (MindIO ZIT), rank side: the zit actions a processor runs (rebuild the shrunken or
full world, repair a new rank from a replica, roll back) and what a training script asks of them
(:func:`is_standby`, :func:`job_rank`). The controller side and the flows are in elastic_flow.py, the
standby process in standby.py; mindio.ttp.elastic, the public module, re-exports these names.
"""
from __future__ import annotations

import logging
import time

from . import inplace
from .._enums import ActionName, RepairType

__all__ = ["ACTIONS", "is_standby", "job_rank"]

_log = logging.getLogger("mindio.ttp.elastic")


# ============================================ processor side (p: the rank's RankState, rank_state.py)
def torch_rank(p, job_rank: int | None = None) -> int:
    """Position of ``job_rank`` (default: processor ``p``'s rank) in the current torch world."""
    r = p.rank if job_rank is None else job_rank
    return r if p.members is None else p.members.index(r)


def zit_rebuild(p, gen: int, members: list, kind: str, dp_groups: list | None = None,
                rank_list: list | None = None) -> dict:
    if kind not in ("downgrade", "upgrade"):
        raise ValueError(f"zit_rebuild kind {kind!r}: 'downgrade' or 'upgrade'")
    members = sorted(int(r) for r in members)
    p.members = None if members == list(range(p.world_size)) else members
    t0 = inplace.new_world(p, gen, torch_rank(p), len(members))
    if kind == "downgrade":
        func, ctx = p.callback("zit_downgrade_rebuild")
        dp = next((g for g in dp_groups or () if p.rank in g), [])
        func(list(dp), members, p.step_args, ctx)
    else:
        func, ctx = p.callback("zit_upgrade_rebuild")
        func(list(rank_list or ()), p.step_args, ctx)
    ms = (time.monotonic() - t0) * 1000
    _log.info("%s: world of %d ranks rebuilt (generation %d, torch rank %d) in %.1f ms", kind, len(members),
              gen, torch_rank(p), ms)
    return {"gen": gen, "ms": round(ms, 2)}


def zit_repair(p, step: int, error_ranks: list, pairs: list) -> dict:
    return inplace.repair_pairs(p, "zit_upgrade_repair", step, error_ranks, pairs,
                                lambda pair: RepairType.RT_RECV_REPAIR.name, lambda r: torch_rank(p, r))


def zit_rollback(p, step: int) -> dict:
    out = inplace.roll_back(p, step, "zit_upgrade_rollback", "recover" if p.standby else "retry")
    p.standby = False
    return out


# the processor's handlers for the zit actions (Processor.ACTIONS takes them in)
ACTIONS = {ActionName.ZIT_REBUILD: zit_rebuild, ActionName.ZIT_REPAIR: zit_repair,
           ActionName.ZIT_ROLLBACK: zit_rollback}


def is_standby() -> bool:
    """True in a standby process until the upgrade repaired it."""
    from .._runtime import state

    return state.processor is not None and state.processor.standby


def job_rank(torch_rank: int) -> int:
    """The controller's rank id of ``torch_rank`` in the current (possibly shrunken) world."""
    from .._runtime import state

    members = state.processor.members if state.processor is not None else None
    return torch_rank if members is None else members[torch_rank]

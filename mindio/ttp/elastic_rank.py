"""Elastic training (MindIO ZIT), rank side: the zit actions a processor runs (rebuild the shrunken or
full world, repair a new rank from a replica, roll back) and what a training script asks of them
(:func:`is_standby`, :func:`job_rank`). The controller side and the flows are in elastic_flow.py, the
standby process in standby.py; mindio.ttp.elastic, the public module, re-exports these names.
"""
from __future__ import annotations

import logging
import time

from .. import _logging
from . import device
from ._enums import OsStatus, RepairType

__all__ = ["ElasticActions", "is_standby", "job_rank"]

_log = logging.getLogger("mindio.ttp.elastic")


# ===================================================================== processor side
class ElasticActions:
    """Processor side; mixed into :class:`mindio.ttp.processor.Processor` (actions run on their own
    thread while the main thread is parked, like inplace.py)."""

    standby = False
    members: list | None = None

    def torch_rank(self, job_rank: int | None = None) -> int:
        """Position of ``job_rank`` (default: this rank) in the current torch world."""
        r = self.rank if job_rank is None else job_rank
        return r if self.members is None else self.members.index(r)

    def _do_zit_rebuild(self, gen: int, members: list, kind: str, dp_groups: list | None = None,
                        rank_list: list | None = None) -> dict:
        import torch.distributed as dist

        if self._base_store is None:
            raise RuntimeError("no job store remembered: cannot rebuild the process groups")
        t0 = time.monotonic()
        if dist.is_initialized():
            device.backend_for().clean()
        members = sorted(int(r) for r in members)
        self.members = None if members == list(range(self.world_size)) else members
        self._init_default_group(gen, self.torch_rank(), len(members))
        device.backend_for().reinit()
        self.gen = gen
        if kind == "downgrade":
            func, ctx = self._callback("zit_downgrade_rebuild")
            dp = next((g for g in dp_groups or () if self.rank in g), [])
            func(list(dp), members, self.step_args, ctx)
        elif kind == "upgrade":
            func, ctx = self._callback("zit_upgrade_rebuild")
            func(list(rank_list or ()), self.step_args, ctx)
        else:
            raise ValueError(f"zit_rebuild kind {kind!r}: 'downgrade' or 'upgrade'")
        ms = (time.monotonic() - t0) * 1000
        _log.info("%s: world of %d ranks rebuilt (generation %d, torch rank %d) in %.1f ms", kind, len(members),
                  gen, self.torch_rank(), ms)
        return {"gen": gen, "ms": round(ms, 2)}

    def _do_zit_repair(self, step: int, error_ranks: list, pairs: list) -> dict:
        return self._repair_pairs("zit_upgrade_repair", step, error_ranks, pairs, lambda p: RepairType.RT_RECV_REPAIR.name,
                                  self.torch_rank)  # inplace.py

    def _do_zit_rollback(self, step: int) -> dict:
        func, ctx = self._callback("zit_upgrade_rollback")
        func(step, self.step_args, ctx)
        self.step, self.data_status = step, OsStatus.UPDATED
        self.repair_type, self.repair_step = ("recover" if self.standby else "retry"), step
        self.standby = False
        _logging.set_context(step=step)
        return {"step": step}


def is_standby() -> bool:
    """True in a standby process until the upgrade repaired it."""
    from ._runtime import state

    return state.processor is not None and state.processor.standby


def job_rank(torch_rank: int) -> int:
    """The controller's rank id of ``torch_rank`` in the current (possibly shrunken) world."""
    from ._runtime import state

    members = state.processor.members if state.processor is not None else None
    return torch_rank if members is None else members[torch_rank]

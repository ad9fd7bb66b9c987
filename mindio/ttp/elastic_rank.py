"""Elastic training (MindIO ZIT), rank side: the zit actions a processor runs (rebuild the shrunken or
full world, repair a new rank from a replica, roll back), and the standby process that offers a removed
rank back (:func:`start_standby`). The controller side and the flows are in elastic.py, which re-exports
these names.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

from .. import _logging
from ..errors import ConfigError
from . import device
from ._enums import OsStatus

__all__ = ["ElasticActions", "start_standby", "is_standby", "job_rank"]

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
        return self._repair_pairs("zit_upgrade_repair", step, error_ranks, pairs, lambda p: "RT_RECV_REPAIR",
                                  self.torch_rank)  # inplace.py

    def _do_zit_rollback(self, step: int) -> dict:
        func, ctx = self._callback("zit_upgrade_rollback")
        func(step, self.step_args, ctx)
        self.step, self.data_status = step, OsStatus.UPDATED
        self.repair_type, self.repair_step = ("recover" if self.standby else "retry"), step
        self.standby = False
        _logging.set_context(step=step)
        return {"step": step}


# ===================================================================== standby process
def start_standby(rank: int, world_size: int, controller_ip: str, controller_port: int, master_addr: str,
                  master_port: int, backend: str = "gloo", enable_tls: bool = False, tls_info: str = "",
                  register=None) -> None:
    """In a new process offering ``rank`` back after a downgrade: start a processor that registers with
    the controller for that (removed) rank, with the job's store (``master_addr:master_port``, the
    TCPStore the survivors' world lives on) remembered for the upgrade's rebuild. No process group exists
    yet; then park the main thread with ``tft_wait_next_action()`` and enter ``train()`` on 0 (RETRY).
    ``register()`` runs after the processor exists and before it registers: register the callbacks there
    (the upgrade may start as soon as the registration arrives).
    """
    import torch.distributed as dist

    from . import api

    if dist.is_initialized():
        raise ConfigError("start_standby: this process already has a process group; a standby joins the "
                          "job's world only when the controller scales out")
    if not 0 <= rank < world_size:
        raise ConfigError(f"start_standby: rank {rank} must be in [0, world_size={world_size})")
    # the survivors rebuild on the store of their first default group (inplace.py remember_world): the
    # env:// TCPStore under torch's prefixes "default_pg" and "<group name>/" (the first group is "0");
    # without a secret of its own (MINDIO_SECRET / _FILE), the one the controller's rank published there
    tcp = dist.TCPStore(master_addr, int(master_port), is_master=False, timeout=timedelta(seconds=60))
    base = dist.PrefixStore("0/", dist.PrefixStore("default_pg", tcp))
    from . import transport

    if not transport.user_secret():
        os.environ["MINDIO_SECRET"] = transport.published_secret(
            base, f"tcp://{controller_ip}:{int(controller_port)}")
    api.tft_init_processor(rank, world_size, False, enable_tls=enable_tls, tls_info=tls_info, enable_zit=True)
    proc = api._proc()
    proc.standby = True
    proc._base_store = base
    proc._pg_settings = {"backend": backend}
    if register is not None:
        register()
    api.tft_start_processor(controller_ip, controller_port)


def is_standby() -> bool:
    """True in a standby process until the upgrade repaired it."""
    from ._runtime import state

    return state.processor is not None and bool(getattr(state.processor, "standby", False))


def job_rank(torch_rank: int) -> int:
    """The controller's rank id of ``torch_rank`` in the current (possibly shrunken) world."""
    from ._runtime import state

    members = getattr(state.processor, "members", None) if state.processor is not None else None
    return torch_rank if members is None else members[torch_rank]

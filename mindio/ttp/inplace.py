"""Processor side of the in-process recovery actions (the retry strategy: processes stay alive).

Mixed into :class:`mindio.ttp.processor.Processor`; each ``_do_<name>`` runs on the action's own
thread while the training main thread is parked in the decorator. The controller (retry.py) sends them
in this order, one action in flight, each to every live rank unless said otherwise:

1. ``clean(timeout)``: a rank whose main thread is blocked at the fence (``tft_start_updating_os`` /
   ``tft_pause_train``) gets ``RuntimeError("FORCE STOP")``, so the decorator reports it (RS_NORMAL),
   runs the stop + clean callbacks and parks; the action waits until the main thread is parked, then
   destroys any process group still left (``device.backend_for().clean()``).
2. ``rebuild(gen, fault_ranks)``: a new default process group on the job's store under the prefix
   ``mindio/gen<gen>/`` (keys of an older generation can never meet this one), device re-init, then the
   framework's ``rebuild_group(fault_ranks, args, ctx)`` callback re-creates its subgroups.
3. ``repair(step, error_ranks, pairs)`` (only the ranks named in ``pairs``): for each pair
   ``{"type", "src", "dst"}`` in the given order, the source calls ``repair(step, False, error_ranks,
   {"type", "repair_type": "RT_SEND", "src", "dst", "rank_list"}, args, ctx)`` and the destination the
   same with the pair's ``repair_type`` -- ``RT_UCE_LOWLEVEL`` (receive into the objects), or
   ``RT_UCE_HIGHLEVEL`` with ``need_rebuild=True`` when the error may have hit the update (the
   controller's choice, retry.uce_repair_type) -- a point-to-point transfer.
4. ``rollback(step)``: ``rollback(step, args, ctx)`` (iteration, scheduler, data iterator, params from
   the fp32 master + all-gather); this rank's step becomes ``step``, its optimizer state UPDATED.
5. ``retry``: release the fence and hand RETRY to the parked main thread: ``train()`` is re-entered.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from .. import _logging
from . import device
from ._enums import Action, OsStatus, RepairType

__all__ = ["InPlaceActions"]

_log = logging.getLogger(__name__)
_PG_TIMEOUT = timedelta(seconds=120)  # a rebuilt default group whose first one's timeout is unknown


class InPlaceActions:
    """See the module docstring. Uses the processor's ``_cond``, ``_main``, ``_next``, ``callbacks``."""

    gen = 0
    _base_store = None
    _pg_settings: dict = {}
    _force = False

    def remember_world(self) -> None:
        """(start-up, and before a teardown) Keep the job's store, backend and group timeout once: a
        rebuild re-creates the default group on them (same rank and world size, a new generation)."""
        if self._base_store is None and dist.is_available() and dist.is_initialized():
            self._base_store = dist.distributed_c10d._get_default_store()
            self._pg_settings = device.group_settings()

    def _init_default_group(self, gen: int, rank: int, world_size: int) -> None:
        """A new default group of generation ``gen`` on the job's store (prefix ``mindio/gen<gen>/``:
        keys of an older generation never meet it), with the first default group's backend, timeout
        and device."""
        settings = self._pg_settings
        dist.init_process_group(settings.get("backend", "gloo"),
                                store=dist.PrefixStore(f"mindio/gen{gen}/", self._base_store), rank=rank,
                                world_size=world_size, timeout=settings.get("timeout") or _PG_TIMEOUT,
                                device_id=settings.get("device_id"))

    def _check_force_stop(self) -> None:
        """(main thread, under ``_cond``) Raise FORCE STOP when the clean action asked for it."""
        if self._force:
            self._force = False
            raise RuntimeError("FORCE STOP: the controller stopped training on this rank (clean: a retry, or the end of the job)")

    def _do_clean(self, timeout: float = 60.0) -> dict:
        end = time.monotonic() + timeout
        with self._cond:
            if self._main == "fenced":
                self._force = True
                self._cond.notify_all()
            while self._main != "parked" and time.monotonic() < end:
                self._cond.wait(0.01)
            main = self._main
        if main != "parked":
            raise TimeoutError(f"main thread still {main} after {timeout:.0f} s; cannot clean this rank")
        destroyed = device.backend_for().clean() if dist.is_initialized() else 0
        return {"main": main, "destroyed": destroyed}

    def _do_rebuild(self, gen: int, fault_ranks: list) -> dict:
        if self._base_store is None:
            raise RuntimeError("no job store remembered (init_process_group must run before "
                               "tft_start_processor); cannot rebuild the process groups in place")
        t0 = time.monotonic()
        if dist.is_initialized():  # a rank that never tore down (should not happen after clean)
            device.backend_for().clean()
        self._init_default_group(gen, self.rank, self.world_size)
        device.backend_for().reinit()
        self.gen = gen
        if "rebuild_group" in self.callbacks:
            func, ctx = self.callbacks["rebuild_group"]
            func(list(fault_ranks), self.step_args, ctx)
        ms = (time.monotonic() - t0) * 1000
        _log.info("process groups rebuilt in place: generation %d in %.1f ms", gen, ms)
        return {"gen": gen, "ms": round(ms, 2)}

    def _do_repair(self, step: int, error_ranks: list, pairs: list, dst_type: str = RepairType.RT_UCE_LOWLEVEL.name) -> dict:
        # the receiver's kind per pair (retry: HIGHLEVEL/LOWLEVEL), else RT_RECV_REPAIR for a replacement
        # process (recover.py)
        return self._repair_pairs("repair", step, error_ranks, pairs, lambda p: p.get("repair_type", dst_type))

    def _repair_pairs(self, callback: str, step: int, error_ranks: list, pairs: list, recv_kind,
                      torch_rank=lambda r: r) -> dict:
        """Call the ``callback`` repair handler once for each pair ``{type, src, dst}`` this rank is in:
        ``RT_SEND`` as the source, ``recv_kind(pair)`` as the destination; ranks in the handler's
        arguments are ``torch_rank(r)`` (the elastic world renumbers them)."""
        func, ctx = self._callback(callback)
        done = []
        for pair in pairs:
            if self.rank == pair["src"]:
                kind = RepairType.RT_SEND.name
            elif self.rank == pair["dst"]:
                kind = recv_kind(pair)
            else:
                continue
            src, dst = torch_rank(pair["src"]), torch_rank(pair["dst"])
            info = {"type": pair["type"], "repair_type": RepairType[kind], "src": [src], "dst": [dst],
                    "rank_list": sorted({src, dst})}
            need_rebuild = kind in (RepairType.RT_UCE_HIGHLEVEL.name, RepairType.RT_LOAD_REBUILD.name)  # model/optimizer rebuilt first
            func(step, need_rebuild, [torch_rank(r) for r in error_ranks], info, self.step_args, ctx)
            done.append(kind)
        return {"done": done}

    def _do_rollback(self, step: int) -> dict:
        func, ctx = self._callback("rollback")
        func(step, self.step_args, ctx)
        self.step, self.data_status = step, OsStatus.UPDATED
        self.repair_type, self.repair_step = "retry", step
        _logging.set_context(step=step)
        return {"step": step}

    def _do_retry(self) -> dict:
        with self._cond:
            if self._main != "parked":
                raise RuntimeError(f"main thread is {self._main}, not parked: cannot re-enter train()")
            self._hold, self._allow, self._limit = False, None, None
            if self._progress_t is not None:  # training resumes: the time parked by the recovery is no hang
                self._progress_t = time.monotonic()
            self._next = (Action.RETRY, 0)
            self._cond.notify_all()
        return {}

"""Processor side of the in-process recovery actions (the retry strategy: processes stay alive).

Handlers of :class:`mindio.ttp.processor.processor.Processor` (``ACTIONS``: each takes the processor and the
action's params) that run on the action's own thread while the training main thread is parked in the
decorator; :class:`World` is what a rebuild needs of the job's first world. The controller (retry.py) sends them
in this order, one action in flight, each to every live rank unless said otherwise:

1. ``clean(timeout)``: a rank whose main thread is blocked at the fence (``tft_start_updating_os`` /
   ``tft_pause_train``) gets ``RuntimeError("FORCE STOP")``, so the decorator reports it (RS_NORMAL),
   runs the stop + clean callbacks and parks; the action waits until the main thread is parked, then
   destroys any process group still left (``device.backend_for().clean()``).
2. ``rebuild(gen, fault_ranks)``: a new default process group on the job's store under the prefix
   ``mindio/gen<gen>/`` (keys of an older generation can never meet this one), device re-init, then the
   framework's ``rebuild_group(fault_ranks, args, ctx)`` callback re-creates its subgroups. With
   ``store`` (host:port) the job's store moved (node 0 lost): the new group is made there (World.move).
   ``same_layout`` (retry, recover-in-place, recover, hot switch): the new world has the same ranks and
   parallel layout; a rank that is the process it was (not a replacement) may keep its framework objects
   and plug the new groups in (``rebuild_same_layout`` on the processor; the Megatron adapter does,
   mindio/megatron/regroup.py).
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

from ... import _logging
from . import device
from .._enums import ActionName, MainState, OsStatus, RepairType

__all__ = ["World", "ACTIONS", "clean", "new_world", "rebuild", "repair", "repair_pairs", "roll_back", "rollback",
           "retry"]

_log = logging.getLogger("mindio.ttp.inplace")
_PG_TIMEOUT = timedelta(seconds=120)  # a rebuilt default group whose first one's timeout is unknown


def env_store(tcp):
    """The store the default group of a process started by env:// uses over the job's TCPStore ``tcp``:
    torch's prefixes ``default_pg`` and the first group's ``0/`` (a standby, a moved store)."""
    return dist.PrefixStore("0/", dist.PrefixStore("default_pg", tcp))


class World:
    """What a rebuild needs of the job's first world: its store (every generation's default group is
    made on it, under its own prefix), backend, timeout and device. The processor holds one
    (``Processor.world``); a replacement (reboot.py) or a standby (standby.py) sets its store."""

    def __init__(self):
        self.base_store = None
        self.pg_settings: dict = {}
        self.moved_to = ""  # the address the store moved to (move), if it did

    def remember(self) -> None:
        """(start-up, and before a teardown) Keep the job's store, backend and group timeout once: a
        rebuild re-creates the default group on them (same rank and world size, a new generation)."""
        if self.base_store is None and dist.is_available() and dist.is_initialized():
            self.base_store = dist.distributed_c10d._get_default_store()
            self.pg_settings = device.group_settings()

    def move(self, address: str) -> None:
        """The job's store moved to ``address`` (host:port): its first host is gone (node 0 lost, a backup
        controller in charge; mindio/launch/takeover.py). Later generations are made on the new one, under
        the prefixes a fresh process's env:// start uses there (``0/`` over ``default_pg``: reboot.install),
        so the survivors and the replacements it starts meet."""
        if self.moved_to == address:
            return
        host, _, port = address.rpartition(":")
        timeout = self.pg_settings.get("timeout") or _PG_TIMEOUT
        self.base_store = env_store(dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                                  timeout=timeout))
        self.moved_to = address
        _log.warning("the job's store moved to %s (its first host is gone): later generations are made there", address)

    def require(self) -> None:
        if self.base_store is None:
            raise RuntimeError("no job store remembered (init_process_group must run before "
                               "tft_start_processor); cannot rebuild the process groups in place")

    def init_default_group(self, gen: int, rank: int, world_size: int) -> None:
        """A new default group of generation ``gen`` on the job's store (prefix ``mindio/gen<gen>/``:
        keys of an older generation never meet it), with the first default group's backend, timeout
        and device."""
        settings = self.pg_settings
        dist.init_process_group(settings.get("backend", "gloo"),
                                store=dist.PrefixStore(f"mindio/gen{gen}/", self.base_store), rank=rank,
                                world_size=world_size, timeout=settings.get("timeout") or _PG_TIMEOUT,
                                device_id=settings.get("device_id"))


# ----------------------------------------------- the actions (p: the rank's RankState, rank_state.py)
def clean(p, timeout: float = 60.0) -> dict:
    main = p.wait_parked(timeout, force=True)
    if main != MainState.PARKED:
        raise TimeoutError(f"main thread still {main} after {timeout:.0f} s; cannot clean this rank")
    destroyed = device.backend_for().clean() if dist.is_initialized() else 0
    return {"main": main, "destroyed": destroyed}


def new_world(p, gen: int, rank: int, world_size: int) -> float:
    """The one rebuild of a rank's torch world (retry, recover, hot switch: :func:`rebuild`; elastic
    downgrade and upgrade: elastic_rank.zit_rebuild): any group still left is destroyed, the default
    group of generation ``gen`` is made on the job's store as torch rank ``rank`` of ``world_size``, the
    device is re-initialised. The framework's callback re-creates its subgroups next. Returns when it
    began (time.monotonic())."""
    p.world.require()
    t0 = time.monotonic()
    if dist.is_initialized():  # a rank that never tore down (should not happen after clean)
        device.backend_for().clean()
    p.world.init_default_group(gen, rank, world_size)
    device.backend_for().reinit()
    p.gen = gen
    return t0


def rebuild(p, gen: int, fault_ranks: list, store: str = "", same_layout: bool = False) -> dict:
    p.world.require()
    p.rebuild_same_layout = bool(same_layout)  # the framework adapter reads it (adapter/interface.py)
    if store:  # the job's store moved (node 0 lost): the controller names the new one
        p.world.move(store)
    t0 = new_world(p, gen, p.rank, p.world_size)
    if "rebuild_group" in p.callbacks:
        func, ctx = p.callbacks["rebuild_group"]
        func(list(fault_ranks), p.step_args, ctx)
    ms = (time.monotonic() - t0) * 1000
    _log.info("process groups rebuilt in place: generation %d in %.1f ms", gen, ms)
    return {"gen": gen, "ms": round(ms, 2)}


def repair(p, step: int, error_ranks: list, pairs: list, dst_type: str = RepairType.RT_UCE_LOWLEVEL.name) -> dict:
    # the receiver's kind per pair (retry: HIGHLEVEL/LOWLEVEL), else RT_RECV_REPAIR for a replacement
    # process (recover.py)
    return repair_pairs(p, "repair", step, error_ranks, pairs, lambda pair: pair.get("repair_type", dst_type))


def repair_pairs(p, callback: str, step: int, error_ranks: list, pairs: list, recv_kind,
                 torch_rank=lambda r: r) -> dict:
    """Call the ``callback`` repair handler once for each pair ``{type, src, dst}`` this rank is in:
    ``RT_SEND`` as the source, ``recv_kind(pair)`` as the destination; ranks in the handler's
    arguments are ``torch_rank(r)`` (the elastic world renumbers them)."""
    func, ctx = p.callback(callback)
    done = []
    for pair in pairs:
        if p.rank == pair["src"]:
            kind = RepairType.RT_SEND.name
        elif p.rank == pair["dst"]:
            kind = recv_kind(pair)
        else:
            continue
        src, dst = torch_rank(pair["src"]), torch_rank(pair["dst"])
        info = {"type": pair["type"], "repair_type": RepairType[kind], "src": [src], "dst": [dst],
                "rank_list": sorted({src, dst})}
        need_rebuild = kind in (RepairType.RT_UCE_HIGHLEVEL.name, RepairType.RT_LOAD_REBUILD.name)  # model/optimizer rebuilt first
        func(step, need_rebuild, [torch_rank(r) for r in error_ranks], info, p.step_args, ctx)
        done.append(kind)
    return {"done": done}


def roll_back(p, step: int, callback: str = "rollback", repair_type: str = "retry") -> dict:
    """The one rollback of a rank (retry, recover: the ``rollback`` handler; elastic upgrade:
    ``zit_upgrade_rollback``, elastic_rank.zit_rollback): the framework's handler puts iteration,
    scheduler, data position and params back to ``step``; this rank's step becomes ``step``, its optimizer
    state UPDATED, and ``tft_get_repair_type`` answers ``repair_type``."""
    func, ctx = p.callback(callback)
    func(step, p.step_args, ctx)
    p.step, p.data_status = step, OsStatus.UPDATED
    p.repair_type, p.repair_step = repair_type, step
    _logging.set_context(step=step)
    return {"step": step}


def rollback(p, step: int) -> dict:
    return roll_back(p, step)


def retry(p) -> dict:
    p.resume()
    return {}


# the processor's handlers for these actions (Processor.ACTIONS takes them in)
ACTIONS = {ActionName.CLEAN: clean, ActionName.REBUILD: rebuild, ActionName.REPAIR: repair,
           ActionName.ROLLBACK: rollback, ActionName.RETRY: retry}

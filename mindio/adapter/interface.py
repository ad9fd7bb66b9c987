"""The framework adapter: what a training framework gives mindio so that recovery can work.

mindio's controller decides *what* to do after a fault; only the framework knows *how* to stop its
loop, drop and rebuild its process groups, move optimizer state and roll its loop back. A framework
provides that by subclassing :class:`FrameworkAdapter` and calling :func:`register` once, after
``tft_init_processor`` and before training starts. The Megatron adapter is
``mindio.megatron.MegatronAdapter``; ``examples/pytorch/train_ddp.py`` is a plain-PyTorch one.

Call order of one in-process recovery (driven by mindio.ttp, on every surviving rank):

1. ``stop()``            — make the training main thread leave its step soon (it raises
                           ``RuntimeError("FORCE STOP")`` at its next check point).
2. ``clean(is_uce)``     — drop every reference to process groups (model/optimizer wrappers
                           included) after saving this rank's state locally; returns 0 ok,
                           1 failed, 2 no rebuild needed.
3. (mindio rebuilds the default process group under a new generation)
4. ``rebuild_groups(fault_ranks)`` — re-create the framework's subgroups and its model/optimizer
                           wrappers, and put the locally saved state back.
5. ``repair(step, need_rebuild, error_ranks, repair_info)`` — RT_SEND ranks send their optimizer
                           shard + scalar state to the paired RT_UCE_*/RT_RECV_REPAIR ranks;
                           RT_LOAD_CKPT/RT_LOAD_REBUILD ranks load the periodic checkpoint instead.
6. ``rollback(step)``    — iteration, consumed samples, LR scheduler and data iterator back to the
                           end of ``step``; model params from the fp32 master + all-gather.
7. the main thread re-enters ``train()``.

Dump (last-words checkpoint): ``stop()`` (if TTP_STOP_CLEAN_BEFORE_DUMP) then ``save(step,
save_info)`` on the chosen ranks, then ``rename(step)`` on one rank makes it the latest -- except a
provisional dump (:attr:`FrameworkAdapter.supports_provisional_dump`).
``stream_sync()`` waits for queued device work; ``pause(step)`` is called by the training loop at
the end of every iteration (``tft_pause_train``).
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Dict, List, Sequence

from ..vocab import RepairType

__all__ = ["FrameworkAdapter", "register", "repair_pairs", "RepairRole"]

_log = logging.getLogger(__name__)


class RepairRole:
    """``repair_info["repair_type"]`` values, by name (the names of :class:`mindio.vocab.RepairType`)."""

    SEND = RepairType.RT_SEND.name
    UCE_HIGHLEVEL = RepairType.RT_UCE_HIGHLEVEL.name
    UCE_LOWLEVEL = RepairType.RT_UCE_LOWLEVEL.name
    RECV_REPAIR = RepairType.RT_RECV_REPAIR.name
    ROLLBACK = RepairType.RT_ROLLBACK.name
    LOAD_CKPT = RepairType.RT_LOAD_CKPT.name
    LOAD_REBUILD = RepairType.RT_LOAD_REBUILD.name
    RECEIVERS = (UCE_HIGHLEVEL, UCE_LOWLEVEL, RECV_REPAIR)
    LOADERS = (LOAD_CKPT, LOAD_REBUILD)


_TYPE_BY_VALUE = tuple(t.name for t in sorted(RepairType))  # by the reference enum's values


def _type_name(repair_type: Any) -> str:
    name = getattr(repair_type, "name", None)
    if name:
        return name
    if isinstance(repair_type, int):
        return _TYPE_BY_VALUE[repair_type]
    return str(repair_type).split(".")[-1]


def repair_pairs(repair_info: Any) -> List[Dict[str, Any]]:
    """Normalise ``repair_info`` (one dict, or a list indexed by optimizer type) to a list of
    ``{"type", "role", "src", "dst", "rank_list"}`` with role the RepairRole name."""
    infos = repair_info if isinstance(repair_info, (list, tuple)) else [repair_info]
    out = []
    for info in infos:
        if not info:
            continue
        src, dst = list(info.get("src", [])), list(info.get("dst", []))
        role = _type_name(info["repair_type"])
        if role in (RepairRole.SEND,) + RepairRole.RECEIVERS and len(src) != len(dst):
            raise ValueError(f"repair_info pairs src {src} with dst {dst}: lengths differ")
        out.append({"type": int(info.get("type", 0)), "role": role, "src": src, "dst": dst,
                    "rank_list": list(info.get("rank_list", []))})
    return out


class FrameworkAdapter(abc.ABC):
    """Recovery callbacks of one training framework. Subclass and implement every method."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Ask the main thread to stop at its next check point (it raises FORCE STOP)."""

    @abc.abstractmethod
    def clean(self, is_uce_error: bool) -> int:
        """Keep local state, drop every process-group reference. 0 ok, 1 failed, 2 no rebuild."""

    @abc.abstractmethod
    def rebuild_groups(self, fault_ranks: Sequence[int]) -> None:
        """Re-create subgroups and wrappers on the new default group; restore local state."""

    @abc.abstractmethod
    def repair(self, step: int, need_rebuild: bool, error_ranks: Sequence[int],
               repair_info: Any) -> None:
        """Send or receive optimizer shard + scalar state, or load the periodic checkpoint."""

    @abc.abstractmethod
    def rollback(self, step: int) -> None:
        """Put iteration, data, scheduler and model params back to the end of ``step``."""

    @abc.abstractmethod
    def save(self, step: int, save_info: Any) -> None:
        """Write the dump checkpoint for ``step`` (this rank's part, per ``save_info``)."""

    @abc.abstractmethod
    def rename(self, step: int) -> None:
        """Make the dump checkpoint of ``step`` the latest one (one rank)."""

    #: An adapter that can write a *provisional* dump -- ordered by a backup controller that cannot tell
    #: node 0's loss from a partition (mindio/launch/backup.py) -- sets this True: its ``save`` and
    #: ``rename`` then read :attr:`provisional` and, when it is set, write the dump complete under that
    #: subdirectory of the job's checkpoint directory, never touching the job's own files or its latest.
    #: Otherwise mindio runs ``save`` as always and skips ``rename`` for such a dump.
    supports_provisional_dump = False
    #: (set by mindio before ``save`` / ``rename``) "" or the subdirectory of a provisional dump
    provisional = ""
    #: (set by mindio before ``rebuild_groups``) True when the new world has the same ranks and parallel
    #: layout as the last one (retry, recover-in-place, recover, hot switch; some ranks may be replacement
    #: processes building from scratch): what ``clean`` kept may be used again with the new groups in place
    #: of the old, provided the collectives a build runs are still run (a replacement's build meets them)
    rebuild_same_layout = False

    def interrupt(self) -> None:
        """(mindio's action thread, when an incident stops this rank while its main thread computes
        outside the optimizer update) Make the main thread leave its step at its next check point with
        ``RuntimeError("FORCE STOP")`` -- the CPU counterpart of stopping the device -- rather than compute
        on to its next collective, which a faulty peer would fail anyway. Default: nothing (the step runs
        on). Must only set state the main thread reads: it runs concurrently with training."""

    def stream_sync(self) -> None:
        """Wait for queued device work (nothing to do on CPU)."""

    def exit(self) -> None:
        """Called before the process exits on the controller's order."""

    def release(self) -> None:
        """Drop every reference to process groups (model/optimizer wrappers, framework globals): called
        once at process exit, before mindio destroys the groups (mindio/ttp/shutdown.py), so that no
        collective thread outlives the interpreter. Default: nothing to drop."""


def register(adapter: FrameworkAdapter, step_args: Any = None) -> None:
    """Register ``adapter``'s callbacks with mindio.ttp (reference signatures of SPEC section 3).

    Raises ImportError with advice when mindio.ttp is not available.
    """
    try:
        from mindio import ttp
    except ImportError as exc:  # pragma: no cover - depends on the installed SDK
        raise ImportError(
            "mindio.ttp is not importable: install mindio fully or run without high availability"
        ) from exc
    if step_args is not None:
        ttp.tft_set_step_args(step_args)
    ttp.tft_register_stop_handler(lambda args, ctx: adapter.stop(), adapter)
    ttp.tft_register_clean_handler(lambda is_uce, args, ctx: adapter.clean(is_uce), adapter)
    from mindio.ttp._runtime import state

    def rebuild_group(fault_ranks, args, ctx):
        adapter.rebuild_same_layout = bool(getattr(state.processor, "rebuild_same_layout", False))
        adapter.rebuild_groups(fault_ranks)
    ttp.tft_register_rebuild_group_handler(rebuild_group, adapter)
    ttp.tft_register_repair_handler(
        lambda step, need_rebuild, error_ranks, repair_info, args, ctx: adapter.repair(
            step, need_rebuild, error_ranks, repair_info), adapter)
    ttp.tft_register_rollback_handler(lambda step, args, ctx: adapter.rollback(step), adapter)

    def save(step, save_info, args, ctx):
        adapter.provisional = getattr(state.processor, "dump_provisional", "")
        adapter.save(step, save_info)

    def rename(step, args, ctx):
        adapter.provisional = getattr(state.processor, "dump_provisional", "")
        adapter.rename(step)

    rename.mindio_provisional = bool(adapter.supports_provisional_dump)  # processor._do_rename
    ttp.tft_register_save_ckpt_handler(save, adapter)
    ttp.tft_register_rename_handler(rename, adapter)
    ttp.tft_register_exit_handler(lambda ctx: adapter.exit(), adapter)
    ttp.tft_register_stream_sync_handler(adapter.stream_sync)
    state.callbacks["interrupt"] = (lambda args, ctx: adapter.interrupt(), adapter)  # not a reference callback
    from mindio.ttp import shutdown

    shutdown.on_exit(adapter.release)
    _log.info("framework adapter %s registered with mindio.ttp", type(adapter).__name__)

"""MegatronAdapter: the recovery callbacks for a megatron-core training loop.

The training loop owns a :class:`TrainingContext` (model chunks, optimizer, scheduler, iteration,
consumed samples, and a ``build`` function that creates model + optimizer + scheduler on the
current parallel state). The loop reads everything from the context each time ``train()`` is
entered, so that callbacks running on mindio's processor thread can replace objects and counters
while the main thread is parked. Call order: see :mod:`mindio.adapter.interface`.
"""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from mindio.adapter import FrameworkAdapter, RepairRole, recv_state, repair_pairs, send_state
from mindio.adapter.transfer import capture_rng, restore_rng
from mindio.errors import ConfigError

from . import checkpoint, replica
from .arguments import replica_count
from .optimizer import distributed_optimizers

__all__ = ["TrainingContext", "MegatronAdapter"]

_log = logging.getLogger(__name__)


@dataclass
class TrainingContext:
    """Everything a recovery callback may read or replace. Owned by the training loop."""

    args: Any
    build: Callable[[], tuple]  # () -> (model_chunks, optimizer, scheduler) on current groups
    model: Optional[List[Any]] = None
    optimizer: Any = None
    scheduler: Any = None
    iteration: int = 0
    consumed_samples: int = 0
    stop_requested: threading.Event = field(default_factory=threading.Event)
    layout: Dict[str, int] = field(default_factory=dict)  # tp, pp, dp_pos, dp_size
    _kept: Optional[Dict[str, Any]] = None  # state saved by clean() for rebuild_groups() and dump
    _loaded_iteration: Optional[int] = None  # set when repair fell back to the periodic checkpoint

    # -- layout -------------------------------------------------------------------------------
    @property
    def replica_cnt(self) -> int:
        return replica_count(self.args)

    def _dp(self):
        """(position in the DP-CP group, its size): cached by init_parallel, valid after clean."""
        return self.layout["dp_pos"], self.layout["dp_size"]

    def shard_index(self) -> int:
        pos, d = self._dp()
        return pos % (d // self.replica_cnt)

    def replica_instance(self) -> int:
        pos, d = self._dp()
        return pos // (d // self.replica_cnt)

    def init_parallel(self) -> None:
        """megatron parallel state with the DP replica groups; caches this rank's coordinates.

        The first call freezes the start-up objects (``mindio.ttp.device.freeze_startup_objects``)."""
        from megatron.core import parallel_state as ps

        from mindio.ttp import device

        device.freeze_startup_objects()  # once, before the first build: teardown gc walks less
        a = self.args
        replica.initialize_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                    replica_cnt=self.replica_cnt)
        self.layout = {
            "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "dp_pos": ps.get_data_parallel_rank(with_context_parallel=True),
            "dp_size": ps.get_data_parallel_world_size(with_context_parallel=True),
        }

    # -- state --------------------------------------------------------------------------------
    def shard_tensors(self) -> List[torch.Tensor]:
        """This rank's optimizer shard(s), flat; after clean(), the copy clean() kept."""
        if self.optimizer is None and self._kept is not None:
            return self._kept["shards"]
        return [t for o in distributed_optimizers(self.optimizer) for t in o.shard_state()]

    def optimizer_state_dicts(self) -> List[Dict[str, Any]]:
        """megatron's non-param optimizer state_dict per distributed optimizer (kept after clean)."""
        if self.optimizer is None and self._kept is not None:
            return self._kept["optimizer"]
        return [o.state_dict() for o in distributed_optimizers(self.optimizer)]

    def shard_groups(self) -> List[List[torch.Tensor]]:
        """Shard tensors grouped per distributed optimizer (dense first, then expert)."""
        if self.optimizer is None and self._kept is not None:
            return self._kept["shard_groups"]
        return [o.shard_state() for o in distributed_optimizers(self.optimizer)]

    def rng_state(self) -> Dict[str, Any]:
        from megatron.core import tensor_parallel

        return capture_rng(tensor_parallel.get_cuda_rng_tracker().get_states())

    def load_rng_state(self, state: Dict[str, Any]) -> None:
        from megatron.core import tensor_parallel

        tracker = restore_rng(state)
        if tracker:
            tensor_parallel.get_cuda_rng_tracker().set_states(tracker)

    def scalar_state(self, with_rng: bool = True) -> Dict[str, Any]:
        if self.optimizer is None and self._kept is not None:
            kept = dict(self._kept["scalars"])
            return kept if with_rng else {k: v for k, v in kept.items() if k != "rng"}
        out = {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
               "scheduler": self.scheduler.state_dict() if self.scheduler else None}
        scaler = getattr(distributed_optimizers(self.optimizer)[0], "grad_scaler", None)
        if scaler is not None:
            out["grad_scaler"] = {k: (v.item() if torch.is_tensor(v) else v)
                                  for k, v in scaler.state_dict().items()}
        if with_rng:
            out["rng"] = self.rng_state()
        return out

    def load_scalar_state(self, state: Dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])
        if state.get("scheduler") is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("grad_scaler"):
            for o in distributed_optimizers(self.optimizer):
                if o.grad_scaler is not None:
                    o.grad_scaler.load_state_dict(
                        {k: torch.tensor([v]) if isinstance(v, float) else v
                         for k, v in state["grad_scaler"].items()})
        if "rng" in state:
            self.load_rng_state(state["rng"])


def _is_group_holder(value: Any) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(g, dist.ProcessGroup) for g in items)


def _drop_megatron_groups() -> int:
    """Destroy every process group megatron's parallel state holds and clear those globals.

    ``destroy_model_parallel`` resets most globals but not all of them in 0.16.1 (some
    partial-DP groups survive); a surviving reference keeps gloo connections open and leaves
    peers blocked (ARCHITECTURE section 3), so every ProcessGroup-valued global is cleared here.
    """
    from megatron.core import parallel_state as ps

    found, seen = [], set()
    for name, value in list(vars(ps).items()):
        if name.startswith("_") and _is_group_holder(value):
            for g in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(g, dist.ProcessGroup) and id(g) not in seen:
                    seen.add(id(g))
                    found.append(g)
    ps.destroy_model_parallel()
    for name, value in list(vars(ps).items()):
        if name.startswith("_") and _is_group_holder(value):
            setattr(ps, name, None)
    world = dist.group.WORLD if dist.is_initialized() else None
    for g in found:
        if g is not world:
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):
                pass  # already destroyed together with the world
    return len(found)


class MegatronAdapter(FrameworkAdapter):
    """Recovery callbacks over a :class:`TrainingContext`."""

    def __init__(self, ctx: TrainingContext):
        self.ctx = ctx

    def stop(self) -> None:
        self.ctx.stop_requested.set()

    def clean(self, is_uce_error: bool) -> int:
        """Keep this rank's shard and counters, drop model/optimizer and megatron's groups."""
        ctx = self.ctx
        try:
            if ctx.optimizer is not None:
                try:
                    groups_ = [[t.detach().clone() for t in g] for g in ctx.shard_groups()]
                    ctx._kept = {"shard_groups": groups_,
                                 "shards": [t for g in groups_ for t in g],
                                 "optimizer": ctx.optimizer_state_dicts(),
                                 "scalars": ctx.scalar_state()}
                except Exception as exc:  # corrupted state (e.g. after a UCE): repair restores it
                    ctx._kept = None
                    _log.warning("clean: this rank's optimizer state could not be kept (%s: %s); "
                                 "it needs a repair from a replica or a checkpoint",
                                 type(exc).__name__, exc)
            ctx.model = ctx.optimizer = ctx.scheduler = None
            dropped = _drop_megatron_groups()
            # no gc here: the caller (mindio's processor teardown) collects once after all callbacks
            if _log.isEnabledFor(logging.DEBUG):  # a heap scan: only when asked for
                gc.collect()
                world = dist.group.WORLD if dist.is_initialized() else None
                alive = [o for o in gc.get_objects()
                         if isinstance(o, dist.ProcessGroup) and o is not world]
                _log.debug("clean: %d process groups still referenced", len(alive))
            _log.info("clean: %d megatron process groups destroyed", dropped)
            return 0
        except Exception:  # reported to the controller as "clean failed"
            _log.exception("clean failed")
            return 1

    def rebuild_groups(self, fault_ranks: Sequence[int]) -> None:
        """Megatron groups + model/optimizer/scheduler on the new world; put kept state back.

        Collective over the new world (group creation, and get_megatron_optimizer all-gathers
        param-group keys), so every rank, including a replacement process at its start-up, must
        run the same sequence: init_parallel, then build. Models are always rebuilt here, so a
        repair with ``need_rebuild`` (RT_UCE_HIGHLEVEL, RT_LOAD_REBUILD) finds fresh objects.
        """
        ctx = self.ctx
        ctx.init_parallel()
        ctx.model, ctx.optimizer, ctx.scheduler = ctx.build()
        kept, ctx._kept = ctx._kept, None
        if kept is not None:
            with torch.no_grad():
                for dst, src in zip(ctx.shard_tensors(), kept["shards"]):
                    dst.copy_(src)
            ctx.load_scalar_state(kept["scalars"])
        ctx.stop_requested.clear()

    def repair(self, step: int, need_rebuild: bool, error_ranks: Sequence[int],
               repair_info: Any) -> None:
        ctx, me = self.ctx, dist.get_rank()
        for pair in repair_pairs(repair_info):
            role = pair["role"]
            opts = distributed_optimizers(ctx.optimizer) if ctx.optimizer is not None else []
            if role == RepairRole.SEND and me in pair["src"]:
                tensors = ctx.shard_groups()[pair["type"]]  # live, or kept by clean()
                for src, dst in zip(pair["src"], pair["dst"]):
                    if src == me:
                        sent = send_state(tensors, ctx.scalar_state(), dst)
                        _log.info("repair: sent %d bytes of shard state to rank %d", sent, dst)
            elif role in RepairRole.RECEIVERS and me in pair["dst"]:
                _require_built(ctx, role)
                src = pair["src"][pair["dst"].index(me)]
                scalars = recv_state(opts[pair["type"]].shard_state(), src)
                ctx.load_scalar_state(scalars)
                _log.info("repair: received shard state of step %s from rank %d",
                          scalars.get("iteration"), src)
            elif role in RepairRole.LOADERS and (not pair["dst"] or me in pair["dst"]):
                _require_built(ctx, role)
                root = ctx.args.load or ctx.args.save
                it = checkpoint.load_checkpoint(ctx, root, gather=False)
                ctx._loaded_iteration = it
                _log.warning("repair: no usable replica; loaded periodic checkpoint of "
                             "iteration %d from %s", it, root)
                _report_load_step(it)

    def rollback(self, step: int) -> None:
        """Counters, scheduler and model params back to the end of ``step``."""
        ctx = self.ctx
        gbs = ctx.args.global_batch_size
        loaded, ctx._loaded_iteration = ctx._loaded_iteration, None
        if loaded is not None and loaded != step:
            _log.warning("rollback to step %d asked, but this rank loaded the checkpoint of "
                         "iteration %d: rolling back to %d", step, loaded, loaded)
            step = loaded
        if ctx.iteration != step:
            _log.info("rollback: iteration %d -> %d", ctx.iteration, step)
        ctx.iteration = step
        ctx.consumed_samples = step * gbs
        if ctx.scheduler is not None:
            ctx.scheduler.num_steps = step * gbs
            ctx.scheduler.step(increment=0)
        for chunk in ctx.model:
            chunk.zero_grad_buffer()
        for opt in distributed_optimizers(ctx.optimizer):
            opt.zero_grad()
            opt.params_from_main()
        ctx.stop_requested.clear()

    def save(self, step: int, save_info: Any) -> None:
        if not self.ctx.args.save:
            raise ConfigError("the last-words checkpoint has no directory: this job runs without --save; "
                              "relaunch with --save DIR to be able to dump")
        checkpoint.save_dump(self.ctx, step, save_info)

    def rename(self, step: int) -> None:
        checkpoint.write_tracker(self.ctx.args.save, step)

    def stream_sync(self) -> None:
        if torch.cuda.is_available() and not _cpu_patched():
            torch.cuda.synchronize()


def _require_built(ctx: TrainingContext, role: str) -> None:
    if ctx.optimizer is None:
        raise RuntimeError(
            f"repair {role}: this rank has no model/optimizer; rebuild_groups must run on every "
            "rank before repair (building them is collective: get_megatron_optimizer all-gathers "
            "over the world, so a single rank cannot build alone)")


def _report_load_step(iteration: int) -> None:
    try:
        from mindio import ttp

        report = getattr(ttp, "tft_report_load_ckpt_step", None)
        if report is not None:
            report(iteration)
    except Exception as exc:  # reporting is advisory; the rollback uses the loaded iteration
        _log.warning("tft_report_load_ckpt_step(%d) failed: %s", iteration, exc)


def _cpu_patched() -> bool:
    from . import _cpu_compat

    return _cpu_compat.is_applied()

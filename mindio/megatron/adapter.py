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
import random
import threading
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from mindio.adapter import FrameworkAdapter, RepairRole, recv_state, repair_pairs, send_state
from mindio.adapter.transfer import restore_rng
from mindio.errors import ConfigError

from . import checkpoint, regroup, replica
from .arguments import replica_count
from .optimizer import distributed_optimizers, params_from_main
from .restore_build import build_for_restore, spare_buffers

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
    layout: Dict[str, Any] = field(default_factory=dict)  # tp, pp, dp_pos, dp_size, groups
    _kept: Optional[Dict[str, Any]] = None  # state saved by clean() for rebuild_groups() and dump
    _loaded_iteration: Optional[int] = None  # set when repair fell back to the periodic checkpoint
    _step_rng: Optional[tuple] = None  # (iteration, RNG state at the end of it): record_step_rng()
    _spares: List[Any] = field(default_factory=list)  # grad buffers clean() kept for the rebuild (restore_build.py)
    #: why the model's params are not the trained ones yet ("rebuild", "replacement process"): a
    #: recovery built the model again and the rollback (or a load) has not set them; None otherwise
    params_pending: Optional[str] = None
    #: (model chunks, optimizer, scheduler, regroup.Unplugged) that clean() kept with their process groups
    #: unplugged, for a rebuild of the same layout (regroup.py) to plug the new groups into; None otherwise
    _parked: Optional[tuple] = None
    #: the collectives the last build ran (regroup.recording): a rank that keeps its model runs them again
    #: at a rebuild, so that a rank building from scratch (a replacement process) meets them
    _build_calls: Optional[list] = None

    def __post_init__(self):
        from mindio.ttp.processor import reboot

        self.build = _instrumented(self.build, self)

        if reboot.is_reboot():  # a replacement process: its first build's weights come from the replicas
            plain = self.build

            def first_build() -> tuple:
                self.build = plain
                self.params_pending = "replacement process"
                return build_for_restore(plain, "replacement process")
            self.build = first_build

    # -- layout -------------------------------------------------------------------------------
    @property
    def replica_cnt(self) -> int:
        return replica_count(self.args)

    @property
    def has_experts(self) -> bool:
        """MoE: a second distributed optimizer (the expert params over the expert-DP group)."""
        return bool(getattr(self.args, "num_experts", None))

    def _dp(self, opt_type: int = 0):
        """(position, size) in the data-parallel group of optimizer ``opt_type`` (0: dense, the DP-CP
        group; 1: MoE experts, the expert-DP group): cached by init_parallel, valid after clean."""
        return tuple(self.layout["groups"][opt_type])

    def shard_index(self, opt_type: int = 0) -> int:
        """Which shard of optimizer ``opt_type`` this rank holds: position mod d/R."""
        pos, d = self._dp(opt_type)
        return pos % (d // self.replica_cnt)

    def replica_instance(self, opt_type: int = 0) -> int:
        """Which copy (optimizer instance) of its shard this rank holds: position // (d/R)."""
        pos, d = self._dp(opt_type)
        return pos // (d // self.replica_cnt)

    def init_parallel(self) -> None:
        """megatron parallel state with the DP replica groups; caches this rank's coordinates.

        The first call freezes the start-up objects (``mindio.ttp.processor.device.freeze_startup_objects``)."""
        from megatron.core import parallel_state as ps

        from mindio.ttp.processor import device

        device.freeze_startup_objects()  # once, before the first build: teardown gc walks less
        a = self.args
        replica.initialize_parallel(
            a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
            expert_model_parallel_size=getattr(a, "expert_model_parallel_size", 1) or 1,
            virtual_pipeline_model_parallel_size=_virtual_size(a), replica_cnt=self.replica_cnt)
        groups = [(ps.get_data_parallel_rank(with_context_parallel=True),
                   ps.get_data_parallel_world_size(with_context_parallel=True))]
        if self.has_experts:
            groups.append((ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()))
        self.layout = {
            "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "dp_pos": groups[0][0],
            "dp_size": groups[0][1],
            "groups": groups,
            "rank": dist.get_rank(),  # also for a dump after mindio destroyed the default group
            "world": dist.get_world_size(),
        }

    # -- state --------------------------------------------------------------------------------
    def shard_tensors(self) -> List[torch.Tensor]:
        """This rank's optimizer shard(s), flat; after clean(), the copy clean() kept."""
        if self.optimizer is None and self._kept is not None:
            return self._kept["shards"]
        return [t for o in distributed_optimizers(self.optimizer) for t in o.shard_state()]

    def shard_groups(self) -> List[List[torch.Tensor]]:
        """Shard tensors grouped per distributed optimizer (dense first, then expert)."""
        if self.optimizer is None and self._kept is not None:
            return self._kept["shard_groups"]
        return [o.shard_state() for o in distributed_optimizers(self.optimizer)]

    # -- RNG: the state at the end of the last completed step, what a rollback returns to ---------
    def record_step_rng(self) -> None:
        """Remember the RNG state at the end of the step just completed (call right after the optimizer
        update, tft_end_updating_os). A rollback restores it on every rank, so that all pipeline stages
        and replicas draw the same random numbers again (dropout, MoE router noise) after a retry; a
        dump and a repair send it instead of the live state a half-run step may have advanced."""
        self._step_rng = (self.iteration, _capture_raw_rng())

    def rng_raw(self) -> tuple:
        """(python, numpy, torch, tracker states) of the end of step ``iteration``, else the live ones."""
        if self._step_rng is not None and self._step_rng[0] == self.iteration:
            return self._step_rng[1]
        return _capture_raw_rng()

    def rng_state(self) -> Dict[str, Any]:
        """:meth:`rng_raw` as JSON-able data (for a repair transfer)."""
        py, np_state, torch_state, tracker = self.rng_raw()
        return {"python": [py[0], list(py[1]), py[2]],
                "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                          float(np_state[4])],
                "torch": torch_state.tolist(), "extra": {k: v.tolist() for k, v in tracker.items()}}

    def load_rng_state(self, state: Dict[str, Any]) -> None:
        """Set the live RNG from :meth:`rng_state`'s data; it is also this step's end-of-step state."""
        tracker = restore_rng(state)
        if tracker:
            get_cuda_rng_tracker().set_states(tracker)
        self.record_step_rng()

    def restore_step_rng(self, step: int) -> bool:
        """Put the RNG back to the end of ``step`` when it was recorded; False if it was not."""
        if self._step_rng is None or self._step_rng[0] != step:
            return False
        _restore_raw_rng(self._step_rng[1])
        return True

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


def _force_stop(event: threading.Event):
    def check(*_args):
        if event.is_set():
            raise RuntimeError("FORCE STOP: the controller stopped training on this rank (interrupted in its step)")
    return check


def install_stop_checks(model_chunks, event: threading.Event) -> int:
    """Check points where a step in flight leaves with FORCE STOP once ``event`` is set
    (:meth:`MegatronAdapter.interrupt`): before the forward of every module that holds parameters, and
    after each param's gradient is accumulated in the backward. Without them a stopped rank computes on
    until its next collective (on CPU at 1 GiB of state per rank: 1.9 s of an incident, issue 18), since
    no device can be stopped under it; each check is an Event test. Returns the checks installed."""
    check, n = _force_stop(event), 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if module._parameters:
                module.register_forward_pre_hook(check)
                n += 1
        for param in chunk.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(check)
                n += 1
    return n


def _instrumented(build: Callable[[], tuple], ctx: "TrainingContext") -> Callable[[], tuple]:
    """``build`` whose collectives are recorded (``ctx._build_calls``, regroup.recording) and whose model
    gets :func:`install_stop_checks`."""
    def built() -> tuple:
        calls: list = []
        with regroup.recording(calls):
            model, optimizer, scheduler = build()
        ctx._build_calls = calls
        install_stop_checks(model, ctx.stop_requested)
        return model, optimizer, scheduler
    return built


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _capture_raw_rng() -> tuple:
    """(python, numpy, torch, megatron tracker) RNG states of this moment (the tracker's tensors cloned).
    Called after every step (record_step_rng): the imports are the module's, not the call's."""
    tracker = get_cuda_rng_tracker().get_states()
    return (random.getstate(), np.random.get_state(), torch.get_rng_state(),
            {k: v.clone() for k, v in tracker.items()})


def _restore_raw_rng(raw: tuple) -> None:
    py, np_state, torch_state, tracker = raw
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    if tracker:
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in tracker.items()})


def _virtual_size(args) -> Optional[int]:
    """Model chunks per pipeline rank from Megatron's --num-layers-per-virtual-pipeline-stage."""
    per = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if not per:
        return None
    return args.num_layers // (args.pipeline_model_parallel_size * per)


def _is_group_holder(value: Any) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(g, dist.ProcessGroup) for g in items)


def _drop_autograd_graphs(model) -> int:
    """Forget the autograd graphs the model keeps between steps (megatron's MoE token dispatcher
    keeps the routing probabilities of the last forward, a tensor whose graph reaches the params'
    gradient accumulators, whose DDP hooks reach the model again: a cycle through C++ autograd nodes
    that Python's garbage collector cannot free; measured: the whole model and its process groups
    stayed alive after clean and EP peers stayed blocked). Non-leaf tensors held by a module or by a
    plain helper object of a module are set to None. Returns how many."""
    dropped = 0

    def forget(obj) -> None:
        nonlocal dropped
        for name, value in list(vars(obj).items()):
            if torch.is_tensor(value) and value.grad_fn is not None:
                setattr(obj, name, None)
                dropped += 1

    for chunk in model or ():
        for module in chunk.modules():
            forget(module)
            for value in list(vars(module).values()):
                if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type)):
                    forget(value)
    return dropped


def _drop_moe_tracker_groups(seen: set) -> list:
    """megatron's MoE aux-loss tracker (moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER) keeps the last
    reduce/avg groups of every MoE layer in a module global: a surviving reference (measured: an EP peer
    then stays blocked in the token dispatcher's all-gather until the stop times out). Cleared here; the
    next forward sets them again. Returns the groups found (not yet in ``seen``)."""
    import sys

    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    found = []
    for entry in (getattr(moe_utils, "_MOE_LAYER_WISE_LOGGING_TRACKER", None) or {}).values():
        for key in ("reduce_group", "avg_group"):
            g = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(g, dist.ProcessGroup):
                if id(g) not in seen:
                    seen.add(id(g))
                    found.append(g)
                entry[key] = None
    return found


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
    found += _drop_moe_tracker_groups(seen)
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
        # the exit teardown (mindio/ttp/shutdown.py) drops what this adapter holds and destroys the groups
        # while the interpreter is whole, also where no processor started it (torch's exit race: a gloo
        # worker thread still destroying the last work at Py_FinalizeEx aborts the process, SIGABRT)
        from mindio.ttp import shutdown
        shutdown.on_exit(self.release)
        from . import torch_dist
        torch_dist.warm()  # a dump's imports now, not on the critical path of the last words

    def stop(self) -> None:
        self.ctx.stop_requested.set()

    def interrupt(self) -> None:
        """The step in flight leaves at its next check point (:func:`install_stop_checks`)."""
        self.ctx.stop_requested.set()

    def release(self) -> None:
        """(process exit) Drop model, optimizer and megatron's groups: mindio then destroys the rest.
        The model's autograd graphs go first (:func:`_drop_autograd_graphs`: with MoE layers the model
        would otherwise outlive every reference in an uncollectable cycle, and the process groups its DDP
        holds with it -- measured: 38 gloo worker threads left at the exit of every moe_ep2dp2 run)."""
        ctx = self.ctx
        _drop_autograd_graphs(ctx.model)
        ctx.model = ctx.optimizer = ctx.scheduler = None
        ctx._spares, ctx._parked = [], None
        _drop_megatron_groups()  # also after dist.destroy_process_group(): its globals still hold the groups

    def clean(self, is_uce_error: bool) -> int:
        """Keep this rank's shard, counters and checkpoint state dict, drop model/optimizer and
        megatron's groups.

        What is kept references the live tensors (no copy; nothing else uses them once the objects are
        dropped): the optimizer shards, for rebuild_groups() and a repair sender, and Megatron's
        sharded state dict (model weights too, detached from their grad buffers), for a dump that
        follows the fault -- the ranks whose training raised have always been cleaned by then."""
        ctx = self.ctx
        # a second fault before the rollback: the rebuilt model's params are not the trained ones (and a
        # kept model's groups may be gone), so a dump comes from the state kept at the first fault
        earlier = ctx._kept.get("checkpoint") if ctx._kept else None
        try:
            if ctx.optimizer is not None:
                try:
                    groups_ = [[t.detach() for t in g] for g in ctx.shard_groups()]
                    ctx._kept = {"shard_groups": groups_,
                                 "shards": [t for g in groups_ for t in g],
                                 "scalars": ctx.scalar_state()}
                except Exception as exc:  # corrupted state (e.g. after a UCE): repair restores it
                    ctx._kept = None
                    # a string, never the exception: a log record holding its traceback would keep
                    # the optimizer and its process groups alive (peers would stay blocked)
                    _log.warning("clean: this rank's optimizer state could not be kept (%s); "
                                 "it needs a repair from a replica or a checkpoint", _describe(exc))
                if ctx._kept is not None and not is_uce_error:  # a UCE rank never dumps
                    try:
                        ctx._kept["checkpoint"] = (checkpoint.snapshot(ctx) if ctx.params_pending is None
                                                   and earlier is None else earlier)
                    except Exception as exc:
                        _log.warning("clean: no checkpoint state kept (%s): this rank cannot write a "
                                     "dump", _describe(exc))
            _drop_autograd_graphs(ctx.model)
            parked_now = False
            if ctx.model is not None:  # (a second clean -- a fenced rank torn down, then cleaned -- has none)
                ctx._parked = self._park() if ctx._kept is not None and ctx.params_pending is None else None
                parked_now = ctx._parked is not None
                if not parked_now:
                    ctx._spares = spare_buffers(ctx.model, ctx._kept)  # memory the rebuild's DDP takes again
            ctx.model = ctx.optimizer = ctx.scheduler = None
            dropped = _drop_megatron_groups()
            if parked_now:
                held = regroup.held_elsewhere(ctx._parked[3].groups, ())
                if held:
                    _log.warning("clean: process groups %s are still referenced where the model's groups were "
                                 "unplugged; dropping the model (a rebuild builds it again)", held[:4])
                    self._unpark(build_again=True)
            # no gc here: the caller (mindio's processor teardown) collects once after all callbacks
            if _log.isEnabledFor(logging.DEBUG):  # a heap scan: only when asked for
                gc.collect()
                world = dist.group.WORLD if dist.is_initialized() else None
                # ProcessGroup objects are not tracked by the collector: look at what tracked objects hold
                alive = {id(r) for o in gc.get_objects() for r in gc.get_referents(o)
                         if isinstance(r, dist.ProcessGroup) and r is not world}
                _log.debug("clean: %d process groups still referenced", len(alive))
            _log.info("clean: %d megatron process groups destroyed", dropped)
            return 0
        except Exception:  # reported to the controller as "clean failed"
            _log.exception("clean failed")
            return 1

    def _park(self) -> Optional[tuple]:
        """(clean) Keep model, optimizer and scheduler with their process groups unplugged
        (regroup.py), for a retry's rebuild; None when some group cannot be named."""
        ctx = self.ctx
        try:
            unplugged = regroup.unplug([ctx.model, ctx.optimizer, ctx.scheduler], self._groups())
        except Exception as exc:
            _log.warning("clean: the model's process groups cannot be unplugged (%s); it is dropped and a "
                         "rebuild builds it again", _describe(exc))
            return None
        return ctx.model, ctx.optimizer, ctx.scheduler, unplugged

    def _unpark(self, build_again: bool) -> None:
        """Drop what clean() parked; with ``build_again``, its grad buffers become the spares of the
        build that follows (restore_build.py)."""
        ctx = self.ctx
        parked, ctx._parked = ctx._parked, None
        if parked is not None and build_again:
            ctx._spares = spare_buffers(parked[0], ctx._kept)

    @staticmethod
    def _groups() -> list:
        """Every registered process group, the default one included."""
        from mindio.ttp.processor import device

        return device.all_groups() + ([dist.group.WORLD] if dist.is_initialized() else [])

    def _can_keep(self, groups: list) -> bool:
        """(rebuild of the same layout) Can this rank keep what clean() parked: is there a parked model
        with its kept state, a counterpart (same ranks and description) of every group it held, and a
        record of its build's collectives that can be run again (regroup.replayable)? ``groups``: the
        registered groups now (:meth:`_groups`)."""
        ctx = self.ctx
        if ctx._parked is None or ctx._kept is None:
            return False
        why = regroup.replayable(ctx._build_calls, groups)
        missing = regroup.missing(ctx._parked[3], groups)
        if missing or why:
            _log.warning("rebuild: the kept model is built again: %s", why or f"no new process group for {missing[:4]}")
            return False
        return True

    def _plug(self, groups: list) -> None:
        """(rebuild_groups of the same layout, :meth:`_can_keep`) Put the new generation's groups into the
        parked objects and take them back."""
        ctx = self.ctx
        model, optimizer, scheduler, unplugged = ctx._parked
        places = regroup.plug(unplugged, groups)
        ctx._parked = None
        ctx.model, ctx.optimizer, ctx.scheduler = model, optimizer, scheduler
        _log.info("rebuild: the kept model and optimizer took the new process groups (%d places)", places)

    def rebuild_groups(self, fault_ranks: Sequence[int]) -> None:
        """Megatron groups + model/optimizer/scheduler on the new world; put kept state back.

        Collective over the new world (group creation, and get_megatron_optimizer all-gathers
        param-group keys), so every rank, including a replacement process at its start-up, must
        run the same sequence: init_parallel, then build (a rank that keeps its parked objects in a
        rebuild of the same layout runs its build's collectives again instead, regroup.py). A rebuilt
        model's weights are not initialised (restore_build.py): every flow that rebuilds rolls back
        before training (``rollback``: params from the fp32 main shards restored here or repaired).
        """
        ctx = self.ctx
        ctx.init_parallel()
        if self.rebuild_same_layout:
            groups = self._groups()
            if self._can_keep(groups):
                # the collectives of the build this rank skips: a rank that builds (a replacement process, or
                # a rank that could not keep its model) runs them in its build and meets these
                regroup.replay(ctx._build_calls, groups)
                self._plug(groups)
                # the shards, scalars and params are the live ones: nothing to put back; until the rollback
                # a dump still writes the state dict clean() kept (the groups may be gone again by then)
                kept = ctx._kept
                ctx._kept = {"checkpoint": kept["checkpoint"]} if kept.get("checkpoint") is not None else None
                ctx.stop_requested.clear()
                return
        if ctx._parked is not None:
            self._unpark(build_again=True)
        ctx.model, ctx.optimizer, ctx.scheduler = build_for_restore(ctx.build, "rebuild", ctx._spares)
        ctx.params_pending = "rebuild"
        kept = ctx._kept
        # until the rollback, a dump writes the state dict clean() kept: the rebuilt model's params
        # are not the trained ones (only this rank's shard of them is put back below)
        ctx._kept = {"checkpoint": kept["checkpoint"]} if kept and kept.get("checkpoint") is not None else None
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
                opts[pair["type"]].params_synced = False  # the params of this shard come from it again
                scalars = recv_state(opts[pair["type"]].shard_state(), src)
                ctx.load_scalar_state(scalars)
                _log.info("repair: received shard state of step %s from rank %d",
                          scalars.get("iteration"), src)
            elif role in RepairRole.LOADERS and (not pair["dst"] or me in pair["dst"]):
                _require_built(ctx, role)
                root = ctx.args.load or ctx.args.save
                it = checkpoint.load_checkpoint(ctx, root)
                ctx._loaded_iteration = it
                _log.warning("repair: no usable replica; loaded periodic checkpoint of "
                             "iteration %d from %s", it, root)
                _report_load_step(it)

    def rollback(self, step: int) -> None:
        """Counters, scheduler, RNG and model params back to the end of ``step``, on every rank (every
        pipeline stage): the next train() starts the data iterators at ``step * global batch``."""
        ctx = self.ctx
        gbs = ctx.args.global_batch_size
        loaded, ctx._loaded_iteration = ctx._loaded_iteration, None
        if loaded is not None and loaded != step:
            _log.warning("rollback to step %d asked, but this rank loaded the checkpoint of "
                         "iteration %d: rolling back to %d", step, loaded, loaded)
            step = loaded
        opts = distributed_optimizers(ctx.optimizer)
        # the params are those of the step rolled back to, gathered, unless the model was built again, the
        # rank is at another step, or its shard was received or loaded since (params_synced)
        intact = ctx.params_pending is None and ctx.iteration == step and all(o.params_synced for o in opts)
        if ctx.iteration != step:
            _log.info("rollback: iteration %d -> %d", ctx.iteration, step)
        if not ctx.restore_step_rng(step):
            _log.warning("rollback to step %d: the RNG state of that step was not recorded "
                         "(TrainingContext.record_step_rng after each update); the RNG is left as it is", step)
        ctx.iteration = step
        ctx.consumed_samples = step * gbs
        if ctx.scheduler is not None:
            ctx.scheduler.num_steps = step * gbs
            ctx.scheduler.step(increment=0)
        for chunk in ctx.model:
            chunk.zero_grad_buffer()
            for param in chunk.parameters():  # a backward the stop interrupted leaves .grad before DDP took it
                param.grad = None
        for opt in opts:
            opt.zero_grad()
        gathered = params_from_main(opts, ctx.model, intact)
        _log.info("rollback: params %s; %d bucket group(s) gathered", "intact" if intact else "from the main shards",
                  gathered)
        ctx.params_pending, ctx._kept = None, None
        ctx.stop_requested.clear()

    supports_provisional_dump = True  # FrameworkAdapter: a provisional dump is written under its own root

    def _dump_root(self) -> Path:
        """The dump's checkpoint directory: --save, or for a provisional dump its subdirectory of --save
        (a complete Megatron checkpoint with its own tracker file: ``--load`` that directory)."""
        root = Path(self.ctx.args.save)
        return root / self.provisional if self.provisional else root

    def save(self, step: int, save_info: Any) -> None:
        if not self.ctx.args.save:
            raise ConfigError("the last-words checkpoint has no directory: this job runs without --save; "
                              "relaunch with --save DIR to be able to dump")
        self.ctx._spares = []  # a dump ends the process: no rebuild will take them
        checkpoint.save_dump(self.ctx, step, save_info, root=self._dump_root())

    def rename(self, step: int) -> None:
        checkpoint.finish_dump(self._dump_root(), step, checkpoint._rank(self.ctx))

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

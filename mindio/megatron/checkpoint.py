"""Checkpoints of the Megatron adapter, in Megatron's own format: periodic (collective) and dump.

Both are megatron-core distributed checkpoints (``dist_checkpointing``, ``torch_dist`` backend), laid
out as Megatron-LM lays them out, so that Megatron's loader, its converters and
``megatron.core.dist_checkpointing.load`` read them::

    latest_checkpointed_iteration.txt     Megatron's tracker file: the newest complete iteration
    iter_0000040/.metadata                PyTorch DCP metadata (what Megatron and torch read)
    iter_0000040/__<rank>_0.distcp        the tensors and sharded objects each writing rank wrote
    iter_0000040/common.pt                the non-sharded part: iteration, args (with
                                          consumed_train_samples), opt_param_scheduler, content_metadata
    iter_0000040/metadata.json            megatron's backend record (torch_dist, version 1)
    iter_0000040/__<rank>.mindio.json     mindio's index of what each rank wrote (JSON; see torch_dist.py)
    iter_0000040/common.mindio.json       the CRC-32 of common.pt (the items' are in the index)

State dict (Megatron-LM's ``generate_state_dict``): ``model`` (``model0``, ``model1``, ... with
virtual pipeline stages), ``optimizer`` (the distributed optimizer in the ``dp_reshardable`` format,
Megatron-LM's default: the fp32 main params and Adam moments of each DP shard, bucket by bucket;
``chained_<i>.`` prefixes with MoE), ``opt_param_scheduler``, ``rng_state`` (one per PP x TP rank),
``iteration``, ``checkpoint_version`` 3.0, ``args``, ``content_metadata``.

Who writes what (the ``replica_id`` of every item, rewritten here before writing; an item is written
by the rank whose copy is the main replica, as in Megatron):

- periodic save (every rank alive): optimizer shards by their first replica instance, model weights,
  non-param optimizer state and RNG by DP position 0 of each model-parallel slice (expert params by
  expert-DP position 0), ``common.pt`` by rank 0; rank 0 merges the index and writes the tracker.
- dump (the ranks the controller picked, one per optimizer shard, no collectives): each writes its
  shards; the one holding shard 0 of its DP group (expert-DP group for MoE experts) also writes that
  group's model weights, non-param optimizer state and RNG; the first of them writes ``common.pt``;
  the rename step merges the index and writes the tracker.

Resharding (megatron-core's own rules): the model weights load at any TP/PP/DP layout; the optimizer
state of the ``dp_reshardable`` format loads at another DP size of the same TP x PP layout only.

Loading here (:func:`load_checkpoint`) runs on each rank alone (no collectives), reads the model
weights and the optimizer shard of this rank, and never unpickles (torch_dist.read_local). Every item it
reads, and ``common.pt``, is checked against the CRC-32 written with it; a checkpoint that fails is never
trained from. With ``fallback=True`` (collective over the world: a job's start) the ranks agree on it and
all load the previous complete checkpoint instead, after one line naming the file and the reason.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from . import torch_dist
from .digest import is_expert_param
from .optimizer import distributed_optimizers
from .torch_dist import CorruptCheckpoint

__all__ = [
    "TRACKER",
    "CHECKPOINT_VERSION",
    "SHARDED_STATE_DICT_METADATA",
    "Writers",
    "initialize_store",
    "checkpoint_dir",
    "sharded_state_dict",
    "save_checkpoint",
    "save_dump",
    "finish_dump",
    "write_tracker",
    "read_tracker",
    "load_checkpoint",
    "complete_iterations",
    "CorruptCheckpoint",
    "snapshot",
]

_log = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
#: What Megatron-LM (core >= 0.14) passes to every ``sharded_state_dict``; saved as content_metadata so
#: that Megatron's loader builds the same structure.
SHARDED_STATE_DICT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable",
                               "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def initialize_store(server_info: Optional[Dict[str, Any]] = None) -> bool:
    """Start/reach the mindio checkpoint store (ACP daemon) ahead of the first save.

    Returns whether saves will go through it. Starting it lazily would put its start-up (pool
    pre-faulting) on the path of the first periodic save or, worse, of a dump after a fault.
    """
    try:
        from mindio import acp as acp_api
    except ImportError:  # pragma: no cover
        return False
    rc = acp_api.initialize(server_info)
    if rc != 0:
        _log.warning("mindio checkpoint store unavailable (initialize returned %s): "
                     "checkpoints are written to storage directly", rc)
    return rc == 0


def checkpoint_dir(root: Path, iteration: int) -> Path:
    """Megatron's directory name for an iteration."""
    return Path(root) / f"iter_{iteration:07d}"


# ------------------------------------------------------------------------ the state dict
@dataclass
class Writers:
    """What this rank writes in one save: per optimizer type (0 dense, 1 MoE experts) its shards
    (``shards``) and its DP group's model weights / non-param state / RNG (``slice``)."""

    shards: List[bool]
    slice: List[bool]
    common: bool
    ranks: List[int] = field(default_factory=list)  # every writing rank of this save
    save_id: str = ""


def _rank(ctx) -> int:
    """This rank's global rank: from the default group while it exists, else as cached by
    init_parallel (a dump runs after mindio's teardown destroyed every group, the default one too)."""
    return dist.get_rank() if dist.is_initialized() else ctx.layout["rank"]


def _periodic_writers(ctx, iteration: int) -> Writers:
    types = range(len(ctx.layout["groups"]))
    return Writers(shards=[ctx.replica_instance(t) == 0 for t in types],
                   slice=[ctx._dp(t)[0] == 0 for t in types], common=dist.get_rank() == 0,
                   ranks=list(range(dist.get_world_size())), save_id=f"periodic-{iteration}")


def _dump_writers(ctx, step: int, save_info: Any) -> Writers:
    infos = list(save_info if isinstance(save_info, (list, tuple)) else [save_info])
    rank = _rank(ctx)
    chosen = {int(i.get("type", n)): {int(r) for r in i.get("ranks", [])} for n, i in enumerate(infos) if i}
    every = sorted(set().union(*chosen.values())) if chosen else []
    types = range(len(ctx.layout["groups"]))
    shards = [rank in chosen.get(t, ()) for t in types]
    return Writers(shards=shards, slice=[shards[t] and ctx.shard_index(t) == 0 for t in types],
                   common=bool(every) and rank == every[0], ranks=every,
                   save_id=f"dump-{step}-" + ",".join(map(str, every)))


def _rng_state(ctx) -> Dict[str, Any]:
    """Megatron-LM's rng state dict, of the end of the current iteration (TrainingContext.rng_raw);
    ``cuda_rng_state`` only with CUDA."""
    py, np_state, torch_state, tracker = ctx.rng_raw()
    out = {"random_rng_state": py, "np_rng_state": np_state, "torch_rng_state": torch_state,
           "rng_tracker_states": tracker}
    if torch.cuda.is_available():
        out["cuda_rng_state"] = torch.cuda.get_rng_state()
    return out


def _load_rng_state(state: Dict[str, Any]) -> None:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _checkpoint_args(ctx) -> argparse.Namespace:
    """Megatron-LM's ``args`` entry: the script's arguments (plain values) + consumed samples."""
    plain = {k: v for k, v in vars(ctx.args).items() if isinstance(v, (bool, int, float, str, type(None)))}
    return argparse.Namespace(**plain, consumed_train_samples=ctx.consumed_samples,
                              consumed_valid_samples=0)


def sharded_state_dict(ctx, is_loading: bool = False) -> Dict[str, Any]:
    """Megatron-LM's state dict of ``ctx`` (model chunks, optimizer, scheduler, RNG), megatron's
    replica ids untouched. Collective-free."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    meta = dict(SHARDED_STATE_DICT_METADATA)
    for opt in distributed_optimizers(ctx.optimizer):
        opt.ensure_state()  # megatron's state_dict needs the Adam state, even before the first step
        if is_loading:  # the checkpoint brings Adam's step; a destroyed one (NaN) would fail megatron's check
            for state in opt.optimizer.state.values():
                state["step"] = torch.zeros((), dtype=torch.float32)
    sd: Dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": ctx.iteration,
                          "args": _checkpoint_args(ctx), "num_floating_point_operations_so_far": 0,
                          "content_metadata": dict(meta)}
    for i, chunk in enumerate(unwrap_model(ctx.model)):  # Megatron-LM's keys: no DDP/Float16 prefix
        sd["model" if len(ctx.model) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=meta)
    sd["optimizer"] = ctx.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=meta)
    if ctx.scheduler is not None:
        sd["opt_param_scheduler"] = ctx.scheduler.state_dict()
    sd["rng_state"] = ShardedObject(
        "rng_state", [_rng_state(ctx)],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    return sd


def _mark_and_detach(sd: Dict[str, Any]) -> Dict[str, Any]:
    """Mark every model item that belongs to the MoE experts (``_mindio_expert``: their params, and
    their extra-state objects, megatron's keys ``...mlp.experts...``) and detach every tensor, so that
    the state dict keeps no grad buffer (``main_grad``) and no autograd graph alive."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    def model_item(x):
        if isinstance(x, (ShardedBase, ShardedTensorFactory)):
            x._mindio_expert = ".experts." in x.key or (torch.is_tensor(x.data) and is_expert_param(x.data))
        return x

    def detach(x):
        if isinstance(x, (ShardedBase, ShardedTensorFactory)) and torch.is_tensor(x.data):
            x.data = x.data.detach()
        return x

    for key in _model_keys(sd):
        dict_list_map_inplace(model_item, sd[key])
    dict_list_map_inplace(detach, sd)
    return sd


def _model_keys(sd: Dict[str, Any]) -> List[str]:
    return [k for k in sd if k == "model" or (k.startswith("model") and k[5:].isdigit())]


def snapshot(ctx) -> Dict[str, Any]:
    """Megatron's state dict of ``ctx``, ready for a dump once the model and optimizer objects are
    gone (clean() keeps it): expert items marked, tensors detached (views, no copy)."""
    return _mark_and_detach(sharded_state_dict(ctx))


def _set_replica(x, owned: bool, keep_model_parts: bool) -> None:
    """Make ``x`` the main replica (written) or not. Model items keep megatron's PP ("tied") and TP
    replica coordinates and get the DP one; optimizer items are (instance, 0, dp) in megatron."""
    rid = x.replica_id
    dp = 0 if owned else 1
    if isinstance(rid, tuple) and len(rid) == 3 and keep_model_parts:
        x.replica_id = (rid[0], rid[1], dp)
    elif isinstance(rid, tuple):
        x.replica_id = (0,) * (len(rid) - 1) + (dp,)
    else:
        x.replica_id = dp


def _assign(sd: Dict[str, Any], writers: Writers) -> None:
    """Rewrite every replica_id of ``sd`` (a :func:`snapshot`) so that this rank writes exactly what
    ``writers`` says."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    def model_item(x):
        if isinstance(x, (ShardedBase, ShardedTensorFactory)):
            t = 1 if x._mindio_expert and len(writers.slice) > 1 else 0
            _set_replica(x, writers.slice[t], keep_model_parts=True)
        return x

    def optimizer_items(t):
        def fix(x):
            if isinstance(x, (ShardedBase, ShardedTensorFactory)):
                bucket = ".gbuf_idx_" in x.key  # a DP shard of the optimizer state
                _set_replica(x, writers.shards[t] if bucket else writers.slice[t], keep_model_parts=False)
            return x
        return fix

    for key in _model_keys(sd):
        dict_list_map_inplace(model_item, sd[key])
    opt = sd["optimizer"]
    if isinstance(opt, dict) and set(opt) == set(range(len(opt))) and len(opt) > 1:  # ChainedOptimizer
        for t, part in opt.items():
            dict_list_map_inplace(optimizer_items(t), part)
    else:
        dict_list_map_inplace(optimizer_items(0), opt)
    _set_replica(sd["rng_state"], writers.slice[0], keep_model_parts=False)


def _write(sd: Dict[str, Any], writers: Writers, directory: Path, rank: int, world: Optional[int] = None,
           last_words: bool = False) -> None:
    _assign(sd, writers)
    common = torch_dist.write_local(sd, directory, rank, writers.save_id, writers.ranks, world, last_words)
    if writers.common:
        torch_dist.write_common(common, directory)


# ------------------------------------------------------------------------------ saving
def save_checkpoint(ctx, root: Optional[Path] = None) -> float:
    """Periodic save (collective on the world). Returns seconds spent."""
    t0 = time.perf_counter()
    root = Path(root or ctx.args.save)
    directory = checkpoint_dir(root, ctx.iteration)
    _write(snapshot(ctx), _periodic_writers(ctx, ctx.iteration), directory, dist.get_rank())
    dist.barrier()
    if dist.get_rank() == 0:
        torch_dist.finalize(directory, 0)
        write_tracker(root, ctx.iteration)
    dist.barrier()
    return time.perf_counter() - t0


def save_dump(ctx, step: int, save_info: Any, root: Optional[Path] = None) -> bool:
    """Dump ("last words"): this rank writes its part if ``save_info`` names it. No collectives.

    ``save_info`` is ``[{"type": t, "ranks": [...]}, ...]`` (one rank per optimizer shard and type).
    Returns whether this rank wrote anything. :func:`finish_dump` (the rename step) must follow on one
    of the writing ranks."""
    writers, rank = _dump_writers(ctx, step, save_info), _rank(ctx)
    if rank not in writers.ranks:
        return False
    if ctx.iteration != step:
        raise RuntimeError(f"dump for step {step} asked, but this rank's state is at iteration {ctx.iteration}")
    if ctx._kept is not None and ctx._kept.get("checkpoint") is not None:
        # kept by clean(), which ran when this rank's training raised, or before a rebuild whose rollback
        # has not run (a rebuilt model's params are not the trained ones; a kept model's groups may be gone)
        sd = ctx._kept["checkpoint"]
    elif ctx.optimizer is not None and ctx.params_pending is None:
        sd = snapshot(ctx)
    elif ctx.params_pending is not None:
        raise RuntimeError(f"dump of step {step}: rank {rank}'s model was built again ({ctx.params_pending}) "
                           "and not rolled back, so its params are not the trained ones, and clean() kept "
                           "no state dict of this rank to write instead (a UCE rank or a replacement "
                           "process): another holder of its shard must write it")
    else:
        raise RuntimeError(f"dump of step {step}: rank {rank} has neither its model and optimizer "
                           "nor the state clean() keeps (clean could not read it; see its warning)")
    t0 = time.perf_counter()
    _write(sd, writers, checkpoint_dir(Path(root or ctx.args.save), step), rank, ctx.layout.get("world"),
           last_words=True)
    _log.warning("dump checkpoint of step %d written by rank %d in %.3f s", step, rank, time.perf_counter() - t0)
    return True


def finish_dump(root: Path, step: int, rank: Optional[int] = None) -> None:
    """The rename step of a dump (on a writing rank, ``rank``: default the default group's): merge the
    index, then point the tracker at it."""
    torch_dist.finalize(checkpoint_dir(root, step), dist.get_rank() if rank is None else rank)
    write_tracker(root, step)


def write_tracker(root: Path, iteration: int) -> None:
    """Atomically point ``root``'s tracker file at ``iteration`` once the store holds nothing unwritten and
    the checkpoint's small files are durable (:func:`torch_dist.persist`)."""
    try:
        from mindio import acp
    except ImportError:  # pragma: no cover
        acp = None
    if acp is not None and acp.flush() != 0:
        raise RuntimeError(f"the checkpoint of iteration {iteration} could not be persisted (mindio.acp.flush "
                           "failed; see the log): the tracker file is not updated")
    torch_dist.persist(checkpoint_dir(root, iteration))
    from mindio.acp._storage import atomic_write, file_mode

    atomic_write(str(Path(root) / TRACKER), [str(iteration).encode()], file_mode())


def read_tracker(root: Path) -> Optional[int]:
    path = Path(root) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path} should hold an iteration number, found {text!r}")
    return int(text)


# ----------------------------------------------------------------------------- loading
def complete_iterations(root: Path, below: int) -> List[int]:
    """The iterations under ``below`` with a complete mindio checkpoint in ``root``, newest first."""
    found = []
    for d in Path(root).glob("iter_*"):
        tail = d.name[len("iter_"):]
        if tail.isdigit() and int(tail) < below and torch_dist.is_complete(d):
            found.append(int(tail))
    return sorted(found, reverse=True)


def _first_failing_rank(failed: bool) -> Optional[int]:
    """Collective over the world: the lowest rank whose load failed verification, or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0 if failed else None
    world = dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    flag = torch.tensor([dist.get_rank() if failed else world], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # bounded by the default group's timeout
    first = int(flag.item())
    return None if first == world else first


def load_checkpoint(ctx, root: Optional[Path] = None, iteration: Optional[int] = None,
                    fallback: bool = False) -> int:
    """Load the latest (or given) checkpoint into ctx's model chunks, optimizer, scheduler, counters
    and RNG. Returns the iteration loaded.

    ``fallback=False``: on this rank alone (no collectives); a file that fails verification raises
    :class:`CorruptCheckpoint`. ``fallback=True``: collective over the world (every rank calls it, as at
    a job's start): when any rank finds a file of the checkpoint corrupt, the lowest such rank logs one
    line naming the file and the reason, and every rank loads the previous complete checkpoint (and so
    on; the error of the newest is raised when none is left)."""
    root = Path(root or ctx.args.load)
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise FileNotFoundError(f"no {TRACKER} in {root}: nothing to load")
    if not fallback:
        return _load(ctx, root, iteration)
    candidates = [iteration] + complete_iterations(root, iteration)
    for n, it in enumerate(candidates):
        problem = None
        try:
            _load(ctx, root, it)
        except CorruptCheckpoint as exc:
            problem = exc
        first = _first_failing_rank(problem is not None)
        if first is None:
            return it
        following = candidates[n + 1] if n + 1 < len(candidates) else None
        if problem is not None and first == _rank(ctx):
            _log.warning("checkpoint iteration %d is not trained from: %s failed verification (%s); %s", it,
                         problem.path, problem.reason,
                         "no earlier complete checkpoint is left" if following is None else
                         f"loading the previous complete checkpoint, iteration {following}")
        if following is None:
            raise problem if problem is not None else CorruptCheckpoint(
                checkpoint_dir(root, it), f"rank {first} found a file of it corrupt (see its log line) and no "
                                          "earlier complete checkpoint is left")
    raise AssertionError("unreachable")  # pragma: no cover


def _load(ctx, root: Path, iteration: int) -> int:
    directory = checkpoint_dir(root, iteration)
    if not torch_dist.has_index(directory):
        raise FileNotFoundError(f"{directory} holds no checkpoint written by mindio (no __<rank>.mindio.json); "
                                "load other Megatron checkpoints with megatron.core.dist_checkpointing.load")
    common = torch_dist.read_common(directory)
    content = common.get("content_metadata") or {}
    if content.get("distrib_optim_sharding_type") != SHARDED_STATE_DICT_METADATA["distrib_optim_sharding_type"]:
        raise ValueError(f"{directory}: optimizer format {content.get('distrib_optim_sharding_type')!r}, "
                         f"expected {SHARDED_STATE_DICT_METADATA['distrib_optim_sharding_type']!r}")
    from megatron.core.utils import unwrap_model

    loaded = torch_dist.read_local(sharded_state_dict(ctx, is_loading=True), directory)
    for i, chunk in enumerate(unwrap_model(ctx.model)):
        chunk.load_state_dict(loaded["model" if len(ctx.model) == 1 else f"model{i}"], strict=True)
    ctx.optimizer.load_state_dict(loaded["optimizer"])
    if ctx.scheduler is not None:
        ctx.scheduler.num_steps = 0  # megatron's load_state_dict adds the checkpoint's steps to its count
        ctx.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    ctx.iteration = int(loaded["iteration"])
    ctx.consumed_samples = int(loaded["args"].consumed_train_samples)
    ctx.params_pending = None  # every model param came from the checkpoint
    _load_rng_state(loaded["rng_state"][0])
    ctx.record_step_rng()
    _log.info("loaded checkpoint iteration %d from %s", iteration, root)
    ttp = sys.modules.get("mindio.ttp")  # a job that uses mindio.ttp: an exception before its first update
    if ttp is not None:                   # after a relaunch is at iteration + 1 (ttp/processor/repeats.py)
        ttp.tft_report_load_ckpt_step(iteration)
    return iteration

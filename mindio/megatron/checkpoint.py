"""Checkpoints of the Megatron adapter: periodic (collective) and dump (no collectives), one format.

Layout under ``<dir>`` (Megatron's tracker file name, so its tools find the latest iteration)::

    latest_checkpointed_iteration.txt          the iteration of the newest complete checkpoint
    iter_0000040/common.pt                     iteration, consumed samples, scheduler, loss scale
    iter_0000040/shard_tp00_pp000_dp000.pt     optimizer shard 0 of TP rank 0 / PP rank 0: fp32
                                               main params + Adam moments + steps (megatron's
                                               bucket order), the optimizer's non-param
                                               state_dict, RNG states

A shard file is written by ONE holder of that shard (replicas are bit-identical): the first
optimizer instance for a periodic save, the rank the controller picked for a dump. Model weights
are not stored separately: on load they are rebuilt from the fp32 main shard plus an all-gather,
exactly as after a rollback, so a dump (written by some ranks, without collectives) and a
periodic checkpoint load the same way. The tracker file is written last, atomically (rename
handler for a dump, rank 0 after a barrier for a periodic save).

Files go through :func:`write_object`/:func:`read_object`: ``mindio.save``/``mindio.load``
(the ACP store) when available, else ``torch.save``/``torch.load`` (weights_only).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .optimizer import distributed_optimizers

__all__ = [
    "FORMAT",
    "TRACKER",
    "initialize_store",
    "write_object",
    "read_object",
    "shard_path",
    "save_checkpoint",
    "save_dump",
    "write_tracker",
    "read_tracker",
    "load_checkpoint",
]

_log = logging.getLogger(__name__)
FORMAT = "mindio-megatron/1"
TRACKER = "latest_checkpointed_iteration.txt"


def _acp():
    try:
        import mindio

        if callable(getattr(mindio, "save", None)) and callable(getattr(mindio, "load", None)):
            return mindio
    except ImportError:
        pass
    return None


def initialize_store(server_info: Optional[Dict[str, Any]] = None) -> bool:
    """Start/reach the mindio checkpoint store (ACP daemon) ahead of the first save.

    Returns whether saves will go through it. Starting it lazily would put its start-up (pool
    pre-faulting) on the path of the first periodic save or, worse, of a dump after a fault.
    """
    acp = _acp()
    if acp is None:
        return False
    from mindio import acp as acp_api

    rc = acp_api.initialize(server_info)
    if rc != 0:
        _log.warning("mindio checkpoint store unavailable (initialize returned %s): "
                     "checkpoints are written to storage directly", rc)
    return rc == 0


def write_object(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` through the ACP store when available, else torch.save (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    acp = _acp()
    if acp is not None:
        rc = acp.save(obj, str(path))
        if rc != -1:
            return
        _log.warning("mindio.save(%s) failed (rc=-1); writing with torch.save instead", path)
    # temp file (O_EXCL, removed on failure), fsync, rename, fsync of the directory
    from mindio.acp._storage import atomic_torch_save, file_mode

    atomic_torch_save(obj, str(path), file_mode())


def read_object(path: Path) -> Any:
    path = Path(path)
    acp = _acp()
    if acp is not None:
        return acp.load(str(path), map_location="cpu")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    return torch.load(path, map_location="cpu", weights_only=True)


def _iter_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def shard_path(root: Path, iteration: int, tp: int, pp: int, shard: int) -> Path:
    return _iter_dir(root, iteration) / f"shard_tp{tp:02d}_pp{pp:03d}_dp{shard:03d}.pt"


def _shard_object(ctx) -> Dict[str, Any]:
    """This rank's shard file content; works on live objects and on the copy clean() kept."""
    return {
        "format": FORMAT,
        "iteration": ctx.iteration,
        "shards": [[t.detach().clone() for t in g] for g in ctx.shard_groups()],
        "optimizer": ctx.optimizer_state_dicts(),
        "rng": ctx.scalar_state()["rng"],
    }


def _common_object(ctx) -> Dict[str, Any]:
    return {"format": FORMAT, **ctx.scalar_state(with_rng=False)}


def save_dump(ctx, step: int, save_info: Any, root: Optional[Path] = None) -> bool:
    """Dump ("last words"): this rank writes its shard if ``save_info`` names it. No collectives.

    ``save_info`` is ``[{"type": 0, "ranks": [...]}, ...]``; the smallest named rank also writes
    common.pt. Returns whether this rank wrote anything. ``rename`` must follow on one rank.
    """
    root = Path(root or ctx.args.save)
    rank = dist.get_rank()
    infos = save_info if isinstance(save_info, (list, tuple)) else [save_info]
    ranks = sorted({r for info in infos if info for r in info.get("ranks", [])})
    if rank not in ranks:
        return False
    if ctx.iteration != step:
        raise RuntimeError(
            f"dump for step {step} asked, but this rank's state is at iteration {ctx.iteration}"
        )
    tp, pp = ctx.layout["tp"], ctx.layout["pp"]
    write_object(_shard_object(ctx), shard_path(root, step, tp, pp, ctx.shard_index()))
    if rank == ranks[0]:
        write_object(_common_object(ctx), _iter_dir(root, step) / "common.pt")
    _log.info("dump checkpoint of step %d written by rank %d", step, rank)
    return True


def write_tracker(root: Path, iteration: int) -> None:
    """Atomically point ``root``'s tracker file at ``iteration`` (the rename step)."""
    acp = _acp()
    if acp is not None and callable(getattr(getattr(acp, "acp", None), "flush", None)):
        acp.acp.flush()
    root = Path(root)
    tmp = root / f".{TRACKER}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tracker(root: Path) -> Optional[int]:
    path = Path(root) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path} should hold an iteration number, found {text!r}")
    return int(text)


def save_checkpoint(ctx, root: Optional[Path] = None) -> float:
    """Periodic save (collective on the world): the first optimizer instance writes the shards,
    rank 0 writes common.pt and then the tracker. Returns seconds spent."""
    t0 = time.perf_counter()
    root = Path(root or ctx.args.save)
    tp, pp = ctx.layout["tp"], ctx.layout["pp"]
    if ctx.replica_instance() == 0:
        write_object(_shard_object(ctx), shard_path(root, ctx.iteration, tp, pp, ctx.shard_index()))
    if dist.get_rank() == 0:
        write_object(_common_object(ctx), _iter_dir(root, ctx.iteration) / "common.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        write_tracker(root, ctx.iteration)
    dist.barrier()
    return time.perf_counter() - t0


def load_checkpoint(ctx, root: Optional[Path] = None, iteration: Optional[int] = None,
                    gather: bool = True) -> int:
    """Load the latest (or given) checkpoint into ctx's model, optimizer, scheduler, counters.

    Every rank reads its shard file (written by any replica) and common.pt, then (``gather``,
    collective) rebuilds the model params from the fp32 main shard with an all-gather; a repair
    callback passes ``gather=False`` and leaves that to the rollback that follows on every rank.
    Returns the iteration loaded.
    """
    root = Path(root or ctx.args.load)
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise FileNotFoundError(f"no {TRACKER} in {root}: nothing to load")
    tp, pp = ctx.layout["tp"], ctx.layout["pp"]
    shard = read_object(shard_path(root, iteration, tp, pp, ctx.shard_index()))
    common = read_object(_iter_dir(root, iteration) / "common.pt")
    for obj, name in ((shard, "shard"), (common, "common.pt")):
        if obj.get("format") != FORMAT:
            raise ValueError(f"{name} of iteration {iteration} in {root} has format "
                             f"{obj.get('format')!r}, expected {FORMAT!r}")
    opts = distributed_optimizers(ctx.optimizer)
    if len(shard["shards"]) != len(opts):
        raise ValueError(f"checkpoint has {len(shard['shards'])} optimizers, model has {len(opts)}")
    for opt, sd, tensors in zip(opts, shard["optimizer"], shard["shards"]):
        opt.load_state_dict(sd)
        opt.load_shard_state(tensors)
        if gather:
            opt.params_from_main()
    ctx.load_scalar_state(common)
    ctx.load_rng_state(shard["rng"])
    _log.info("loaded checkpoint iteration %d from %s", iteration, root)
    return iteration

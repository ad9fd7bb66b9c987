"""Undo silent corruption: roll the job back to the last verified state when the replica cross-check
finds two holders of a shard that differ (mindio.adapter.crosscheck, ``MINDIO_CROSSCHECK_STEPS=N``).

At every boundary (``iteration % N == 0``) :meth:`VerifiedState.after_step` checks this rank's optimizer
shard(s) (fp32 main params, Adam moments and step) in full across the holders -- each hashes its N slices
(mindio.adapter.crosscheck: one pass), the holders compare them, and every rank learns of a mismatch
anywhere -- and, when they agree, keeps a copy of them (in the previous copy's memory) and of the scalar
state (iteration, consumed samples, scheduler, loss scale, RNG), with the copy's slice hashes, checked
again before the copy is ever restored. A mismatch (every rank learns of it at the same step) makes every
rank load the previous copy back, take the model params from the main shards again (``params_from_main``)
and recompute from there: the training loop restarts its data at ``ctx.consumed_samples`` (``after_step``
returns True). The end state is bit for bit that of a fault-free run. What the check costs is reported
at each copy (event ``crosscheck_cost``: seconds hashing and copying, seconds in its all-gathers, steps).
A rank in two mismatches within ``MINDIO_CROSSCHECK_WINDOW`` steps is sub-healthy (with two replicas both
holders are: nothing tells which one is bad). After the rollback the lowest of them asks the controller to
switch them out (``Processor.ask_switch_out``: hot-switched one after another while training goes on, each
backup taking the shard from the other holder; recovered as failed ranks when the controller cannot switch,
controller/hotswitch.py). Without a controller it raises :class:`SubHealthyRank` (the others go on into the
next collective, where mindio's recovery finds them).

Memory: one copy of the shard state per rank (12 bytes per param held), in host memory on the CPU.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from mindio import _knobs, _logging
from mindio.adapter.crosscheck import COST, ReplicaMismatch, shard_bytes, slice_hashes

from .optimizer import distributed_optimizers, params_from_main

__all__ = ["VerifiedState", "SubHealthyRank"]

_log = logging.getLogger(__name__)


class SubHealthyRank(RuntimeError):
    """This rank was a holder in two replica mismatches within the window: replace it."""


@dataclass
class _Snapshot:
    iteration: int
    shards: List[List[torch.Tensor]]  # per distributed optimizer, cloned
    scalars: Dict
    owners: List[int]  # id() of the optimizers it was taken from
    sums: List[List[int]]  # each optimizer's copy's slice hashes (XXH3-64), checked before it is restored


class VerifiedState:
    """Keeps the last verified state of this rank and rolls back to it; call :meth:`after_step` after
    every completed step, on every rank."""

    def __init__(self, every: Optional[int] = None, window: Optional[int] = None):
        self.every = every if every is not None else _knobs.get("MINDIO_CROSSCHECK_STEPS")
        self.window = window if window is not None else _knobs.get("MINDIO_CROSSCHECK_WINDOW")
        self.snapshot: Optional[_Snapshot] = None
        self.incidents: List[Dict] = []  # (step, holders) of every mismatch, for the sub-health rule

    def after_step(self, ctx) -> bool:
        """After step ``ctx.iteration`` completed (counters, scheduler): roll back if the cross-check found
        a mismatch (returns True: restart the data at ``ctx.consumed_samples``), else keep a verified
        snapshot at a coverage boundary. Collective over the world when it acts."""
        if not self.every:
            return False
        opts = distributed_optimizers(ctx.optimizer)
        if self.snapshot is not None and self.snapshot.owners != [id(o) for o in opts]:
            self.snapshot = None  # the optimizers were built again (a recovery, a new layout): keep a new one
        for o in opts:
            o.defer_mismatch = True  # this checks, not the optimizer (a rebuilt one too)
        COST["steps"] += 1
        if ctx.iteration % self.every:
            return False
        found = self._capture(ctx, opts)
        if not found:
            return False
        sick = self._sub_healthy(found, ctx.iteration)
        if not self._same_snapshot_everywhere(opts):
            raise ReplicaMismatch(found[0])  # nothing verified to go back to on every rank
        self._restore(ctx, opts, found[0])
        if sick:
            self._replace(sick)
            # they are being replaced: a later mismatch counts anew (on every rank alike)
            self.incidents = [i for i in self.incidents if not set(i["holders"]) & set(sick)]
        return True

    def _same_snapshot_everywhere(self, opts) -> bool:
        """Collective over the world: does every rank hold a verified copy of the same step? (A replacement
        process, or a rank whose optimizer was built again since, holds none.)"""
        mine = self.snapshot.iteration if self.snapshot is not None else -1
        tensors = opts[0].shard_state() if opts else []
        device = tensors[0].device if tensors else None
        both = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN)
        low, high = int(both[0]), -int(both[1])
        return low == high >= 0

    def _capture(self, ctx, opts) -> List[Dict]:
        """Verify this rank's shards in full across the holders, then copy them (into the previous copy's
        memory when the layout is the same: no new pages) and the scalars, with each copy's CRC-32."""
        live = [o.shard_state() for o in opts]
        found, sums = [], []
        t0, worked, gathered = time.perf_counter(), COST["work_s"], COST["gather_s"]
        for o, tensors in zip(opts, live):
            sums.append(slice_hashes(tensors, self.every))
            found += o.cross_check(self.every, ctx.iteration, sums[-1])
        if found:
            return found
        old = self.snapshot
        reuse = old is not None and [[(t.shape, t.dtype) for t in g] for g in old.shards] == \
            [[(t.shape, t.dtype) for t in g] for g in live]
        with torch.no_grad():
            shards = ([[dst.copy_(src) for dst, src in zip(d, g)] for d, g in zip(old.shards, live)] if reuse
                      else [[t.detach().clone() for t in g] for g in live])
        self.snapshot = _Snapshot(ctx.iteration, shards, ctx.scalar_state(), [id(o) for o in opts], sums)
        COST["work_s"] = worked + time.perf_counter() - t0 - (COST["gather_s"] - gathered)  # less its gathers
        # what the check cost since the last copy: bench/ha_overhead.py --crosscheck compares it with the step
        _logging.event("crosscheck_cost", at_step=ctx.iteration, every=self.every, steps=COST["steps"],
                       work_s=round(COST["work_s"], 6), gather_s=round(COST["gather_s"], 6),
                       shard_bytes=sum(shard_bytes(t) for t in live), allocated=not reuse)  # a first copy
        COST.update(work_s=0.0, gather_s=0.0, steps=0)
        return []
    def _restore(self, ctx, opts, incident: Dict) -> None:
        snap = self.snapshot
        found_at = ctx.iteration
        for saved, want in zip(snap.shards, snap.sums):
            got = slice_hashes(saved, len(want))
            if got != want:  # the copy itself changed since it was verified: never restore it
                bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                raise ReplicaMismatch(incident) from RuntimeError(
                    f"the verified copy of step {snap.iteration} changed in memory (slice {bad} of {len(want)} "
                    "hashes otherwise than when it was kept): nothing verified to roll back to")
        for o, saved in zip(opts, snap.shards):
            o.load_shard_state(saved)
        if ctx.scheduler is not None:
            ctx.scheduler.num_steps = 0  # megatron's load_state_dict adds the saved steps to its count
        ctx.load_scalar_state(snap.scalars)
        params_from_main(opts, ctx.model, intact=False)
        ctx.params_pending = None
        if dist.get_rank() == 0:
            _log.warning("replica mismatch found at step %d (shard %s, holders %s, bytes %d..%d): rolled back to "
                         "the verified state of step %d; recomputing steps %d..%d", found_at, incident["shard"],
                         incident["holders"], *incident["slice"], snap.iteration, snap.iteration + 1, found_at)
        _logging.event("replica_undo", found_at=found_at, to_step=snap.iteration, holders=incident["holders"])

    def _sub_healthy(self, found: List[Dict], step: int) -> Dict[int, List[int]]:
        """The holders in two mismatches or more within the window, with those mismatches' steps (every rank
        learns of every mismatch: the same answer on every rank)."""
        self.incidents = [i for i in self.incidents if step - i["at"] < self.window]
        self.incidents += [{"at": step, "holders": i["holders"]} for i in found]
        steps: Dict[int, List[int]] = {}
        for i in self.incidents:
            for r in i["holders"]:
                steps.setdefault(r, []).append(i["at"])
        return {r: at for r, at in sorted(steps.items()) if len(at) >= 2}

    def _replace(self, sick: Dict[int, List[int]]) -> None:
        """After the rollback: ask the controller to switch the sub-healthy holders out (hot switch, one after
        another; it recovers them as failed ranks when it cannot) and train on; without a controller (no
        high availability) a sub-healthy rank raises :class:`SubHealthyRank`."""
        me = dist.get_rank()
        if me not in sick:
            return
        why = (f"rank {me} is sub-healthy: a holder in {len(sick[me])} replica mismatches within {self.window} "
               f"steps (MINDIO_CROSSCHECK_WINDOW), at steps {', '.join(map(str, sick[me]))}")
        ttp = sys.modules.get("mindio.ttp._runtime")
        proc = ttp.state.processor if ttp is not None else None
        ranks = sorted(sick)
        if proc is None or not (proc.ask_switch_out(ranks, why) if me == ranks[0] else proc.connected):
            raise SubHealthyRank(why + ": replace it")
        _log.warning("%s: the controller is asked to switch ranks %s out, one after another", why, ranks)

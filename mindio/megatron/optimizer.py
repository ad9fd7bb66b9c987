"""The replica distributed optimizer: megatron-core's DistributedOptimizer, fixed and made repairable.

Replicas. megatron-core 0.16.1 can already keep every ZeRO-1 shard on R ranks:
``num_distributed_optimizer_instances=R`` cuts the data-parallel group into R contiguous parts
(one optimizer *instance* each), reduce-scatters gradients inside an instance, all-reduces the
shards across instances and all-gathers updated params inside the instance. Shard ``j`` therefore
lives on DP positions ``j, j+d/R, j+2d/R, ...``: exactly MindIO's replica layout (shard index =
position in the sorted DP group mod d/R), and the replicas stay bit-identical because every
instance applies the same Adam update to the same all-reduced gradient. We use that machinery
instead of re-implementing the collectives (see docs/megatron.md for the justification and the
test that checks the replicas bit for bit after every step).

What this module adds on top (class :class:`ReplicaDistributedOptimizer`):

1. Four upstream bugs on the torch-Adam path (no TE/Apex), the first two present in 0.16.1 and 0.19.2:
   - ``_set_main_param_and_optimizer_states`` iterates the *destination* keys, so a checkpoint
     without a ``step`` key raises ``KeyError``, and it copies into leaf parameters outside
     ``no_grad`` (``RuntimeError: a leaf Variable that requires grad ...``). Fixed: copy the keys
     both sides have, under ``no_grad``, and give each param its own ``step`` tensor.
   - ``load_state_dict`` assigns ONE shared ``step`` tensor to every param state; torch Adam then
     increments it once per param per step and the bias correction drifts silently after a restore.
     Fixed: every param state gets its own copy.
   - loading a ``dp_reshardable`` checkpoint (Megatron-LM's default distributed-optimizer format):
     ``load_state_dict`` sets Adam's step from the checkpoint's param groups, then the param-state
     load copies each param's ``step`` entry over it -- an entry the format does not store (a
     LocalNonpersistentObject: the rank's own current step, 0 in a fresh job). Fixed: an existing
     ``step`` is kept.
   - ``state_dict()`` of an optimizer that has not stepped yet fails (``assert len(steps) == 1`` over an
     empty Adam state), so megatron's ``sharded_state_dict(is_loading=True)`` -- Megatron-LM's way of
     loading a checkpoint into a freshly built model -- fails. Fixed: the Adam state is allocated first
     (zeros, step 0: what torch Adam allocates at its first step).
2. ``shard_state()`` / ``load_shard_state()``: this rank's shard (fp32 main params, exp_avg,
   exp_avg_sq, step, per param in bucket order) as a flat, ordered list of tensors, for
   repair (point-to-point send/recv), for dump checkpoints and for keeping state across a rebuild.
3. :func:`params_from_main` (module function): model params from the fp32 main shards (rollback),
   gathered only in the instances where some rank's params are not the gathered ones of the step
   rolled back to (``params_synced``).
4. On CPU, torch's fused Adam/AdamW kernel. Without TE/Apex megatron-core builds a plain
   ``torch.optim.AdamW``, whose per-tensor loop is ~7x slower on CPU than ``fused=True`` (one
   vectorised pass per tensor, deterministic); with replicas every rank updates R/d of the params
   instead of 1/d, so that loop was the largest part of the replicas' extra step time (issue 18,
   docs/benchmarks.md). On GPU megatron already uses a fused kernel (TE/Apex FusedAdam).

5. The replica cross-check (``MINDIO_CROSSCHECK_STEPS=N``, mindio.adapter.crosscheck): after every N-th
   update (by Adam's step count, which every holder shares) the holders of this shard (megatron's
   inter-instance group) compare the hash of each of its N slices. A mismatch is logged, recorded
   (event ``replica_mismatch``) and raised (:class:`~mindio.adapter.crosscheck.ReplicaMismatch`); with
   :class:`mindio.megatron.verified.VerifiedState` in the loop it checks at its boundaries instead and
   rolls the job back.
   :meth:`ReplicaDistributedOptimizer.flip_bit` is the ``--inject flip`` drill's corruption.

:func:`install` puts the class into the ``megatron.core.optimizer`` namespace, where
``get_megatron_optimizer`` looks ``DistributedOptimizer`` up, so megatron builds ours; it also makes
megatron's grad reduce-scatter and param all-gather skip a one-rank optimizer instance (d = R), where they
are the identity (:mod:`mindio.megatron._one_rank`).
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch
from megatron.core import optimizer as _mopt

from mindio import _knobs, _logging
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

__all__ = ["ReplicaDistributedOptimizer", "install", "distributed_optimizers", "params_from_main", "STATE_KEYS"]

_log = logging.getLogger(__name__)

#: Per-param tensors of a shard, in the order they are sent and stored.
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq", "step")


class ReplicaDistributedOptimizer(DistributedOptimizer):
    """DistributedOptimizer with the two restore bugs fixed and a flat shard-state interface."""

    #: the model params are the all-gather of the main shards of this optimizer's last update: set once
    #: ``step_with_ready_grads`` gathered them (not with an overlapped param gather, which finishes in the
    #: next forward), cleared when it starts and when a shard is loaded or received. A rollback to that
    #: step need not gather them again (:func:`params_from_main`).
    params_synced = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _fuse_cpu_adam(self.optimizer)

    def step_with_ready_grads(self) -> bool:
        self.params_synced = False
        ok = super().step_with_ready_grads()
        self.params_synced = not (self.ddp_config.overlap_param_gather or self.ddp_config.use_megatron_fsdp)
        every = _knobs.get("MINDIO_CROSSCHECK_STEPS")
        if every and not self.defer_mismatch and self.adam_step() % every == 0:
            found = self.cross_check(every)  # with mindio.megatron.verified in the loop, it checks instead
            if found:
                from mindio.adapter.crosscheck import ReplicaMismatch

                raise ReplicaMismatch(found[0])
        return ok

    # -- replica cross-check ----------------------------------------------------------------
    @staticmethod
    def _holders_group():
        """The group of every holder of this rank's shard: megatron's inter-instance group (the same for
        the dense and the expert optimizer), or None with one instance."""
        from megatron.core import parallel_state as ps

        group = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
        return group if group is not None and torch.distributed.get_world_size(group) > 1 else None

    def adam_step(self) -> int:
        """Adam's step count of this shard (replicated state: the same on every holder)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    #: True once :class:`mindio.megatron.verified.VerifiedState` runs the check at its boundaries (and undoes
    #: a mismatch); until then the optimizer checks after every N-th update and raises on a mismatch
    defer_mismatch = False

    def cross_check(self, every: int, step: Optional[int] = None, hashes: Optional[list] = None) -> list:
        """Compare the whole shard with the other holders, as ``every`` slices (collective over the holders,
        then the world; mindio.adapter.crosscheck.compare); each mismatch is logged by its holders and
        recorded. ``step``: default Adam's step count; ``hashes``: the slices' hashes when the caller has
        them. Returns the incidents (the same on every rank)."""
        group = self._holders_group()
        if group is None:  # one optimizer instance: no replica to compare with
            return []
        from mindio.adapter.crosscheck import ReplicaMismatch, compare

        tensors = self.shard_state()
        key = min(torch.distributed.get_process_group_ranks(group))
        found = compare(tensors, self.adam_step() if step is None else step, every, key,
                        self.data_parallel_group.rank(), group, tensors[0].device if tensors else None, hashes)
        me = torch.distributed.get_rank()
        for incident in found:
            if me in incident["holders"]:
                _log.error("%s", ReplicaMismatch(incident))
                _logging.event("replica_mismatch", **{k: v for k, v in incident.items() if k != "kind"})
        return found

    @torch.no_grad()
    def flip_bit(self, which: str = "param", bit: int = 0) -> str:
        """Flip mantissa bit ``bit`` of one fp32 element of this shard's ``which`` (a STATE_KEYS name but
        ``step``): the largest in magnitude of the first such tensor with a nonzero one (a plausible value,
        never a NaN; on a large value the next updates do not round the flipped low bit away). Returns what
        was flipped (for the drill's line)."""
        if which not in STATE_KEYS[:3]:
            raise ValueError(f"flip: {which!r} is not one of {STATE_KEYS[:3]}")
        if not 0 <= bit < 23:
            raise ValueError(f"flip: bit {bit} is not a mantissa bit of fp32 (0..22)")
        tensors = self.shard_state()
        for i in range(STATE_KEYS.index(which), len(tensors), len(STATE_KEYS)):
            t = tensors[i]
            if t.dtype != torch.float32 or not t.is_contiguous() or not t.numel() or not t.abs().max():
                continue
            j = int(t.reshape(-1).abs().argmax())
            before = float(t.reshape(-1)[j])
            t.reshape(-1)[j:j + 1].view(torch.int32).bitwise_xor_(1 << bit)
            self.params_synced = False
            return f"{which} of shard tensor {i}, element {j}, bit {bit}: {before!r} -> {float(t.reshape(-1)[j])!r}"
        raise ValueError(f"flip: no nonzero contiguous fp32 {which} in this rank's shard")

    # -- upstream bug 1 ---------------------------------------------------------------------
    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        self.params_synced = False
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return super()._set_main_param_and_optimizer_states(model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        optim_state = self.optimizer.state[main_param]
        for key, value in tensors.items():
            if key == "param":
                main_param.copy_(value)
            elif key == "step":
                # bug 3: the step of a loaded param state is this rank's own (a LocalNonpersistentObject
                # of the dp_reshardable format); the checkpoint's step came with load_state_dict
                # (param_groups) and must not be overwritten. Each param keeps its own tensor.
                if "step" not in optim_state:
                    optim_state["step"] = torch.as_tensor(value, dtype=torch.float32).detach().clone()
            elif key in optim_state:
                optim_state[key].copy_(value)
            elif isinstance(value, torch.Tensor):
                optim_state[key] = value.detach().clone()

    # -- upstream bug 2 ---------------------------------------------------------------------
    def load_state_dict(self, state_dict):
        self.params_synced = False
        super().load_state_dict(state_dict)
        _unshare_steps(self.optimizer)

    # -- upstream bug 4 ---------------------------------------------------------------------
    def state_dict(self):
        self.ensure_state()  # upstream asserts one step value over an empty Adam state
        return super().state_dict()

    # -- shard state ------------------------------------------------------------------------
    def _param_states(self):
        """(model_param, tensors-dict) for every param of this rank's shard, in bucket order."""
        for gbuf_range_maps in self.gbuf_ranges:
            for gbuf_range_map_for_all_buckets in gbuf_range_maps.values():
                for gbuf_range_map in gbuf_range_map_for_all_buckets:
                    for model_param in gbuf_range_map["param_map"]:
                        yield model_param, self._get_main_param_and_optimizer_states(model_param)

    def ensure_state(self) -> None:
        """Allocate Adam state (zeros, step 0) if no step has run yet, so a shard can be received.

        Done by hand, not with megatron's dummy optimizer step, which would apply weight decay.
        """
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state[param]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )

    def shard_state(self) -> List[torch.Tensor]:
        """This rank's shard as a flat list: for each param in bucket order, STATE_KEYS tensors.

        The tensors are the live ones (no copy); clone them to keep a snapshot.
        """
        self.ensure_state()
        out: List[torch.Tensor] = []
        for _, tensors in self._param_states():
            for key in STATE_KEYS:
                value = tensors[key]
                out.append(value if value.dim() else value.reshape(1))
        return out

    @torch.no_grad()
    def load_shard_state(self, tensors: List[torch.Tensor]) -> None:
        """Inverse of :meth:`shard_state`: copy a shard (from a replica or a file) into this rank."""
        mine = self.shard_state()
        self.params_synced = False
        if len(tensors) != len(mine):
            raise ValueError(
                f"shard has {len(tensors)} tensors, this optimizer expects {len(mine)}: "
                "the model, parallel layout or replica count differs from the sender's"
            )
        for i, (dst, src) in enumerate(zip(mine, tensors)):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(
                    f"shard tensor {i} ({STATE_KEYS[i % len(STATE_KEYS)]}): expected "
                    f"{tuple(dst.shape)}/{dst.dtype}, got {tuple(src.shape)}/{src.dtype}"
                )
            dst.copy_(src)


@torch.no_grad()
def params_from_main(optimizers: List[ReplicaDistributedOptimizer], model_chunks, intact: bool) -> int:
    """Model params from the main shards of ``optimizers`` (a rollback, on every rank): each rank copies
    its own shard into its params unless they are ``intact`` (the all-gather of the main shards of the
    step rolled back to: :attr:`ReplicaDistributedOptimizer.params_synced`); then, for each DDP bucket
    group, in its optimizer instance (one small all-gather of the members' flags decides; a one-rank
    instance has nothing to gather): nothing when every member is intact; when one is not, the others
    send it their shards point to point (an intact rank needs nothing: half the bytes of an all-gather
    in a 2-rank instance); else megatron's all-gather. A kept model (regroup.py) gathers only where a
    rank was repaired or replaced. Returns the bucket groups that moved params."""
    if not intact:
        for opt in optimizers:
            opt._copy_main_params_to_model_params()
    gathered = 0
    for chunk in model_chunks:
        if chunk.ddp_config.reuse_grad_buf_for_mxfp8_param_ag or chunk.ddp_config.use_megatron_fsdp:
            chunk.start_param_sync(force_sync=True)  # megatron's own copies after the gather: all of it
            gathered += 1
            continue
        for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            size = bucket_group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            group = bucket_group.intra_distributed_optimizer_instance_group
            device = bucket_group.buckets[0].param_data.device
            flags = torch.zeros(size, dtype=torch.int32, device=device)
            torch.distributed.all_gather_into_tensor(flags, torch.tensor([0 if intact else 1], dtype=torch.int32,
                                                                         device=device), group=group)
            stale = [i for i, f in enumerate(flags.tolist()) if f]
            if len(stale) == 1:
                _send_shards_to(bucket_group, stale[0])
            elif stale:
                bucket_group.start_param_sync(force_sync=True)
            gathered += bool(stale)
    return gathered


def _send_shards_to(bucket_group, dst: int) -> None:
    """Every member of the bucket group's optimizer instance but ``dst`` (its group rank) sends its own
    shard of each bucket's params to ``dst``, which receives them into place: ``dst`` ends with the
    all-gathered params, the others already had them."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    group = bucket_group.intra_distributed_optimizer_instance_group
    me, size = bucket_group.intra_distributed_optimizer_instance_rank, bucket_group.intra_distributed_optimizer_instance_size
    works = []
    for bucket in bucket_group.buckets:
        shards = shard_buffer(bucket.param_data, size)
        if me == dst:
            works += [torch.distributed.irecv(shards[j], group=group, group_src=j) for j in range(size) if j != dst]
        else:
            works.append(torch.distributed.isend(shards[me], group=group, group_dst=dst))
    for work in works:
        work.wait()


def _fuse_cpu_adam(opt: torch.optim.Optimizer) -> bool:
    """Switch a torch Adam/AdamW over CPU fp32 params to the fused kernel, as ``fused=True`` at
    construction would (the flag is per param group; the constructor also marks the optimizer as
    accepting grad-scaler arguments). Left alone: other optimizers, other devices or dtypes, and
    groups where foreach / fused / capturable / differentiable was chosen explicitly."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return False
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("capturable")
           or g.get("differentiable") for g in opt.param_groups):
        return False
    for g in opt.param_groups:
        g["fused"] = True
    opt.defaults["fused"] = True
    opt._step_supports_amp_scaling = True
    return True


def _unshare_steps(torch_optimizer: torch.optim.Optimizer) -> None:
    for state in torch_optimizer.state.values():
        if "step" in state and isinstance(state["step"], torch.Tensor):
            state["step"] = state["step"].detach().clone()


def install() -> None:
    """Make ``get_megatron_optimizer`` build :class:`ReplicaDistributedOptimizer`; megatron's bucket
    collectives skip a one-rank group (an optimizer instance of one rank, _one_rank.py)."""
    from . import _one_rank

    _mopt.DistributedOptimizer = ReplicaDistributedOptimizer
    _one_rank.install()


def distributed_optimizers(optimizer) -> List[ReplicaDistributedOptimizer]:
    """The ReplicaDistributedOptimizer(s) inside what ``get_megatron_optimizer`` returned."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    found = [o for o in inner if isinstance(o, ReplicaDistributedOptimizer)]
    if len(found) != len(inner):
        raise TypeError(
            "the optimizer is not (only) a ReplicaDistributedOptimizer: call "
            "mindio.megatron.optimizer.install() before get_megatron_optimizer(), with "
            "use_distributed_optimizer=True"
        )
    return found

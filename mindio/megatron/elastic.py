"""Elastic training callbacks for megatron-core (the zit handlers of mindio.ttp.elastic).

Downgrade keeps whole optimizer *instances*: with DP=d and R replicas (num_distributed_optimizer_
instances=R), each instance shards the optimizer d/R ways. Removing k instances leaves DP=d*(R-k)/R
with R-k instances, each still sharded d/R ways -- so every survivor's shard keeps its size and
content and is simply put back into the rebuilt optimizer (no re-sharding, no transfer). The global
batch is kept: ``num_microbatches`` grows by d/d' (gradient accumulation), and megatron's loss
scaling (1/num_microbatches per micro-batch, 1/DP in the gradient reduction) rescales the gradient to
the mean over the same global batch. Megatron's pretraining sampler derives each DP rank's samples
from (consumed samples, DP rank, DP size), so the same samples are consumed, split differently.

Upgrade restores the original replica count and micro-batch count, rebuilds model/optimizer on every
rank (the standby builds its own here, collectively with the survivors), the new ranks receive their
shard + scalar state from a replica (the ordinary repair, RT_RECV_REPAIR), and the rollback rebuilds
model params from the fp32 main shards + all-gather.

    from mindio.megatron.elastic import register_elastic
    register_elastic(adapter)          # after mindio.megatron.register(adapter, step_args=ctx)
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch.distributed as dist

from . import replica
from .adapter import MegatronAdapter

__all__ = ["register_elastic", "downgrade_rebuild", "upgrade_rebuild", "report_layout"]

_log = logging.getLogger(__name__)


def _original(ctx) -> dict:
    """The layout the job started with, remembered at the first downgrade."""
    orig = getattr(ctx, "_elastic_original", None)
    if orig is None:
        a = ctx.args
        orig = {"replica_cnt": ctx.replica_cnt, "num_microbatches": a.num_microbatches,
                "dp_size": ctx.layout["dp_size"]}
        ctx._elastic_original = orig
    return orig


def downgrade_rebuild(adapter: MegatronAdapter, new_dp_ranks: Sequence[int],
                      new_world_ranks: Sequence[int]) -> None:
    """Megatron groups, model and optimizer on the shrunken world; this rank's kept shard goes back."""
    ctx = adapter.ctx
    a = ctx.args
    _original(ctx)  # the layout to return to, remembered at the first downgrade
    d_old, r_old = ctx.layout["dp_size"], ctx.replica_cnt
    d_new = len(new_dp_ranks)
    per = d_old // r_old  # ranks per optimizer instance: unchanged by a downgrade
    if d_new % per or not d_new:
        raise ValueError(f"downgrade to a DP group of {d_new} ranks: not a whole number of optimizer instances "
                         f"of {per} ranks (DP {d_old}, replica_cnt {r_old})")
    step_samples = a.micro_batch_size * d_new
    if a.global_batch_size % step_samples:
        raise ValueError(f"global batch {a.global_batch_size} is not a multiple of micro batch x DP = "
                         f"{step_samples} after the downgrade: the global batch cannot be kept")
    prev_mb = a.num_microbatches
    a.replica_cnt = d_new // per
    a.num_microbatches = a.global_batch_size // step_samples
    adapter.rebuild_groups([])
    report_layout(ctx)
    _log.warning("downgrade: DP %d -> %d (replica_cnt %d -> %d), micro-batches per step %d -> %d, global "
                 "batch %d kept; world %s", d_old, ctx.layout["dp_size"], r_old, a.replica_cnt,
                 prev_mb, a.num_microbatches, a.global_batch_size, list(new_world_ranks)[:16])


def upgrade_rebuild(adapter: MegatronAdapter, rank_list: Sequence[int]) -> None:
    """Back to the original layout; survivors put their shard back, new ranks build empty ones."""
    ctx = adapter.ctx
    orig = getattr(ctx, "_elastic_original", None)
    if orig is not None:  # a standby never downgraded: its args already hold the original layout
        ctx.args.replica_cnt = orig["replica_cnt"]
        ctx.args.num_microbatches = orig["num_microbatches"]
    adapter.rebuild_groups([])
    report_layout(ctx)
    _log.warning("upgrade: DP %d, replica_cnt %d, micro-batches per step %d; new ranks %s",
                 ctx.layout["dp_size"], ctx.replica_cnt, ctx.args.num_microbatches, list(rank_list)[:16])


def report_layout(ctx) -> None:
    """Tell the controller this rank's (new) DP group and replica layout, in the controller's rank ids."""
    from mindio import ttp
    from mindio.ttp.elastic import job_rank

    info = replica.replica_info(ctx.replica_cnt, experts=ctx.has_experts)
    for entry in info:
        entry["rank_list"] = [job_rank(r) for r in entry["rank_list"]]
    me = job_rank(dist.get_rank())
    ttp.tft_set_optimizer_replica(me, info)
    ttp.tft_set_dp_group_info(me, [job_rank(r) for r in replica.dp_rank_list()])


def register_elastic(adapter: MegatronAdapter) -> None:
    """Register the four zit handlers (reference signatures) for ``adapter``."""
    from mindio import ttp

    ttp.tft_register_zit_downgrade_rebuild_handler(
        lambda new_dp_ranks, new_world_ranks, args, ctx: downgrade_rebuild(ctx, new_dp_ranks, new_world_ranks),
        adapter)
    ttp.tft_register_zit_upgrade_rebuild_handler(
        lambda rank_list, args, ctx: upgrade_rebuild(ctx, rank_list), adapter)
    ttp.tft_register_zit_upgrade_repair_handler(
        lambda step, need_rebuild, error_ranks, repair_info, args, ctx: ctx.repair(
            step, need_rebuild, error_ranks, repair_info), adapter)
    ttp.tft_register_zit_upgrade_rollback_handler(lambda step, args, ctx: ctx.rollback(step), adapter)

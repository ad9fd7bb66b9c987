"""DP replica groups: layout, megatron parallel-state setup and what is reported to mindio.

Layout (MindIO's, and megatron-core's ``num_distributed_optimizer_instances``): the data-parallel
group of ``d`` ranks (sorted) is cut into ``R = replica_cnt`` contiguous parts of ``d/R`` ranks.
Each part holds one full copy of the ZeRO-1 optimizer state, sharded ``d/R`` ways, so the shard at
position ``i`` of the DP group is ``i mod d/R`` and its replicas are ``i mod d/R + k*d/R``.
With context parallelism on, the "dense" group is DP x CP; with expert parallelism, the expert
optimizer uses the expert-DP group (index 1 of ``tft_set_optimizer_replica``).

The pure functions here need no megatron and no process group; :func:`initialize_parallel`
and :func:`replica_info` read megatron's parallel state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

__all__ = [
    "ReplicaLayout",
    "shard_index",
    "replica_ranks",
    "memory_overhead_bytes",
    "initialize_parallel",
    "replica_info",
    "dp_rank_list",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaLayout:
    """One DP group cut into ``replica_cnt`` contiguous optimizer instances."""

    dp_ranks: tuple  # global ranks of the DP group, sorted
    replica_cnt: int

    def __post_init__(self):
        d = len(self.dp_ranks)
        if self.replica_cnt < 1:
            raise ValueError(f"replica_cnt must be >= 1, got {self.replica_cnt}")
        if d % self.replica_cnt:
            raise ValueError(
                f"the data-parallel size {d} is not divisible by replica_cnt={self.replica_cnt}: "
                "choose a replica count that divides the DP size, or pass "
                "--distributed-optimizer-no-replica"
            )
        if list(self.dp_ranks) != sorted(self.dp_ranks):
            raise ValueError(f"dp_ranks must be sorted, got {self.dp_ranks}")

    @property
    def shards(self) -> int:
        return len(self.dp_ranks) // self.replica_cnt

    def shard_of(self, rank: int) -> int:
        return shard_index(self.dp_ranks, self.replica_cnt, rank)

    def replicas_of(self, rank: int) -> List[int]:
        return replica_ranks(self.dp_ranks, self.replica_cnt, rank)


def shard_index(dp_ranks: Sequence[int], replica_cnt: int, rank: int) -> int:
    """Which optimizer shard ``rank`` holds: its position in the sorted DP group mod d/R."""
    ranks = sorted(dp_ranks)
    return ranks.index(rank) % (len(ranks) // replica_cnt)


def replica_ranks(dp_ranks: Sequence[int], replica_cnt: int, rank: int) -> List[int]:
    """Every rank (``rank`` included) that holds the same shard as ``rank``, sorted."""
    ranks = sorted(dp_ranks)
    step = len(ranks) // replica_cnt
    j = ranks.index(rank) % step
    return [ranks[j + k * step] for k in range(replica_cnt)]


def memory_overhead_bytes(num_params: int, replica_cnt: int, dp_size: int) -> float:
    """Extra optimizer memory per rank from the replicas: 12 * P * (R - 1) / d bytes.

    fp32 main params + exp_avg + exp_avg_sq = 12 bytes per parameter; a rank holds P*R/d of
    them instead of P/d.
    """
    return 12.0 * num_params * (replica_cnt - 1) / dp_size


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    replica_cnt: int = 2,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> None:
    """megatron's ``initialize_model_parallel`` with ``replica_cnt`` optimizer instances (the dense
    DP group and, with experts, the expert-DP group are each cut into ``replica_cnt`` parts)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        num_distributed_optimizer_instances=replica_cnt,
    )


def dp_rank_list(with_context_parallel: bool = True) -> List[int]:
    """Global ranks of this rank's (dense) DP group, sorted."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group(with_context_parallel=with_context_parallel)
    return sorted(dist.get_process_group_ranks(group))


def replica_info(replica_cnt: int, experts: Optional[bool] = None) -> List[Dict]:
    """The ``replica_info`` list for ``tft_set_optimizer_replica``: [dense, (expert)], one entry per
    distributed optimizer in megatron's order. ``experts``: the model has MoE experts (their own
    optimizer over the expert-DP group, even at EP=1); None = expert parallelism is on."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    info = [{"rank_list": dp_rank_list(True), "replica_cnt": replica_cnt, "replica_shift": 0}]
    if experts is None:
        experts = ps.get_expert_model_parallel_world_size() > 1
    if experts:
        group = ps.get_expert_data_parallel_group()
        info.append(
            {
                "rank_list": sorted(dist.get_process_group_ranks(group)),
                "replica_cnt": replica_cnt,
                "replica_shift": 0,
            }
        )
    return info

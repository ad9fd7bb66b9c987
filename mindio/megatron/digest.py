"""``state-digest`` for a megatron-core job: parameters and optimizer state of every rank.

Each model-parallel slice contributes its model params once and each optimizer shard once, so the
digest does not count replicas twice and is the same for any run with the same parallel layout and
the same state: dense params on DP position 0, MoE expert params on expert-DP position 0; the shards
of each distributed optimizer (dense, then expert) on its first replica instance.
"""

from __future__ import annotations

from mindio.adapter import global_digest, local_digest

from .optimizer import STATE_KEYS

__all__ = ["state_digest", "is_expert_param"]

_PREFIX = ("shard", "expert_shard")  # per optimizer type


def is_expert_param(param) -> bool:
    """megatron marks expert-parallel params ``allreduce = False`` (reduced over the expert-DP group)."""
    return not getattr(param, "allreduce", True)


def state_digest(ctx) -> str:
    """Collective over the world: the sha256 hex digest of the whole training state."""
    parts = []
    main = [ctx._dp(t)[0] == 0 for t in range(len(ctx.layout["groups"]))]
    for i, chunk in enumerate(ctx.model):
        for n, p in chunk.named_parameters():
            if main[1 if is_expert_param(p) and len(main) > 1 else 0]:
                parts.append((f"model{i}.{n}", p))
    for t, tensors in enumerate(ctx.shard_groups()):
        if ctx.replica_instance(t) == 0:
            parts += [(f"{_PREFIX[t]}{ctx.shard_index(t)}.{i // len(STATE_KEYS)}."
                       f"{STATE_KEYS[i % len(STATE_KEYS)]}", x) for i, x in enumerate(tensors)]
    return global_digest(local_digest(parts))

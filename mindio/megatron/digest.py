"""``state-digest`` for a megatron-core job: parameters and optimizer state of every rank.

Each model-parallel slice contributes its model params once (DP position 0) and each optimizer
shard once (first replica instance), so the digest does not count replicas twice and is the same
for any run with the same parallel layout and the same state.
"""

from __future__ import annotations

from mindio.adapter import global_digest, local_digest

from .optimizer import STATE_KEYS

__all__ = ["state_digest"]


def state_digest(ctx) -> str:
    """Collective over the world: the sha256 hex digest of the whole training state."""
    parts = []
    if ctx._dp()[0] == 0:
        for i, chunk in enumerate(ctx.model):
            parts += [(f"model{i}.{n}", p) for n, p in chunk.named_parameters()]
    if ctx.replica_instance() == 0:
        tensors = ctx.shard_tensors()
        parts += [(f"shard{ctx.shard_index()}.{i // len(STATE_KEYS)}."
                   f"{STATE_KEYS[i % len(STATE_KEYS)]}", t) for i, t in enumerate(tensors)]
    return global_digest(local_digest(parts))

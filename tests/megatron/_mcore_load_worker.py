"""Worker for test_layouts_megatron.py: reads a checkpoint written by mindio with megatron-core's own
loader (``megatron.core.dist_checkpointing.load``), the way Megatron-LM's ``load_checkpoint`` does, into
freshly built models -- no mindio code on the load path.

    _mcore_load_worker.py CKPT_ITER_DIR OUT_DIR -- EXAMPLE_ARGS...

1. The layout of EXAMPLE_ARGS (the one the checkpoint was written at): model and distributed optimizer
   from ``model.sharded_state_dict`` / ``optimizer.sharded_state_dict(..., is_loading=True)`` with the
   checkpoint's content metadata, ``dist_checkpointing.load``, ``load_state_dict`` on both; prints
   ``mcore-load state-digest: <sha256>`` (the digest mindio prints after its own load) and writes every
   model tensor this rank loaded to OUT_DIR/rank<r>.pt, by checkpoint key.
2. TP1 x PP1 x DP=world (megatron-core reshards the model weights; the dp_reshardable optimizer state
   reshards along DP only, so it is not loaded here): the model alone, then rank 0 compares every
   tensor with what step 1 loaded and prints ``resharded-equal: <n> tensors``.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "megatron"))
import pretrain_gpt as example  # noqa: E402

from mindio import megatron as mio  # noqa: E402  (only to build the example's objects and the digest)


def build(args):
    ctx = mio.TrainingContext(args, build=lambda: example.setup_model_and_optimizer(args))
    ctx.init_parallel()
    ctx.model, ctx.optimizer, ctx.scheduler = ctx.build()
    return ctx


def model_state_dicts(ctx, metadata):
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(ctx.model)  # a copy of metadata: megatron adds the current DP group to it
    return {("model" if len(chunks) == 1 else f"model{i}"): c.sharded_state_dict(metadata=dict(metadata))
            for i, c in enumerate(chunks)}


def main() -> None:
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.utils import unwrap_model

    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    args = example.parse_args(sys.argv[sys.argv.index("--") + 1:])
    example.prepare(args)
    args.padded_vocab_size = example.CorpusDataset(args.data_path, args.tokenizer_file, args.seq_length,
                                                   args.seed).vocab_size
    example.initialize(args)
    rank = dist.get_rank()
    metadata = dist_checkpointing.load_content_metadata(ckpt)

    # 1. same layout: model + optimizer, as Megatron-LM's load_checkpoint builds them
    ctx = build(args)
    sd = model_state_dicts(ctx, metadata)
    keys = {id(t.data): t.key for t in nested_values(sd) if isinstance(t, ShardedTensor)}
    sd["optimizer"] = ctx.optimizer.sharded_state_dict(sd, is_loading=True, metadata=dict(metadata))
    state = dist_checkpointing.load(sd, str(ckpt))
    for i, chunk in enumerate(unwrap_model(ctx.model)):
        chunk.load_state_dict(state["model" if len(ctx.model) == 1 else f"model{i}"], strict=True)
    ctx.optimizer.load_state_dict(state["optimizer"])
    mine = {keys[id(p)]: p.detach().clone() for c in unwrap_model(ctx.model) for p in c.parameters()
            if id(p) in keys}
    torch.save(mine, out / f"rank{rank}.pt")
    digest = mio.state_digest(ctx)
    if rank == 0:
        print(f"mcore-load state-digest: {digest}", flush=True)

    # 2. TP1 x PP1 x DP=world: the model weights only
    ctx.model = ctx.optimizer = ctx.scheduler = None
    ps.destroy_model_parallel()
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.num_layers_per_virtual_pipeline_stage = None
    args.replica_cnt, args.distributed_optimizer_no_replica = 1, True
    ctx = build(args)
    sd = model_state_dicts(ctx, metadata)
    keys = {id(t.data): t.key for t in nested_values(sd) if isinstance(t, ShardedTensor)}
    state = dist_checkpointing.load(sd, str(ckpt))
    unwrap_model(ctx.model)[0].load_state_dict(state["model"], strict=True)
    dist.barrier()
    if rank == 0:
        before = {}
        for path in sorted(out.glob("rank*.pt")):
            before.update(torch.load(path, weights_only=True))
        now = {keys[id(p)]: p.detach() for p in unwrap_model(ctx.model)[0].parameters() if id(p) in keys}
        differ = sorted(k for k in now if k not in before or not torch.equal(now[k], before[k]))
        assert not differ and set(now) == set(before), (differ[:5], sorted(set(before) ^ set(now))[:5])
        print(f"resharded-equal: {len(now)} tensors", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

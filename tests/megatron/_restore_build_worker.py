"""Worker for test_restore_build.py (2 gloo ranks, DP=2, one optimizer instance): a build whose weights
the rollback restores skips megatron's weight initialisation, takes the previous build's grad buffers
again, and ends, after the rollback, with the params of a full build; with a frozen param (not restored
by the rollback) it builds again in full.

    _restore_build_worker.py trainable|frozen
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "megatron"))
import pretrain_gpt as pg  # noqa: E402

from megatron.core.tensor_parallel import layers  # noqa: E402

from mindio import megatron as mio  # noqa: E402
from mindio.megatron.restore_build import build_for_restore, spare_buffers  # noqa: E402

DRAWN = [0]  # weights megatron initialised (its CPU initialisation, one call per weight)


def count_draws():
    original = layers._initialize_affine_weight_cpu

    def counted(*a, **k):
        DRAWN[0] += 1
        return original(*a, **k)
    layers._initialize_affine_weight_cpu = counted


def params(model) -> list:
    return [p.detach().clone() for chunk in model for p in chunk.parameters()]


def main():
    frozen = sys.argv[1] == "frozen"
    args = pg.parse_args(["--use-distributed-optimizer", "--replica-cnt", "1"])
    pg.initialize(args)
    dataset = pg.CorpusDataset(args.data_path, args.tokenizer_file, args.seq_length, args.seed)
    args.padded_vocab_size = dataset.vocab_size
    if frozen:  # the position embedding stays at its initial value: outside the optimizer
        provider = pg.model_provider

        def model_provider(*a, **k):
            model = provider(*a, **k)
            model.embedding.position_embeddings.weight.requires_grad_(False)
            return model
        pg.model_provider = model_provider
    ctx = mio.TrainingContext(args, build=lambda: pg.setup_model_and_optimizer(args))
    ctx.init_parallel()
    count_draws()
    ctx.model, ctx.optimizer, ctx.scheduler = ctx.build()
    full, full_draws = params(ctx.model), DRAWN[0]
    shards = [t.clone() for t in ctx.shard_tensors()]
    DRAWN[0] = 0
    spares = spare_buffers(ctx.model)  # the first build's grad buffers, as clean() keeps them
    offered = {t.data_ptr() for t in spares}
    ctx.model, ctx.optimizer, ctx.scheduler = build_for_restore(ctx.build, "test", spares)
    print(f"draws full={full_draws} restore={DRAWN[0]}", flush=True)
    taken = sum(t.data_ptr() in offered for chunk in ctx.model for b in chunk.buffers
                for t in (b.param_data, b.grad_data) if t is not None)
    print(f"spare buffers taken again: {taken} of {len(offered)}", flush=True)
    with torch.no_grad():
        for dst, src in zip(ctx.shard_tensors(), shards):
            dst.copy_(src)
    mio.MegatronAdapter(ctx).rollback(0)
    same = all(torch.equal(a, b) for a, b in zip(full, params(ctx.model)))
    print(f"params after rollback equal to the full build: {same}", flush=True)


if __name__ == "__main__":
    main()

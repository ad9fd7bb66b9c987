"""What the Megatron test workers share (run under torchrun): examples/megatron/pretrain_gpt.py's job set
up on the launched world with its TrainingContext built, and one training step of it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "megatron"))
import pretrain_gpt as pg  # noqa: E402

from mindio import megatron as mio  # noqa: E402


def built(argv: list) -> tuple:
    """``(args, dataset, ctx)``: the example's ``argv``, its process groups, its corpus, and a
    TrainingContext whose model, optimizer and scheduler are built (mindio's DP replica groups first)."""
    args = pg.parse_args(argv)
    pg.initialize(args)
    dataset = pg.CorpusDataset(args.data_path, args.tokenizer_file, args.seq_length, args.seed)
    args.padded_vocab_size = dataset.vocab_size
    ctx = mio.TrainingContext(args, build=lambda: pg.setup_model_and_optimizer(args))
    ctx.init_parallel()
    ctx.model, ctx.optimizer, ctx.scheduler = ctx.build()
    return args, dataset, ctx


def step(ctx, dataset) -> float:
    """One training step of the example on ``ctx`` (its data from ``ctx.consumed_samples``), the RNG of its
    end recorded as the example's train() does; returns the grad norm."""
    it = pg.batch_iterator(dataset, ctx.consumed_samples, ctx.args)
    _, norm, _ = pg.train_step(pg.forward_step, it, ctx.model, ctx.optimizer, ctx.scheduler, ctx)
    ctx.record_step_rng()
    return norm

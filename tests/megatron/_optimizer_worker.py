"""Worker for test_optimizer_fixes.py: one gloo rank, upstream DistributedOptimizer vs ours.

Prints one JSON line ``RESULT {...}``. Run as a script (megatron state is process-global).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "megatron"))
import pretrain_gpt as pg  # noqa: E402

from megatron.core import optimizer as mopt  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from mindio import megatron as mio  # noqa: E402
from mindio.megatron.optimizer import ReplicaDistributedOptimizer, params_from_main  # noqa: E402


def build(args, cls):
    mio.install()  # setup_model_and_optimizer calls install(); then choose the class under test
    model, optimizer, scheduler = None, None, None
    orig_install = mio.install
    try:
        pg.mio.install = lambda: setattr(mopt, "DistributedOptimizer", cls)
        model, optimizer, scheduler = pg.setup_model_and_optimizer(args)
    finally:
        pg.mio.install = orig_install
    return model, optimizer, scheduler


def train(args, ctx, n):
    it = pg.batch_iterator(ctx.dataset, ctx.consumed_samples, args)
    for _ in range(n):
        pg.train_step(pg.forward_step, it, ctx.model, ctx.optimizer, ctx.scheduler, ctx)


def inner(optimizer):
    return optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer


def live_state(opt):
    """Shard tensors (param, exp_avg, exp_avg_sq, step per param), for either class."""
    out = []
    for gbuf_range_maps in opt.gbuf_ranges:
        for maps in gbuf_range_maps.values():
            for gbuf_range_map in maps:
                for model_param in gbuf_range_map["param_map"]:
                    t = opt._get_main_param_and_optimizer_states(model_param)
                    out += [t["param"], t["exp_avg"], t["exp_avg_sq"], t["step"].reshape(1)]
    return out


def snapshot(opt):
    return [t.detach().clone() for t in live_state(opt)]


def run(args, cls):
    """Train 3 steps, keep state_dict + shard, train 3 more (reference); rebuild, restore the
    kept state with the class under test, train 3 more; compare."""
    res = {}
    ctx = mio.TrainingContext(args, build=None)
    ctx.dataset = pg.CorpusDataset(args.data_path, args.tokenizer_file, args.seq_length, args.seed)
    ctx.model, ctx.optimizer, ctx.scheduler = build(args, cls)
    res["class"] = type(inner(ctx.optimizer)).__name__
    train(args, ctx, 3)
    opt = inner(ctx.optimizer)
    kept_sd, kept_shard = opt.state_dict(), snapshot(opt)
    kept_sched, kept_counters = ctx.scheduler.state_dict(), (ctx.iteration, ctx.consumed_samples)
    # bug 1: set states from a checkpoint-style dict without "step"
    model_param = next(iter(opt.gbuf_ranges[0].values()))[0]["param_map"].__iter__().__next__()
    src = {k: v.detach().clone() for k, v in opt._get_main_param_and_optimizer_states(model_param).items()
           if k != "step"}
    try:
        opt._set_main_param_and_optimizer_states(model_param, src)
        res["set_states"] = "ok"
    except Exception as exc:  # the upstream bug
        res["set_states"] = f"{type(exc).__name__}: {exc}"[:200]
    train(args, ctx, 3)
    reference = snapshot(inner(ctx.optimizer))

    ctx.model, ctx.optimizer, ctx.scheduler = build(args, cls)
    opt = inner(ctx.optimizer)
    opt.load_state_dict(kept_sd)
    steps = [s["step"] for s in opt.optimizer.state.values()]
    res["params"] = len(steps)
    res["distinct_step_tensors"] = len({id(s) for s in steps})
    with torch.no_grad():
        for dst, srct in zip(live_state(opt), kept_shard):
            dst.copy_(srct)
    params_from_main([opt], ctx.model, intact=False)
    ctx.scheduler.load_state_dict(kept_sched)
    ctx.iteration, ctx.consumed_samples = kept_counters
    train(args, ctx, 3)
    restored = snapshot(inner(ctx.optimizer))
    res["restored_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(reference, restored))
    res["restored_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(reference, restored))
    return res


if __name__ == "__main__":
    args = pg.parse_args(["--use-distributed-optimizer", "--train-iters", "20"])
    pg.initialize(args)
    args.padded_vocab_size = 512
    mio.replica.initialize_parallel(1, 1, replica_cnt=1)
    out = {"upstream": run(args, DistributedOptimizer), "ours": run(args, ReplicaDistributedOptimizer)}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()

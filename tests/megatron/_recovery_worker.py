"""Worker for test_recovery_callbacks.py: drives MegatronAdapter's callbacks by hand, as mindio.ttp
would, on a 4-rank gloo job (DP=4, two replicas of each optimizer shard).

    _recovery_worker.py none   ITERS         train ITERS steps, print the digest
    _recovery_worker.py repair ITERS STEP    at STEP rank 1's optimizer shard, params and counters
                                             are destroyed; stop, clean, new world (generation 1),
                                             rebuild groups, repair from rank 3, rollback; go on
    _recovery_worker.py dump   ITERS STEP DIR  at STEP ranks 0 and 3 dump (one per shard), rank 0
                                             renames; then exit (the test resumes with --load)
    _recovery_worker.py rebuiltdump ITERS STEP DIR  at STEP every rank stops, cleans (rank 1 as a UCE
                                             rank: no state dict kept) and rebuilds its groups and
                                             model on a new world (no repair, no rollback: a flow that
                                             failed after its rebuild); rank 1, asked to dump, refuses
                                             and writes nothing; then the dump above (the test
                                             resumes with --load)
    _recovery_worker.py loadckpt ITERS STEP DIR  no replicas (R=1); periodic checkpoint every 4
                                             steps; at STEP rank 1's state is destroyed and every
                                             rank falls back to the checkpoint (RT_LOAD_CKPT)
REPLICAS=1 in the environment runs ``none`` without replicas (the loadckpt reference).
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from _example_job import built, pg  # tests/megatron/_example_job.py
from mindio import megatron as mio


def new_world(generation: int) -> None:
    """What mindio.ttp's rebuild does: a fresh default group on a generation-prefixed store."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"mindio/gen{generation}", store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))


def main():
    scenario, iters = sys.argv[1], int(sys.argv[2])
    step = int(sys.argv[3]) if len(sys.argv) > 3 else iters
    extra = ["--save", sys.argv[4]] if len(sys.argv) > 4 else []
    if scenario == "loadckpt":
        extra += ["--save-interval", "4"]
    replicas = "1" if scenario == "loadckpt" else os.environ.get("REPLICAS", "2")
    args, dataset, ctx = built(["--use-distributed-optimizer", "--replica-cnt", replicas,
                                "--train-iters", str(iters), "--exit-interval", str(step)] + extra)
    adapter = mio.MegatronAdapter(ctx)
    pg.train(pg.forward_step, ctx, dataset)
    rank = dist.get_rank()

    if scenario == "repair":
        if rank == 1:  # an uncorrectable memory error wiped this rank's state
            with torch.no_grad():
                for t in ctx.shard_tensors():
                    t.fill_(float("nan"))
                for p in ctx.model[0].parameters():
                    p.fill_(123.0)
            ctx.iteration, ctx.consumed_samples = 999, 0
        adapter.stop()
        assert adapter.clean(is_uce_error=(rank == 1)) == 0
        assert ctx.model is None and ctx.optimizer is None
        new_world(1)
        adapter.rebuild_groups([1])
        info = {"type": 0, "src": [3], "dst": [1], "rank_list": [1, 3]}
        if rank == 3:
            adapter.repair(step, False, [1], {**info, "repair_type": "RT_SEND"})
        elif rank == 1:
            adapter.repair(step, False, [1], {**info, "repair_type": "RT_UCE_LOWLEVEL"})
        adapter.rollback(step)
        assert ctx.iteration == step and not ctx.stop_requested.is_set()
        print(f"rank {rank} repaired", flush=True)
    elif scenario == "loadckpt":
        if rank == 1:
            with torch.no_grad():
                for t in ctx.shard_tensors():
                    t.fill_(float("nan"))
        adapter.stop()
        assert adapter.clean(is_uce_error=(rank == 1)) == 0
        new_world(1)
        adapter.rebuild_groups([1])
        adapter.repair(step, False, [1], {"type": 0, "repair_type": "RT_LOAD_CKPT", "src": [],
                                          "dst": [], "rank_list": [0, 1, 2, 3]})
        adapter.rollback(step)
        print(f"rank {rank} reloaded at iteration {ctx.iteration}", flush=True)
    elif scenario in ("dump", "rebuiltdump"):
        if scenario == "rebuiltdump":  # the rebuilt model's weights are not drawn (restore_build.py)
            adapter.stop()
            assert adapter.clean(is_uce_error=(rank == 1)) == 0  # a UCE rank keeps no state dict to dump
            new_world(1)
            adapter.rebuild_groups([])
            if rank == 1:  # its params are not the trained ones and it has nothing else: it must refuse
                try:
                    adapter.save(step, [{"type": 0, "ranks": [1, 2]}])
                    print("rank 1 wrote a dump from a rebuilt model", flush=True)
                except RuntimeError as exc:
                    print(f"rank 1 refused: {exc}", flush=True)
        adapter.save(step, [{"type": 0, "ranks": [0, 3]}])
        dist.barrier()
        if rank == 0:
            adapter.rename(step)
        pg.print_rank_0(f"dumped step {step}")
        dist.destroy_process_group()
        return

    args.exit_interval = None
    pg.train(pg.forward_step, ctx, dataset)
    pg.print_rank_0(f"state-digest: {mio.state_digest(ctx)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

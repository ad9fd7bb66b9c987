"""A user's loop that hangs on one rank: torchrun, gloo, the reference ``tft_*`` API and nothing of
mindio's internals.

    torchrun --nproc-per-node 3 tests/ttp/_hang_loop.py --out DIR [--ddp | --fsdp] [--steps 40] [--hang RANK:STEP]
             [--step-sleep 0.1] [--work RANK:STEP:SECONDS] [--spin RANK:STEP:SECONDS]
             [--slow-link RANK,RANK:STEP:SECONDS]

``--ddp``: the model is wrapped in ``DistributedDataParallel`` (its all-reduce runs from autograd,
inside ``loss.backward()``); ``--fsdp``: each layer and the model are sharded with FSDP2's ``fully_shard``
(its all-gathers run from forward hooks, its reduce-scatters from backward ones); else the gradients are
summed with one ``dist.all_reduce`` a step.
``--hang RANK:STEP``: that rank ``time.sleep``s for 600 s at the start of STEP (its time to
``DIR/hang_t``). ``--work RANK:STEP:SECONDS``: that rank alone writes a checkpoint for SECONDS at the
start of STEP (``torch.save`` of fresh tensors to ``DIR/work.pt``, again and again), while its peers wait
in the step's collective: slow, not hung. ``--spin RANK:STEP:SECONDS``: from STEP on, that rank computes
SECONDS more (CPU: matrix products) every step, a straggler its peers wait for. ``--slow-link
RANK,RANK:STEP:SECONDS``: those ranks form a process group and all-reduce their loss in it every step;
from STEP on, each of them takes SECONDS more in that collective (it sleeps after it: a slow link between
them, as their main threads see it), and the other ranks wait for them in the next world collective.
Save and rename handlers write ``DIR/ckpt/step_<s>/rank<r>.pt`` and ``DIR/ckpt/latest``; every rank holds
the whole state (``replica_cnt`` = world size).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mindio.ttp import (tft_destroy_controller, tft_destroy_processor, tft_end_updating_os, tft_exception_handler,
                        tft_init_controller, tft_init_processor, tft_register_rename_handler,
                        tft_register_save_ckpt_handler, tft_set_optimizer_replica, tft_start_controller,
                        tft_start_processor, tft_start_updating_os)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hang", default="", help="RANK:STEP")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--work", default="", help="RANK:STEP:SECONDS")
    p.add_argument("--spin", default="", help="RANK:STEP:SECONDS")
    p.add_argument("--slow-link", default="", help="RANK,RANK:STEP:SECONDS")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["TTP_PORT"])
    if rank == 0:
        tft_init_controller(rank, world, enable_local_copy=False)
        tft_start_controller(addr, port, enable_tls=False)
    tft_init_processor(rank, world, enable_local_copy=False, enable_tls=False)
    tft_start_processor(addr, port)
    tft_set_optimizer_replica(rank, [{"rank_list": list(range(world)), "replica_cnt": world, "replica_shift": 0}])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DistributedDataParallel(net) if args.ddp else net
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"step": 0}
    hang_rank, hang_step = map(int, args.hang.split(":")) if args.hang else (-1, -1)
    work = args.work.split(":") if args.work else ("-1", "-1", "0")
    work_rank, work_step, work_s = int(work[0]), int(work[1]), float(work[2])

    spin_rank, spin_step, spin_s = (int(args.spin.split(":")[0]), int(args.spin.split(":")[1]),
                                    float(args.spin.split(":")[2])) if args.spin else (-1, -1, 0.0)

    link = args.slow_link.split(":") if args.slow_link else ()
    link_ranks = [int(r) for r in link[0].split(",")] if link else []
    link_group = dist.new_group(link_ranks) if link else None  # every rank creates it
    link_step, link_s = (int(link[1]), float(link[2])) if link else (-1, 0.0)

    def save(step, save_info, _args, _ctx):
        d = os.path.join(args.out, "ckpt", f"step_{step}")
        os.makedirs(d, exist_ok=True)
        torch.save({"step": state["step"], "model": net.state_dict()}, os.path.join(d, f"rank{rank}.pt"))

    def rename(step, _args, _ctx):
        with open(os.path.join(args.out, "ckpt", "latest"), "w") as f:
            f.write(str(step))

    tft_register_save_ckpt_handler(save)
    tft_register_rename_handler(rename)

    @tft_exception_handler
    def train():
        while state["step"] < args.steps:
            step = state["step"] + 1
            if rank == hang_rank and step == hang_step:
                with open(os.path.join(args.out, "hang_t"), "w") as f:
                    f.write(repr(time.time()))
                time.sleep(600)
            if rank == work_rank and step == work_step:
                end = time.monotonic() + work_s
                while time.monotonic() < end:
                    torch.save({"w": torch.randn(256, 1024)}, os.path.join(args.out, "work.pt"))
            if rank == spin_rank and step >= spin_step:
                m, end = torch.randn(64, 64), time.thread_time() + spin_s
                while time.thread_time() < end:
                    m = torch.tanh(m @ m)
            g = torch.Generator().manual_seed(step * world + rank)
            x = torch.randn(4, 8, generator=g)
            loss = (model(x) - torch.sin(x.sum(1, keepdim=True))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if not (args.ddp or args.fsdp):
                for prm in net.parameters():
                    dist.all_reduce(prm.grad)
            if rank in link_ranks:
                dist.all_reduce(loss.detach().clone(), group=link_group)
                if step >= link_step:
                    time.sleep(link_s)
            tft_start_updating_os(-1)
            opt.step()
            state["step"] = step
            tft_end_updating_os(step)
            time.sleep(args.step_sleep)

    train()
    tft_destroy_processor()
    if rank == 0:
        tft_destroy_controller()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

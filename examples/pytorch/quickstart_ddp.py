# quickstart_ddp.py -- docs/quickstart.md's DDP loop: 4 ranks, gloo, a tiny model, the tft_* API
#   torchrun   --nproc-per-node 4 quickstart_ddp.py [--steps 40] [--inject raise:rank=1,step=6]
#   mindio-run --nproc-per-node 4 --high-availability recover-in-place,dump quickstart_ddp.py
import argparse
import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from mindio.adapter import wrap_ddp
from mindio.drill import inject
from mindio.ttp import (RepairType, tft_destroy_controller, tft_destroy_processor, tft_end_updating_os,
                        tft_exception_handler, tft_init_controller, tft_init_processor, tft_register_clean_handler,
                        tft_register_rebuild_group_handler, tft_register_rename_handler,
                        tft_register_repair_handler, tft_register_rollback_handler, tft_register_save_ckpt_handler,
                        tft_set_optimizer_replica, tft_start_controller, tft_start_processor, tft_start_updating_os)

cli = argparse.ArgumentParser()
cli.add_argument("--steps", type=int, default=40)
cli.add_argument("--inject", default=None, help="a fault drill (docs/recovery.md), e.g. uce:rank=1,step=6")
args = cli.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))   # before mindio: it shares the job's store
rank, world = dist.get_rank(), dist.get_world_size()
addr, port = os.environ["MASTER_ADDR"], int(os.environ.get("TTP_PORT", "8000"))
if rank == 0:                                    # the controller lives in rank 0 (or in mindio-run)
    tft_init_controller(rank, world, enable_local_copy=False)
    tft_start_controller(addr, port, enable_tls=False)
tft_init_processor(rank, world, enable_local_copy=False, enable_tls=False, enable_uce=True)
tft_start_processor(addr, port)
# plain DDP: every rank holds the whole optimizer state, so every rank is a replica of every other
tft_set_optimizer_replica(rank, [{"rank_list": list(range(world)), "replica_cnt": world, "replica_shift": 0}])

torch.manual_seed(0)                             # the same initial model on every rank
module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
model = wrap_ddp(module)                         # DDP whose gradient buckets never change (bitwise recovery)
opt = torch.optim.Adam(module.parameters(), lr=0.01)
state = {"step": 0}
os.makedirs("ckpt", exist_ok=True)


def tensors():                                   # the state a replica sends to a rank being repaired
    out = [p.data for p in module.parameters()]
    for p in module.parameters():
        st = opt.state[p]
        if not st:                               # before the first step: allocate what Adam would
            st.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        out += [st["exp_avg"], st["exp_avg_sq"], st["step"].reshape(1)]
    return out


def clean(is_uce_error, args, ctx):              # drop the wrapper: it holds the process group mindio destroys
    global model
    model = None
    return 0


def rebuild(fault_ranks, args, ctx):             # the new default group exists: wrap the module again
    global model
    model = wrap_ddp(module)


def save(step, save_info, args, ctx):            # last-words checkpoint, on one rank per shard
    torch.save({"step": step, "model": module.state_dict(), "opt": opt.state_dict()}, f"ckpt/step_{step}_r{rank}.pt")


def rename(step, args, ctx):                     # once every save succeeded: make it the latest
    with open("ckpt/latest", "w") as f:
        f.write(str(step))


def repair(step, need_rebuild, error_ranks, repair_info, args, ctx):  # point to point, from a replica
    flat = torch.cat([t.reshape(-1) for t in tensors()] + [torch.tensor([float(state["step"])])])
    if repair_info["repair_type"] == RepairType.RT_SEND:
        dist.send(flat, repair_info["dst"][0])
        return
    dist.recv(flat, repair_info["src"][0])
    offset = 0
    with torch.no_grad():
        for t in tensors():
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    state["step"] = int(flat[-1])


def rollback(step, args, ctx):                   # back to the end of `step`; train() is called again
    state["step"] = step


def corrupt():                                   # what a memory error does to this rank's state (--inject uce)
    with torch.no_grad():
        for t in tensors():
            t.fill_(float("nan"))


tft_register_clean_handler(clean)
tft_register_rebuild_group_handler(rebuild)
tft_register_save_ckpt_handler(save)
tft_register_rename_handler(rename)
tft_register_repair_handler(repair)
tft_register_rollback_handler(rollback)


@tft_exception_handler                           # a fault is reported; recovery re-enters train()
def train():
    while state["step"] < args.steps:
        step = state["step"] + 1
        inject(args.inject, step, rank, corrupt)  # a fault drill, when --inject asks for one
        g = torch.Generator().manual_seed(step)  # the batch of a step derives from the step
        x = torch.randn(4 * world, 8, generator=g)[4 * rank:4 * rank + 4]
        loss = ((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()
        opt.zero_grad()
        loss.backward()                          # DDP all-reduces the gradients here
        tft_start_updating_os(-1)                # the optimizer state is being updated
        opt.step()
        state["step"] = step
        tft_end_updating_os(step)                # the state of `step` is complete on this rank
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)


train()
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors())).hexdigest()
print(f"rank {rank} step {state['step']} digest {digest}", flush=True)
tft_destroy_processor()                          # this rank leaves on purpose: not a fault
if rank == 0:
    tft_destroy_controller()
model = None                                     # DDP holds the default group: drop it before destroying it
dist.destroy_process_group()

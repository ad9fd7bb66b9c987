"""A user's own training loop, written only against the reference ``tft_*`` API (as MindSpeed-LLM calls
it), and nothing of mindio's internals: no stop, clean or rebuild handler, no process-group handling.

    torchrun --nproc-per-node 4 tests/dropin/plain_loop.py --out DIR [--steps 10] [--fault KIND:RANK:STEP] [--repair]
             [--device cuda]
    mindio-run --nproc-per-node 4 tests/dropin/plain_loop.py --out DIR ...

Every rank holds the whole model (a 2-layer MLP) and its Adam state; gradients are summed with one
``dist.all_reduce`` a step (gloo, timeout 60 s). The job tells mindio that the optimizer state lives on
2 replicas of the 4-rank DP group (``replica_cnt=2``: ranks 0/2 and 1/3 hold one shard each; one copy
when the job has a single rank). ``--device cuda``: model, optimizer and batches on ``cuda:LOCAL_RANK``,
the default group on NCCL bound to that device (``device_id``). The data come as a newcomer writes it:
a ``DataLoader`` over a map-style dataset of ``4 x world x 4`` samples with a shuffling ``DistributedSampler``
(4 steps an epoch, ``set_epoch`` each epoch, batches of 4 per rank). The loop finds the batch of step ``s``
from ``s`` alone (epoch ``(s-1) // 4``, that epoch's ``(s-1) % 4``-th batch: the iterator is rebuilt and
fast-forwarded when the step is not the one it holds next, as a resume does), so a resumed, retried or
repaired run sees the batches an uninterrupted run saw. Each committed step appends the sample ids it
trained on to ``DIR/samples-rank<r>.jsonl`` (tests/_samples.py reads them).

Handlers: save (``DIR/ckpt/step_<s>/rank<r>.pt``) and rename (``DIR/ckpt/latest``, one line appended to
``DIR/renames``); with ``--repair``, repair (the replica sends its model and optimizer state to the rank
being repaired, point to point) and rollback (the step counter back to the lock step); with
``--stop-clean``, stop and clean handlers that leave the process groups alone (each call is appended to
``DIR/handlers_rank<r>``). ``--keep-group``: the all-reduce runs on a group the loop creates and keeps
(``--pg-timeout`` s, default 60). ``--enable-arf``: ``tft_init_processor(enable_arf=True)``.
``--fault KIND:RANK:STEP[,...]`` (each once per job, a marker file in DIR): ``unknown`` raises ``RuntimeError("Other ERROR ...")``
at the start of the step, ``uce`` overwrites the rank's parameters and optimizer state with NaN and
raises ``RuntimeError("UCE ERROR ...")``, ``network`` raises ``RuntimeError("HCCL OP RETRY FAILED ...")``
(a network-class error: nothing lost, a retry rebuilds the groups and redoes the step), ``kill``
SIGKILLs the rank. The time of the (latest) fault
goes to ``DIR/fault_t``; the time every rank is training again after a recovery can be read from each rank's
``DIR/trained_rank<r>`` (time of each finished step). At the end every rank writes
``DIR/final_rank<r>.pt``. ``--resume``: start from ``DIR/ckpt/latest`` when there is one (every rank holds
the whole state, so any saved rank's file will do); ``--step-sleep S``: each step also takes S seconds (a
longer step, for a test that signals the job mid-training).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mindio.ttp import (RepairType, tft_destroy_controller, tft_destroy_processor, tft_end_updating_os,
                        tft_exception_handler, tft_init_controller, tft_init_processor,
                        tft_register_clean_handler, tft_register_rename_handler, tft_register_repair_handler,
                        tft_register_rollback_handler, tft_register_save_ckpt_handler,
                        tft_register_stop_handler, tft_set_optimizer_replica, tft_start_controller,
                        tft_start_processor, tft_start_updating_os)


STEPS_PER_EPOCH = 4


class Samples(torch.utils.data.Dataset):
    """``n`` samples (x, y = sin(sum x), id), fixed by a seed."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.sin(self.x.sum(1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Job:
    """The loop's state: model, optimizer, the last finished step."""

    def __init__(self, args):
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) \
            if args.device == "cuda" else torch.device("cpu")
        self.group = dist.new_group(list(range(self.world)), timeout=timedelta(seconds=args.pg_timeout)) \
            if args.keep_group else None
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.model.to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.step = 0
        data = Samples(4 * self.world * STEPS_PER_EPOCH)
        self.sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=self.world, rank=self.rank,
                                                                       shuffle=True, seed=0, drop_last=True)
        self.loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=self.sampler)
        self.batches, self.next_at = None, None  # the loader's iterator and the (epoch, index) it yields next

    def resume(self) -> None:
        """Load the checkpoint ``DIR/ckpt/latest`` names, if any (written by save + rename)."""
        latest = os.path.join(self.args.out, "ckpt", "latest")
        if not os.path.exists(latest):
            return
        d = os.path.join(self.args.out, "ckpt", f"step_{int(open(latest).read())}")
        state = torch.load(os.path.join(d, sorted(os.listdir(d))[0]))
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = state["step"]

    def batch(self, step: int):
        """The batch of ``step``: the ``(step-1) % STEPS_PER_EPOCH``-th of epoch ``(step-1) // STEPS_PER_EPOCH``."""
        at = divmod(step - 1, STEPS_PER_EPOCH)
        if self.next_at != at:  # a resume, a rollback: start the epoch again and skip what came before
            self.sampler.set_epoch(at[0])
            self.batches = iter(self.loader)
            for _ in range(at[1]):
                next(self.batches)
        x, y, ids = next(self.batches)
        self.next_at = (at[0], at[1] + 1) if at[1] + 1 < STEPS_PER_EPOCH else None  # None: the epoch is over
        return x.to(self.device), y.to(self.device), ids.tolist()

    def train_step(self) -> None:
        step = self.step + 1
        x, y, ids = self.batch(step)
        self.maybe_fault(step)
        loss = ((self.model(x) - y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        dist.all_reduce(grads, group=self.group)
        grads /= self.world
        offset = 0
        for p in self.model.parameters():
            p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        tft_start_updating_os(-1)
        self.opt.step()
        self.step = step
        tft_end_updating_os(step)
        with open(os.path.join(self.args.out, f"trained_rank{self.rank}"), "a") as f:
            f.write(f"{step} {time.time()!r}\n")
        with open(os.path.join(self.args.out, f"samples-rank{self.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"iteration": step, "dp": self.world, "dp_rank": self.rank, "rank": self.rank,
                                "samples": ids, "t": time.time()}) + "\n")
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # --step-sleep: the first round only
            time.sleep(self.args.step_sleep)

    def maybe_fault(self, step: int) -> None:
        for fault in filter(None, self.args.fault.split(",")):
            kind, rank, at = fault.split(":")
            if int(rank) == self.rank and int(at) == step:
                self.fault(kind, step, os.path.join(self.args.out, f"fault_fired_{kind}_{rank}_{at}"))

    def fault(self, kind: str, step: int, marker: str) -> None:
        try:  # once per job: a replacement process or a retried step must not fault again
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        with open(os.path.join(self.args.out, "fault_t"), "w") as f:
            f.write(repr(time.time()))
        if kind == "unknown":
            raise RuntimeError(f"Other ERROR: injected on rank {self.rank} at step {step}")
        if kind == "uce":  # the memory error destroyed this rank's copy of the state
            with torch.no_grad():
                for t in self.tensors():
                    t.fill_(float("nan"))
            raise RuntimeError(f"UCE ERROR: injected on rank {self.rank} at step {step}")
        if kind == "network":
            raise RuntimeError(f"HCCL OP RETRY FAILED: injected on rank {self.rank} at step {step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"unknown fault kind {kind!r}")

    def tensors(self) -> list:
        """Parameters and Adam's moments and step counters (allocated before the first step)."""
        out = [p.data for p in self.model.parameters()]
        for p in self.model.parameters():
            st = self.opt.state[p]
            if not st:
                st.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            out += [st["exp_avg"], st["exp_avg_sq"], st["step"].reshape(1)]
        return out

    # ---- the handlers of the reference API
    def save(self, step, save_info, args, ctx):
        assert self.step == step, (self.step, step)
        d = os.path.join(self.args.out, "ckpt", f"step_{step}")
        os.makedirs(d, exist_ok=True)
        torch.save({"step": step, "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "save_info": save_info}, os.path.join(d, f"rank{self.rank}.pt"))

    def rename(self, step, args, ctx):
        with open(os.path.join(self.args.out, "ckpt", "latest"), "w") as f:
            f.write(str(step))
        with open(os.path.join(self.args.out, "renames"), "a") as f:
            f.write(f"{step}\n")

    def repair(self, step, need_rebuild, error_ranks, repair_info, args, ctx):
        flat = torch.cat([t.reshape(-1).to(self.device) for t in self.tensors()]
                         + [torch.tensor([float(self.step)], device=self.device)])
        if repair_info["repair_type"] == RepairType.RT_SEND:
            dist.send(flat, repair_info["dst"][0])
            return
        dist.recv(flat, repair_info["src"][0])
        offset = 0
        with torch.no_grad():
            for t in self.tensors():
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        self.step = int(flat[-1])

    def rollback(self, step, args, ctx):
        self.step = step

    def stop(self, args, ctx):
        self.note("stop")

    def clean(self, is_uce_error, args, ctx):
        self.note(f"clean {is_uce_error}")
        return 0

    def note(self, what: str) -> None:
        with open(os.path.join(self.args.out, f"handlers_rank{self.rank}"), "a") as f:
            f.write(what + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fault", default="", help="KIND:RANK:STEP[,...], KIND in unknown, uce, network, kill")
    p.add_argument("--repair", action="store_true", help="register the repair and rollback handlers")
    p.add_argument("--stop-clean", action="store_true", help="register stop and clean handlers (no group handling)")
    p.add_argument("--keep-group", action="store_true", help="all-reduce on a group the loop keeps")
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--resume", action="store_true", help="start from DIR/ckpt/latest when there is one")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step of the launcher's first round also takes (a relaunched round: none)")
    p.add_argument("--enable-arf", action="store_true", help="tft_init_processor(enable_arf=True)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL on cuda:LOCAL_RANK")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.pg_timeout), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ.get("TTP_PORT", "8000"))
    if rank == 0:
        tft_init_controller(rank, world, enable_local_copy=False)
        tft_start_controller(addr, port, enable_tls=False)
    tft_init_processor(rank, world, enable_local_copy=False, enable_tls=False, enable_uce=True,
                       enable_arf=args.enable_arf)
    tft_start_processor(addr, port)
    tft_set_optimizer_replica(rank, [{"rank_list": list(range(world)), "replica_cnt": min(2, world),
                                     "replica_shift": 0}])
    job = Job(args)
    if args.resume:
        job.resume()
    tft_register_save_ckpt_handler(job.save)
    tft_register_rename_handler(job.rename)
    if args.repair:
        tft_register_repair_handler(job.repair)
        tft_register_rollback_handler(job.rollback)
    if args.stop_clean:
        tft_register_stop_handler(job.stop)
        tft_register_clean_handler(job.clean)

    @tft_exception_handler
    def train():
        while job.step < args.steps:
            job.train_step()

    train()
    torch.save({"step": job.step, "tensors": job.tensors()}, os.path.join(args.out, f"final_rank{rank}.pt"))
    tft_destroy_processor()
    if rank == 0:
        tft_destroy_controller()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

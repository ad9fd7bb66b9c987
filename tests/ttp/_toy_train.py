"""A tiny gloo/CPU data-parallel training job wired to mindio.ttp, for the integration tests.

One process per rank: ``python _toy_train.py --rank R --world 4 --store-port P --ctl-port C --out DIR``.
Model: MLP 8-16-1, parameters kept as one flat fp32 vector. Optimizer: ZeRO-1-style Adam whose state is
sharded over a *replica group* -- the DP group cut into 2 contiguous halves {0,1},{2,3}; shard i of the
flat vector lives on ranks i and i+2 (shard index = position in the DP group mod d/R). Gradients are
all-reduced over the DP group, each rank updates its shard, and the updated shards are all-gathered
inside the replica group. Data of iteration ``it`` is derived from ``it`` only, so a resumed run sees
exactly the batches the uninterrupted run saw.

Dump: the save callback writes this rank's shard (master, exp_avg, exp_avg_sq) and the iteration to
``DIR/ckpt/iter_<step>.tmp/shard<k>.pt``; the rename callback renames the directory and writes
``DIR/ckpt/latest``. ``--resume`` starts from ``latest``. ``--plan <json>``: the faults to inject and
the toy's settings, one tests/_faultplan.py ``FaultPlan`` (what each fault does is said there). A
fault fires on its rank once per process, at the start of its iteration (raise-uce-update and
kill-update: after the fence, once every rank that the plan's ``fenced_late`` does not hold has
passed its own). Faults of several ranks in one iteration fire together (:meth:`Trainer.maybe_inject`).
Repairs append ``<repair_type> <need_rebuild>`` to ``DIR/repair_rank<r>``.
Retry (HIGH_AVAILABILITY=retry): rebuild re-creates the groups, repair sends/receives one shard,
rollback sets the iteration and re-gathers the parameters from the master shards.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import mindio.ttp as ttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests._faultplan import FaultPlan  # noqa: E402  (the repository root: run as a script)

R = 2                   # replica count
STATE: dict = {}        # every reference to process groups lives here (dropped by the stop callback)


def batch(it: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + it)
    x = torch.randn(4 * world, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def forward(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = flat[:128].view(16, 8), flat[128:144], flat[144:160].view(1, 16), flat[160:161]
    return torch.tanh(x @ w1.t() + b1) @ w2.t() + b2


NPARAM = 161
SHARD = math.ceil(NPARAM / R)  # 81; the flat vector is padded to R * SHARD


def init_params() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    flat = torch.zeros(R * SHARD)
    flat[:NPARAM] = torch.randn(NPARAM, generator=g) * 0.3
    return flat


def shard_index(rank: int, world: int) -> int:
    return sorted(range(world)).index(rank) % (world // R)


class Trainer:
    def __init__(self, args):
        self.args, self.rank, self.world = args, args.rank, args.world
        self.k = shard_index(self.rank, self.world)
        self.flat = init_params()
        lo = self.k * SHARD
        self.master = self.flat[lo:lo + SHARD].clone()
        self.m = torch.zeros(SHARD)
        self.v = torch.zeros(SHARD)
        self.it = 0
        self.injected = False
        # the plan's fenced_late ranks reach their fence of iteration fence_step only once stopped
        self.stop_before_fence = {(r, args.plan.fence_step) for r in args.plan.fenced_late}
        if args.resume:
            self.load(args.resume)

    def load(self, root: str) -> None:
        with open(os.path.join(root, "latest")) as f:
            step = int(f.read().strip())
        d = os.path.join(root, f"iter_{step:07d}")
        shards = [torch.load(os.path.join(d, f"shard{k}.pt")) for k in range(self.world // R)]
        self.flat = torch.cat([s["master"] for s in shards])
        mine = shards[self.k]
        self.master, self.m, self.v, self.it = mine["master"].clone(), mine["m"].clone(), mine["v"].clone(), mine["it"]
        assert all(s["it"] == step for s in shards)
        ttp.tft_report_load_ckpt_step(step)  # a generic exception before the first update names step + 1

    def step(self) -> None:
        it, rank, a = self.it, self.rank, self.args
        x, y = batch(it, rank, self.world)
        flat = self.flat.clone().requires_grad_(True)
        if any(fit == it and not _in_update_window(k) for k, _r, fit in a.faults):
            a.store.add(f"toy/reached/{it}", 1)  # a fault fires at this iteration's start: see maybe_inject
        self.maybe_inject()
        loss = ((forward(flat, x) - y) ** 2).mean()
        loss.backward()
        grad = flat.grad.detach().clone()
        dist.all_reduce(grad, group=STATE["dp"])
        grad /= self.world
        if (rank, it) in self.stop_before_fence:  # this rank is late to its fence: it arrives once stopped
            proc = ttp.api._proc()
            _wait_until(lambda: proc._hold)
        ttp.tft_start_updating_os(-1)
        window = {frank: kind for kind, frank, fit in a.faults if fit == it and _in_update_window(kind)}
        if window:  # inside the optimizer update window, once every rank the stop will not hold at its fence
            key = f"toy/updating/{it}"  # (the plan's fenced_late) has passed its own: else the stop can hold
            a.store.add(key, 1)         # healthy ranks at the fence of this step while others update
            if rank in window and not self.injected:
                self.injected = True
                late = {r for r, i in self.stop_before_fence if i == it}
                _wait_until(lambda: a.store.add(key, 0) >= self.world - len(late))
                self.inject({"kill-update": "kill"}.get(window[rank], window[rank]))
        lo, g = self.k * SHARD, grad[self.k * SHARD:(self.k + 1) * SHARD]
        t = it + 1
        self.m.mul_(0.9).add_(g, alpha=0.1)
        self.v.mul_(0.999).addcmul_(g, g, value=0.001)
        mhat, vhat = self.m / (1 - 0.9 ** t), self.v / (1 - 0.999 ** t)
        self.master.sub_(0.01 * mhat / (vhat.sqrt() + 1e-8))
        self.it = it + 1
        ttp.tft_end_updating_os(self.it)
        parts = [torch.empty(SHARD) for _ in range(R)]
        dist.all_gather(parts, self.master, group=STATE["replica"])
        self.flat = torch.cat(parts)

    def maybe_inject(self) -> None:
        """This rank's fault of this iteration (not one of the update window), once per process: a
        retried step must not fault again. A fault at the start of iteration ``it`` fires once every rank
        has reached it (has step ``it``; at most 30 s, counted on the TCPStore by step()), except the
        ranks the plan's ``fenced_late`` holds at their fence of the iteration before. Else (found by
        scripts/stress.sh, test_dump_e2e raise-unknown under load 30) a faulty rank, which depends on a
        slow rank of the other replica half only through the gradient all-reduce, can fault while
        that rank has not reached its fence of step ``it`` yet; the stop holds it there one step behind
        its replica peer, and no step has a healthy copy of every shard: exit instead of the dump the
        test is about. The same wait lets faults of several ranks in one iteration fire together."""
        mine = [k for k, frank, fit in self.args.faults if frank == self.rank and fit == self.it
                and not _in_update_window(k)]
        if not mine or (self.injected and mine[0] != "raise-always"):  # raise-always: every time (a bug)
            return
        self.injected = True
        if mine[0] != "raise-always" and self.fired(mine[0]):  # a replacement of the faulty rank: its fault fired in the process it replaces
            return  # (the count it would wait for is not seen by this process again: it waited its 30 s bound)
        late = {r for r, i in self.stop_before_fence if i == self.it - 1}
        key = f"toy/reached/{self.it}"
        _wait_until(lambda: self.args.store.add(key, 0) >= self.world - len(late))
        self.inject(mine[0])

    def fired(self, kind: str) -> bool:
        """Did this rank's fault ``kind`` fire already, in a process this one replaces? Here each process
        fires its faults itself (``injected``); tests/recovery/_recover_toy.py's marker files say it."""
        return False

    def inject(self, kind: str) -> None:
        with open(os.path.join(self.args.out, f"fault_t_rank{self.rank}"), "w") as f:
            f.write(repr(time.time()))
        if kind == "raise-uce":  # the memory error destroyed this rank's optimizer shard
            self.master.fill_(float("nan"))
            self.m.fill_(float("nan"))
            self.v.fill_(float("nan"))
            self.flat.fill_(float("nan"))
            raise RuntimeError("UCE ERROR: injected uncorrectable memory error")
        if kind == "raise-uce-update":  # hit mid-update: the shard is half written
            self.master[: SHARD // 2].fill_(float("nan"))
            raise RuntimeError("UCE ERROR: injected uncorrectable memory error during the optimizer update")
        if kind == "raise-net":
            raise RuntimeError("HCCL OP RETRY FAILED: injected network error")
        if kind == "raise-unknown":
            raise ValueError("injected unknown error")
        if kind == "raise-always":  # a deterministic bug: the same exception whenever this step runs
            raise ValueError(f"injected deterministic error (rank {self.rank}, iteration {self.it})")
        if kind == "raise-unknown-update":  # a generic exception inside the optimizer update window
            raise ValueError("injected unknown error during the optimizer update")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            time.sleep(3600)
        if kind == "stop":  # frozen: no reset reaches the peers (a silent host death; MINDIO_PID_PROBE=0)
            os.kill(os.getpid(), signal.SIGSTOP)
        if kind == "freeze":  # a short outage: frozen for the plan's freeze_s s, then continued by a helper
            import subprocess
            self.helper = subprocess.Popen(["sh", "-c", f"sleep {float(self.args.plan.freeze_s)}; "
                                                        f"kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
            self.helper.wait(10)

    def save(self, step, save_info, args, ctx):
        if self.rank in self.args.plan.fail_save:
            raise RuntimeError(f"fail_save: rank {self.rank} cannot write the dump (injected)")
        d = os.path.join(self.args.out, "ckpt", f"iter_{step:07d}.tmp")
        os.makedirs(d, exist_ok=True)
        assert self.it == step, (self.it, step)
        path = os.path.join(d, f"shard{self.k}.pt")
        torch.save({"master": self.master, "m": self.m, "v": self.v, "it": self.it, "save_info": save_info},
                   path + ".part")
        os.replace(path + ".part", path)

    def rename(self, step, args, ctx):
        root = os.path.join(self.args.out, "ckpt")
        os.replace(os.path.join(root, f"iter_{step:07d}.tmp"), os.path.join(root, f"iter_{step:07d}"))
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))


    def stream_sync(self):
        """Graceful pause: nothing is queued on a CPU; record the step at which this rank paused."""
        with open(os.path.join(self.args.out, f"stream_sync_rank{self.rank}"), "a") as f:
            f.write(f"{self.it}\n")

    # ---- retry (in-place recovery) callbacks: mindio.ttp has re-created the default group already
    def rebuild(self, fault_ranks, args, ctx):
        build_groups(self.rank, self.world)

    def repair(self, step, need_rebuild, error_ranks, info, args, ctx):
        """RT_SEND: this rank's shard (master, m, v) and iteration to info["dst"]; RT_UCE_*: receive."""
        buf = torch.empty(3 * SHARD + 1)
        with open(os.path.join(self.args.out, f"repair_rank{self.rank}"), "a") as f:
            f.write(f"{info['repair_type']} {need_rebuild}\n")
        if info["repair_type"] == "RT_SEND":
            if self.args.plan.fail_repair == "raise":
                raise RuntimeError("fail_repair: injected repair failure")
            if self.args.plan.fail_repair == "kill":  # a second fault during the recovery
                os.kill(os.getpid(), signal.SIGKILL)
            torch.cat([self.master, self.m, self.v, torch.tensor([float(self.it)])], out=buf)
            dist.send(buf, info["dst"][0])
        else:
            dist.recv(buf, info["src"][0])
            self.master, self.m, self.v = (buf[i * SHARD:(i + 1) * SHARD].clone() for i in range(3))
            self.it = int(buf[-1])

    def rollback(self, step, args, ctx):
        """Iteration back to ``step``; params from the fp32 master shards (all-gather in the replica group)."""
        self.it = step
        parts = [torch.empty(SHARD) for _ in range(R)]
        dist.all_gather(parts, self.master, group=STATE["replica"])
        self.flat = torch.cat(parts)


def _in_update_window(kind: str) -> bool:
    """Faults that fire inside the optimizer update window (Trainer.step), not at the iteration's start."""
    return kind in ("raise-uce-update", "kill-update", "raise-unknown-update")


def _wait_until(done, timeout: float = 30.0) -> None:
    """Poll ``done()`` until it is true, at most ``timeout`` s."""
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        time.sleep(0.005)


def build_groups(rank: int, world: int) -> None:
    """The DP group and this rank's replica half; collective: every rank creates every group."""
    STATE["dp"] = dist.new_group(list(range(world)))
    groups = [dist.new_group(list(range(h * (world // R), (h + 1) * (world // R)))) for h in range(R)]
    STATE["replica"] = groups[rank // (world // R)]


def stop_groups(args, ctx):
    """Tear down every process group and drop every reference to them (ARCHITECTURE §3); the
    processor's teardown collects garbage once after this callback."""
    STATE.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--ctl-port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--plan", type=FaultPlan.loads, default=FaultPlan())
    p.add_argument("--resume", default="")
    p.add_argument("--external-controller", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args()
    a.faults = a.plan.tuples()
    torch.manual_seed(0)
    store = dist.TCPStore("127.0.0.1", a.store_port, a.world, is_master=a.rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world, timeout=timedelta(seconds=120))
    build_groups(a.rank, a.world)
    a.store = store  # Trainer.maybe_inject: several ranks' faults of one iteration fire together

    if a.rank == 0 and not a.external_controller:
        ttp.tft_init_controller(0, a.world, enable_local_copy=False)
        ttp.tft_start_controller("127.0.0.1", a.ctl_port, enable_tls=False)
    ttp.tft_init_processor(a.rank, a.world, enable_local_copy=False, enable_tls=False,
                           enable_uce=a.plan.enable_uce)
    trainer = Trainer(a)
    ttp.tft_register_save_ckpt_handler(trainer.save)
    ttp.tft_register_rename_handler(trainer.rename)
    ttp.tft_register_stop_handler(stop_groups)
    ttp.tft_register_rebuild_group_handler(trainer.rebuild)
    ttp.tft_register_repair_handler(trainer.repair)
    ttp.tft_register_rollback_handler(trainer.rollback)
    ttp.tft_register_stream_sync_handler(trainer.stream_sync)
    ttp.tft_start_processor("127.0.0.1", a.ctl_port)
    ttp.tft_set_optimizer_replica(a.rank, [{"rank_list": list(range(a.world)), "replica_cnt": R, "replica_shift": 0}])

    @ttp.tft_exception_handler
    def train():
        while trainer.it < a.steps:
            trainer.step()
            if a.step_sleep:
                time.sleep(a.step_sleep)
            ttp.tft_pause_train(trainer.it)  # end of the iteration: where a graceful pause parks
        return 0

    train()
    torch.save({"flat": trainer.flat, "master": trainer.master, "m": trainer.m, "v": trainer.v, "it": trainer.it},
               os.path.join(a.out, f"final_rank{a.rank}.pt"))
    # finish together so that no rank tears its groups down under a peer still in a collective
    dist.barrier(group=STATE["dp"])
    ttp.tft_destroy_processor()
    if a.rank == 0:
        dist.barrier(group=STATE["dp"])
        ttp.tft_destroy_controller()
    else:
        dist.barrier(group=STATE["dp"])
    stop_groups(None, None)  # no group outlives main(): mindio/ttp/shutdown.py
    return 0


if __name__ == "__main__":
    sys.exit(main())

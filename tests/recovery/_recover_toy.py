"""The toy job of tests/ttp/_toy_train.py (DP=4, ZeRO-1 Adam over 2 replica halves) under mindio-run.

Same model, data, callbacks and ``--plan`` (tests/_faultplan.py), but started by mindio-run: rank,
world size and the worker store come from the torchrun environment, and the controller is the one
node 0's agent hosts (MINDIO_CONTROLLER_EXTERNAL, TTP_PORT, MINDIO_SECRET). A replacement process
(``tft_is_reboot_node()``) builds the same objects and parks before ``train()``; its shard, moments
and iteration come from the replica (repair), its parameters from the all-gather (rollback).
Faults fire once per job: a marker file in ``--out`` is created before firing (``raise-always``: every
time its step runs, a deterministic bug). A relaunch resumes from ``--out``/ckpt when a dump wrote it. ``kill-node`` at
rank R SIGKILLs rank R's launcher agent, then R itself (the node's other workers die with the agent);
``stop-node`` SIGSTOPs the process groups of rank R's agent and of R (the agent and its workers: a frozen or
partitioned host, as seen from the others); ``hold`` waits for ``<out>/release``.
``TOY_LOSE_NODE_AFTER=R``: rank R SIGKILLs its agent once every rank's training has finished (its node is
lost after the job's work is done).

The plan's ``enable_arf``: the processors register with ``enable_arf`` (worker reboot);
``declared_replicas``: how many copies of each shard they declare to mindio (1: none to repair from);
``replacement_fails``: a replacement exits at ``start`` or once ``joined``.

At the end every rank writes ``final_rank<r>.pt`` and rank 0 prints ``state-digest: <sha256>`` over
every rank's (flat, master, m, v, it).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ttp"))
import _toy_train as toy  # noqa: E402

import mindio.ttp as ttp  # noqa: E402


class Trainer(toy.Trainer):
    def _marker(self, kind: str) -> str:
        return os.path.join(self.args.out, f"fired-{kind}-{self.rank}")

    def fired(self, kind: str) -> bool:
        return os.path.exists(self._marker(kind))

    def inject(self, kind: str) -> None:
        if kind == "raise-always":  # a deterministic bug: every time, in every process (no marker)
            print(f"[rank {self.rank}] injecting {kind} at step {self.it}", flush=True)
            return super().inject(kind)
        marker = self._marker(kind)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # fired already in the process this one replaces
        print(f"[rank {self.rank}] injecting {kind} at step {self.it}", flush=True)
        if os.environ.get("MINDIO_EVENT_LOG"):
            from mindio import _logging
            _logging.event("fault_injected", fault=kind, at_step=self.it)
        if kind == "hold":  # the job waits here until <out>/release exists (<= 120 s): see _hotswitch_brain
            end = time.monotonic() + 120
            while not os.path.exists(os.path.join(self.args.out, "release")) and time.monotonic() < end:
                time.sleep(0.01)
            return
        if kind == "kill-node":  # the node's launcher agent dies; this node's workers die with it
            import signal
            os.kill(int(os.environ["MINDIO_AGENT_PID"]), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stop-node":  # the node freezes (agent and workers); peers see silence
            import signal
            # the agent's process group holds its workers, except where a fork-server host forked their fork
            # server (MINDIO_FORK_SERVER_HOST): it leads a group of its own, with the workers
            own = os.getpgrp()
            os.killpg(os.getpgid(int(os.environ["MINDIO_AGENT_PID"])), signal.SIGSTOP)
            os.killpg(own, signal.SIGSTOP)
        super().inject(kind)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--plan", type=toy.FaultPlan.loads, default=toy.FaultPlan())
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--step-sleep-from", type=int, default=0, help="only steps from this one on sleep")
    a = p.parse_args()
    a.rank, a.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # a relaunch (mindio-run --max-restarts) resumes from the last checkpoint the job wrote, if any
    # (or a requeued Slurm job: examples/slurm/pretrain_gpt.sbatch)
    relaunched = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0 \
        or int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    a.resume = os.path.join(a.out, "ckpt") if relaunched and os.path.exists(os.path.join(a.out, "ckpt", "latest")) else ""
    a.faults = a.plan.tuples()
    torch.manual_seed(0)
    fails = a.plan.replacement_fails if ttp.tft_is_reboot_node() else ""
    if fails == "start":
        print(f"[rank {a.rank}] replacement fails at start-up (replacement_fails)", flush=True)
        return 3
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if fails == "joined":  # a hot-switch backup released into the new generation dies there
        print(f"[rank {a.rank}] replacement fails after joining the world (replacement_fails=joined)", flush=True)
        os._exit(3)
    toy.build_groups(a.rank, a.world)
    a.store = _JobStore(dist.distributed_c10d._get_default_store())  # toy.Trainer.maybe_inject: faults of one step together
    # enable_arf: the ranks register for worker reboot (the launcher then enables recover-in-place)
    ttp.tft_init_processor(a.rank, a.world, enable_local_copy=False, enable_tls=False, enable_arf=a.plan.enable_arf,
                           enable_uce=a.plan.enable_uce)
    trainer = Trainer(a)
    if a.resume and a.rank == 0:
        print(f"[rank 0] loaded checkpoint iteration {trainer.it}", flush=True)
    ttp.tft_register_save_ckpt_handler(trainer.save)
    ttp.tft_register_rename_handler(trainer.rename)
    ttp.tft_register_stop_handler(toy.stop_groups)
    ttp.tft_register_rebuild_group_handler(trainer.rebuild)
    ttp.tft_register_repair_handler(trainer.repair)
    ttp.tft_register_rollback_handler(trainer.rollback)
    ttp.tft_start_processor(os.environ.get("TTP_ADDR", "127.0.0.1"), int(os.environ["TTP_PORT"]))
    # declared_replicas=1: tell mindio there is no replica (as a job without one would): every shard
    # then lives on one rank only, whatever the toy keeps (test_controller_node_loss: no surviving copy)
    replicas = toy.R if a.plan.declared_replicas is None else a.plan.declared_replicas
    ttp.tft_set_optimizer_replica(a.rank, [{"rank_list": list(range(a.world)), "replica_cnt": replicas,
                                            "replica_shift": 0}])
    if ttp.tft_is_reboot_node():
        print(f"[rank {a.rank}] replacement process ({ttp.tft_get_reboot_type()}), pid {os.getpid()}", flush=True)

    @ttp.tft_exception_handler
    def train():
        while trainer.it < a.steps:
            trainer.step()
            print(f"[rank {a.rank}] iteration {trainer.it}\n", end="", flush=True)  # one write: ranks share a pipe
            if a.step_sleep and trainer.it >= a.step_sleep_from:
                time.sleep(a.step_sleep)
        return 0

    train()
    state = {"flat": trainer.flat, "master": trainer.master, "m": trainer.m, "v": trainer.v, "it": trainer.it}
    torch.save(state, os.path.join(a.out, f"final_rank{a.rank}.pt"))
    h = hashlib.sha256()
    for key in ("flat", "master", "m", "v"):
        h.update(state[key].numpy().tobytes())
    h.update(str(trainer.it).encode())
    digests = [None] * a.world
    dist.all_gather_object(digests, h.hexdigest(), group=toy.STATE["dp"])
    if a.rank == 0:
        print("state-digest: " + hashlib.sha256("".join(digests).encode()).hexdigest(), flush=True)
    dist.barrier(group=toy.STATE["dp"])
    ttp.tft_destroy_processor()
    toy.stop_groups(None, None)  # no group outlives main(): mindio/ttp/shutdown.py
    if os.environ.get("TOY_LOSE_NODE_AFTER") == str(a.rank):  # its node is lost after every rank's training
        import signal
        print(f"[rank {a.rank}] SIGKILL of this node's agent at {time.time():.3f}", flush=True)
        os.kill(int(os.environ["MINDIO_AGENT_PID"]), signal.SIGKILL)
        time.sleep(30)  # dies with its agent
    return 0


class _JobStore:
    """The store the toy counts its steps on (toy.Trainer): the one its world started on -- or, once mindio
    moved the job's store because its host was lost (node 0 lost, a backup controller in charge:
    mindio.ttp.processor.inplace.World.move), the moved one."""

    def __init__(self, first):
        self.first = first

    def add(self, key, n):
        from mindio.ttp.api import _rt

        world = _rt.processor.world if _rt.processor is not None else None
        return (world.base_store if world is not None and world.moved_to else self.first).add(key, n)


if __name__ == "__main__":
    sys.exit(main())

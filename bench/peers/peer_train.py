"""One training loop for the peer drills, under the fault tolerance a user would pick instead of mindio.

    --ft ddp       plain torch DDP over gloo (torchrun, 4 ranks): the baseline of the steady-state rows
    --ft torchft   torchft fault-tolerant DDP: one replica group per process (torchrun --nproc-per-node 1
                   each, REPLICA_GROUP_ID / NUM_REPLICA_GROUPS / TORCHFT_LIGHTHOUSE as in torchft's
                   train_ddp.py), Manager + DistributedDataParallel + Optimizer wrappers, a lighthouse
    --ft nvrx      nvidia-resiliency-ext in-process restart: ``inprocess.Wrapper`` around the DDP loop
                   (torchrun, 4 ranks), written as its advanced example: store, model and optimizer
                   are made once, the wrapped function re-creates the process group and DDP per restart

bench/peers/run_all.py starts these; the settings (``--settings default|tuned``) are each peer's
defaults and its best documented tuning (docs/benchmarks.md lists them). The model and data are
bench/peers/_model.py's (the shapes of the megatron GPT of the same ``--size``). Faults
(``--inject kill:rank=R,step=S`` or ``raise:...``) fire once, in the first incarnation of rank R,
before the forward of step S (steps count from 1).

Every rank prints machine-readable lines (``t`` = wall clock)::

    peer: ready rank=R restart=N t=...                 model built, about to train
    peer: fault rank=R kind=K step=S t=...             just before the fault
    peer: step rank=R step=S participants=K ms=M t=... step S committed (torchft: should_commit true)
    peer: digest rank=R step=S sha=...                 sha256 of the parameters at the end

A drill runs with a large ``--steps``; run_all.py ends it through the control store (``stop``) once
every rank committed a step after the fault.
"""
import argparse
import hashlib
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _model  # noqa: E402
import _sizes  # noqa: E402  (bench/_sizes.py, put on sys.path by _model)

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def log(event: str, **kv) -> None:
    """One write per line: the ranks share torchrun's stdout, and a single short write is atomic."""
    line = f"peer: {event} " + " ".join(f"{k}={v}" for k, v in kv.items()) + f" t={time.time():.6f}\n"
    sys.stdout.write(line)
    sys.stdout.flush()


class Fault:
    """``KIND:rank=R,step=S`` (KIND kill or raise); fires once, in the first incarnation of rank R."""

    def __init__(self, spec: str | None):
        self.kind = self.rank = self.step = None
        if spec:
            kind, _, rest = spec.partition(":")
            kv = dict(x.split("=") for x in rest.split(","))
            if kind not in ("kill", "raise") or set(kv) != {"rank", "step"}:
                raise SystemExit(f"--inject {spec!r}: use kill:rank=R,step=S or raise:rank=R,step=S")
            self.kind, self.rank, self.step = kind, int(kv["rank"]), int(kv["step"])
        self.fired = False

    def maybe_fire(self, rank: int, step: int) -> None:
        if self.fired or RESTART or rank != self.rank or step != self.step:
            return
        self.fired = True
        log("fault", rank=rank, kind=self.kind, step=step)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault at step {step} on rank {rank}")


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)


class Control:
    """The store run_all.py hosts (PEER_CONTROL = host:port): a start barrier, and the step to stop
    after, which run_all sets once a drill showed what it measures (so that every process, the
    restarted one too, ends at the same step and the final digests compare)."""

    def __init__(self, last_step: int):
        addr = os.environ.get("PEER_CONTROL")
        self.last = last_step
        self.store = None
        if addr:
            host, port = addr.rsplit(":", 1)
            self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))

    def barrier(self, slots: int) -> None:
        """First incarnation only: wait until every process of the job built its model."""
        if self.store is None or RESTART:
            return
        start_barrier(self.store, slots)

    def last_step(self) -> int:
        if self.store is not None and self.store.check(["stop"]):
            self.last = min(self.last, int(self.store.get("stop")))
        return self.last


def start_barrier(store, slots: int) -> None:
    store.add("ready", 1)
    deadline = time.monotonic() + 300
    while store.add("ready", 0) < slots:
        if time.monotonic() > deadline:
            raise SystemExit(f"start barrier: {store.add('ready', 0)} of {slots} processes ready after 300 s")
        time.sleep(0.01)


def step_once(model, opt, batch) -> None:
    opt.zero_grad()
    _model.loss_fn(model, batch).backward()
    opt.step()


# --------------------------------------------------------------------------------------- plain DDP
def run_ddp(a, size) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model.build(size)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt, corpus = optimizer(model), _model.Corpus()
    log("ready", rank=rank, restart=RESTART)
    Control(a.steps).barrier(world)
    fault = Fault(a.inject)
    for step in range(1, a.steps + 1):
        fault.maybe_fire(rank, step)
        t0 = time.perf_counter()
        step_once(ddp, opt, corpus.batch(step - 1, rank, world, size.micro_batch))
        log("step", rank=rank, step=step, participants=world, ms=f"{(time.perf_counter() - t0) * 1000:.1f}")
    log("digest", rank=rank, step=a.steps, sha=digest(model))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- torchft
TORCHFT = {  # Manager / process group / transport settings (the lighthouse's are run_all.py's)
    # every constructor default: Manager timeouts 60 s, ProcessGroupGloo 60 s, HTTPTransport
    "default": {"pg_timeout": None, "manager_timeout": None, "transport": "http"},
    # torchft's train_ddp.py on CPU: ProcessGroupGloo(timeout=5 s), Manager(timeout=30 s), PGTransport(10 s)
    "tuned": {"pg_timeout": 5, "manager_timeout": 30, "transport": "pg"},
}


def run_torchft(a, size) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    cfg = TORCHFT[a.settings]
    rid, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    model = _model.build(size)
    inner, corpus = optimizer(model), _model.Corpus()
    pg = ProcessGroupGloo(**({"timeout": timedelta(seconds=cfg["pg_timeout"])} if cfg["pg_timeout"] else {}))
    kw = {"timeout": timedelta(seconds=cfg["manager_timeout"])} if cfg["manager_timeout"] else {}
    if cfg["transport"] == "pg":
        from torchft.checkpointing.pg_transport import PGTransport

        kw["checkpoint_transport"] = PGTransport(pg, timeout=timedelta(seconds=10), device="cpu")
    manager = Manager(
        pg=pg, min_replica_size=1, replica_id=f"peer_{rid}", hostname="localhost",
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()}, **kw)
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    log("ready", rank=rid, restart=RESTART)
    control = Control(a.steps)
    control.barrier(groups)
    fault = Fault(a.inject)
    while manager.current_step() < control.last_step():
        step = manager.current_step() + 1
        fault.maybe_fire(rid, step)
        t0 = time.perf_counter()
        step_once(ddp, opt, corpus.batch(step - 1, rid, groups, size.micro_batch))
        if manager.current_step() == step:  # committed
            log("step", rank=rid, step=step, participants=manager.num_participants(),
                ms=f"{(time.perf_counter() - t0) * 1000:.1f}")
    log("digest", rank=rid, step=manager.current_step(), sha=digest(model))
    manager.shutdown(wait=False)


# -------------------------------------------------------------------------------------------- NVRx
def nvrx_settings(name: str) -> dict:
    """inprocess.Wrapper keyword arguments. default: the constructor's (1 s monitor / heartbeat /
    watchdog intervals, last_call_wait 1 s, soft/hard timeouts 60/90 s); tuned: every interval and
    last_call_wait at 0.1 s (the documented knobs; the values are ours)."""
    if name == "default":
        return {}
    s = timedelta(seconds=0.1)
    return {"monitor_thread_interval": s, "monitor_process_interval": s, "heartbeat_interval": s,
            "progress_watchdog_interval": s, "last_call_wait": s}


def run_nvrx(a, size) -> None:
    import nvidia_resiliency_ext.inprocess as inprocess

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    model = _model.build(size)
    opt, corpus = optimizer(model), _model.Corpus()
    progress = {"step": 0}  # survives restarts (in memory; the drill's fault leaves it consistent)
    # made once, as in NVRx's advanced example: MASTER_PORT + 2 (the Wrapper's own store is on + 1)
    base = dist.TCPStore(os.environ["MASTER_ADDR"], port + 2, world, is_master=rank == 0,
                         multi_tenant=True, wait_for_workers=True, use_libuv=True)
    log("ready", rank=rank, restart=RESTART)
    control = Control(a.steps)
    control.barrier(world)
    fault = Fault(a.inject)

    def train(call_wrapper: inprocess.CallWrapper = None):  # evaluated: the Wrapper looks for this type
        r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.PrefixStore(str(call_wrapper.iteration), base)
        dist.init_process_group("gloo", store=store, rank=r, world_size=w,
                                timeout=timedelta(seconds=a.gloo_timeout))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        while progress["step"] < control.last_step():
            step = progress["step"] + 1
            fault.maybe_fire(r, step)
            t0 = time.perf_counter()
            step_once(ddp, opt, corpus.batch(step - 1, r, w, size.micro_batch))
            progress["step"] = step
            log("step", rank=r, step=step, participants=w, ms=f"{(time.perf_counter() - t0) * 1000:.1f}",
                restart=call_wrapper.iteration)
        return progress["step"]

    wrapped = inprocess.Wrapper(store_kwargs={"port": port + 1}, **nvrx_settings(a.settings))(train)
    wrapped()
    log("digest", rank=rank, step=progress["step"], sha=digest(model))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ft", required=True, choices=["ddp", "torchft", "nvrx"])
    p.add_argument("--size", default="tiny", choices=list(_sizes.SIZES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--inject", default=None, metavar="KIND:rank=R,step=S")
    p.add_argument("--settings", default="default", choices=["default", "tuned"])
    p.add_argument("--gloo-timeout", type=float, default=10.0,
                   help="nvrx: the gloo process group timeout (NVRx's CPU examples: 10 s)")
    a = p.parse_args(argv)
    Fault(a.inject)  # a bad spec fails now
    torch.set_num_threads(1)
    size = _sizes.get(a.size)
    {"ddp": run_ddp, "torchft": run_torchft, "nvrx": run_nvrx}[a.ft](a, size)


if __name__ == "__main__":
    main()

"""Run examples/megatron/pretrain_gpt.py with per-phase CPU-time counters (used by bench/ha_cpu.py).

    HA_CPU_OUT=DIR torchrun ... bench/_cpu_phases.py <pretrain_gpt.py flags>   # HA_CPU_WARMUP: steps left out

Wraps, without changing what they do, the pieces of a training step that high availability adds to or
changes, and accumulates over the steps after the warm-up, per rank:

* CPU time of the main thread (``time.thread_time``) inside each piece, and its wall time;
* CPU time of the whole process over the counted steps, and of each of its threads (``/proc``), so that
  what the other threads (mindio's link and controller, gloo's) burn is counted too.

Pieces (nested ones are counted inside their parent as well): ``step`` (train_step), ``fwd_bwd`` (the
pipeline schedule, grad sync included), ``grad_sync`` (finalize_model_grads: reduce-scatter, the
replicas' all-reduce, embedding grads), ``opt_step`` (optimizer.step), ``adam`` (torch Adam inside it),
``clip`` (the grad norm), ``param_sync`` (the all-gather of updated params), ``reduce_scatter`` / ``all_gather``
(megatron's bucket collectives), ``ttp_start`` / ``ttp_end`` /
``ttp_pause`` (tft_start_updating_os / tft_end_updating_os / tft_pause_train), ``rng_record``
(TrainingContext.record_step_rng; ``rng_python`` / ``rng_numpy`` / ``rng_torch`` / ``rng_tracker``: its
parts, wherever they are called), ``sched`` (the LR scheduler step), ``gc<N>``: garbage collections.

At the end every rank writes ``$HA_CPU_OUT/rank<N>.json``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = int(os.environ.get("HA_CPU_WARMUP", "5"))

_on = False
_acc: dict = {}  # name -> [calls, cpu_s, wall_s]
_main = threading.main_thread().ident


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if not _on or threading.get_ident() != _main:
            return fn(*a, **kw)
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            e = _acc.setdefault(name, [0, 0.0, 0.0])
            e[0] += 1
            e[1] += time.thread_time() - c0
            e[2] += time.perf_counter() - w0
    return wrapper


def _patch(owner, attr: str, name: str) -> None:
    setattr(owner, attr, _timed(name, getattr(owner, attr)))


def _threads() -> dict:
    """CPU seconds (user + system) of each thread of this process, by tid: (name, seconds); the name is
    the Python thread's (digits left out) where there is one, else the OS thread's."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {str(t.native_id): "".join(c for c in t.name if not c.isdigit()).rstrip("-_ ")
             for t in threading.enumerate()}
    names[str(threading.main_thread().native_id)] = "main"
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (names.get(tid, comm), (int(fields[11]) + int(fields[12])) / tick)
    return out


def _gc_timer(phase: str, info: dict) -> None:
    """gc.callbacks: main-thread CPU inside garbage collections, per generation ('gc<N>')."""
    if not _on or threading.get_ident() != _main:
        return
    if phase == "start":
        _gc_start[0] = time.thread_time()
    elif _gc_start[0] is not None:
        e = _acc.setdefault(f"gc{info['generation']}", [0, 0.0, 0.0])
        e[0] += 1
        e[1] += time.thread_time() - _gc_start[0]
        _gc_start[0] = None


_gc_start = [None]


def install(example) -> None:
    import gc

    gc.callbacks.append(_gc_timer)
    import torch
    from megatron.core import distributed as mdist, pipeline_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from mindio import ttp
    from mindio.megatron import TrainingContext

    get_fb = pipeline_parallel.get_forward_backward_func
    pipeline_parallel.get_forward_backward_func = lambda *a, **k: _timed("fwd_bwd", get_fb(*a, **k))
    _patch(mdist, "finalize_model_grads", "grad_sync")
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    _patch(ChainedOptimizer, "step", "opt_step")  # (what get_megatron_optimizer returns)
    _patch(ChainedOptimizer, "get_grad_norm", "clip")
    _patch(DistributedDataParallel, "start_param_sync", "param_sync")
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        _patch(cls, "step", "adam")
    _patch(OptimizerParamScheduler, "step", "sched")
    from megatron.core.distributed import param_and_grad_buffer as pgb
    _patch(pgb, "dist_reduce_scatter_func", "reduce_scatter")
    _patch(pgb, "dist_all_gather_func", "all_gather")
    import random

    import numpy as np
    from megatron.core.tensor_parallel import random as mrandom
    _patch(random, "getstate", "rng_python")
    _patch(np.random, "get_state", "rng_numpy")
    _patch(torch, "get_rng_state", "rng_torch")
    _patch(mrandom.CudaRNGStatesTracker, "get_states", "rng_tracker")
    _patch(TrainingContext, "record_step_rng", "rng_record")
    for attr, name in (("tft_start_updating_os", "ttp_start"), ("tft_end_updating_os", "ttp_end"),
                       ("tft_pause_train", "ttp_pause")):
        if hasattr(ttp, attr):
            _patch(ttp, attr, name)

    state = {"proc0": None, "threads0": None, "proc": 0.0, "steps": 0}
    train_step = example.train_step

    def counted_step(forward_step_func, data_iterator, model, optimizer, sched, ctx):
        global _on
        if ctx.iteration < WARMUP:
            return train_step(forward_step_func, data_iterator, model, optimizer, sched, ctx)
        if state["proc0"] is None:
            state["proc0"], state["threads0"] = time.process_time(), _threads()
        _on = True
        try:
            return _timed("step", train_step)(forward_step_func, data_iterator, model, optimizer, sched, ctx)
        finally:
            state["steps"] += 1

    example.train_step = counted_step
    finish = example.finish

    def counted_finish(ctx):
        global _on
        _on = False
        if state["proc0"] is not None:
            proc = time.process_time() - state["proc0"]
            now, before = _threads(), state["threads0"]
            threads: dict = {}
            for tid, (comm, s) in now.items():
                d = s - before.get(tid, (comm, 0.0))[1]
                threads[comm] = threads.get(comm, 0.0) + d
            gone = sum(s for tid, (_, s) in before.items() if tid not in now)
            threads["(exited, CPU before the window)"] = -gone
            import torch.distributed as dist

            rank = dist.get_rank()
            Path(os.environ["HA_CPU_OUT"], f"rank{rank}.json").write_text(json.dumps({
                "rank": rank, "steps": state["steps"], "process_cpu_s": proc,
                "threads_cpu_s": threads, "phases": _acc}))
        return finish(ctx)

    example.finish = counted_finish


def main() -> None:
    spec = importlib.util.spec_from_file_location("pretrain_gpt", REPO / "examples/megatron/pretrain_gpt.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_gpt"] = example
    spec.loader.exec_module(example)
    import logging

    args = example.parse_args(sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    example.prepare(args)  # megatron's CPU patches before the wrapped modules are imported (done again later)
    install(example)
    example.pretrain(args)


if __name__ == "__main__":
    main()

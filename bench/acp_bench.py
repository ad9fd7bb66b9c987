"""Benchmark of the checkpoint store against torch.save/torch.load and DCP async_save, in one run.

For each size (default 256 MiB and 1 GiB of float32 tensors of 16 MiB) it prints:
  save (blocking)   mindio.save | torch.save to the same directory | DCP async_save's blocking part |
                    two plain copies into reused, pre-faulted (anonymous) buffers, the floor for any
                    in-memory save, both on as many threads as mindio.save copies with: torch's copy_,
                    and mindio's own copy routine (mindio._native.copy_many, streaming stores) -- the
                    save's ratio is taken against the faster of the two
  load              mindio from the pool | mindio from storage, page cache dropped for that file |
                    torch.load from the page cache | torch.load cold
  background        compute-loop throughput while the daemon persists, relative to the same loop idle:
                    persist windows alternate with idle ones and each is compared with its two
                    neighbours (median of --rounds), with the loop's CPU-seconds and the daemon's.
                    Measured with a loop of 1 torch thread (the target's figure: torchrun and
                    mindio-run start workers with OMP_NUM_THREADS=1, one process per core or device,
                    so a trainer process computes on one thread) and again with a loop using every
                    CPU (torch's default here; nothing is left idle for the daemon then)
Fast measurements are interleaved and the best of --repeat is kept (the machine may be shared);
cold loads and torch.save run once. Loads are shown alone and followed by one read of every tensor
(a sum, as load_state_dict's copy does), because a lazy load that never reads its data proves little.
Pool loads view the client's pre-faulted copy-on-write view of the pool (mindio/acp/_loadview.py).

    .venv/bin/python bench/acp_bench.py                 # 256 MiB and 1 GiB, < 2 minutes here
    .venv/bin/python bench/acp_bench.py --sizes 64 --repeat 1 --rounds 2   # a quick check
    .venv/bin/python bench/acp_bench.py --sizes 256,1024,4096 --dir /mnt/ckpt
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
import warnings

import torch
from _store import private_store

_MIB = 1 << 20


def state_dict(mib: int) -> dict:
    n = max(1, mib // 16)
    return {f"layer{i}.weight": torch.randn((16 * _MIB) // 4) for i in range(n)}


def touch(obj) -> float:
    return float(sum(t.sum() for t in obj.values()))


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def drop_cache(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


_A = _B = _C = None


def _loop(stop) -> tuple:
    """Run the compute loop until ``stop(elapsed)``; (iterations, wall s, process CPU s).

    The same work every iteration: a 384x384 matmul of fixed normal-range operands and a tanh, into
    reused buffers. (The loop used to feed ``tanh(a @ a * 0.01)`` back into itself: the values
    shrank through denormals -- ~100x slower arithmetic for the first ~0.2 s of every window -- to
    exact zeros, so each window began with a fixed stall that weighed more on the shorter, busy
    windows of the 256 MiB size: 45 % "of idle" with the loop's own CPU fully available.)"""
    global _A, _B, _C
    if _A is None:
        g = torch.Generator().manual_seed(0)
        _A, _B = torch.randn(384, 384, generator=g), torch.randn(384, 384, generator=g) / 384 ** 0.5
        _C = torch.empty(384, 384)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while not stop(time.perf_counter() - t0):
        torch.tanh(torch.mm(_A, _B, out=_C), out=_C)
        n += 1
    return n, time.perf_counter() - t0, time.process_time() - c0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compute_during_persistence(acp, sd, path, rounds: int) -> dict:
    """Compute-loop throughput while the daemon persists ``sd``, against the same loop idle.

    Windows alternate idle, persist, idle, persist, ... idle; each persist window (from the moment
    async_save returns until the daemon reports the file persisted) is compared with the idle windows
    on both sides of it, so slow drifts of the machine's other load cancel out. Reported: the median
    of the per-round ratios (iterations per wall second), the same ratio per CPU-second of this
    process (what the loop got done with the CPU it got: cache/memory interference only), the share
    of the machine's CPUs the loop got in each kind of window, and the daemon's CPU-seconds.
    """
    from mindio.acp import api

    daemon = api._client.hello["pid"]
    assert acp.flush() == 0
    idle_len = 1.0
    idles = [_loop(lambda e: e >= idle_len)]
    busy = []
    for _ in range(rounds):
        cpu0 = cpu_seconds(daemon)
        handle = acp.async_save(sd, path)
        assert handle.rc == 1
        done = threading.Event()

        def waiter(handle=handle, done=done):
            try:
                handle.wait(600)          # blocks in recv, GIL released
            finally:
                done.set()

        threading.Thread(target=waiter, daemon=True).start()
        n, wall, cpu = _loop(lambda e: (done.is_set() and e >= 0.3) or e > 600)
        assert handle.wait(5), "the daemon did not persist the compute-loop save"   # re-raises a failure
        busy.append((n, wall, cpu, cpu_seconds(daemon) - cpu0))
        idle_len = min(3.0, max(0.5, wall))                 # idle windows as long as the busy ones
        idles.append(_loop(lambda e: e >= idle_len))
    ncpu = os.cpu_count() or 1
    ratios, cpu_ratios = [], []
    for i, (n, wall, cpu, _) in enumerate(busy):
        before, after = idles[i], idles[i + 1]
        idle_rate = (before[0] + after[0]) / (before[1] + after[1])
        idle_per_cpu = (before[0] + after[0]) / max(1e-9, before[2] + after[2])
        ratios.append((n / wall) / idle_rate)
        cpu_ratios.append((n / max(1e-9, cpu)) / idle_per_cpu)
    return {
        "ratio": median(ratios), "ratios": ratios, "cpu_ratio": median(cpu_ratios),
        "window": median([b[1] for b in busy]), "daemon_cpu": median([b[3] for b in busy]),
        "share_idle": sum(i[2] for i in idles) / sum(i[1] for i in idles) / ncpu,
        "share_busy": sum(b[2] for b in busy) / sum(b[1] for b in busy) / ncpu,
        "idle_rate": sum(i[0] for i in idles) / sum(i[1] for i in idles),
        "sched_idle": acp.server_stat().get("sched_idle"),
    }


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def bench_size(mib: int, work: str, repeat: int, rounds: int, acp) -> dict:
    import torch.distributed.checkpoint as dcp

    sd = state_dict(mib)
    r: dict = {}
    mpath, tpath = os.path.join(work, f"mindio_{mib}.pt"), os.path.join(work, f"torch_{mib}.pt")
    from mindio import _native
    from mindio.acp import api

    nthreads = api._client.cfg.copy_threads()        # the threads mindio.save copies with
    # one reused, pre-faulted destination for both plain copies: torch's copy_ into views of it, and
    # mindio's routine into its bytes
    flat = torch.empty(sum(v.numel() for v in sd.values()), dtype=torch.float32).fill_(0)
    dst, jobs, off = {}, [], 0
    for k, v in sd.items():
        dst[k] = flat[off: off + v.numel()].view_as(v)
        jobs.append((off * 4, v.numpy().view("uint8")))
        off += v.numel()
    flat_bytes = flat.numpy().view("uint8")

    def torch_copy():
        threads = torch.get_num_threads()
        torch.set_num_threads(nthreads)
        try:
            for k, v in sd.items():
                dst[k].copy_(v)
        finally:
            torch.set_num_threads(threads)

    def msave():
        assert acp.flush() == 0                  # time each save with the daemon idle
        t0 = time.perf_counter()
        rc = acp.save(sd, mpath)
        took = time.perf_counter() - t0
        assert rc == 1, f"mindio.save returned {rc} (expected 1: memory pool)"
        return took

    def dcp_blocking():
        cdir = os.path.join(work, f"dcp_{mib}")
        shutil.rmtree(cdir, ignore_errors=True)
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=cdir)
        took = time.perf_counter() - t0
        fut.result()
        return took

    t_start = time.perf_counter()
    copies, ncopies, saves, dcps = [], [], [], []
    for _ in range(repeat):                       # interleaved, best of each: the machine is shared
        copies.append(timed(torch_copy))
        ncopies.append(timed(lambda: _native.copy_many(flat_bytes, jobs, nthreads, api._client.cfg.slice_bytes)))
        saves.append(msave())
        dcps.append(dcp_blocking())
    assert torch.equal(flat[-5:], sd[next(reversed(sd))][-5:])
    del dst, flat, flat_bytes, jobs
    r["copy_torch"], r["copy_native"] = min(copies), min(ncopies)
    r["copy"], r["copy_threads"] = min(r["copy_torch"], r["copy_native"]), nthreads
    r["mindio_save"], r["dcp_blocking"] = min(saves), min(dcps)
    r["torch_save"] = timed(lambda: torch.save(sd, tpath))

    assert acp.flush() == 0
    t_saves = time.perf_counter()
    touch(torch.load(tpath, weights_only=True))                     # page cache warm for torch.load
    runs: dict = {"pool": [], "torch": []}

    def load_and_read(kind, load):
        """(call s, call + read s, CPU-s of this process, all threads) of one load and one read."""
        c0, t0 = time.process_time(), time.perf_counter()
        obj = load()
        t1 = time.perf_counter()
        touch(obj)
        runs[kind].append((t1 - t0, time.perf_counter() - t0, time.process_time() - c0))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # reads on one thread: on a shared machine a 2-thread parallel region
    try:                          # waits for both threads to be scheduled; the read is the same for both
        for _ in range(repeat):                   # interleaved, best of each
            load_and_read("pool", lambda: acp.load(mpath))
            load_and_read("torch", lambda: torch.load(tpath, weights_only=True))
    finally:
        torch.set_num_threads(threads)
    best = {k: [min(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
    r["mindio_load_call"], r["mindio_load_pool"], r["mindio_load_pool_cpu"] = best["pool"]
    r["torch_load_call"], r["torch_load"], r["torch_load_cpu"] = best["torch"]
    r["cold_ok"] = drop_cache(mpath) and drop_cache(tpath)
    r["mindio_load_storage"] = timed(lambda: touch(acp.load(mpath, open_way="fopen")))
    r["torch_load_cold"] = timed(lambda: touch(torch.load(tpath, weights_only=True)))
    assert torch.equal(acp.load(mpath)["layer0.weight"], sd["layer0.weight"])

    t_loads = time.perf_counter()
    r["compute"] = {}
    threads = torch.get_num_threads()
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        try:
            r["compute"][n] = compute_during_persistence(acp, sd, mpath, rounds)
        finally:
            torch.set_num_threads(threads)
    r["phases"] = (t_saves - t_start, t_loads - t_saves, time.perf_counter() - t_loads)
    for p in (mpath, tpath):
        os.unlink(p)
    shutil.rmtree(os.path.join(work, f"dcp_{mib}"), ignore_errors=True)
    return r


def report(mib: int, r: dict) -> None:
    def line(name, t, base, base_name, better="faster", note=""):
        print(f"  {name:34} {t:8.3f} s   {base / t:6.1f}x {better} than {base_name}{note}")
    print(f"\n== {mib} MiB state dict ({mib // 16} float32 tensors of 16 MiB)")
    print("  blocking save")
    line("mindio.save (to memory pool)", r["mindio_save"], r["torch_save"], "torch.save", note=" (target 10x)")
    print(f"  {'':34} {'':10}   {r['dcp_blocking'] / r['mindio_save']:6.1f}x faster than DCP async_save blocking "
          f"({r['dcp_blocking']:.3f} s; target 4x)")
    print(f"  {'':34} {'':10}   {r['mindio_save'] / r['copy']:6.2f}x the time of the faster plain copy into "
          f"reused buffers ({r['copy']:.3f} s; target <= 1.5x)")
    print(f"  {'plain copy, torch copy_':34} {r['copy_torch']:8.3f} s   ({r['copy_threads']} threads, "
          f"as mindio.save; into reused, pre-faulted anonymous buffers)")
    print(f"  {'plain copy, mindio copy_many':34} {r['copy_native']:8.3f} s   ({r['copy_threads']} threads, the "
          f"routine mindio.save copies with; same buffers)")
    line("torch.save (local disk)", r["torch_save"], r["torch_save"], "torch.save")
    line("DCP async_save (blocking part)", r["dcp_blocking"], r["torch_save"], "torch.save")
    print("  load call alone (returns tensors; the pool's are zero-copy views of its pre-faulted load view)")
    line("mindio.load (memory pool)", r["mindio_load_call"], r["torch_load_call"], "torch.load (page cache)")
    line("torch.load (page cache)", r["torch_load_call"], r["torch_load_call"], "torch.load (page cache)")
    print("  load and read every tensor once (what load_state_dict does; reads on 1 thread)")
    line("mindio.load (memory pool)", r["mindio_load_pool"], r["torch_load"], "torch.load (page cache)",
         note=" (target 3x)")
    print(f"  {'  in CPU-seconds of this process':34} {r['mindio_load_pool_cpu']:8.3f} s   "
          f"{r['torch_load_cpu'] / r['mindio_load_pool_cpu']:6.1f}x less than torch.load (page cache) "
          f"({r['torch_load_cpu']:.3f} s; target 3x)")
    cold = "" if r["cold_ok"] else " (page cache could not be dropped)"
    line("mindio.load (storage, cold)" + cold, r["mindio_load_storage"], r["torch_load_cold"], "torch.load cold")
    line("torch.load (page cache)", r["torch_load"], r["torch_load"], "torch.load (page cache)")
    line("torch.load (cold)", r["torch_load_cold"], r["torch_load"], "torch.load (page cache)")
    ncpu = os.cpu_count() or 1
    for n, c in r["compute"].items():
        why = ("1 thread per trainer process, as torchrun/mindio-run start workers (OMP_NUM_THREADS=1)"
               if n == 1 else f"{n} threads: every CPU busy, none left idle for the daemon")
        print(f"  background persistence, compute loop of {why}; daemon workers "
              f"{'SCHED_IDLE' if c['sched_idle'] else 'nice 19'}; {len(c['ratios'])} persist windows between idle ones")
        print(f"  {'compute loop throughput':34} {100 * c['ratio']:7.1f} %   of idle ({c['idle_rate']:.1f} it/s idle; "
              f"per window: {', '.join(f'{100 * x:.0f}%' for x in c['ratios'])}; target >= 90%)")
        print(f"  {'  per CPU-second it got':34} {100 * c['cpu_ratio']:7.1f} %   of idle (interference beyond lost CPU)")
        print(f"  {'  CPU share it got':34} {100 * c['share_busy']:7.1f} %   of {ncpu} CPUs while persisting, "
              f"{100 * c['share_idle']:.1f}% idle (the machine's other load shows here)")
        share = c["daemon_cpu"] / (c["window"] * ncpu)
        print(f"  {'daemon CPU per persist':34} {c['daemon_cpu']:7.2f} s   for {mib} MiB over {c['window']:.2f} s "
              f"(save returned -> persisted): {100 * share:.1f}% of the machine's CPU")
    phases = r["phases"]
    print(f"  ({sum(phases):.0f} s for this size: saves {phases[0]:.0f} s, loads {phases[1]:.0f} s, "
          f"background {phases[2]:.0f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="comma list of state-dict sizes in MiB")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir on local disk)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5,
                        help="persist windows of the compute-loop measurement (the median is reported)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    warnings.filterwarnings("ignore")
    from mindio import _native, acp

    pool_gb = max(1, -(-3 * max(sizes) // 1024))         # room for two versions of the largest size
    t0 = time.perf_counter()
    with private_store(args.dir, {"memfs.data_block_pool_capacity_in_gb": str(pool_gb)}) as store:
        print(f"mindio {_native.BACKEND} core, {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads; pool {pool_gb} GB mapped and faulted in {store.init_s:.1f} s, its "
              f"copy-on-write load view in {store.view_s:.1f} s more (background, nice 19); dir {store.work}")
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for mib in sizes:
            report(mib, bench_size(mib, store.work, args.repeat, args.rounds, acp))
        took = time.perf_counter() - t0
        print(f"\nbench took {took:.0f} s (bound at the default sizes: 120 s); load average at end: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

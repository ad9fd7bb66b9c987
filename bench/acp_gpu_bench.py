"""Benchmark of CUDA state through the checkpoint store, against the device-to-host copy floor,
torch.save/torch.load and DCP async_save, all measured in one run (docs/acp.md, "GPU state").

For each size (default 1, 4 and 16 GiB of float32 CUDA tensors of 64 MiB) it prints:
  save (blocking)  mindio.save: the first save of the size (for the first size, the very first save
                   after initialize(), which registered the pool up front because CUDA was in use)
                   and the later ones |
                   the floor: non-blocking copies of the same tensors into reused pinned host buffers,
                   then a synchronize |
                   torch.save to the checkpoint directory (sizes <= --torch-max) |
                   DCP async_save's blocking part (the call, then torch.cuda.synchronize()): the
                   default call, and with BlockingAsyncStager(cache_staged_state_dict=True) (cached
                   pinned staging), its first save and its later ones
  load to device   mindio.load(map_location="cuda") from the pool, checked bitwise against the state |
                   torch.load(map_location="cuda") of the torch.save file from the page cache
Every save is timed with the daemon idle (flush first) and every DCP save finishes writing before the
next measurement. Best and median of --repeat are printed, with ratios. Without a GPU the benchmark
says why and exits 0.

    python bench/acp_gpu_bench.py                       # 1, 4 and 16 GiB (about 5 minutes on an H100)
    python bench/acp_gpu_bench.py --sizes 256,1024 --repeat 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings

import torch
from _store import private_store

_MIB = 1 << 20
_TENSOR_MIB = 64


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _sync_timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _free_host_cache() -> None:
    empty = getattr(torch._C, "_host_emptyCache", None)     # pinned blocks torch keeps cached
    if empty is not None:
        empty()


def state_dict(mib: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(mib)
    n = max(1, mib // _TENSOR_MIB)
    return {f"layer{i}.weight": torch.randn((_TENSOR_MIB * _MIB) // 4, device="cuda", generator=g) for i in range(n)}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].device == b[k].device and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def floor_copy(sd: dict, repeat: int) -> list:
    """Non-blocking copies into reused pinned host buffers (allocated and touched before timing)."""
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}

    def copy():
        for k, v in sd.items():
            pinned[k].copy_(v, non_blocking=True)
    copy()
    torch.cuda.synchronize()
    times = [_sync_timed(copy) for _ in range(repeat)]
    assert all(torch.equal(pinned[k], sd[k].cpu()) for k in list(sd)[:2])
    del pinned
    _free_host_cache()
    return times


def dcp_saves(sd: dict, work: str, count: int, cached: bool) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    stager = BlockingAsyncStager(cache_staged_state_dict=True) if cached else None
    cdir = os.path.join(work, "dcp")
    times = []
    for _ in range(count):
        shutil.rmtree(cdir, ignore_errors=True)
        kwargs = {"async_stager": stager} if stager is not None else {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        resp = dcp.async_save(sd, checkpoint_id=cdir, **kwargs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        fut = getattr(resp, "upload_completion", resp)     # torch >= 2.9 may answer an AsyncSaveResponse
        fut.result()
    shutil.rmtree(cdir, ignore_errors=True)
    del stager
    _free_host_cache()
    return times


def bench_size(mib: int, work: str, repeat: int, torch_max: int, acp) -> dict:
    sd = state_dict(mib)
    torch.cuda.synchronize()
    r: dict = {"n": len(sd)}
    mpath, tpath = os.path.join(work, f"mindio_{mib}.pt"), os.path.join(work, f"torch_{mib}.pt")
    stamp = time.perf_counter()

    saves = []
    for _ in range(repeat):
        assert acp.flush() == 0                  # each save with the daemon idle
        t0 = time.perf_counter()
        rc = acp.save(sd, mpath)
        saves.append(time.perf_counter() - t0)
        assert rc == 1, f"mindio.save returned {rc} (expected 1: memory pool)"
    r["mindio_first"], r["mindio_later"] = saves[0], saves[1:] or saves
    assert acp.flush() == 0
    r["floor"] = floor_copy(sd, repeat)
    r["dcp_cached"] = dcp_saves(sd, work, max(2, repeat), cached=True)
    r["dcp_default"] = dcp_saves(sd, work, 1 if mib > torch_max else 2, cached=False)
    if mib <= torch_max:
        t0 = time.perf_counter()
        torch.save(sd, tpath)
        r["torch_save"] = time.perf_counter() - t0
    r["t_saves"] = time.perf_counter() - stamp

    stamp = time.perf_counter()
    r["mindio_load"], r["bitwise"] = [], True
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        back = acp.load(mpath, map_location="cuda")
        torch.cuda.synchronize()
        r["mindio_load"].append(time.perf_counter() - t0)
        r["bitwise"] = r["bitwise"] and same_bits(back, sd)
        del back
    if mib <= torch_max:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        back = torch.load(tpath, map_location="cuda", weights_only=True)
        torch.cuda.synchronize()
        r["torch_load"] = time.perf_counter() - t0
        r["torch_bitwise"] = same_bits(back, sd)
        del back
        os.unlink(tpath)
    r["t_loads"] = time.perf_counter() - stamp
    del sd
    torch.cuda.empty_cache()
    return r


def report(mib: int, r: dict) -> None:
    floor = min(r["floor"])

    def line(name, times, note=""):
        times = times if isinstance(times, list) else [times]
        best = min(times)
        spread = f" (median {median(times):.4f})" if len(times) > 1 else ""
        print(f"  {name:46} {best:8.4f} s{spread:18} {best / floor:6.2f}x floor{note}")
    later = min(r["mindio_later"])
    print(f"\n== {mib} MiB of CUDA state ({r['n']} float32 tensors of {_TENSOR_MIB} MiB)")
    spread = f" (median {median(r['floor']):.4f})"
    print(f"  {'D2H floor (non-blocking into reused pinned)':46} {floor:8.4f} s{spread:18} "
          f"{mib * _MIB / 1e9 / floor:6.1f} GB/s")
    line("mindio.save, first save of this size", r["mindio_first"], "  (target <= 1.5x)")
    line("mindio.save, later saves", r["mindio_later"], "  (target <= 1.5x)")
    line("DCP async_save blocking, cached pinned, first", r["dcp_cached"][0])
    line("DCP async_save blocking, cached pinned, later", r["dcp_cached"][1:])
    line("DCP async_save blocking, default call", r["dcp_default"])
    if "torch_save" in r:
        line("torch.save (checkpoint directory)", r["torch_save"])
    print(f"  {'':46} mindio.save first / floor {r['mindio_first'] / floor:5.2f}x, later / floor {later / floor:5.2f}x")
    print(f"  {'':46} DCP cached later / mindio later {min(r['dcp_cached'][1:]) / later:5.2f}x (target >= 1)")
    print(f"  {'':46} DCP cached first / mindio first {r['dcp_cached'][0] / r['mindio_first']:5.2f}x (target >= 3)")
    print(f"  {'':46} DCP default / mindio later {min(r['dcp_default']) / later:5.2f}x")
    print("  load to the device (map_location='cuda')")
    ml = min(r["mindio_load"])
    print(f"  {'mindio.load (memory pool)':46} {ml:8.4f} s (median {median(r['mindio_load']):.4f})   "
          f"bitwise {'equal' if r['bitwise'] else 'DIFFERENT'}")
    if "torch_load" in r:
        print(f"  {'torch.load (page cache)':46} {r['torch_load']:8.4f} s   {r['torch_load'] / ml:6.1f}x slower than "
              f"mindio.load (target >= 3x); bitwise {'equal' if r['torch_bitwise'] else 'DIFFERENT'}")
    else:
        print(f"  torch.save/torch.load skipped at this size (--torch-max)")
    print(f"  ({r['t_saves'] + r['t_loads']:.0f} s for this size: saves {r['t_saves']:.0f} s, loads {r['t_loads']:.0f} s)")


def _pool_mb(max_mib: int) -> int:
    """Two versions of the largest state and room, within the free space of the pool's file system."""
    from mindio.acp import _config

    want = (-(-2 * max_mib // 1024) + 2) << 10
    st = os.statvfs(os.path.dirname(_config.pool_dir("/")) or "/")
    return max(1024, min(want, (st.f_bavail * st.f_frsize >> 20) - 2048))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,4096,16384", help="comma list of state sizes in MiB")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir under /var/tmp)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--torch-max", type=int, default=4096,
                        help="largest size (MiB) at which torch.save/torch.load are measured (they are slow)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"acp_gpu_bench skipped: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is "
              "False). Run it on a machine with a GPU.")
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    pool_mb = _pool_mb(max(sizes))
    warnings.filterwarnings("ignore")
    from mindio import _native, acp
    from mindio.acp import api

    torch.zeros(1, device="cuda")                       # CUDA in use before initialize(), as in training
    t0 = time.perf_counter()
    with private_store(args.dir, pool_mb=pool_mb, prefix="mindio-gpubench") as store:
        dev = api._client.device
        pre = acp.server_stat().get("prefaulted", 0)
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name} ({props.total_memory >> 30} GiB), torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"{os.cpu_count()} CPUs, mindio {_native.BACKEND} core")
        print(f"pool {pool_mb >> 10} GiB: initialize() {store.init_s:.2f} s, of which page-locked registration "
              f"{dev.register_s.get('cuda', float('nan')):.2f} s (path: {dev.paths.get('cuda', 'none')}); "
              f"copy-on-write load view faulted in {store.view_s:.1f} s more (background); the daemon had faulted "
              f"in {pre / (1 << 30):.1f} GiB of its mapping at the first save (background); dir {store.work}")
        for mib in sizes:
            report(mib, bench_size(mib, store.work, args.repeat, args.torch_max, acp))
        print(f"\nbench took {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

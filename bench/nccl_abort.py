"""How long the NCCL stop of a teardown takes, by way of aborting: one rank, N process groups, each
used by one all_reduce (so that its communicator exists), then all of them aborted -- each way in a
fresh process, all in one run (docs/recovery.md, "Stopping collectives on each backend"):

  one-by-one   _abort_process_group(g) for every subgroup, then the default group (mindio before)
  grouped      one _abort_process_group(): every group inside one ncclGroupStart/End (torch's way)
  mindio       mindio.ttp.processor.device.NcclBackend().stop(): every group's abort on its own thread,
               then one _abort_process_group() to unregister them

It prints the seconds each took and its ratio to mindio's. Without CUDA or NCCL it says why and exits 0.

    python bench/nccl_abort.py [--groups 20]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MODES = ("one-by-one", "grouped", "mindio")


def child(mode: str, groups: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", device_id=dev)
    made = [dist.new_group([0]) for _ in range(groups)]
    t = torch.ones(1 << 20, device=dev)
    for g in [None] + made:
        dist.all_reduce(t, group=g)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    if mode == "one-by-one":
        world = dist.group.WORLD
        for g in [g for g in list(dist.distributed_c10d._world.pg_map) if g is not world] + [world]:
            _abort_process_group(g)
    elif mode == "grouped":
        _abort_process_group()
    else:
        from mindio.ttp.processor import device
        device.NcclBackend().stop()
    took = time.monotonic() - t0
    print(f"RESULT {took:.4f} {len(dist.distributed_c10d._world.pg_map)}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=20, help="subgroups besides the default one (Megatron: ~20)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    import torch
    import torch.distributed as dist
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        print("no CUDA device or no NCCL in this torch: nothing to measure (run it on a GPU machine)")
        return 0
    from mindio._ports import free_port
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; 1 rank, {args.groups} groups + the default one")
    took = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--child", mode, str(args.groups), str(free_port())],
                             env=env, capture_output=True, text=True, timeout=300)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            print(f"  {mode:<11} failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
            continue
        took[mode], left = float(line[0].split()[1]), int(line[0].split()[2])
        print(f"  {mode:<11} {took[mode]:8.3f} s   groups still registered after it: {left}")
    if "mindio" in took:
        for mode in MODES[:2]:
            if mode in took:
                print(f"  {mode} / mindio: {took[mode] / took['mindio']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

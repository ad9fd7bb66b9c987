"""A 2-rank script that ends without any teardown of its own (tests/ttp/test_exit.py).

``python _exit_probe.py RANK STORE_PORT OUT {drop|keep}``: gloo world of 2, a subgroup, the collectives
that ended the crashing run of issue 13 (``all_gather_object`` then ``barrier`` on the subgroup); each rank
also runs a controller and two processors in-process (tests/ttp/_harness.py ``start_plane``). Nothing is
destroyed or stopped. ``keep`` leaves the subgroup in a global, as a framework would. An atexit handler
registered before mindio's (so it runs after it, just before the interpreter shuts down) writes the
native thread names (/proc) and the Python threads still alive to ``OUT/threads<rank>.json``.
"""
import atexit
import json
import os
import sys
import threading

RANK, PORT, OUT, KEEP = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "keep"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def record() -> None:
    native = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                native.append(f.read().strip())
        except OSError:
            pass
    python = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    with open(os.path.join(OUT, f"threads{RANK}.json"), "w") as f:
        json.dump({"native": sorted(native), "python": sorted(python)}, f)


atexit.register(record)  # before mindio registers its exit teardown: runs after it

import torch.distributed as dist  # noqa: E402

KEPT = []


def main() -> None:
    store = dist.TCPStore("127.0.0.1", PORT, 2, is_master=RANK == 0)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=2)
    from tests.ttp._harness import start_plane

    start_plane(2, b"k" * 32)  # a controller + 2 processors in this process, never stopped
    sub = dist.new_group([0, 1])
    if KEEP:
        KEPT.append(sub)
    gathered = [None, None]
    dist.all_gather_object(gathered, RANK, group=sub)
    dist.barrier(group=sub)


main()

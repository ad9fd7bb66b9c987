"""Trainer processes for the crash tests: they print a line at the moment the parent should kill them."""
import os
import resource
import signal
import sys
import time

import torch

from mindio import acp
from mindio.acp import _storage, client


def state(value: float, mib: int = 32) -> dict:
    return {"w": torch.full(((mib << 20) // 4,), value), "step": int(value)}


def say(text: str) -> None:
    print(text, flush=True)


def main(cmd: str, path: str) -> None:
    if cmd == "mid_save":                       # killed between alloc and commit of version 2
        assert acp.initialize() == 0
        assert acp.save(state(1.0), path) == 1 and acp.flush() == 0
        real = client.Client._copy_many

        def slow_copy(self, dst, jobs):
            real(self, dst, [(off, src[: len(src) // 2]) for off, src in jobs])   # half of every storage
            say("COPYING")
            time.sleep(120)
        client.Client._copy_many = slow_copy
        acp.save(state(2.0), path)
    elif cmd == "mid_direct":                   # killed half-way through a direct write (no daemon)
        assert acp.save(state(1.0), path) == 2
        real_write = os.write

        def slow_write(fd, data):
            n = real_write(fd, data[: len(data) // 2])
            say("WRITING")
            time.sleep(120)
            return n
        _storage.os.write = slow_write
        acp.save(state(2.0), path)
    elif cmd == "after_save":                   # killed right after save returned
        from mindio.acp import api
        assert acp.initialize() == 0
        assert acp.save(state(3.0, 64), path) == 1
        # the daemon's worker sleeps MINDIO_ACP_PERSIST_DELAY before writing: stopped inside that sleep, it
        # cannot persist before the parent killed this process and looked (the parent continues it)
        daemon = api._client.hello["pid"]
        os.kill(daemon, signal.SIGSTOP)
        say(f"SAVED {daemon}")
        time.sleep(120)
    elif cmd == "fsize_limit":                  # storage refuses big files (RLIMIT_FSIZE, inherited by the daemon)
        assert acp.initialize() == 0
        from mindio.acp import api
        limit = (4 << 20, 4 << 20)       # storage refuses files > 4 MiB: the daemon's writes and ours
        resource.prlimit(api._client.hello["pid"], resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        small, big = os.path.join(path, "small.pt"), os.path.join(path, "big.pt")
        assert acp.save(state(1.0, 1), small) == 1
        rc = acp.save(state(2.0, 8), big)
        say(f"RC {rc} FLUSH {acp.flush(timeout=30)}")
        after = acp.save(state(4.0, 8), os.path.join(path, "big2.pt"))
        say(f"AFTER {after} {sorted(acp.fallback_counts().items())}")
        say(f"SMALL {acp.load(small, open_way='fopen')['step']} BIG {acp.load(big)['step']}")
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

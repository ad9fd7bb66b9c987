"""Launch the toy job (_toy_train.py) as real processes on loopback; always reap what we started."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import torch

TOY = os.path.join(os.path.dirname(__file__), "_toy_train.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One launch of ``world`` ranks; ``wait`` returns the exit codes, ``kill`` reaps leftovers."""

    def __init__(self, out: str, world: int = 4, args: list | None = None, env: dict | None = None,
                 ctl_port: int | None = None):
        os.makedirs(out, exist_ok=True)
        self.out, self.world = out, world
        self.ctl_port = ctl_port or free_port()
        store_port = free_port()
        e = dict(os.environ, PYTHONPATH=ROOT, TTP_LOG_STDOUT="1", TTP_LOG_LEVEL="INFO",
                 MINDIO_EVENT_LOG=os.path.join(out, "events.jsonl"), OMP_NUM_THREADS="1")
        e.update(env or {})
        self.logs = [open(os.path.join(out, f"rank{r}.log"), "w") for r in range(world)]
        self.procs = [subprocess.Popen([sys.executable, TOY, "--rank", str(r), "--world", str(world),
                                        "--store-port", str(store_port), "--ctl-port", str(self.ctl_port),
                                        "--out", out] + (args or []), env=e, stdout=self.logs[r],
                                       stderr=subprocess.STDOUT) for r in range(world)]

    def wait(self, timeout: float) -> list:
        end = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not finish in {timeout} s; logs in {self.out}:\n" + self.tail())
        finally:
            for f in self.logs:
                f.close()
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def tail(self, n: int = 3000) -> str:
        text = ""
        for r in range(self.world):
            with open(os.path.join(self.out, f"rank{r}.log")) as f:
                text += f"--- rank {r}\n" + f.read()[-n:]
        return text

    def events(self) -> list:
        path = os.path.join(self.out, "events.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]


def final_state(out: str, world: int) -> list:
    return [torch.load(os.path.join(out, f"final_rank{r}.pt")) for r in range(world)]


def assert_bitwise_equal(a: list, b: list) -> None:
    for r, (x, y) in enumerate(zip(a, b)):
        assert x["it"] == y["it"], (r, x["it"], y["it"])
        for key in ("flat", "master", "m", "v"):
            assert torch.equal(x[key], y[key]), f"rank {r}: {key} differs"

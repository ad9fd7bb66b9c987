"""Warm spares: interpreters started ahead of need that have imported torch and the rank-independent
part of the training script's top-level imports (mindio.launch._bootstrap) and wait on stdin for an
assignment (environment, argv, where stdout/stderr go), so that starting or replacing a worker does not
pay interpreter start-up on the critical path.

``--no-python`` (the entrypoint is a program, not a Python script): the bootstrap imports nothing and,
once assigned, replaces itself with the program (``--exec``); it still dies with its agent."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from .config import LaunchConfig

__all__ = ["Spares"]


class Spares:
    """Warm bootstrap interpreters waiting for an assignment."""

    def __init__(self, cfg: LaunchConfig, env: dict):
        self._cfg = cfg
        self._env = env
        self._pool: list[subprocess.Popen] = []

    def _start(self) -> subprocess.Popen:
        cfg = self._cfg
        if cfg.no_python:
            target = ["--exec", cfg.entrypoint]
        else:
            target = ["-m", cfg.entrypoint] if cfg.is_module else [cfg.entrypoint]
        return subprocess.Popen(
            [sys.executable, "-u", "-m", "mindio.launch._bootstrap", *target],
            stdin=subprocess.PIPE, env=self._env, text=True,
        )

    def fill(self, count: int | None = None) -> None:
        """Keep ``count`` (default ``--warm-spares``) interpreters warming or waiting."""
        self._pool = [p for p in self._pool if p.poll() is None]
        while len(self._pool) < max(count or 0, self._cfg.warm_spares):
            self._pool.append(self._start())

    def take(self, env: dict, argv, stdout: str | None = None, stderr: str | None = None) -> subprocess.Popen:
        """A worker with ``env`` (on top of the node's), ``argv``, its output to ``stdout`` / ``stderr``
        (paths; None: the agent's console)."""
        self._pool = [p for p in self._pool if p.poll() is None]
        proc = self._pool.pop(0) if self._pool else self._start()
        proc.stdin.write(json.dumps({"env": env, "argv": list(argv), "stdout": stdout, "stderr": stderr}) + "\n")
        proc.stdin.close()
        return proc

    def close(self) -> None:
        """End the spares at once: one still warming up (importing torch) would read its EOF only when
        done, seconds later, and hold the agent's exit that long; none holds any state."""
        for p in self._pool:
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self._pool:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._pool = []


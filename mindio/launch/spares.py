"""Warm spares: interpreters started ahead of need that have imported torch and the rank-independent
part of the training script's top-level imports (mindio.launch._bootstrap) and wait on stdin for an
assignment (environment, argv, where stdout/stderr go), so that starting or replacing a worker does not
pay interpreter start-up on the critical path.

``--no-python`` (the entrypoint is a program, not a Python script): the bootstrap imports nothing and,
once assigned, replaces itself with the program (``--exec``); it still dies with its agent.

Where a fork is safe (mindio/launch/forkserver.py), a Python entrypoint gets no spares: one fork server
per agent pays the imports once and forks each worker; if it cannot fork (or ends), the agent goes back
to spares, with a warning saying why."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

from . import forkserver
from .config import LaunchConfig

log = logging.getLogger(__name__)

__all__ = ["Spares"]


class Spares:
    """Warm bootstrap interpreters waiting for an assignment."""

    def __init__(self, cfg: LaunchConfig, env: dict):
        self._cfg = cfg
        self._env = env
        self._pool: list[subprocess.Popen] = []
        if cfg.no_python:
            self._target = ["--exec", cfg.entrypoint]
        else:
            self._target = ["-m", cfg.entrypoint] if cfg.is_module else [cfg.entrypoint]
        why = "--no-python" if cfg.no_python else forkserver.unusable(env)
        if why:
            log.info("workers are exec'd warm spares, not forked: %s", why)
        self._forking = not why
        self._server: forkserver.ForkServer | None = None

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-u", "-m", "mindio.launch._bootstrap", *self._target],
            stdin=subprocess.PIPE, env=self._env, text=True,
        )

    def _fork(self, assignment: dict | None):
        """A worker forked by this agent's fork server (started on first use; ``assignment`` None: only
        that); None: exec one."""
        if not self._forking:
            return None
        if self._server is None:
            self._server = forkserver.ForkServer(self._target, self._env)
        worker = self._server.take(assignment) if assignment is not None else None
        if worker is None and self._server.fork is False:
            self._forking = False
            log.warning("the fork server cannot fork workers (%s): they are exec'd warm spares from now on",
                        self._server.why)
        return worker

    def fill(self, count: int | None = None) -> None:
        """Keep ``count`` (default ``--warm-spares``) interpreters warming or waiting (with a fork server:
        start it; it is all the warm interpreter this agent needs)."""
        self._fork(None)
        if self._forking:
            return
        self._pool = [p for p in self._pool if p.poll() is None]
        while len(self._pool) < max(count or 0, self._cfg.warm_spares):
            self._pool.append(self._start())

    def take(self, env: dict, argv, stdout: str | None = None, stderr: str | None = None) -> subprocess.Popen:
        """A worker with ``env`` (on top of the node's), ``argv``, its output to ``stdout`` / ``stderr``
        (paths; None: the agent's console)."""
        assignment = {"env": env, "argv": list(argv), "stdout": stdout, "stderr": stderr}
        worker = self._fork(assignment)
        if worker is not None:
            return worker
        self._pool = [p for p in self._pool if p.poll() is None]
        proc = self._pool.pop(0) if self._pool else self._start()
        proc.stdin.write(json.dumps(assignment) + "\n")
        proc.stdin.close()
        return proc

    def close(self) -> None:
        """End the spares at once: one still warming up (importing torch) would read its EOF only when
        done, seconds later, and hold the agent's exit that long; none holds any state."""
        if self._server is not None:
            self._server.close()
            self._server = None
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


"""Fork server: one warm interpreter per agent that forks a worker for each assignment.

A warm spare (``_bootstrap``) pays the imports (torch, torch.distributed, megatron-core: 2-5 CPU-s) once
per worker, replacements and spares thrown away at the end included. The fork server pays them once per
agent: it preloads exactly what a spare does, then forks; a child copies the warm interpreter (copy on
write, a few ms) and becomes its worker through the same code as a spare (``_bootstrap.become``).

It is used only where a fork is safe (mindio/launch/forkserver.py decides, the server checks again):
torch built for the CPU only (a CUDA/ROCm/XPU build or torch_npu: every worker is exec'd, a fork after an
accelerator runtime started is unsafe), and after the imports one thread only and no CUDA initialised.

Protocol: JSON lines on a Unix stream socket (the agent's end of a socketpair, fd ``argv[1]``),
each with ``"v": 1``.

server -> agent  ``{"ready": true, "fork": bool, "why": str, "warm_s": float}`` once, after the imports.
                 ``fork`` false: the server exits; the agent execs its workers (``why`` says why).
agent -> server  ``{"assign": {"env", "argv", "stdout", "stderr"}}``: fork a worker (see _bootstrap).
server -> agent  ``{"pid": N}``: the child's pid, in the order of the assignments.
agent -> server  ``{"ack": N}``: the agent holds a pidfd of N; until then N is not reaped, so that the
                 pid cannot be reused before the agent can signal it (pidfd_send_signal).
server -> agent  ``{"exit": N, "code": C}``: N ended; C as ``Popen.returncode`` (-SIG for a signal).

EOF from the agent: fork no more; exit once every child has been reaped. The server dies with its agent
(PR_SET_PDEATHSIG), and its children with it, so the agent's death still ends every worker.

A child keeps the fds a spare would have (0-2 and what the imports opened) and closes the server's own
(socket, selector, pidfds); gets SIGINT back as Python's default (the server ignores it: a Ctrl-C to the
job's process group goes to the agent and the workers, as with spares); numpy's global generator is
seeded again from the OS, and so is torch's default (CPU) generator, as in a fresh process (Python's
``random`` reseeds itself in a fork child). String hashes: every child of a server has the server's
hash seed (an exec'd worker draws its own unless PYTHONHASHSEED is set). With ``MINDIO_GC_FREEZE`` (on by
default) the server collects, then freezes (``gc.freeze``) what its imports created before it forks:
a child starts with those objects frozen, as its own ``freeze_startup_objects`` would leave them.
"""
from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import sys
import time

from . import _bootstrap
from .. import _knobs

VERSION = 1


def unsafe_to_fork() -> str:
    """Why forking this (preloaded) interpreter would be unsafe, or ''."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return "cannot count this process's threads (/proc)"
    if threads > 1:
        return f"{threads} threads run after the imports (a fork child gets only the forking one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an import initialised CUDA (a fork child cannot use it)"
    return ""


class _Server:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ)
        self.buf = b""
        self.open = True
        self.children: dict = {}  # pidfd -> pid
        self.unacked: set = set()
        self.ended: dict = {}  # pid -> pidfd, ended before its ack

    def send(self, **msg) -> None:
        if self.open:
            try:
                self.sock.sendall((json.dumps({"v": VERSION, **msg}) + "\n").encode())
            except OSError:  # the agent is gone: we die with it (PDEATHSIG); reap meanwhile
                self.open = False

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.send(exit=pid, code=os.waitstatus_to_exitcode(status))

    def serve(self):
        """Fork on each assignment; returns it in the child, None in the server when it is done."""
        while self.open or self.children:
            for key, _ in self.sel.select():
                if key.fileobj is not self.sock:
                    pid = self.children[key.fd]
                    if pid in self.unacked:
                        self.sel.unregister(key.fd)  # reaped after the ack
                        self.ended[pid] = key.fd
                    else:
                        self._reap(key.fd)
                    continue
                data = self.sock.recv(65536)
                if not data:
                    self.open = False
                    self.sel.unregister(self.sock)
                    for pid, fd in list(self.ended.items()):  # no ack will come
                        self.sel.register(fd, selectors.EVENT_READ)
                        self.unacked.discard(pid)
                        self._reap(fd)
                    self.ended.clear()
                    continue
                self.buf += data
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "ack" in msg:
                        pid = msg["ack"]
                        self.unacked.discard(pid)
                        if pid in self.ended:
                            fd = self.ended.pop(pid)
                            self.sel.register(fd, selectors.EVENT_READ)
                            self._reap(fd)
                    elif "assign" in msg:
                        if self._fork() == 0:
                            return msg["assign"]
        return None

    def _fork(self) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._leave(server)
            return 0
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.unacked.add(pid)
        self.sel.register(pidfd, selectors.EVENT_READ)
        self.send(pid=pid)
        return pid

    def _leave(self, server: int) -> None:
        """(fork child) Drop the server's fds and state: the child looks like a warm spare."""
        self.sel.close()
        for fd in [*self.children, *self.ended.values()]:
            os.close(fd)
        self.sock.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _preempt_signals(signal.SIG_DFL)
        _bootstrap._die_with_parent(server)
        # a fresh process seeds these generators from the OS; a fork child would share the server's stream
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.default_generator.seed()
        np = sys.modules.get("numpy.random")
        if np is not None:
            np.seed()


def _preempt_signals(action) -> None:
    """The preemption signals (MINDIO_PREEMPT_SIGNAL) set to ``action``. The server ignores them: a scheduler
    that signals every process of a job (Slurm's ``scancel --signal``, ``--signal``) must not end it, and its
    forked workers with it, before their last-words checkpoint; the agent and the workers act on them."""
    try:
        names = _knobs.get("MINDIO_PREEMPT_SIGNAL")
    except Exception:  # noqa: BLE001  (the agent refused a bad value already)
        names = ("SIGTERM",)
    for name in names:
        signal.signal(getattr(signal, name), action)


def main() -> None:
    _bootstrap._die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    target, is_module, is_program = _bootstrap.parse_target(sys.argv[2:])
    t0 = time.monotonic()
    _bootstrap._preload(target, is_module)
    why = unsafe_to_fork()
    if not why and _knobs.get("MINDIO_GC_FREEZE"):
        # the children's freeze of their start-up objects (mindio.ttp.processor.device.freeze_startup_objects)
        # done once here: each child's collection then walks only what it created (~0.1 CPU-s a worker
        # with megatron-core imported), and touches no inherited object (no copy-on-write of the heap)
        gc.collect()
        gc.freeze()
    warm_s = time.monotonic() - t0
    server = _Server(sock)
    _preempt_signals(signal.SIG_IGN)  # from here on the agent stops it by closing its socket, or SIGKILL
    server.send(ready=True, fork=not why, why=why, warm_s=round(warm_s, 3))
    if why:
        sys.exit(0)
    assignment = server.serve()
    if assignment is None:
        sys.exit(0)
    _bootstrap.become(assignment, target, is_module, is_program, warm_s)


if __name__ == "__main__":
    main()

"""The agent's side of the fork server (mindio/launch/_zygote.py: the server and its protocol).

With the fork server, an agent pays the workers' imports once: its workers, replacements and standby
ranks are forked from one warm interpreter instead of each importing torch (and megatron-core) again.
A forked worker is a :class:`ForkedWorker`: the part of ``subprocess.Popen`` the agent uses (``pid``,
``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate``, ``kill``), its exit code relayed by
the server (its parent), its signals sent through a pidfd (never to a reused pid).

``MINDIO_FORK_SERVER`` (``auto``, default, or ``off``): ``auto`` forks where it is safe -- workers
with ``OMP_NUM_THREADS=1`` (mindio-run's default with several workers a node; otherwise numpy's
OpenBLAS starts threads at import: the server would find them and fall back, its imports wasted), a CPU-only
torch build (no CUDA, ROCm or XPU build, no torch_npu: an accelerator runtime that may start in the
server makes a fork child unusable, so there every worker is exec'd as a warm spare) and a server
that, after its imports, runs one thread and has not initialised CUDA. Otherwise, or when the server
fails, the agent starts warm spares (mindio/launch/spares.py) as without it.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from .. import _knobs, _secure

log = logging.getLogger(__name__)

__all__ = ["ForkServer", "ForkedWorker", "HostedServer", "unusable"]


def unusable(env: dict) -> str:
    """Why this agent must exec its workers instead of forking them, or ''."""
    if _knobs.get("MINDIO_FORK_SERVER", env) == "off":
        return "MINDIO_FORK_SERVER=off"
    omp = _knobs.get("OMP_NUM_THREADS", env)
    if omp != "1":  # mindio-run sets 1 for several workers a node, as torchrun does
        return (f"OMP_NUM_THREADS={omp!r}, not 1: the imports would start BLAS/OpenMP "
                "thread pools (a fork child gets only the forking thread)")
    if not hasattr(os, "pidfd_open"):
        return "no pidfd_open (Linux 5.3+)"
    import torch

    for name in ("cuda", "hip", "xpu"):
        version = getattr(torch.version, name, None)
        if version:
            return f"torch is built for {name.upper()} {version} (a fork after its runtime started is unsafe)"
    if importlib.util.find_spec("torch_npu") is not None:
        return "torch_npu is installed (a fork after its runtime started is unsafe)"
    return ""


class ForkedWorker:
    """A worker forked by the fork server: the part of ``subprocess.Popen`` the agent uses."""

    def __init__(self, pid: int, args: list):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._pidfd: int | None = os.pidfd_open(pid)  # not reaped before our ack (_zygote.py)
        self._lock = threading.Lock()
        self._done = threading.Event()

    def _ended(self, code: int) -> None:
        with self._lock:
            self.returncode = code
            os.close(self._pidfd)
            self._pidfd = None
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self._pidfd is None:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # reaped meanwhile: its exit is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server process and its reader thread."""

    def __init__(self, target: list, env: dict):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.args = [sys.executable, "-u", "-m", "mindio.launch._zygote", str(theirs.fileno()), *target]
        self.proc = _hosted(target, env, theirs)  # MINDIO_FORK_SERVER_HOST
        if self.proc is None:
            self.proc = subprocess.Popen(self.args, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.timeout = _knobs.get("MINDIO_FORK_SERVER_TIMEOUT", env)
        self.fork: bool | None = None  # None: still importing
        self.why = ""
        self._ready = threading.Event()
        self._pids: queue.Queue = queue.Queue()
        self._workers: dict[int, ForkedWorker] = {}
        self._take = threading.Lock()  # one assignment at a time: pids come back in order
        threading.Thread(target=self._read, name="mindio-forkserver", daemon=True).start()

    def _send(self, **msg) -> None:
        self._sock.sendall((json.dumps({"v": 1, **msg}) + "\n").encode())

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._sock.close()
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if "ready" in msg:
                    self.fork, self.why = bool(msg["fork"]), msg.get("why", "")
                    self._ready.set()
                elif "pid" in msg:
                    self._pids.put(msg["pid"])
                elif "exit" in msg:
                    self._workers.pop(msg["exit"])._ended(msg["code"])
        self._lost()

    def _lost(self) -> None:
        """The server's end closed: it exited. Its live children died with it (PDEATHSIG, SIGKILL)."""
        if not self._ready.is_set():
            self.fork, self.why = False, "the fork server ended before its imports were done"
            self._ready.set()
        self._pids.put(None)
        for pid, worker in list(self._workers.items()):
            with worker._lock:
                fd = worker._pidfd
            if fd is not None:
                select.select([fd], [], [], 5.0)  # SIGKILLed by its parent's death: at once
            log.error("the fork server (pid %d) ended while worker %d ran: the worker died with it (SIGKILL)",
                      self.proc.pid, pid)
            self._workers.pop(pid, None)
            worker._ended(-signal.SIGKILL)

    def take(self, assignment: dict) -> ForkedWorker | None:
        """A worker forked for ``assignment``; None if this server cannot fork (``why`` says why)."""
        with self._take:
            if not self._ready.wait(self.timeout):
                raise TimeoutError(f"the fork server (pid {self.proc.pid}) did not finish its imports within "
                                   f"{self.timeout} s (MINDIO_FORK_SERVER_TIMEOUT; MINDIO_FORK_SERVER=off execs "
                                   "every worker instead)")
            if not self.fork:
                return None
            try:
                self._send(assign=assignment)
                pid = self._pids.get(timeout=self.timeout)
            except queue.Empty:  # a fork that comes later would be no one's: end the server (and its children)
                self.proc.kill()
                self.fork, self.why = False, "it did not fork within MINDIO_FORK_SERVER_TIMEOUT"
                raise TimeoutError(f"the fork server (pid {self.proc.pid}) did not fork a worker within "
                                   f"{self.timeout} s (MINDIO_FORK_SERVER_TIMEOUT)") from None
            except OSError:
                pid = None
            if pid is None:
                self.fork, self.why = False, f"the fork server ended (exit code {self.proc.poll()})"
                return None
            worker = ForkedWorker(pid, self.args)
            self._workers[pid] = worker
            self._send(ack=pid)
            return worker

    def close(self, wait_s: float = 5.0) -> None:
        """No more workers: the server exits once its children are reaped (it is killed at once when it
        is still importing, or after ``wait_s``)."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if not self._ready.is_set() and self.proc.poll() is None:
            self.proc.terminate()
        deadline = time.monotonic() + wait_s
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class HostedServer:
    """A fork server forked for this agent by a fork-server host (mindio/launch/_zygote_host.py): the part of
    ``subprocess.Popen`` ForkServer uses. Signals go through its pidfd; its exit code comes from the host;
    closing the connection (:meth:`wait` done, or this agent's death) makes the host SIGKILL it if it runs."""

    def __init__(self, conn: socket.socket, pid: int, pidfd: int):
        self._conn = conn
        self.pid = pid
        self._pidfd = pidfd
        self.returncode: int | None = None
        self._lock = threading.Lock()  # poll (the reader thread) and wait (close) may race

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read()
        return self.returncode

    def _read(self) -> None:
        with self._lock:
            if self.returncode is None:
                self._read_exit()

    def _read_exit(self) -> None:
        try:
            msg = json.loads(self._conn.recv(4096) or b"{}")
        except (OSError, ValueError):
            msg = {}
        # no message: the host is gone, and its fork servers with it (PR_SET_PDEATHSIG)
        self.returncode = msg.get("code", -signal.SIGKILL)
        self._conn.close()
        os.close(self._pidfd)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(["fork server", str(self.pid)], timeout)
            self._read()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _hosted(target: list, env: dict, theirs: socket.socket) -> HostedServer | None:
    """The fork server for ``target``, forked by the host at MINDIO_FORK_SERVER_HOST; None (the agent starts
    its own) when none is set, or it cannot be used or refuses (the log says why)."""
    path = _knobs.get("MINDIO_FORK_SERVER_HOST", env)
    if not path:
        return None
    from . import _zygote_host as host

    why = host.private_socket(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if why:
            raise OSError(why)
        conn.settimeout(_knobs.get("MINDIO_FORK_SERVER_TIMEOUT", env))
        conn.connect(path)
        if _secure.peer_uid(conn)[1] != os.geteuid():
            raise OSError("its listener is another user's")
        socket.send_fds(conn, [json.dumps(host.request(target, env)).encode()], [theirs.fileno(), 1, 2])
        msg, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        answer = json.loads(msg or b"{}")
        if "pid" not in answer or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(answer.get("refused", "no answer"))
    except Exception as exc:  # noqa: BLE001  (an optional shortcut: whatever fails, the agent starts its own)
        conn.close()
        log.info("fork-server host %s not used (%s): this agent starts its own fork server", path, exc)
        return None
    conn.settimeout(None)
    log.debug("fork server %d forked by the fork-server host %s", answer["pid"], path)
    return HostedServer(conn, answer["pid"], fds[0])

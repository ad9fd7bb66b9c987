"""A fork-server host: warm fork servers for many mindio-run agents in a row (a test suite, a CI job).

Each mindio-run agent starts its own fork server (mindio/launch/_zygote.py), which imports torch,
torch._dynamo and megatron-core once for the node's workers: ~2.9 CPU-s per launch on the CI machine.
A job pays it once; a suite that launches hundreds of short jobs pays it hundreds of times. With
``MINDIO_FORK_SERVER_HOST=PATH`` an agent asks the host listening at ``PATH`` for its fork server: the
host forks it from an interpreter that has imported those already, and from then on it is the fork
server the agent would have started -- the same code (``_zygote.main``), protocol, preload (the rest of
it: the script's own cheap imports) and children -- with the agent's environment, working directory,
umask, CPU affinity, stdout and stderr. Start one with ``python -m mindio.launch._zygote_host PATH``
(PATH's directory must be the caller's and private: 0700); it prints ``ready`` once it listens and
lives until its parent ends.

Structure: the host imports torch and torch.distributed, then keeps one **branch** per set of heavy
imports a script wants (torch._dynamo or not, megatron-core or not: ``_bootstrap.preload_plan``), each a
fork of the host that imported that set; a request goes to its branch, which forks the fork server.

Protocol (SOCK_SEQPACKET: one message per request, JSON with ``"v": 1``):

agent -> host    ``{"zygote": {"target", "env", "cwd", "umask", "affinity", "executable", "ns"}}`` with
                 three fds: the fork server's end of the agent's socketpair, its stdout, its stderr.
host -> agent    ``{"pid": N}`` with a pidfd of the fork server N (the agent signals and watches it
                 through it), or ``{"refused": why}``: the agent starts its own fork server.
host -> agent    ``{"exit": N, "code": C}``: the fork server ended (C as ``Popen.returncode``).
agent closes     the agent is done with it (or died): a fork server still running is SIGKILLed, its
                 workers with it (PR_SET_PDEATHSIG), as when a fork server's agent dies.

Refused, so that a hosted fork server is never different from one the agent would start: another user
(SO_PEERCRED), another interpreter, other namespaces (a network namespace, ...), or a different value of
any variable read at import time (:data:`IMPORT_TIME_ENV`: ``PYTHON*``, ``TORCH*``, ``OMP_*``, ...).
"""
from __future__ import annotations

import gc
import json
import os
import select
import selectors
import signal
import socket
import stat
import subprocess
import sys

from .. import _secure
from . import _bootstrap

VERSION = 1
# environment variables that can change what an import does: the host's must equal the agent's
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "LD_", "MALLOC",
                   "CUDA", "HIP_", "ROCM", "NVTE_", "NVIDIA", "MEGATRON", "TRITON", "NCCL", "XLA", "ASCEND")
# ... except these: read when used (torch's inductor writes its cache directory into os.environ at first use);
# PYTHONPATH is compared through the sys.path it gives (_moved)
USE_TIME_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TORCHELASTIC_", "PYTHONPATH")
MAX_MESSAGE = 1 << 20


def import_time_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and not k.startswith(USE_TIME_ENV)}


def _path_entries(env) -> list:
    return [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]


def _agent_path(cwd: str, env) -> list:
    """sys.path of ``python -m ...`` started in ``cwd`` with ``env``, from this interpreter's."""
    ours = {os.path.abspath(p) for p in _path_entries(os.environ)}
    rest = [p for p in sys.path[1:] if os.path.abspath(p) not in ours]
    return [cwd, *[os.path.join(cwd, p) for p in _path_entries(env)], *rest]


def _locate(name: str, path: list):
    """Where ``import name`` would load it from with ``path`` as sys.path (nothing is imported)."""
    from importlib.machinery import PathFinder

    try:
        spec = PathFinder.find_spec(name, path)
        for finder in ([] if spec else sys.meta_path):  # editable installs, builtins: not on the path
            if finder is not PathFinder and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, None)
                if spec:
                    break
    except (ImportError, ValueError, OSError):
        return "?"
    return (spec.origin, tuple(spec.submodule_search_locations or ())) if spec else None


def _moved(cwd: str, env) -> str:
    """A module the host or its branches import that the agent's sys.path (its cwd, its PYTHONPATH) would
    load from elsewhere, or ''."""
    theirs = _agent_path(cwd, env)
    for name in sorted({m.partition(".")[0] for m in sys.modules} | {"megatron", "mindio", "numpy"}):
        if name.startswith("_") or name in sys.builtin_module_names:
            continue
        if _locate(name, theirs) != _locate(name, sys.path):
            return name
    return ""


def namespaces() -> dict:
    """This process's namespaces (``/proc/self/ns``), {} where they cannot be read."""
    out = {}
    try:
        for name in sorted(os.listdir("/proc/self/ns")):
            if not name.endswith("_for_children"):
                out[name] = os.readlink(f"/proc/self/ns/{name}")
    except OSError:
        return {}
    return out


def request(target: list, env: dict) -> dict:
    """The agent's request for a fork server of ``target`` (the fork server's argv after its fd)."""
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"v": VERSION, "zygote": {"target": list(map(str, target)), "env": dict(env), "cwd": os.getcwd(),
                                     "umask": _secure.umask(), "affinity": affinity, "executable": sys.executable,
                                     "ns": namespaces()}}


def private_socket(path: str) -> str:
    """Why the host socket at ``path`` must not be used, or '': its directory and it are this user's,
    nobody else may write the directory (0700 or stricter for group/other), and it is a socket."""
    uid = os.geteuid()
    try:
        d = os.stat(os.path.dirname(os.path.abspath(path)))
        s = os.lstat(path)
    except OSError as exc:
        return f"cannot stat it: {exc}"
    if d.st_uid != uid or d.st_mode & 0o077:
        return f"its directory is not private to uid {uid} (owner {d.st_uid}, mode {oct(d.st_mode & 0o777)})"
    if s.st_uid != uid or not stat.S_ISSOCK(s.st_mode):
        return "it is not a socket of this user"
    return ""


def _refused(req: dict) -> str:
    z = req.get("zygote") or {}
    if req.get("v") != VERSION:
        return f"protocol version {req.get('v')!r}, not {VERSION}"
    if z.get("executable") != sys.executable:
        return f"another interpreter ({z.get('executable')} vs {sys.executable})"
    ns = namespaces()
    if not ns or z.get("ns") != ns:
        return "other namespaces (a network namespace, ...) than the host's"
    mine, theirs = import_time_env(os.environ), import_time_env(z.get("env") or {})
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        return f"import-time environment differs from the host's: {', '.join(diff[:5])}"
    moved = _moved(z["cwd"], z.get("env") or {})
    if moved:
        return f"the agent's sys.path (its directory, PYTHONPATH) finds {moved!r} elsewhere than the host did"
    return ""


def _branch_key(z: dict) -> tuple:
    target, is_module, is_program = _bootstrap.parse_target(z["target"])
    if is_program:
        return (False, False)
    path = target if is_module or os.path.isabs(target) else os.path.join(z["cwd"], target)
    dynamo, wanted = _bootstrap.preload_plan(path, is_module, z["env"])
    return (dynamo, _bootstrap.wants_megatron(wanted))


def _become_zygote(z: dict, zsock: int, out: int, err: int) -> None:
    """(fork child of a branch) Take the agent's process context, then run as its fork server."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in (out, err, null):
        if fd > 2:
            os.close(fd)
    os.setsid()  # its own session and process group (the host's are not the job's); its workers join the group
    os.umask(z["umask"])
    os.chdir(z["cwd"])
    if z.get("affinity"):
        os.sched_setaffinity(0, z["affinity"])
    # sys.path as ``python -m mindio.launch._zygote`` started there would have it (finding every module the
    # host imported where the host found it: _refused)
    sys.path[:] = _agent_path(z["cwd"], z["env"])
    os.environ.clear()
    os.environ.update(z["env"])
    from .. import _knobs
    from . import _zygote

    if not _knobs.get("MINDIO_GC_FREEZE"):
        gc.unfreeze()  # as the agent's own fork server would be: nothing frozen (_Branch.warm froze the imports')

    sys.argv = [_zygote.__file__, str(zsock), *z["target"]]
    _zygote.main()


class _Branch:
    """(fork child of the host) One set of heavy imports; forks a fork server for each request."""

    def __init__(self, sock: socket.socket, key: tuple):
        self.sock = sock
        self.key = key
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ)
        self.running: dict = {}  # pidfd -> (pid, conn fd)
        self.conns: dict = {}  # conn fd -> (conn, pidfd while its fork server runs, else None)

    def warm(self) -> None:
        dynamo, megatron = self.key
        if dynamo:
            import torch._dynamo  # noqa: F401
        if megatron:
            try:
                from mindio._lazy_compile import import_megatron_core

                import_megatron_core()
            except Exception:  # not installed: each fork server meets it in its own preload
                pass
        # frozen here, once: each fork server's collection before it forks (_zygote.main, MINDIO_GC_FREEZE) then
        # walks only what its own preload created, not the whole heap of torch's (0.2-0.3 CPU-s each, copy on
        # write of every page that holds an object); a server whose agent turned MINDIO_GC_FREEZE off unfreezes
        gc.collect()
        gc.freeze()

    def serve(self) -> tuple:
        """Fork a fork server for each request; returns only in a fork server (a fork child): its request."""
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.sock:
                    job = self._request()
                    if job is not None:
                        return job
                elif key.fd in self.running:
                    self._reap(key.fd)
                else:
                    self._agent_done(key.fd)

    def _request(self) -> tuple | None:
        msg, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
        if not msg:  # the host is gone
            os._exit(0)
        conn = socket.socket(fileno=fds[0])
        z = json.loads(msg)["zygote"]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.sel.close()
            self.sock.close()
            conn.close()
            for c, pfd in self.conns.values():
                c.close()
                if pfd is not None:
                    os.close(pfd)
            return z, fds[1:]
        for fd in fds[1:]:
            os.close(fd)
        pidfd = os.pidfd_open(pid)  # before any reaping: it is this pid's process
        print(f"mindio fork-server host: fork server {pid} for agent {_secure.peer_uid(conn)[0]} (branch {self.key})",
              file=sys.stderr, flush=True)
        try:
            socket.send_fds(conn, [json.dumps({"v": VERSION, "pid": pid}).encode()], [pidfd])
        except OSError:  # the agent is gone already
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        self.running[pidfd] = (pid, conn.fileno())
        self.conns[conn.fileno()] = (conn, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ)
        self.sel.register(conn, selectors.EVENT_READ)
        return None

    def _reap(self, pidfd: int) -> None:
        pid, cfd = self.running.pop(pidfd)
        self.sel.unregister(pidfd)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        if cfd in self.conns:  # the agent still holds it: tell it the exit code
            conn, _ = self.conns[cfd]
            self.conns[cfd] = (conn, None)
            try:
                conn.send(json.dumps({"v": VERSION, "exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass

    def _agent_done(self, fd: int) -> None:
        """The agent closed its connection (done, or dead): its fork server, if it still runs, goes (SIGKILL:
        its workers die with it), as when a fork server's agent dies."""
        conn, pidfd = self.conns.pop(fd)
        self.sel.unregister(conn)
        if pidfd is not None:
            pid, _ = self.running[pidfd]
            self.running[pidfd] = (pid, None)  # its fd number may be reused by the next connection
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        conn.close()


class _Host:
    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.branches: dict = {}  # key -> socket to the branch

    def _route(self, conn: socket.socket) -> tuple | None:
        """Read a request; answer a refusal, or return ``(branch key, message, fds)``."""
        conn.settimeout(10.0)  # a client that connects and says nothing does not hold the host
        try:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        except OSError:
            return None
        why = ""
        try:
            if _secure.peer_uid(conn)[1] != os.geteuid():
                why = "another user"
            elif len(fds) != 3 or not msg:
                why = "the request must carry 3 fds (socket, stdout, stderr)"
            else:
                req = json.loads(msg)
                why = _refused(req) or ""
                if not why:
                    return _branch_key(req["zygote"]), msg, fds
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = f"bad request: {exc}"
        for fd in fds:
            os.close(fd)
        print(f"mindio fork-server host: refused agent {_secure.peer_uid(conn)[0]}: {why}", file=sys.stderr, flush=True)
        try:
            conn.send(json.dumps({"v": VERSION, "refused": why}).encode())
        except OSError:
            pass
        return None

    def serve(self) -> tuple:
        """Route each request to its branch, forked at its first request; returns only in a branch (a fork
        child): its socket and key."""
        while True:
            conn, _ = self.listener.accept()
            routed = self._route(conn)
            if routed is not None:
                key, msg, fds = routed
                if key not in self.branches:
                    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    if os.fork() == 0:
                        self.listener.close()
                        ours.close()
                        for s in self.branches.values():
                            s.close()
                        for fd in fds:  # the agent's: only its fork server may hold them (else its pipes never end)
                            os.close(fd)
                        conn.close()
                        return theirs, key
                    theirs.close()
                    self.branches[key] = ours
                try:
                    socket.send_fds(self.branches[key], [msg], [conn.fileno(), *fds])
                except OSError:  # the branch is gone: the agent sees its connection close and starts its own
                    self.branches.pop(key).close()
                for fd in fds:
                    os.close(fd)
            conn.close()


def spawn(path: str, stderr, env: dict | None = None, cwd: str | None = None, timeout: float = 120.0):
    """Start a host listening at ``path`` (its directory private) and wait for its ``ready``: the process, or
    None when it did not get ready within ``timeout`` (it is killed; its ``stderr`` says why). It lives until
    it is killed or its parent -- the caller -- ends."""
    p = subprocess.Popen([sys.executable, "-u", "-m", "mindio.launch._zygote_host", path], env=env, cwd=cwd,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr)
    if select.select([p.stdout], [], [], timeout)[0] and p.stdout.readline().strip() == b"ready":
        return p
    p.kill()
    p.wait()
    return None


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m mindio.launch._zygote_host SOCKET_PATH")
    path = sys.argv[1]
    d = os.stat(os.path.dirname(os.path.abspath(path)))
    if d.st_uid != os.geteuid() or d.st_mode & 0o077:
        sys.exit(f"{os.path.dirname(os.path.abspath(path))}: not a private directory of this user (chmod 700)")
    _bootstrap._die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from ._zygote import unsafe_to_fork

    why = unsafe_to_fork()
    if why:
        sys.exit(f"mindio fork-server host: cannot fork: {why}")
    host = _Host(path)
    print("ready", flush=True)
    host_pid = os.getpid()
    sock, key = host.serve()  # returns in a branch only
    _bootstrap._die_with_parent(host_pid)
    branch = _Branch(sock, key)
    branch.warm()
    z, fds = branch.serve()  # returns in a fork server only
    del host, branch
    # here, at the top of the stack: the fork server's (and its workers') exit is Python's own
    _become_zygote(z, *fds)


if __name__ == "__main__":
    main()

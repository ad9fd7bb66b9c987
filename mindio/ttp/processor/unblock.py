"""Release a rank blocked in a gloo collective with a peer that vanished without a TCP reset.

A peer host that loses power, panics or drops off the network sends no FIN or RST: a survivor's
gloo pair waits for bytes that never come, until the process group's timeout (minutes). gloo in torch
2.13 offers no way to fail a pending collective from another thread (``ProcessGroup.abort()`` does not
release it, ``_abort_process_group`` SIGABRTs the process: device.py). What does release it is the
socket: ``shutdown(SHUT_RDWR)`` of the rank's own connections makes gloo's I/O loop read EOF, the
pending operation raises ``Connection closed by peer`` in the main thread, the decorator parks the rank
(a secondary error, policy.secondary_in_incident) and the recovery goes on as after a reset.

Which sockets: the established TCP connections of this process (``/proc/self/net/tcp*`` mapped to
``/proc/self/fd``), except those of the control plane and the stores, found by port: the controller
link's addresses, every TCPStore behind the default group, MASTER_PORT and the launcher agent's store
(MINDIO_AGENT_STORE). Listening sockets are kept. ``shutdown`` acts on the connection, not on a file
descriptor, so it is applied through a duplicate and the owner's descriptor stays valid (gloo closes it
when the group is destroyed). Only called while the main thread is inside torch.distributed during an
incident (processor ``unblock`` action): the groups are destroyed right after anyway.
"""
from __future__ import annotations

import logging
import os
import socket

__all__ = ["protected_ports", "shutdown_connections"]

_log = logging.getLogger("mindio.ttp.unblock")
_ESTABLISHED = "01"


def _port_of(addr: str) -> int | None:
    """The port of ``tcp://host:port`` or ``host:port``; None if there is none."""
    tail = addr.rsplit(":", 1)[-1] if ":" in addr else ""
    return int(tail) if tail.isdigit() else None


def _store_ports() -> set:
    """Ports of the TCPStores behind the default process group (PrefixStore chains unwrapped)."""
    import torch.distributed as dist

    ports: set = set()
    if not dist.is_available() or not dist.is_initialized():
        return ports
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no default store registered: nothing to protect
        return ports
    for _ in range(16):
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.add(port)
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return ports


def protected_ports(link_addrs=()) -> set:
    """Ports whose connections are never shut down: the control plane and the stores."""
    ports = {p for p in (_port_of(a) for a in link_addrs) if p is not None}
    ports |= _store_ports()
    for name in ("MASTER_PORT", "MINDIO_AGENT_STORE", "MINDIO_STATUS_PORT"):
        for value in os.environ.get(name, "").split(","):  # the agents' store: the members of an etcd cluster
            p = int(value) if value.isdigit() else _port_of(value)
            if p:
                ports.add(p)
    return ports


def _socket_fds() -> dict:
    """{socket inode: one fd of this process}."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.setdefault(int(target[8:-1]), int(fd))
    return out


def _connections():
    """(local port, remote port, inode) of every established TCP connection in this network namespace."""
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            p = line.split()
            if len(p) > 9 and p[3] == _ESTABLISHED:
                yield int(p[1].rsplit(":", 1)[1], 16), int(p[2].rsplit(":", 1)[1], 16), int(p[9])


def shutdown_connections(keep_ports: set) -> int:
    """shutdown(SHUT_RDWR) every established TCP connection of this process whose local and remote
    ports are not in ``keep_ports``; returns how many."""
    fds = _socket_fds()
    n = 0
    for local, remote, inode in _connections():
        fd = fds.get(inode)
        if fd is None or local in keep_ports or remote in keep_ports:
            continue
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        try:
            dup.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError as exc:
            _log.debug("shutdown of fd %d (ports %d->%d): %s", fd, local, remote, exc)
        finally:
            dup.close()  # closes the duplicate only
    return n

"""Free TCP ports for a service that another process binds later (a job's store, a controller).

``bind(0)`` hands out a port from the kernel's *ephemeral* range, the range every outgoing connection
takes its local port from. Between the moment such a port is chosen and the moment its real owner binds
it (seconds later, after a launcher and a training script started), any outgoing connection on the
machine -- gloo's full mesh, store clients -- can be given that very port as its local end, and the
owner's bind fails with EADDRINUSE (seen: the controller's ``TTP_PORT`` under torchrun, in a full test
run). :func:`free_port` therefore picks, at random, a port *below* the ephemeral range that nothing is
bound to now; only another caller of this function choosing the same port at the same time can still
collide, and the random choice over ~10k ports makes that rare.
"""
from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_LOWEST = 20000           # below: well-known and registered services are more common
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768      # Linux's default range starts here


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing is bound to now, outside the ephemeral range when there is
    room below it (otherwise whatever ``bind(0)`` gives)."""
    high = _ephemeral_low() - 1
    if high - _LOWEST >= 1000:
        for _ in range(100):
            port = _rng.randint(_LOWEST, high)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

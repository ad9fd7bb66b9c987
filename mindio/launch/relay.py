"""The node agent's relay process (``MINDIO_RELAYS``, on by default under ``--high-availability``).

Each round the agent starts ``python -m mindio.launch.relay``: a process of its own (not a thread of
the agent), so that a stall of the agent (a long store call, a stop signal for the agent's pid alone) does
not stop its ranks' beats, while the agent's death does end it: it dies with its agent
(PR_SET_PDEATHSIG) and leaves when its stdin -- a pipe only the agent holds -- closes. What it carries and
how it authenticates: mindio/ttp/wire/relay.py.

The agent creates the relay's directory (mode 0700) and hands it, the controller's address, this node's
ranks and the job secret over that pipe (one JSON line: never argv, never a store). Workers get the
socket's address as ``MINDIO_RELAY_ADDR``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import types

from .. import _knobs
from . import tmpdirs
from .._secret import secret_key

log = logging.getLogger(__name__)

__all__ = ["RelayProcess", "start"]


class RelayProcess:
    """The agent's handle on its relay process."""

    def __init__(self, secret: str, controller: str, ranks: range, world_size: int, node: int = 0):
        self.dir = tmpdirs.make("mindio-relay-")  # mode 0700: only this user reaches the socket (tmpdirs.py)
        self.address = f"ipc://{self.dir}/s"
        self.proc = subprocess.Popen([sys.executable, "-m", "mindio.launch.relay"], stdin=subprocess.PIPE,
                                     text=True)
        self.proc.stdin.write(json.dumps({"secret": secret, "controller": controller, "dir": self.dir,
                                          "ranks": [ranks.start, ranks.stop], "world_size": world_size,
                                          "node": node}) + "\n")
        self.proc.stdin.flush()
        log.info("relay (pid %d) for ranks %d-%d on %s -> controller %s (MINDIO_RELAYS)", self.proc.pid,
                 ranks.start, ranks.stop - 1, self.address, controller)

    def close(self, timeout: float) -> bool:
        """End the relay (its stdin closes; SIGKILL after ``timeout`` s); whether it ended by itself."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
            ok = True
        except subprocess.TimeoutExpired:
            log.warning("relay pid %d did not end within %.1f s of its stdin closing; killing it", self.proc.pid,
                        timeout)
            self.proc.kill()
            self.proc.wait()
            ok = False
        shutil.rmtree(self.dir, ignore_errors=True)
        return ok


def start(agent, info: dict) -> RelayProcess | None:
    """This node's relay to the round's controller ``info`` ({addr, port}), or None with MINDIO_RELAYS=0."""
    if not _knobs.get("MINDIO_RELAYS"):
        return None
    cfg = agent.cfg
    first = cfg.node_rank * cfg.nproc_per_node
    return RelayProcess(agent.secret, f"tcp://{info['addr']}:{info['port']}", range(first, first + cfg.nproc_per_node),
                        cfg.world_size, cfg.node_rank)


def _wire_only() -> None:
    """Make ``mindio.ttp`` importable without its ``__init__``: that re-exports the whole API and imports
    torch (seconds, at a round's start); the relay needs only mindio.ttp.wire (zmq, msgpack)."""
    if "mindio.ttp" not in sys.modules:
        pkg = types.ModuleType("mindio.ttp")
        pkg.__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ttp")]
        sys.modules["mindio.ttp"] = pkg


def main() -> int:
    from ._bootstrap import _die_with_parent

    _die_with_parent()
    _wire_only()
    from .. import _logging
    from ..ttp.wire.relay import Relay

    conf = json.loads(sys.stdin.readline() or "{}")
    if not conf:
        return 0  # the agent ended before it said anything
    _logging.set_context(rank="relay", node=conf.get("node", "-"))  # its lines: [node/relay]
    _logging.setup()
    lo, hi = conf["ranks"]
    relay = Relay(secret_key(conf["secret"]), conf["controller"], lambda: range(lo, hi), conf["world_size"],
                  dir=conf["dir"])
    relay.start()
    sys.stdin.read()  # until the agent closes the pipe (or dies)
    relay.close(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ha.py, switch.py, elastic.py and preempt.py may use of the node's agent: :class:`WorkerView`.

The agent (agent.py) runs the rounds and owns the worker processes; high availability (ha.py: the
hosted controller, deaths, replacement orders, takeovers), the hot switch's backups (switch.py),
elastic standbys (elastic.py) and a preemption (preempt.py) act on those workers through this narrow,
explicit surface -- never the agent's private state. agent.py imports them; none of them imports agent.py.
"""
from __future__ import annotations

import subprocess
import threading
from typing import Protocol

__all__ = ["WorkerView"]


class WorkerView(Protocol):
    """The node's agent as the launcher's high-availability parts see it (agent.Agent implements it)."""

    cfg: object                      # LaunchConfig; a standby's takeover replaces it (node rank)
    secret: str                      # the job secret (secret.py): the hosted controller signs with it
    taken_over: dict                 # node given to a standby -> that node's last beat before (ha.py)
    lost_now: list                   # nodes lost in this round, not taken over (node 0)
    late_ranks: set                  # ranks that failed after their training finished (ha.py)
    removed: frozenset               # ranks the controller removed by a downgrade (elastic.py)
    removed_published: tuple         # the removed ranks node 0 last published (elastic.py)
    hosted_code: "int | None"        # the exit code the hosted controller ended the job with
    switch_backups: dict             # rank -> (gen, Popen) of a hot-switch backup not released (switch.py)
    takeover_kind: str               # how a standby took its node: "recover" or "elastic"

    @property
    def store(self):  # the agents' TCPStore (node 0's)
        ...

    @property
    def lock(self) -> threading.Lock:  # guards workers (the controller's driver thread replaces ranks)
        ...

    @property
    def workers(self) -> dict:  # global rank -> its worker process
        ...

    @property
    def replacements(self) -> set:  # worker processes started as replacements
        ...

    @property
    def hosted(self):  # node 0's ha.HostedController of this round, else None
        ...

    @property
    def current_round(self) -> int:
        ...

    @property
    def stopping(self) -> bool:  # a signal stopped the agent
        ...

    @property
    def clock(self):  # the main loop's time less its own stalls (liveness.StallClock)
        ...

    def spawn(self, local_rank: int, extra: dict | None = None, replacement: bool = False) -> subprocess.Popen:
        ...

    def replace_local(self, ranks, gen: int, reboot_type: str = "arf") -> None:
        ...

    def record_failures(self, rnd: int, codes: dict) -> None:
        ...

    def add_failure(self, failure) -> None:  # a failure learned of for a lost node (ha.py), for the summary
        ...

    def lost_nodes(self) -> list:  # other nodes whose agent stopped beating
        ...

    def beat(self) -> None:  # write this agent's beat now
        ...

    def request_refill(self) -> None:  # a warm spare was taken: start another (from the main loop)
        ...

    def refill_spares(self) -> None:  # (main loop) start the spares requested since the last call
        ...

    def stop(self, signum: int) -> None:  # stop the agent as a signal would (preempt.py: past its bound)
        ...

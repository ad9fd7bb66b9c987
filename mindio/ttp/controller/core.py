"""What the controller's parts share, given to each part instead of the controller (issue 34).

:class:`Core` holds the collaborators of the parts (incident.py, pause.py, retry.py, stopround.py,
recover.py, hotswitch.py, elastic_flow.py, dump.py, sequence.py, watch.py) and of the strategies:

* the job's configuration: ``world_size``, ``interval``, ``misses``, ``action_limit``, ``hang_timeout``,
  ``hang_fixed``, ``enabled`` (the controller's strategies), ``strategies`` (Controller.STRATEGIES);
* the shared state and its lock: ``ranks`` (ranks.RankTable), ``lock`` / ``cond``, ``sm`` (states.py),
  ``stop`` (the controller is closing), ``final`` (the job ended), and the job's scalars the parts
  change: ``gen``, ``active``, ``registered``, ``exit_code``, ``last_decision``, ``mindx`` (the cluster
  brain's callbacks), ``provisional_dump`` / ``provisional_renamed``, ``takeover_quorum``,
  ``held_reports``, ``drained_at``;
* ports: ``actions`` / ``call`` (actions.ActionEngine: send an action to ranks and wait for their
  replies), ``send`` (queue one message for a rank), and the I/O thread's ``ack_register``,
  ``take_over``, ``primary_link`` and ``sessions`` (set by the controller);
* the brain (brain.Brain, built on first use) and the facts every decision reads
  (:meth:`job_strategies`, :meth:`uce_refused`, :meth:`implemented_strategies`);
* the peer parts, filled in by the controller once each is built (``incidents``, ``pause``,
  ``liveness``, ``stop_round``, ``replacements``, ``hot_switch``, ``elastic``).

The controller (controller.py) builds one Core, hands it to each part, and reads and writes the same
objects (its public attributes ``gen``, ``exit_code``, ``action_limit``, ... are the Core's). No part
holds the controller (tests/unit/test_parts.py).
"""
from __future__ import annotations

import threading
import time

from . import policy
from .brain import Brain
from .ranks import RankTable
from .states import StateMachine

__all__ = ["Core", "SHARED"]

# the controller's attributes that are the Core's (controller.py delegates them): {controller name: core name}
SHARED = {"gen": "gen", "active": "active", "exit_code": "exit_code", "last_decision": "last_decision",
          "mindx": "mindx", "provisional_dump": "provisional_dump", "provisional_renamed": "provisional_renamed",
          "takeover_quorum": "takeover_quorum", "action_limit": "action_limit", "interval": "interval",
          "misses": "misses", "hang_timeout": "hang_timeout", "hang_fixed": "hang_fixed",
          "world_size": "world_size", "enabled": "enabled", "_registered": "registered",
          "_held_reports": "held_reports", "_drained_at": "drained_at"}


class Core:
    """The collaborators of the controller's parts (module docstring)."""

    def __init__(self, world_size: int, enabled, strategies: dict, *, interval: float, misses: int,
                 action_limit: float, hang_timeout: float, hang_fixed: bool, active: bool):
        self.world_size, self.enabled, self.strategies = world_size, set(enabled), strategies
        self.interval, self.misses, self.action_limit = interval, misses, action_limit
        self.hang_timeout, self.hang_fixed = hang_timeout, hang_fixed
        self.ranks = RankTable(capacity=world_size)  # {rank: RankRecord} over numpy columns (ranks.py)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.sm = StateMachine()
        self.stop = threading.Event()  # the controller is closing
        self.final = threading.Event()  # the job ended (exit order given and awaited)
        self.clock = time.monotonic
        # the job's state the parts change
        self.gen = 0  # the generation of the job's process groups (a recovery's rebuild makes the next)
        self.active = active  # a passive backup is not
        self.registered = 0  # ranks registered now (a counter, not a scan)
        self.exit_code: int | None = None
        self.last_decision: dict = {}
        self.mindx: dict = {}  # the cluster brain's callbacks (tft_register_mindx_callback)
        self.provisional_dump = ""  # a backup that cannot rule out a partition: its dumps' subdirectory (dump.py)
        self.provisional_renamed = False
        self.takeover_quorum: int | None = None  # a backup: registered ranks it takes over with (None: > half)
        self.held_reports: list = []  # reports received while a passive backup (controller._take_over)
        self.drained_at = time.monotonic()  # when the I/O thread last drained its socket (watch.py)
        self._brain: Brain | None = None
        # ports, set by the controller
        self.actions = self.call = self.send = None
        self.ack_register = self.take_over = self.primary_link = self.sessions = None
        # the peer parts, set by the controller once built
        self.incidents = self.pause = self.liveness = self.stop_round = None
        self.replacements = self.hot_switch = self.elastic = None

    def use_actions(self, engine) -> None:
        """The action engine (actions.ActionEngine): ``call`` sends an action and awaits the replies."""
        self.actions, self.call = engine, engine.call

    @property
    def brain(self) -> Brain:
        """The cluster brain (brain.py): table from MINDIO_FAULT_TABLE or the default, unless assigned."""
        if self._brain is None:
            self._brain = Brain()
        return self._brain

    @brain.setter
    def brain(self, value: Brain) -> None:
        self._brain = value

    def implemented_strategies(self) -> tuple:
        """Strategies (policy names) the controller can run, in fallback order: those policy.py knows
        that are in its ``strategies`` table (strategy.py)."""
        return tuple(s for s in policy.STRATEGY_ORDER if s in self.strategies)

    def job_strategies(self) -> set:
        """The strategies the job asked for: the controller's list and what its processors registered
        with (policy.strategies_of)."""
        return self.enabled | self.ranks_ask()

    def ranks_ask(self) -> set:
        with self.lock:
            return self.ranks.strategies_asked()  # policy.strategies_of over the registered ranks' features

    def uce_refused(self) -> list:
        """Live ranks whose processor registered with ``enable_uce=False``."""
        with self.lock:
            alive = self.ranks.col["alive"]
            return sorted(r.rank for r in self.ranks.values() if not r.features.get("uce", True) and alive[r.rank])

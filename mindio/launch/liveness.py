"""Liveness of the launch agents, robust to a stall of a few seconds of any one process.

* Every agent beats (``agent/<node>/beat`` in node 0's store, every monitor interval) from a thread of
  its own with its own store client (:class:`Beater`): a main loop busy starting workers, waiting on the
  store or probing another node does not stop its beats.
* An agent judges another node's beats by what it observed itself (:class:`BeatWatch`): a node is lost
  when its beat *value* did not change for ``node_lost_after`` seconds of this agent's own running time
  (:class:`StallClock`). Time in which the observer itself did not run -- its process was stopped or
  starved, or it was blocked on a store whose host (node 0) was stalled -- is not counted: after such a
  stall every node gets its full timeout again. No comparison of wall clocks across hosts.

CI 2026-11-21 (tests/recovery/test_recover_megatron.py, recover): every process of the job stalled
~4.7 s during the repair; on resume node 0 read the standby's beat, 4.7 s old by the wall clock, and
declared the standby's just started ranks dead.
"""
from __future__ import annotations

import logging
import threading
import time

from .. import _logging

log = logging.getLogger(__name__)

__all__ = ["StallClock", "BeatWatch", "Beater"]


class StallClock:
    """Monotonic seconds minus the time its owner was not running. The owner calls :meth:`now` once per
    turn of its loop; a turn normally follows the last within ``slack`` s, and the excess of a longer
    gap is skipped (not counted)."""

    def __init__(self, slack: float, name: str = "agent"):
        self.slack, self.name = slack, name
        self.skipped = 0.0
        self._last: float | None = None

    def now(self) -> float:
        t = time.monotonic()
        if self._last is not None and t - self._last > self.slack:
            gap = t - self._last
            self.skipped += gap - self.slack
            log.log(logging.WARNING if gap > 2 * self.slack else logging.INFO,
                    "%s loop did not run for %.1f s (process stalled, or blocked on the store?); beats "
                    "missed in that time are not counted", self.name, gap)
            _logging.event("agent_stalled", stall_s=round(gap, 3), who=self.name)
        self._last = t
        return t - self.skipped


class BeatWatch:
    """Which nodes stopped beating: a beat value unchanged for ``after`` s of :class:`StallClock` time."""

    def __init__(self, after: float, slack: float):
        self.after = after
        self.clock = StallClock(slack, "agent monitor")
        self._seen: dict[int, tuple[bytes, float]] = {}  # node -> (its beat value, since when unchanged)

    def lost(self, beats: dict) -> list[int]:
        """``beats``: {node: its beat value now}. Returns the nodes whose value has not changed for
        ``after`` s (a node seen for the first time starts its count now)."""
        now = self.clock.now()
        out = []
        for node, value in beats.items():
            old = self._seen.get(node)
            if old is None or old[0] != value:
                self._seen[node] = (value, now)
            elif now - old[1] > self.after:
                out.append(node)
        return sorted(out)


class Beater(threading.Thread):
    """Writes the agent's beat every monitor interval through a store client of its own, while the
    agent is not a waiting standby (a standby beats as the node it took, from its takeover on)."""

    def __init__(self, agent):
        super().__init__(name="mindio-agent-beat", daemon=True)
        self.agent = agent
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        from . import stores

        store = None
        while not self._stop.is_set():
            cfg = self.agent.cfg
            try:
                if store is None:
                    store = stores.client(cfg, max(cfg.node_lost_after, 10.0))
                if not cfg.standby:
                    store.set(f"agent/{cfg.node_rank}/beat", repr(time.time()))
                lead = self.agent.leader
                if lead is not None and not lead.refresh(store):  # etcd: the controller's leader key
                    self.agent.lose_leadership()
            except Exception as exc:  # node 0's store is gone (the job ended) or stalled past the timeout
                if self._stop.is_set():
                    return
                log.info("agent beat: store unreachable (%s); retrying", exc)
                store = None
            self._stop.wait(cfg.monitor_interval)

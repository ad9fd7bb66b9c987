"""Preemption in the launcher: a stop signal to ``mindio-run`` becomes a last-words checkpoint.

Schedulers preempt with SIGTERM, then SIGKILL after a grace period (Kubernetes'
``terminationGracePeriodSeconds`` and Slurm's ``KillWait`` are 30 s by default). torchrun's agent turns
SIGTERM into a ``SignalException`` and forwards the signal to its workers (SIGKILL 30 s later); here a
signal of ``--preempt-signal`` (``MINDIO_PREEMPT_SIGNAL``, default SIGTERM) that comes while workers
run is first turned into a dump request:

1. the signal handler only notes it (:meth:`Preemption.on_signal`); the agent's main loop
   (:meth:`Preemption.tick`) asks for
   the checkpoint: node 0's agent, when it hosts the controller (``--high-availability``), asks it
   directly; an agent without one forwards the signal to its workers, whose processors ask their
   controller (mindio.ttp.processor.preempt) -- rank 0's, as under torchrun;
2. the controller stops every rank at its current step, the ranks that hold each shard save it, one
   renames it "latest", and every worker exits with 75 (EXIT_CODE_DUMPED);
3. the agent reports "a last-words checkpoint was written after: preemption (...)" and exits with 75,
   without restarting the workers (``--max-restarts`` is for faults; a preempted node goes away).
   Every agent does the same: the first preempted one posts ``round/<n>/preempt`` (why) in node 0's
   agent store, so an agent that got no signal does not restart its workers either.

Bound: if the workers have not ended ``--preempt-timeout`` s (``MINDIO_PREEMPT_TIMEOUT``, 20) after the
signal, the agent stops them as for any other signal: the signal again, SIGKILL ``--shutdown-timeout``
s (3) later. 20 + 3 s leaves the agent's own exit well inside a 30 s grace period. A second
preemption signal within the bound changes nothing; any other handled signal (SIGINT: Ctrl-C) stops
the agent at once, as before. A worker killed by its preemption signal's forwarding (a script whose
processor has not started yet: nothing to checkpoint) ends the round as any signal would.
"""
from __future__ import annotations

import logging
import signal
import sys
import time

from .. import _logging

log = logging.getLogger(__name__)

__all__ = ["Preemption"]


class Preemption:
    """One agent's preemption: its signal and when it came (``signum`` None: none), whether the
    checkpoint was asked for. The agent holds one and hands itself as a :class:`~mindio.launch.view.
    WorkerView` (its cfg, store, lock, workers, hosted controller, stopping, stop)."""

    def __init__(self):
        self.signum: int | None = None
        self.t0 = 0.0
        self.asked = False

    def on_signal(self, agent, signum: int) -> bool:
        """(the agent's signal handler) Whether ``signum`` is taken as a preemption: then it is only
        noted, for :meth:`tick`. Not while the agent stops already, nor while no worker runs (nothing to
        save)."""
        if agent.stopping or signal.Signals(signum).name not in agent.cfg.preempt_signals:
            return False
        if self.signum is not None:
            return True  # asked already; the bound covers it
        if not agent.workers:
            return False
        self.signum, self.t0 = signum, time.monotonic()
        return True

    def tick(self, agent, rnd: int) -> None:
        """(agent main loop, while a round runs) Ask for the checkpoint once; past the bound, stop."""
        if self.signum is None:
            return
        name, cfg = signal.Signals(self.signum).name, agent.cfg
        if not self.asked:
            self.asked = True
            why = f"{name} to node {cfg.node_rank}'s mindio-run"
            print(f"mindio-run: {name}: preemption; asking for a last-words checkpoint at the current step (the "
                  f"workers then exit with 75; bound {cfg.preempt_timeout:g} s, --preempt-timeout)",
                  file=sys.stderr)
            _logging.event("preempt", signal=name, node=cfg.node_rank, round=rnd)
            try:
                agent.store.compare_set(f"round/{rnd}/preempt", "", why)
            except Exception as exc:  # node 0's store is gone: this agent still knows
                log.info("could not post the preemption: %s", exc)
            if agent.hosted is not None:
                agent.hosted.ctl.request_dump(why)
            else:  # each worker's processor asks its controller (mindio.ttp.processor.preempt)
                with agent.lock:
                    live = [p for p in agent.workers.values() if p.poll() is None]
                for p in live:
                    p.send_signal(self.signum)
        elif time.monotonic() - self.t0 > cfg.preempt_timeout:
            print(f"mindio-run: {name} {time.monotonic() - self.t0:.0f} s ago and the workers have not ended with "
                  f"a last-words checkpoint (--preempt-timeout / MINDIO_PREEMPT_TIMEOUT {cfg.preempt_timeout:g} "
                  f"s): stopping them", file=sys.stderr)
            _logging.event("preempt_timeout", signal=name, node=cfg.node_rank, round=rnd)
            agent.stop(self.signum)

    def reason(self, agent, rnd: int) -> str | None:
        """Why round ``rnd`` ended in a preemption (this agent's signal, or another agent's post), else
        None."""
        if self.signum is not None:
            return f"preemption ({signal.Signals(self.signum).name} to node {agent.cfg.node_rank}'s mindio-run)"
        try:
            key = f"round/{rnd}/preempt"
            if agent.store is not None and agent.store.check([key]):
                return f"preemption ({agent.store.get(key).decode()})"
        except Exception:  # node 0's store is gone: no other agent's word
            pass
        return None

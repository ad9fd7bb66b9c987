"""Controller side: what a recovery strategy is -- an object the incident flow (incident.py) runs
after the stop round and the decision, found in ``Controller.STRATEGIES`` (controller.py).

* :class:`Context` -- the incident as a strategy sees it: lock step, the ranks' views, the primary
  reports, the dump plan, when it began, whether it is a requested (graceful) dump;
* :class:`Outcome` -- what a strategy's ``run`` returns: RESUMED (every rank trains again), ENDED (the
  job ended: dump + exit) or FAILED (fall back to the next strategy of the incident's order);
* :class:`Strategy` -- ``name``, ``run(core, ctx)``, and for a strategy that ``policy.py`` does not know
  (one added by a new file) ``feasible(core, enabled, facts)`` and ``before`` (the strategy it is tried
  before in the fallback order).

The steps themselves go through a :class:`mindio.ttp.controller.sequence.Sequence` (logging, events, timings,
abandon, resume and the cluster brain's report written once). Adding a strategy: one new file with a
subclass, one line in ``Controller.STRATEGIES`` (docs/architecture.md, "Adding a strategy").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import policy
from ...vocab import Outcome  # the vocabulary (mindio/vocab.py)

__all__ = ["Outcome", "Context", "Strategy"]


@dataclass
class Context:
    """The incident at decision time (the driver thread's; a failed strategy may re-plan the dump)."""
    lock: int                                   # the lock step (policy.choose_lock_step)
    views: list                                 # policy.RankView of every rank of the job
    primary: dict = field(default_factory=dict)  # rank -> ReportState of its primary report
    plan: policy.DumpPlan | None = None         # who saves which shard at the lock step
    t0: float = 0.0                             # time.monotonic() when the incident opened
    graceful: bool = False                      # a requested dump (no fault)

    def replan_dump(self, dead_now) -> None:
        """After a failed strategy: ranks of ``dead_now`` may have died meanwhile; plan the dump again."""
        self.views = [v if v.rank not in dead_now else v._replace(alive=False, faulty=True) for v in self.views]
        self.plan = policy.plan_dump(self.views, self.lock)


class Strategy:
    """One recovery strategy. Subclasses set ``name`` and implement :meth:`run`."""

    name: str = ""
    before: str = "dump"  # a strategy policy.py does not know is tried right before this one (or "exit")

    def feasible(self, core, enabled: set, facts: policy.Incident) -> bool:
        """For a strategy policy.feasible_strategies does not know: may it run for this incident?
        ``enabled``: the job's strategies; ``facts``: what the decision knows (policy.Incident)."""
        return self.name in enabled

    def run(self, core, ctx: Context) -> Outcome:
        raise NotImplementedError

    def fall_back(self, core, ctx: Context) -> Outcome:
        """A step failed: a rank may have died meanwhile, so the dump is planned again; FAILED."""
        with core.lock:
            dead_now = set(core.ranks.dead())
        ctx.replan_dump(dead_now)
        return Outcome.FAILED

"""Controller side of the strategies that replace processes: recover-in-place and recover (MindIO ARF).

recover-in-place: a rank's process died; its launcher agent starts ONLY that rank again (a warm spare
interpreter takes it). recover: a whole node (all ranks of one agent) is gone; a ``--standby`` agent
takes the node's ranks. The survivors never restart. Both need a *replacer* -- the launcher agent that
hosts this controller (mindio.launch.agent, :meth:`Replacements.attach`); without one (plain
torchrun) neither is feasible and the incident falls back to dump / exit as before.

Every live rank is already stopped (parked in the decorator, released from gloo by the peer's death)
when this starts. Sequence, each step bounded (MINDIO_RECOVER_TIMEOUT, TTP_NORMAL_ACTION_TIME_LIMIT)::

    ABNORMAL -RECOVER-> ENV_CLEAR
      clean       survivors: groups destroyed, references dropped (inplace.py)
      replace     generation g+1; the replacer starts the dead ranks with MINDIO_REBOOT_GEN=g+1
                  (reboot.py: the new process joins the world on store prefix mindio/gen<g+1>/)
      rebuild     survivors: new default group + framework subgroups (``same_layout``: a framework may
                  keep its objects, inplace.rebuild); completes together with the replacement's own
                  init_process_group / subgroup creation and its build
      register    the replacement registers carrying generation g+1 (older generations are refused)
      prerepair   the replacement built its model/optimizer and parked before train()
    ENV_CLEAR -OK-> REPAIR
      repair      replica RT_SEND -> replacement RT_RECV_REPAIR (optimizer shard + scalar state); a
                  survivor stopped at another step than the lock step receives RT_UCE_* (retry.py)
      rollback    every rank back to the lock step
    REPAIR -OK-> NORMAL
      retry       every rank (re-)enters train()

Any step that fails, times out, or loses a rank (a second fault during recovery: the agent reports the
death at once) goes -FAIL-> ABNORMAL: the survivors' half-built groups are destroyed (``clean``) and the
caller falls back (dump with the ranks still alive, then exit) with a log line naming the step.
"""
from __future__ import annotations

import logging
import time

from ... import _logging, vocab
from . import policy
from ..wire import protocol as P
from .._enums import ActionName, RepairType, ReportState
from .retry import uce_repair_type
from .sequence import Sequence
from .states import Result, State
from .strategy import Context, Outcome, Strategy

__all__ = ["Replacements", "Replace", "REPLACING"]

_log = logging.getLogger("mindio.ttp.recover")
REPLACING = vocab.REPLACING


class Replacements:
    """The controller's side of process replacement (``Controller.replacements``): the launcher's
    replacer, which ranks were replaced in which generation (their old processes' frames are refused),
    the replacements that died during a recovery, and the wait for the new processes to register."""

    def __init__(self, core):
        self.core = core
        self.replacer = None       # launcher side: replace(ranks, gen, strategy) / possible(ranks, strategy)
        self.timeout = 60.0        # seconds for a replacement to join, build and park
        self.stale_refused = 0
        self.replaced: dict[int, int] = {}  # rank -> generation a recovery replaced its process in
        self.dead: set[int] = set()         # replacements that died during the recovery in flight

    def attach(self, replacer, timeout: float | None = None) -> None:
        """(launcher agent) Enable recover-in-place / recover: ``replacer.replace(ranks, gen, strategy)``
        starts new processes for ``ranks``; ``replacer.possible(ranks, strategy)`` says if it can."""
        self.replacer = replacer
        if timeout:
            self.timeout = timeout

    def died(self, rank: int, why: str) -> None:
        """(launcher, any thread) The process started to replace ``rank`` exited: the recovery step in
        flight fails now instead of at its deadline (survivors waiting in the rebuild are cleaned)."""
        core = self.core
        core.liveness.declare_dead([rank], "agent", reason=why)
        if core.sm.state not in (State.ENV_CLEAR, State.REPAIR):
            return  # no recovery in flight: an ordinary death (the incident above handles it)
        _log.error("replacement process of rank %d %s: the recovery fails", rank, why)
        _logging.event("replacement_died", dead_rank=rank, reason=why)
        with core.cond:
            self.dead.add(rank)
            core.actions.fail_pending()
            core.cond.notify_all()

    def possible(self, strategy: str, dead) -> bool:
        if self.replacer is None or not dead:
            return False
        try:
            return bool(self.replacer.possible(sorted(dead), strategy))
        except Exception:
            _log.exception("replacer.possible failed")
            return False

    def refuse_stale(self, env: P.Envelope) -> bool:
        """(I/O thread) True (drop the frame) when ``env`` comes from a rank whose process was replaced
        in a newer generation than the one the frame carries: an old process must never rejoin or be
        answered."""
        if not self.replaced:
            return False
        g = self.replaced.get(env.rank)
        if g is None or env.gen >= g:
            return False
        self.stale_refused += 1
        if self.stale_refused <= 16 or self.stale_refused % 1000 == 0:
            _log.error("refused %s from rank %d of generation %d: that rank was replaced in generation %d "
                       "(%d stale frames refused so far)", env.type.name, env.rank, env.gen, g,
                       self.stale_refused)
            _logging.event("stale_refused", from_rank=env.rank, msg=env.type.name, frame_gen=env.gen,
                           replaced_gen=g, count=self.stale_refused)
        return True

    def wait_registered(self, ranks: list, gen: int, deadline: float) -> bool:
        """(driver thread) Block until every rank in ``ranks`` registered in generation >= ``gen`` and is
        alive."""
        core = self.core
        with core.cond:
            while True:
                ok = [r for r in ranks if core.ranks.get(r) is not None and core.ranks[r].alive
                      and core.ranks[r].gen >= gen]
                if len(ok) == len(ranks):
                    return True
                now = time.monotonic()
                if self.dead:
                    return False
                if now >= deadline or core.stop.is_set():
                    _log.error("recover: replacement rank(s) %s did not register in generation %d within "
                               "%.0f s", sorted(set(ranks) - set(ok)), gen, self.timeout)
                    return False
                core.cond.wait(min(0.05, deadline - now))

class Replace(Strategy):
    """recover-in-place / recover (module docstring): new processes for the dead ranks, from the
    launcher's replacer; the hot switch (hotswitch.py) runs the same sequence as ``Replace("hot switch")``."""

    def __init__(self, name: str):
        self.name = str(name)

    def run(self, core, ctx: Context) -> Outcome:
        with core.lock:
            dead = core.ranks.dead()
        dead += sorted(set(range(core.world_size)) - set(core.ranks))
        if not core.replacements.possible(self.name, dead):
            why = ("no launcher agent hosts this controller (run under mindio-run with --high-availability)"
                   if core.replacements.replacer is None else f"the launcher cannot replace ranks {dead[:16]} this way")
            _log.error("%s not possible: %s", self.name, why)
            return Outcome.FAILED
        return Outcome.RESUMED if self.steps(core, ctx.lock, ctx.views, ctx.t0) else self.fall_back(core, ctx)

    def steps(self, core, lock: int, views: list, t_incident: float) -> bool:
        """Run the sequence of the module docstring; True when every rank trains again."""
        strategy, rep = self.name, core.replacements
        seq = Sequence(core, strategy, t_incident, label="recover", lost=lambda: rep.dead)
        core.sm.fire(Result.RECOVER, lock_step=lock, strategy=strategy)
        with core.lock:
            dead, survivors = core.ranks.dead(), core.ranks.live()
        dead += sorted(set(range(core.world_size)) - set(core.ranks))
        if not dead:
            _log.error("recover: no rank is dead")
            return seq.fail("lock step")
        # survivors the stop caught at another step than the lock step (policy.choose_lock_step) or
        # mid-update: repaired from replicas like a UCE rank (retry.py), next to the replacements
        stale = policy.stale_ranks(views, lock, among=survivors)
        if stale:
            _log.warning("recover: survivors %s are not at the lock step %d with complete optimizer state; they "
                         "are repaired from replicas too", stale[:16], lock)
        try:
            sources = policy.select_repair_sources(views, lock, dead + stale)
        except ValueError as exc:
            _log.error("recover: %s", exc)
            return seq.fail("repair plan")
        limit = core.action_limit
        if not seq.step(ActionName.CLEAN, {"timeout": limit}, survivors, watch=survivors, abandon=survivors):
            return False
        core.gen += 1
        gen = core.gen
        rep.dead.clear()
        for r in dead:
            rep.replaced[r] = gen
        try:
            rep.replacer.replace(dead, gen, strategy)
        except Exception as exc:
            _log.error("recover: starting replacement(s) for %s failed: %s", dead, exc)
            return seq.abandon(survivors, "replace")
        seq.mark("replace")
        deadline = time.monotonic() + rep.timeout
        moved = getattr(rep.replacer, "store_moved", "")  # node 0 lost: the job's store moved (launch/takeover.py)
        if not seq.step(ActionName.REBUILD, {"gen": gen, "fault_ranks": dead, "same_layout": True,
                                    **({"store": moved} if moved else {})},
                        survivors, timeout=rep.timeout,
                        watch=survivors, abandon=survivors):
            return False
        if not rep.wait_registered(dead, gen, deadline):
            return seq.abandon(survivors, "register")
        everyone = sorted(survivors + dead)
        if not seq.step(ActionName.PREREPAIR, {"timeout": max(1.0, deadline - time.monotonic())}, dead,
                        timeout=max(1.0, deadline - time.monotonic()) + 2, watch=everyone, abandon=everyone,
                        mark="start"):
            return False
        core.sm.fire(Result.OK, gen=gen)
        status = {v.rank: v.data_status for v in views}
        pairs = [{"type": t, "src": src, "dst": dst} if dst in dead else
                 {"type": t, "src": src, "dst": dst, "repair_type": uce_repair_type(ReportState.RS_NORMAL, status[dst])}
                 for (dst, t), src in sorted(sources.items())]
        involved = sorted({p["src"] for p in pairs} | {p["dst"] for p in pairs})
        _log.warning("recover: repairing %s from replicas %s", sorted(dead + stale),
                     {f"{p['dst']}/{p['type']}": p["src"] for p in pairs[:16]})
        if not seq.step(ActionName.REPAIR, {"step": lock, "error_ranks": sorted(dead + stale), "pairs": pairs,
                                   "dst_type": RepairType.RT_RECV_REPAIR.name}, involved, watch=everyone,
                        abandon=everyone):
            return False
        if not seq.step(ActionName.ROLLBACK, {"step": lock}, everyone, watch=everyone, abandon=everyone):
            return False
        seq.resume(lock, everyone)
        seq.done("every rank trains again", f"replaced {dead}", ({r: 1 for r in dead}, strategy),
                 event="recover_done", strategy=strategy, lock_step=lock, replaced=dead, stale=stale)
        return True

"""Controller side: the dump strategy -- a last-words checkpoint at the lock step, then the exit order.

``save(step, save_info)`` on one usable rank per optimizer shard (policy.select_dump_ranks), then
``rename(step)`` on one of them -- only after every save succeeded, so the checkpoint becomes "latest"
only when complete (a *provisional* dump, ordered by a backup controller that cannot rule out a
partition, ``Controller.provisional_dump``, never does: the processor's rename) -- then ``exit(75)`` to
every live rank (``exit(76)`` when the dump failed). A chosen rank that cannot write (its save answers an error: no trained state to write -- a replacement process or
a UCE rank (mindio.megatron.checkpoint.save_dump refuses) --, a failing disk; or it died meanwhile) is
replaced by the next usable holder of its shards, a replica, and the save runs again by the new set of
writers; only when some shard has no holder left that can write does the dump fail, with a line naming
the shard. A rank that does not answer in time fails the dump as before (it may still be writing). The incident flow runs it as a fallback, and for a requested dump (preemption,
tft_notify_controller_dump); the pause and the hot switch end with it too.
"""
from __future__ import annotations

import logging

from ... import _logging, vocab
from . import policy
from .._enums import ActionName, EXIT_CODE_DUMPED, EXIT_CODE_FAULT, ResultCode
from .states import Result, State
from .strategy import Context, Outcome, Strategy

__all__ = ["Dump", "save", "no_writer", "nothing_to_save"]

_log = logging.getLogger("mindio.ttp.incident")  # the name these lines always logged under


def save(core, lock: int, plan: policy.DumpPlan, views=()) -> bool:
    """Save the lock step's state by ``plan``'s ranks, then rename it "latest"; whether both succeeded.

    ``views`` (policy.RankView of the decision): the other holders of each shard, for a writer whose save
    answered an error (it wrote nothing, or gave up) or that died; without them a failed writer fails the
    dump, as does one that did not answer in time (it may still be writing). Each try excludes at least one
    more rank: bounded by the replica count, each try by the action limit."""
    if lock <= 0:  # (policy.plan_dump plans none; a pause or a hot switch before the first step)
        nothing_to_save(lock)
        return False
    unable: dict = {}  # rank -> why it could not write this dump
    while True:
        _log.warning("dump at step %d by %d ranks %s%s", lock, len(plan.ranks), list(plan.ranks[:16]),
                     " ..." if len(plan.ranks) > 16 else "")
        params = {"step": lock, "save_info": plan.save_info}
        if core.provisional_dump:  # a backup that cannot rule out a partition (mindio/launch/backup.py)
            params["provisional"] = core.provisional_dump
        saved = core.call(ActionName.SAVE, params, plan.ranks, core.action_limit)
        with core.lock:
            dead = set(core.ranks.dead())
        bad = {r: (_why(saved[r].detail) if r in saved else "died" if r in dead else "no reply in time")
               for r in plan.ranks if r not in saved or not saved[r].ok}
        if not bad:
            break
        _log.error("dump failed on %d ranks %s: %s", len(bad), sorted(bad)[:16], dict(list(bad.items())[:16]))
        unable.update(bad)
        slow = sorted(r for r, why in bad.items() if why == "no reply in time")
        if slow:  # its save may still be under way: another writer's pieces must not race with it
            _log.error("dump at step %d failed: ranks %s did not answer the save within %.0f s "
                       "(TTP_NORMAL_ACTION_TIME_LIMIT) and may still be writing, so no other holder writes "
                       "their shards", lock, slow[:16], core.action_limit)
            return False
        if not views:
            return False
        plan = policy.select_dump_ranks(views, lock, unable)
        if not plan.possible:
            no_writer(views, lock, plan.missing, unable)
            return False
        _log.warning("dump at step %d: ranks %s could not write their shards; their replicas write instead "
                     "(new writers %s)", lock, sorted(bad)[:16], list(plan.ranks[:16]))
        _logging.event("dump_replanned", step=lock, unable=sorted(unable)[:64], ranks=list(plan.ranks[:64]))
    params = {"step": lock, "provisional": core.provisional_dump} if core.provisional_dump else {"step": lock}
    renamed = core.call(ActionName.RENAME, params, [plan.ranks[0]], core.action_limit)
    ok = plan.ranks[0] in renamed and renamed[plan.ranks[0]].ok
    if ok and core.provisional_dump:
        core.provisional_renamed = bool(renamed[plan.ranks[0]].detail.get("renamed"))
    return ok


def _why(detail) -> str:
    return str(detail.get("error", detail) if isinstance(detail, dict) else detail)[:300]


def nothing_to_save(lock: int) -> None:
    """The error line of a dump asked for at step ``lock`` <= 0 (policy.plan_dump)."""
    _log.error("dump at step %d impossible: nothing to save -- the state at step 0 is the one this run started "
               "from (its initialisation, or the checkpoint it loaded, which a dump would label step 0); the job "
               "exits with %d; relaunched, it starts again from there", lock, EXIT_CODE_FAULT)
    _logging.event("dump_impossible", step=lock, shards=[], unable={}, why="nothing to save at step 0")


def no_writer(views, lock: int, missing, unable: dict | None = None) -> None:
    """One error line per shard of ``missing`` that no rank can write (at most 16), naming its holders and
    why each cannot (``unable``: the ranks whose save failed, and why)."""
    unable = unable or {}
    memo: dict = {}
    holders: dict = {}
    for v in views:
        for key in policy.shards_of(v, memo):
            holders.setdefault(key, []).append(v)
    for key in missing[:16]:
        why = {v.rank: unable.get(v.rank) or ("dead" if not v.alive else "faulty" if v.faulty else
                                               f"state of step {v.step}, not {lock}" if v.step != lock else
                                               "state incomplete") for v in holders.get(key, ())}
        _log.error("dump at step %d impossible: no rank can write %s; its holders: %s", lock,
                   policy.describe_shard(key), why)
    _logging.event("dump_impossible", step=lock, shards=[policy.describe_shard(k) for k in missing[:16]],
                   unable={str(r): w for r, w in list(unable.items())[:16]})


class Dump(Strategy):
    name = vocab.Strategy.DUMP.value

    def run(self, core, ctx: Context) -> Outcome:
        if not ctx.graceful and core.sm.state is not State.DUMP:
            core.sm.fire(Result.DUMP, lock_step=ctx.lock)
        ok = save(core, ctx.lock, ctx.plan, ctx.views)
        core.sm.fire(Result.OK if ok else Result.FAIL)
        core.incidents.mindx_call("report_result", int(ResultCode.OK if ok else ResultCode.EXIT_ONLY),
                                 "dump done" if ok else "dump failed", core.incidents.error_ranks(), "dump")
        if ctx.graceful:
            core.incidents.settle()
        core.incidents.exit(EXIT_CODE_DUMPED if ok else EXIT_CODE_FAULT)
        return Outcome.ENDED

"""Controller side: the dump strategy -- a last-words checkpoint at the lock step, then the exit order.

``save(step, save_info)`` on one usable rank per optimizer shard (policy.select_dump_ranks), then
``rename(step)`` on one of them -- only after every save succeeded, so the checkpoint becomes "latest"
only when complete -- then ``exit(75)`` to every live rank (``exit(76)`` when the dump failed). The
incident flow runs it as a fallback, and for a requested dump (preemption, tft_notify_controller_dump);
the pause and the hot switch end with it too.
"""
from __future__ import annotations

import logging

from ... import vocab
from . import policy
from .._enums import EXIT_CODE_DUMPED, EXIT_CODE_FAULT, ResultCode
from .states import Result, State
from .strategy import Context, Outcome, Strategy

__all__ = ["Dump", "save"]

_log = logging.getLogger("mindio.ttp.incident")  # the name these lines always logged under


def save(ctl, lock: int, plan: policy.DumpPlan) -> bool:
    """Save the lock step's state by ``plan``'s ranks, then rename it "latest"; whether both succeeded."""
    _log.warning("dump at step %d by %d ranks %s%s", lock, len(plan.ranks), list(plan.ranks[:16]),
                 " ..." if len(plan.ranks) > 16 else "")
    saved = ctl._call("save", {"step": lock, "save_info": plan.save_info}, plan.ranks, ctl.action_limit)
    bad = [r for r in plan.ranks if r not in saved or not saved[r].ok]
    if bad:
        _log.error("dump failed on %d ranks %s: %s", len(bad), bad[:16],
                   {r: saved[r].detail for r in bad[:16] if r in saved})
        return False
    renamed = ctl._call("rename", {"step": lock}, [plan.ranks[0]], ctl.action_limit)
    return plan.ranks[0] in renamed and renamed[plan.ranks[0]].ok


class Dump(Strategy):
    name = vocab.Strategy.DUMP.value

    def run(self, ctl, ctx: Context) -> Outcome:
        if not ctx.graceful and ctl.sm.state is not State.DUMP:
            ctl.sm.fire(Result.DUMP, lock_step=ctx.lock)
        ok = save(ctl, ctx.lock, ctx.plan)
        ctl.sm.fire(Result.OK if ok else Result.FAIL)
        ctl.incidents.mindx_call("report_result", int(ResultCode.OK if ok else ResultCode.EXIT_ONLY),
                                 "dump done" if ok else "dump failed", ctl.incidents.error_ranks(), "dump")
        if ctx.graceful:
            ctl.incidents.settle()
        ctl.incidents.exit(EXIT_CODE_DUMPED if ok else EXIT_CODE_FAULT)
        return Outcome.ENDED

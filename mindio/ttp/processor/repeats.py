"""A rank's memory of its generic exceptions: one retry, then the dump, then no loop.

A generic exception (policy.classify: no pattern of the reference table or the user's matched) raised
while the optimizer update window is closed -- in forward, backward, data loading or the loss -- left the
model state intact: the decorator reports it as RS_RETRY, and the controller retries the step (retry.py:
clean, rebuild, rollback of the step's partial work, resume). A deterministic bug would raise it again
at the same step, so :meth:`Repeats.judge` keeps what it let through:

1. the first time, at step S, with message M: RS_RETRY (the step runs again);
2. the same M at the same S again in this process: RS_UNKNOWN -- the next strategy (dump: exit 75);
3. a generic exception that is not retried (a repeat, one inside the update window, one before this
   process finished a step) is remembered in a private file, ``<runtime dir>/mindio-faults-<uid>/
   <run id>@<job store>.rank<R>.json``, as the one the dump follows;
4. a relaunch of the same job (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT`` > 0) that meets
   the same M at the same S on this rank: RS_REPEATED, and the message names the step and the rank.
   The controller then ends the job with EXIT_CODE_REPEATED (79), on which the launcher does not relaunch
   (launch/failures.py): the relaunch would meet it again.

The step is the one being computed: the rank's last completed step + 1; before its first update after a
relaunch, the step of the checkpoint it loaded (``tft_report_load_ckpt_step``; mindio.megatron reports
it) + 1. A first launch (restart count 0) removes this rank's record of an earlier job with the same run
id, and a rank whose ``train()`` returns removes its record. Without a run id (a process not started by
torchrun or mindio-run) nothing is written.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile

from ... import _logging, _secure
from .._enums import ReportState

__all__ = ["Repeats"]

_log = logging.getLogger("mindio.ttp.processor")


def _record_path(rank: int, environ) -> str | None:
    """This rank's record: named by the job's run id and the store its launcher keeps for the whole job
    (mindio-run's agents' store; torchrun's rendezvous), so two jobs of one user on a host, both with the
    default run id, never read each other's."""
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    store = environ.get("MINDIO_AGENT_STORE") or f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"
    base = environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{run_id}@{store}")[:160]
    return os.path.join(base, f"mindio-faults-{os.geteuid()}", f"{safe}.rank{rank}.json")


class Repeats:
    """What one rank retried and what it met before the relaunch (module docstring)."""

    def __init__(self, rank: int, environ=None):
        environ = os.environ if environ is None else environ
        self.rank = rank
        self.retried: set = set()  # (step, message) let through as RS_RETRY in this process
        self.path = _record_path(rank, environ)
        try:
            self.restart = int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        except ValueError:
            self.restart = 0
        self.before = self._load()  # (step, message) the previous launch of this job ended on, or None

    def _load(self):
        if self.path is None or not os.path.exists(self.path):
            return None
        if self.restart == 0:  # a first launch: a record of an earlier job with this run id is stale
            try:
                os.unlink(self.path)
            except OSError:
                pass
            return None
        try:
            fd = _secure.open_private(self.path, os.O_RDONLY)
            with os.fdopen(fd) as f:
                rec = json.load(f)
            if int(rec["restart"]) < self.restart:
                return int(rec["step"]), str(rec["message"])
        except Exception as exc:  # unreadable: this launch goes on without it
            _log.warning("the record of this rank's last exception (%s) could not be read: %s", self.path, exc)
        return None

    def forget(self) -> None:
        """(train() returned) This rank's training finished: its record, if any, is no longer needed."""
        self.before = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _remember(self, step: int, message: str) -> None:
        if self.path is None:
            return
        try:
            _secure.private_dir(os.path.dirname(self.path))
            tmp = f"{self.path}.{os.getpid()}.tmp"
            fd = _secure.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            with os.fdopen(fd, "w") as f:
                json.dump({"rank": self.rank, "step": step, "message": message, "restart": self.restart}, f)
            os.replace(tmp, self.path)
        except Exception as exc:  # a relaunch then retries once more before its own dump
            _log.warning("could not record this rank's exception in %s: %s", self.path, exc)

    def judge(self, state: ReportState, step: int, message: str) -> tuple[ReportState, str]:
        """(main thread) The state to report for a generic exception ``message`` classified ``state``
        (RS_RETRY or RS_UNKNOWN) at ``step``, and the message to report."""
        key = (step, message)
        if key == self.before:
            line = (f"{message} -- rank {self.rank} raised it again at step {step}, as before the relaunch from "
                    f"the last-words checkpoint: a deterministic fault, not retried or dumped again; fix it, "
                    f"then resume from that checkpoint")
            _log.error("%s", line)
            _logging.event("fault_repeated", step=step, message=message[:300], relaunch=self.restart)
            return ReportState.RS_REPEATED, line
        if state is ReportState.RS_RETRY:
            if key not in self.retried:
                self.retried.add(key)
                return state, message
            _log.error("the same exception at step %d again after its retry: %s -- not retried again",
                       step, message[:300])
            _logging.event("retry_repeated", step=step, message=message[:300])
            state = ReportState.RS_UNKNOWN
        self._remember(step, message)
        return state, message

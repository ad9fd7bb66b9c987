"""Controller states and the transition table, as data.

The controller is always in one :class:`State`. Something happens (a :class:`Result`), and the table
``TRANSITIONS[(state, result)]`` names the next state; a pair not in the table raises
:class:`mindio.errors.IllegalTransition`. Each transition writes one log line and one ``transition``
event (``mindio._logging.event``) so a recovery can be replayed as a timeline.

Flows (later issues fill in the ones marked *):

* start:        INIT -ALL_REGISTERED-> NORMAL
* fault:        NORMAL/PAUSE/DOWNGRADE -FAULT-> ABNORMAL, then the chosen strategy:
  dump          ABNORMAL -DUMP-> DUMP -OK/FAIL-> EXIT -OK-> FINAL
  retry*        ABNORMAL -RETRY-> ENV_CLEAR -OK-> REPAIR -OK-> NORMAL
  recover*      ABNORMAL -RECOVER-> ENV_CLEAR (same as retry, with new processes)
  downgrade*    ABNORMAL -DOWNGRADE-> DG_REPAIR -OK-> DOWNGRADE -UPGRADE-> UPGRADE -OK-> NORMAL
  exit          ABNORMAL -EXIT-> EXIT
  A failed step of a strategy goes back to ABNORMAL (-FAIL->) where the next strategy of the fallback
  order is chosen.
* pause:        NORMAL -PAUSE-> PAUSE -CONTINUE-> NORMAL (pause.py); PAUSE -DUMP-> DUMP, PAUSE -EXIT-> EXIT,
                PAUSE -FAULT-> ABNORMAL; PAUSE -MIGRATE-> MIGRATION -RECOVER-> ENV_CLEAR
                (hot switch, hotswitch.py: then as recover)
* step finish*: NORMAL -STEP_FINISH-> STEP_FINISH -OK-> NORMAL
* shutdown:     any state but FINAL -SHUTDOWN-> FINAL
"""
from __future__ import annotations

import logging
import threading
import time

from ... import _logging
from ...errors import IllegalTransition
from ...vocab import Result, State  # the vocabulary (mindio/vocab.py)

__all__ = ["State", "Result", "TRANSITIONS", "StateMachine"]

_log = logging.getLogger("mindio.ttp.states")


S, R = State, Result
TRANSITIONS: dict[tuple[State, Result], State] = {
    (S.INIT, R.ALL_REGISTERED): S.NORMAL,
    (S.INIT, R.FAULT): S.ABNORMAL,
    (S.NORMAL, R.FAULT): S.ABNORMAL,
    (S.NORMAL, R.PAUSE): S.PAUSE,
    (S.NORMAL, R.STEP_FINISH): S.STEP_FINISH,
    (S.NORMAL, R.DUMP): S.DUMP,            # graceful dump on the cluster brain's request
    (S.STEP_FINISH, R.OK): S.NORMAL,
    (S.STEP_FINISH, R.FAULT): S.ABNORMAL,
    (S.PAUSE, R.CONTINUE): S.NORMAL,
    (S.PAUSE, R.MIGRATE): S.MIGRATION,
    (S.MIGRATION, R.RECOVER): S.ENV_CLEAR,  # hot switch: the recover sequence (hotswitch.py)
    (S.PAUSE, R.FAULT): S.ABNORMAL,
    (S.PAUSE, R.DUMP): S.DUMP,
    (S.PAUSE, R.EXIT): S.EXIT,             # the cluster brain ends a paused job
    (S.MIGRATION, R.OK): S.NORMAL,
    (S.MIGRATION, R.FAIL): S.ABNORMAL,
    (S.ABNORMAL, R.RETRY): S.ENV_CLEAR,
    (S.ABNORMAL, R.RECOVER): S.ENV_CLEAR,
    (S.ABNORMAL, R.DOWNGRADE): S.DG_REPAIR,
    (S.ABNORMAL, R.DUMP): S.DUMP,
    (S.ABNORMAL, R.EXIT): S.EXIT,
    (S.ABNORMAL, R.FAULT): S.ABNORMAL,     # another rank failed while deciding: widen the incident
    (S.ENV_CLEAR, R.OK): S.REPAIR,
    (S.ENV_CLEAR, R.FAIL): S.ABNORMAL,
    (S.ENV_CLEAR, R.FAULT): S.ABNORMAL,
    (S.REPAIR, R.OK): S.NORMAL,
    (S.REPAIR, R.FAIL): S.ABNORMAL,
    (S.REPAIR, R.FAULT): S.ABNORMAL,
    (S.DG_REPAIR, R.OK): S.DOWNGRADE,
    (S.DG_REPAIR, R.FAIL): S.ABNORMAL,
    (S.DG_REPAIR, R.FAULT): S.ABNORMAL,
    (S.DOWNGRADE, R.FAULT): S.ABNORMAL,
    (S.DOWNGRADE, R.UPGRADE): S.UPGRADE,
    (S.DOWNGRADE, R.PAUSE): S.PAUSE,
    (S.UPGRADE, R.OK): S.NORMAL,
    (S.UPGRADE, R.FAIL): S.ABNORMAL,
    (S.DUMP, R.OK): S.EXIT,
    (S.DUMP, R.FAIL): S.EXIT,
    (S.DUMP, R.FAULT): S.DUMP,             # a fault during a dump: the dump action decides its outcome
    (S.EXIT, R.OK): S.FINAL,
    (S.EXIT, R.FAULT): S.EXIT,
}
TRANSITIONS.update({(s, R.SHUTDOWN): S.FINAL for s in State if s is not S.FINAL})
del S, R


class StateMachine:
    """The controller's current state; :meth:`fire` applies one result through the table."""

    def __init__(self, table: dict | None = None, initial: State = State.INIT):
        self._table = TRANSITIONS if table is None else table
        self._state = initial
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self.history: list[tuple[State, Result, State]] = []

    @property
    def state(self) -> State:
        return self._state

    @property
    def since(self) -> float:
        """time.monotonic() when the current state was entered."""
        return self._since

    def can(self, result: Result) -> bool:
        return (self._state, result) in self._table

    def fire(self, result: Result, **why) -> State:
        with self._lock:
            old = self._state
            try:
                new = self._table[(old, result)]
            except KeyError:
                allowed = sorted(r.value for (s, r) in self._table if s is old)
                raise IllegalTransition(
                    f"controller cannot go from {old.value} on {result.value}; allowed here: {allowed}") from None
            now = time.monotonic()
            spent = now - self._since
            self._state, self._since = new, now
            self.history.append((old, result, new))
        _log.info("state %s -%s-> %s (%.3f s in %s) %s", old.value, result.value, new.value, spent,
                  old.value, why or "")
        _logging.event("transition", src=old.value, result=result.value, dst=new.value,
                       spent_s=round(spent, 6), **why)
        return new

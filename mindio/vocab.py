"""mindio's vocabulary: every enum, strategy name and exit code that the controller, the processors
and the launcher share, defined once (and the controller's own: its states, results and strategy outcomes).

Importing it is light (the standard library only: no torch, no zmq), so the launcher's agent and
:mod:`mindio._knobs` use it too. The reference import paths stay: ``mindio.ttp`` and
``mindio.ttp._enums`` re-export the enums of the ``tft_*`` API (values as in MindIO TFT).
"""
from __future__ import annotations

import enum

__all__ = ["ReportState", "RepairType", "Action", "ActionName", "OptimizerType", "OsStatus", "ResultCode", "ExitCode",
           "EXIT_CODE_DUMPED", "EXIT_CODE_FAULT", "EXIT_CODE_REMOVED", "EXIT_CODE_SWITCHED", "EXIT_CODE_REPEATED",
           "EXIT_MEANINGS",
           "Strategy", "HA_STRATEGIES", "STRATEGY_ORDER", "MINDX_STRATEGIES", "REPLACING", "HOT_SWITCH_ACTIONS",
           "MsgType", "State", "Result", "Outcome", "MainState", "Cause"]


# ----------------------------------------------------------------------------- exit codes
class ExitCode(enum.IntEnum):
    """Process exit codes after an incident (distinct from 0 and from Python's 1 for an uncaught error)."""
    DUMPED = 75    # a complete last-words checkpoint was written; relaunch and resume from it
    FAULT = 76     # the job stopped on a fault without a new checkpoint (no strategy possible)
    REMOVED = 77   # this rank's DP slice was removed by an elastic downgrade; its process is no longer needed
    SWITCHED = 78  # this process was switched out by a hot switch; a backup serves its rank now
    REPEATED = 79  # a rank met the exception it met before the relaunch, at the same step: not relaunched again

    @property
    def meaning(self) -> str:
        """What the code tells the person reading the console."""
        return EXIT_MEANINGS[self]


# the module-level names are plain ints (as they always were: they travel in control frames and logs)
EXIT_CODE_DUMPED = int(ExitCode.DUMPED)
EXIT_CODE_FAULT = int(ExitCode.FAULT)
EXIT_CODE_REMOVED = int(ExitCode.REMOVED)
EXIT_CODE_SWITCHED = int(ExitCode.SWITCHED)
EXIT_CODE_REPEATED = int(ExitCode.REPEATED)
EXIT_MEANINGS = {
    EXIT_CODE_DUMPED: "a last-words checkpoint was written: relaunch the job to resume from it",
    EXIT_CODE_FAULT: "stopped on a fault; no new checkpoint could be written (resume from the last one)",
    EXIT_CODE_REMOVED: "this rank's data-parallel slice was removed by an elastic downgrade; the job goes on "
                       "without it",
    EXIT_CODE_SWITCHED: "switched out by a hot switch; a backup process serves this rank now",
    EXIT_CODE_REPEATED: "a rank raised the same exception at the same step as before the relaunch from the "
                        "last-words checkpoint: a deterministic fault; fix it, then resume from that checkpoint",
}


# ----------------------------------------------------------------------------- strategies
class Strategy(str, enum.Enum):
    """The names of the recovery strategies. A member *is* its string (equal, same hash, prints as it),
    so it stands wherever the name was written as a literal: in sets, dict keys, control frames, logs."""
    RETRY = "retry"                        # in place: clean, rebuild groups, repair from replicas, roll back
    RECOVER_IN_PLACE = "recover-in-place"  # replace dead ranks' processes on their (live) nodes
    RECOVER = "recover"                    # a standby node takes a lost node's ranks
    ELASTIC_TRAINING = "elastic-training"  # the enable name of downgrade/upgrade (HIGH_AVAILABILITY)
    DOWNGRADE = "downgrade"                # go on without the faulty ranks' data-parallel slices
    UPGRADE = "upgrade"                    # take removed ranks back when standbys offer them
    HOT_SWITCH = "hot switch"              # move healthy ranks to backup processes
    DUMP = "dump"                          # write a last-words checkpoint and exit 75
    EXIT = "exit"                          # stop without a checkpoint (76)
    CONTINUE = "continue"                  # (MindX, after a pause) go on training
    MIGRATION = "migration"                # (MindX) a strategy name tft_notify_controller_change_strategy accepts

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# the lists below hold the plain names (they print as before in messages and reprs)
S = Strategy
# what a job may enable (HIGH_AVAILABILITY / --high-availability; the cluster brain's fallback order)
HA_STRATEGIES = tuple(s.value for s in (S.RETRY, S.RECOVER_IN_PLACE, S.RECOVER, S.ELASTIC_TRAINING, S.DUMP, S.EXIT))
# the incident flow's fallback order (policy.feasible_strategies; "downgrade" for elastic-training)
STRATEGY_ORDER = tuple(s.value for s in (S.RETRY, S.RECOVER_IN_PLACE, S.RECOVER, S.DOWNGRADE, S.DUMP, S.EXIT))
# what tft_notify_controller_change_strategy accepts (the MindX names)
MINDX_STRATEGIES = tuple(s.value for s in (S.RETRY, S.DOWNGRADE, S.UPGRADE, S.RECOVER, S.DUMP, S.CONTINUE,
                                           S.MIGRATION, S.EXIT))
# the strategies that start new processes for ranks (a replacer carries them out)
REPLACING = (S.RECOVER_IN_PLACE.value, S.RECOVER.value)
# tft_notify_controller_prepare_action's hot-switch actions
HOT_SWITCH_ACTIONS = (S.HOT_SWITCH.value, "stop switch")
del S


# ----------------------------------------------------------------------------- the controller's actions
class ActionName(str, enum.Enum):
    """The ACTION frames' names: the controller sends them (actions.py ``call``), a rank's processor runs
    them (``Processor.ACTIONS``). A member *is* its string, as :class:`MainState`'s are: the wire is unchanged."""
    # the stop round (controller/retry.py), checkpoints, lifecycle (processor.py)
    STOP = "stop"
    WAIT_QUIET = "wait_quiet"
    TEARDOWN = "teardown"
    UNBLOCK = "unblock"
    ADVANCE = "advance"
    SAVE = "save"
    RENAME = "rename"
    EXIT = "exit"
    KILL = "kill"
    UNHOLD = "unhold"
    PING = "ping"
    PAUSE_QUERY = "pause_query"
    PAUSE_AT = "pause_at"
    PAUSE_RESUME = "pause_resume"
    # retry and the recoveries (processor/inplace.py, reboot.py)
    CLEAN = "clean"
    REBUILD = "rebuild"
    REPAIR = "repair"
    ROLLBACK = "rollback"
    RETRY = "retry"
    PREREPAIR = "prerepair"
    # elastic training (processor/elastic_rank.py)
    ZIT_REBUILD = "zit_rebuild"
    ZIT_REPAIR = "zit_repair"
    ZIT_ROLLBACK = "zit_rollback"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# ----------------------------------------------------------------------------- a rank's main thread
class MainState(str, enum.Enum):
    """Where a rank's training main thread is (the processor's ``_main``; the stop round's replies carry it
    as ``main``). A member *is* its string, as :class:`Strategy`'s are: frames and logs are unchanged."""
    RUNNING = "running"  # training (computing, or blocked in a collective)
    FENCED = "fenced"    # held at its fence (tft_start_updating_os / tft_pause_train) by a stop or a pause
    PARKED = "parked"    # after a fault, in the decorator's wait_next_action: groups torn down

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# ----------------------------------------------------------------------------- an incident's cause
class Cause(str, enum.Enum):
    """Why the controller's incident opened (controller/incident.py). A member *is* its string, as
    :class:`MainState`'s are: the state machine's log lines and events (``cause``) are unchanged."""
    FAULT = "fault"                  # a rank's report, or a rank declared dead
    DUMP_REQUEST = "dump_request"    # a last-words checkpoint (a preemption, tft_notify_controller_dump)
    PAUSE = "pause"                  # the cluster brain's pause (tft_notify_controller_stop_train ... pause)
    HOT_SWITCH = "hot_switch"        # the cluster brain's hot switch (tft_notify_controller_prepare_action)
    CLUSTER_BRAIN = "cluster_brain"  # the cluster brain named faulty ranks (tft_notify_controller_stop_train)

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# ----------------------------------------------------------------------------- the reference enums
class ReportState(enum.IntEnum):
    """What the exception decorator reports for the training state of its rank."""
    RS_NORMAL = 0            # this rank is fine; it was stopped (FORCE STOP) or failed only because a peer did
    RS_RETRY = 1             # (mindio) a generic exception outside the optimizer update window: state intact, retry
    RS_UCE = 2               # UCE ERROR: a memory error whose data can be repaired from a replica
    RS_UCE_CORRUPTED = 3     # HBM MULTI BIT ECC inside the optimizer update window: this rank's state is lost
    RS_HCCL_FAILED = 4       # network fault; no repair needed
    RS_INIT_FINISH = 5
    RS_PREREPAIR_FINISH = 6  # ARF FINISH
    RS_STEP_FINISH = 7       # STEP FINISH
    RS_UNKNOWN = 8           # anything else
    RS_REPEATED = 9          # (mindio) the exception met before the relaunch, at the same step, on this rank again


class RepairType(enum.IntEnum):
    """``repair_info["repair_type"]`` of the repair handler. A member equals its value (the reference's
    enum) and also its name: a handler written against the reference (``== RepairType.RT_SEND``) and
    one that compares names (``== "RT_SEND"``) both work; it prints as its name."""
    # (control frames carry the name: ``RepairType.RT_SEND.name``)
    RT_SEND = 0
    RT_UCE_HIGHLEVEL = 1
    RT_UCE_LOWLEVEL = 2
    RT_RECV_REPAIR = 3
    RT_ROLLBACK = 4
    RT_LOAD_CKPT = 5
    RT_LOAD_REBUILD = 6

    def __eq__(self, other):
        return self.name == other if isinstance(other, str) else int.__eq__(self, other)

    def __ne__(self, other):
        return self.name != other if isinstance(other, str) else int.__ne__(self, other)

    __hash__ = int.__hash__

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


class Action(enum.IntEnum):
    """What the parked main thread does next (return of tft_wait_next_action, see decorator)."""
    RETRY = 0
    EXIT = 1


class OptimizerType(enum.IntEnum):
    ATTENTION = 0
    MOE = 1


class OsStatus(enum.IntEnum):
    """Optimizer-state status of one rank (tft_start_updating_os / tft_end_updating_os / tft_start_copy_os)."""
    UPDATED = 0
    UPDATING = 1
    COPYING = 2


class ResultCode(enum.IntEnum):
    """Codes reported to the cluster brain (report_stop_complete / report_result)."""
    OK = 0
    ACCEPTED = 201
    NOT_READY = 404          # processors not all ready
    RETRY_FAILED = 405       # retry failed; recover, dump, exit allowed
    DUMP_OR_EXIT = 406       # repair failed; dump or exit allowed
    EXIT_ONLY = 499


# ----------------------------------------------------------------------------- the wire's message types
# (mindio/ttp/wire/protocol.py frames them; controller and processors both read them)
class MsgType(enum.IntEnum):
    REGISTER = 1       # processor -> controller: join as a rank (or a backup / relay); opens the session
    REGISTER_ACK = 2   # controller -> processor: accepted; heartbeat interval, backup addresses
    HEARTBEAT = 3      # processor -> controller: liveness + step progress
    HEARTBEAT_ACK = 4  # controller -> processor: controller liveness
    REPORT = 5         # processor -> controller: an error caught on the rank (wakes the controller)
    INFO = 6           # processor -> controller: optimizer replica layout / DP group changed
    ACTION = 7         # controller -> processor: do something (sn identifies it)
    REPLY = 8          # processor -> controller: result of ACTION sn
    BYE = 9            # processor -> controller: leaving normally (training finished); not a fault
    BEATS = 10         # relay -> controller: heartbeats of many ranks in one frame (v2)
    BATCH = 11         # relay <-> controller: many messages of other types in one frame (v2)
    HELLO = 12         # any -> controller: a fresh nonce; asks for a session (v3)
    CHALLENGE = 13     # controller -> sender of a HELLO: its nonce back and the session to register in (v3)
    REQUEST = 14       # processor -> controller: ask for a graceful action ("dump": preemption, preempt.py)
    REPLIES = 15       # relay -> controller (a BATCH item): its ranks' REPLYs to one action, in columns (v7)


# ----------------------------------------------------------------------------- the controller's state machine
# (mindio/ttp/controller/states.py: TRANSITIONS and StateMachine over these)
class State(enum.Enum):
    INIT = "INIT"
    NORMAL = "NORMAL"
    PAUSE = "PAUSE"
    STEP_FINISH = "STEP_FINISH"
    MIGRATION = "MIGRATION"
    ENV_CLEAR = "ENV_CLEAR"
    REPAIR = "REPAIR"
    ABNORMAL = "ABNORMAL"
    DG_REPAIR = "DG_REPAIR"
    DOWNGRADE = "DOWNGRADE"
    UPGRADE = "UPGRADE"
    DUMP = "DUMP"
    EXIT = "EXIT"
    FINAL = "FINAL"


class Result(enum.Enum):
    ALL_REGISTERED = "ALL_REGISTERED"
    FAULT = "FAULT"
    OK = "OK"
    FAIL = "FAIL"
    RETRY = "RETRY"
    RECOVER = "RECOVER"
    DOWNGRADE = "DOWNGRADE"
    UPGRADE = "UPGRADE"
    DUMP = "DUMP"
    EXIT = "EXIT"
    PAUSE = "PAUSE"
    CONTINUE = "CONTINUE"
    MIGRATE = "MIGRATE"
    STEP_FINISH = "STEP_FINISH"
    SHUTDOWN = "SHUTDOWN"


# ----------------------------------------------------------------------------- what a strategy's run returns
# (mindio/ttp/controller/strategy.py)
class Outcome(enum.Enum):
    RESUMED = "resumed"  # every rank trains again: the incident is over
    ENDED = "ended"      # the job ended (a dump and/or the exit order was sent)
    FAILED = "failed"    # not possible or a step failed: the incident falls back to the next strategy

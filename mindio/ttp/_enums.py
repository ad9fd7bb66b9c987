"""Enums and result codes of the reference API (values as in MindIO TFT), shared by every ttp module."""
from __future__ import annotations

import enum

__all__ = ["ReportState", "RepairType", "Action", "OptimizerType", "OsStatus", "ResultCode",
           "EXIT_CODE_DUMPED", "EXIT_CODE_FAULT", "EXIT_MEANINGS"]

# Process exit codes after an incident (distinct from 0 and from Python's 1 for an uncaught error):
EXIT_CODE_DUMPED = 75   # a complete last-words checkpoint was written; relaunch and resume from it
EXIT_CODE_FAULT = 76    # the job stopped on a fault without a new checkpoint (no strategy possible)
# what each code tells the person reading the console (77: elastic.py, 78: hotswitch.py)
EXIT_MEANINGS = {
    EXIT_CODE_DUMPED: "a last-words checkpoint was written: relaunch the job to resume from it",
    EXIT_CODE_FAULT: "stopped on a fault; no new checkpoint could be written (resume from the last one)",
    77: "this rank's data-parallel slice was removed by an elastic downgrade; the job goes on without it",
    78: "switched out by a hot switch; a backup process serves this rank now",
}


class ReportState(enum.IntEnum):
    """What the exception decorator reports for the training state of its rank."""
    RS_NORMAL = 0            # this rank is fine; it was stopped (FORCE STOP) or failed only because a peer did
    RS_RETRY = 1
    RS_UCE = 2               # UCE ERROR: a memory error whose data can be repaired from a replica
    RS_UCE_CORRUPTED = 3     # HBM MULTI BIT ECC inside the optimizer update window: this rank's state is lost
    RS_HCCL_FAILED = 4       # network fault; no repair needed
    RS_INIT_FINISH = 5
    RS_PREREPAIR_FINISH = 6  # ARF FINISH
    RS_STEP_FINISH = 7       # STEP FINISH
    RS_UNKNOWN = 8           # anything else


class RepairType(enum.IntEnum):
    RT_SEND = 0
    RT_UCE_HIGHLEVEL = 1
    RT_UCE_LOWLEVEL = 2
    RT_RECV_REPAIR = 3
    RT_ROLLBACK = 4
    RT_LOAD_CKPT = 5
    RT_LOAD_REBUILD = 6


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

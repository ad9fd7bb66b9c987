"""Enums and result codes of the reference API (values as in MindIO TFT): this import path stays; the
definitions are in :mod:`mindio.vocab`, mindio's one vocabulary module."""
from __future__ import annotations

from ..vocab import (EXIT_CODE_DUMPED, EXIT_CODE_FAULT, EXIT_CODE_REMOVED, EXIT_CODE_SWITCHED, EXIT_CODE_REPEATED,
                     EXIT_MEANINGS,
                     Action, ActionName, Cause, ExitCode, MainState, OptimizerType, OsStatus, RepairType, ReportState,
                     ResultCode, Strategy)

__all__ = ["ReportState", "RepairType", "Action", "ActionName", "OptimizerType", "OsStatus", "ResultCode", "ExitCode",
           "Strategy", "MainState", "Cause",
           "EXIT_CODE_DUMPED", "EXIT_CODE_FAULT", "EXIT_CODE_REMOVED", "EXIT_CODE_SWITCHED", "EXIT_CODE_REPEATED",
           "EXIT_MEANINGS"]

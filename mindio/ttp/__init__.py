"""mindio.ttp: training fault tolerance (MindIO TFT/TTP compatible API).

Everything public is re-exported here, so ``from mindio.ttp import tft_init_processor`` works like
``from mindio_ttp.framework_ttp import tft_init_processor`` in the reference. Importing starts nothing;
in a process that has imported torch and has no process group yet, for a script that will import
torch._dynamo anyway (a torch optimizer, DDP, megatron), it imports it now (mindio/_dynamo.py: torch
2.13 keeps the default group alive when it comes after init_process_group).
See docs/ttp.md for the controller <-> processor conversation.
"""
from __future__ import annotations

from . import shutdown as _shutdown

_shutdown.import_dynamo_early()  # before the script's init_process_group (shutdown.import_dynamo_early)

from ._enums import (EXIT_CODE_DUMPED, EXIT_CODE_FAULT, Action, OptimizerType, OsStatus, RepairType,  # noqa: E402
                     ReportState, ResultCode)

# The API itself loads on first use (PEP 562): ``from mindio.ttp import tft_init_processor`` works as before,
# while a process that needs only a part of the package -- mindio-run's relay (wire/relay.py), which runs
# once per node and launch -- does not import torch and the processor (~1.5 CPU-s) to start.
_API = (
    "tft_init_controller", "tft_start_controller", "tft_destroy_controller", "start_backup_controller",
    "tft_init_processor", "tft_start_processor", "tft_destroy_processor", "tft_start_updating_os", "tft_start_copy_os",
    "tft_end_updating_os", "tft_set_optimizer_replica", "tft_set_dp_group_info", "tft_set_step_args",
    "tft_register_save_ckpt_handler", "tft_register_rename_handler", "tft_register_exit_handler",
    "tft_register_stop_handler", "tft_register_clean_handler", "tft_register_rebuild_group_handler",
    "tft_register_repair_handler", "tft_register_rollback_handler", "tft_register_stream_sync_handler",
    "tft_register_zit_downgrade_rebuild_handler", "tft_register_zit_upgrade_rebuild_handler",
    "tft_register_zit_upgrade_repair_handler", "tft_register_zit_upgrade_rollback_handler",
    "tft_register_exception_handler", "tft_report_error", "tft_wait_next_action", "tft_get_repair_step",
    "tft_get_repair_type", "tft_is_reboot_node", "tft_get_reboot_type", "tft_reset_limit_step",
    "tft_report_load_ckpt_step", "tft_register_decrypt_handler", "tft_pause_train", "tft_can_do_uce_repair",
    "tft_set_update_start_time", "tft_set_update_end_time", "tft_notify_controller_dump",
    "tft_notify_controller_stop_train", "tft_notify_controller_on_global_rank",
    "tft_notify_controller_prepare_action", "tft_notify_controller_change_strategy", "tft_register_mindx_callback",
    "tft_query_high_availability_switch",
)
_LAZY = {**{n: "api" for n in _API}, "tft_exception_handler": "decorator",
         **{n: "compat" for n in ("get_device", "get_mindio_export_version", "set_mindio_export_version",
                                  "tft_wait_repair_action")}}

__all__ = list(_API) + [
    "tft_exception_handler", "ReportState", "RepairType", "Action", "OptimizerType", "OsStatus", "ResultCode",
    "EXIT_CODE_DUMPED", "EXIT_CODE_FAULT", "tft_wait_repair_action", "set_mindio_export_version",
    "get_mindio_export_version", "get_device",
]


def __getattr__(name: str):
    """A public name (its module imported now, once), or a submodule by name (``mindio.ttp.api``)."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

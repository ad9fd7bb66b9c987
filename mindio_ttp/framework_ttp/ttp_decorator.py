"""``mindio_ttp.framework_ttp.ttp_decorator``: the processor-side functions of MindIO TFT, plus the
helpers MindSpeed-LLM imports from this path (``get_device``, ``get_mindio_export_version``)."""
from mindio.ttp import (Action, OptimizerType, RepairType, ReportState, tft_destroy_processor, tft_end_updating_os,
                        tft_exception_handler, tft_get_reboot_type, tft_get_repair_step, tft_get_repair_type,
                        tft_init_processor, tft_is_reboot_node, tft_pause_train, tft_register_clean_handler,
                        tft_register_decrypt_handler, tft_register_exception_handler, tft_register_exit_handler,
                        tft_register_rebuild_group_handler, tft_register_rename_handler, tft_register_repair_handler,
                        tft_register_rollback_handler, tft_register_save_ckpt_handler, tft_register_stop_handler,
                        tft_register_stream_sync_handler, tft_register_zit_downgrade_rebuild_handler,
                        tft_register_zit_upgrade_rebuild_handler, tft_register_zit_upgrade_repair_handler,
                        tft_register_zit_upgrade_rollback_handler, tft_report_error, tft_report_load_ckpt_step,
                        tft_reset_limit_step, tft_set_dp_group_info, tft_set_optimizer_replica, tft_set_step_args,
                        tft_start_copy_os, tft_start_processor, tft_start_updating_os, tft_wait_next_action)
from mindio.ttp.compat import get_device, get_mindio_export_version, set_mindio_export_version, tft_wait_repair_action

__all__ = [
    "tft_init_processor", "tft_start_processor", "tft_destroy_processor", "tft_pause_train",
    "tft_start_updating_os", "tft_end_updating_os", "tft_start_copy_os", "tft_exception_handler", "tft_set_step_args",
    "tft_set_optimizer_replica", "tft_set_dp_group_info", "tft_register_save_ckpt_handler",
    "tft_register_rename_handler", "tft_register_exit_handler", "tft_register_stop_handler",
    "tft_register_clean_handler", "tft_register_repair_handler", "tft_register_rollback_handler",
    "tft_register_rebuild_group_handler", "tft_register_stream_sync_handler",
    "tft_register_zit_upgrade_rollback_handler", "tft_register_zit_upgrade_repair_handler",
    "tft_register_zit_upgrade_rebuild_handler", "tft_register_zit_downgrade_rebuild_handler",
    "tft_register_decrypt_handler", "tft_register_exception_handler", "tft_report_error", "tft_wait_next_action",
    "tft_wait_repair_action", "tft_get_repair_step", "tft_get_repair_type", "tft_report_load_ckpt_step",
    "tft_is_reboot_node", "tft_reset_limit_step", "tft_get_reboot_type", "ReportState", "Action", "OptimizerType",
    "RepairType", "set_mindio_export_version", "get_mindio_export_version", "get_device",
]

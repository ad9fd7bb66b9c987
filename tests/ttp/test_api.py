"""The reference API surface: names, parameter lists and defaults (SPEC §3), and input validation."""
import inspect

import pytest

import mindio.ttp as ttp
from mindio.errors import ConfigError

SIGNATURES = {
    "tft_init_controller": "(rank, world_size, enable_local_copy, enable_arf=False, enable_zit=False)",
    "tft_start_controller": "(bind_ip, port, enable_tls=True, tls_info='')",
    "tft_destroy_controller": "()",
    "tft_init_processor": "(rank, world_size, enable_local_copy, enable_tls=True, tls_info='', enable_uce=True, "
                          "enable_arf=False, enable_zit=False)",
    "tft_start_processor": "(master_ip, port, local_ip='')",
    "tft_destroy_processor": "()",
    "tft_start_updating_os": "(backup_step=-1)",
    "tft_start_copy_os": "()",
    "tft_end_updating_os": "(step)",
    "tft_set_optimizer_replica": "(rank, replica_info)",
    "tft_set_dp_group_info": "(rank, dp_rank_list)",
    "tft_exception_handler": "(func)",
    "tft_set_step_args": "(args)",
    "tft_register_save_ckpt_handler": "(func, ctx=None)",
    "tft_register_rename_handler": "(func, ctx=None)",
    "tft_register_exit_handler": "(func, ctx=None)",
    "tft_register_stop_handler": "(func, ctx=None)",
    "tft_register_clean_handler": "(func, ctx=None)",
    "tft_register_rebuild_group_handler": "(func, ctx=None)",
    "tft_register_repair_handler": "(func, ctx=None)",
    "tft_register_rollback_handler": "(func, ctx=None)",
    "tft_register_stream_sync_handler": "(func, ctx=None)",
    "tft_register_zit_downgrade_rebuild_handler": "(func, ctx=None)",
    "tft_register_zit_upgrade_rebuild_handler": "(func, ctx=None)",
    "tft_register_zit_upgrade_repair_handler": "(func, ctx=None)",
    "tft_register_zit_upgrade_rollback_handler": "(func, ctx=None)",
    "tft_register_exception_handler": "(fault_pattern, fault_type, fault_handle=None)",
    "tft_report_error": "(error_type, error_code='')",
    "tft_wait_next_action": "()",
    "tft_get_repair_step": "()",
    "tft_get_repair_type": "()",
    "tft_is_reboot_node": "()",
    "tft_get_reboot_type": "()",
    "tft_reset_limit_step": "()",
    "tft_report_load_ckpt_step": "(step)",
    "tft_register_decrypt_handler": "(decryptor)",
    "tft_pause_train": "(cur_step)",
    "tft_can_do_uce_repair": "(hbm_error_time, start_time=None, end_time=None)",
    "tft_set_update_start_time": "(start_time=None)",
    "tft_set_update_end_time": "(end_time=None)",
    "tft_notify_controller_dump": "()",
    "tft_notify_controller_stop_train": "(fault_ranks, stop_type='stop', timeout=None)",
    "tft_notify_controller_on_global_rank": "(fault_ranks, time=1)",
    "tft_notify_controller_prepare_action": "(action, fault_ranks=None)",
    "tft_notify_controller_change_strategy": "(strategy, params='')",
    "tft_register_mindx_callback": "(action, func)",
    "tft_query_high_availability_switch": "()",
}


def _plain(sig: inspect.Signature) -> str:
    return str(sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                           return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_reference_signature(name):
    assert name in ttp.__all__
    assert _plain(inspect.signature(getattr(ttp, name))) == SIGNATURES[name]


def test_enums_have_reference_values():
    # the reference's members with their values, then mindio's one addition (issue 33: a fault met again after
    # the relaunch from its dump)
    assert [m.name for m in ttp.ReportState] == ["RS_NORMAL", "RS_RETRY", "RS_UCE", "RS_UCE_CORRUPTED", "RS_HCCL_FAILED",
                                                "RS_INIT_FINISH", "RS_PREREPAIR_FINISH", "RS_STEP_FINISH", "RS_UNKNOWN",
                                                "RS_REPEATED"]
    assert [int(m) for m in ttp.ReportState] == list(range(10))
    assert [m.name for m in ttp.RepairType] == ["RT_SEND", "RT_UCE_HIGHLEVEL", "RT_UCE_LOWLEVEL", "RT_RECV_REPAIR",
                                               "RT_ROLLBACK", "RT_LOAD_CKPT", "RT_LOAD_REBUILD"]
    assert (ttp.Action.RETRY, ttp.Action.EXIT) == (0, 1)
    assert (ttp.OptimizerType.ATTENTION, ttp.OptimizerType.MOE) == (0, 1)
    assert {int(c) for c in ttp.ResultCode} == {0, 201, 404, 405, 406, 499}
    assert len({ttp.EXIT_CODE_DUMPED, ttp.EXIT_CODE_FAULT, 0, 1}) == 4


def test_bad_input_is_rejected_with_clear_errors():
    with pytest.raises(ConfigError, match="world_size"):
        ttp.tft_init_controller(5, 4, enable_local_copy=False)
    with pytest.raises(ConfigError, match="callable"):
        ttp.tft_register_save_ckpt_handler("not a function")
    with pytest.raises(ConfigError, match="not one of"):
        ttp.tft_notify_controller_change_strategy("teleport")
    with pytest.raises(ConfigError, match="not one of"):
        ttp.tft_register_mindx_callback("report_weather", print)
    with pytest.raises(RuntimeError, match="tft_init_processor"):
        ttp.tft_start_updating_os(-1)
    with pytest.raises(RuntimeError, match="no controller"):  # hot switch: tests/recovery/test_hotswitch.py
        ttp.tft_notify_controller_prepare_action("hot switch", {1: 1})


def test_decorator_is_transparent_without_processor():
    @ttp.tft_exception_handler
    def train(x):
        if x:
            raise ValueError("boom")
        return 7

    assert train(0) == 7
    with pytest.raises(ValueError, match="boom"):
        train(1)


def test_uce_window_helpers():
    ttp.tft_set_update_start_time(100)
    ttp.tft_set_update_end_time(200)
    assert not ttp.tft_can_do_uce_repair(150)
    assert ttp.tft_can_do_uce_repair(250)
    assert ttp.tft_can_do_uce_repair(150, 0, 10)
    from mindio.ttp._runtime import state
    state.update_window[:] = [None, None]

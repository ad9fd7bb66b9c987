"""The reference's module paths and the names MindIO users call exist, with the reference signatures
(docs/migration.md). No processes: the end-to-end run is test_mindspeed_style.py."""
from __future__ import annotations

import inspect
import subprocess
import sys
import threading

import pytest
import torch

import mindio_acp
import mindio_ttp.framework_ttp as framework_ttp
from mindio.errors import CheckpointError, ConfigError
from mindio.ttp import _runtime

# framework_ttp/__init__.py's __all__ in MindIO TFT, plus what MindSpeed-LLM imports beside it
REFERENCE_FRAMEWORK = """tft_init_controller tft_start_controller tft_destroy_controller tft_init_processor
tft_start_processor tft_destroy_processor tft_start_updating_os tft_start_copy_os tft_end_updating_os
tft_set_optimizer_replica tft_exception_handler tft_set_step_args tft_register_rename_handler
tft_register_save_ckpt_handler tft_register_exit_handler tft_register_stop_handler tft_register_clean_handler
tft_register_rebuild_group_handler tft_register_repair_handler tft_register_rollback_handler
tft_register_stream_sync_handler tft_register_zit_upgrade_rollback_handler tft_register_zit_upgrade_repair_handler
tft_register_zit_upgrade_rebuild_handler tft_register_zit_downgrade_rebuild_handler tft_report_error
tft_wait_next_action tft_get_repair_step tft_get_repair_type tft_is_reboot_node tft_get_reboot_type
tft_can_do_uce_repair tft_reset_limit_step tft_pause_train tft_set_dp_group_info tft_report_load_ckpt_step
tft_register_decrypt_handler OptimizerType Action ReportState RepairType set_mindio_export_version
tft_register_exception_handler""".split()
REFERENCE_PATHS = {
    "mindio_ttp.framework_ttp.ttp_decorator": "get_device tft_report_load_ckpt_step get_mindio_export_version "
                                              "tft_get_repair_type tft_wait_repair_action tft_wait_next_action",
    "mindio_ttp.controller_ttp": "tft_set_dp_group_info tft_notify_controller_dump tft_notify_controller_stop_train "
                                 "tft_notify_controller_on_global_rank tft_notify_controller_prepare_action "
                                 "tft_notify_controller_change_strategy tft_register_mindx_callback "
                                 "tft_query_high_availability_switch ttp_logger",
    "mindio_ttp.utils": "tft_can_do_uce_repair tft_set_update_start_time tft_set_update_end_time",
    "mindio_acp": "initialize save multi_save load preload flush register_checker convert open_file create_file "
                  "CheckpointHelper",
    "mindio_acp.acc_checkpoint.framework_acp": "CheckpointHelper",
}
SIGNATURES = {  # the reference's, for the names mindio added for it
    "set_mindio_export_version": "(framework_type: str)",
    "get_mindio_export_version": "()",
    "tft_wait_repair_action": "()",
    "get_device": "()",
}


def test_the_reference_imports_work_outside_the_source_tree(tmp_path):
    code = "import mindio_ttp.framework_ttp, mindio_acp; print(mindio_acp.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "mindio_acp" in out


def test_every_reference_name_is_there():
    import importlib

    assert not [n for n in REFERENCE_FRAMEWORK if not hasattr(framework_ttp, n)]
    assert set(REFERENCE_FRAMEWORK) - {"set_mindio_export_version"} <= set(framework_ttp.__all__)
    for module, names in REFERENCE_PATHS.items():
        mod = importlib.import_module(module)
        assert not [n for n in names.split() if not hasattr(mod, n)], module
    assert framework_ttp.ttp_decorator.tft_wait_next_action is __import__("mindio.ttp").ttp.tft_wait_next_action
    import mindio_ttp.controller_ttp as controller_ttp
    assert controller_ttp.ttp_logger.LOGGER.name == "mindio.ttp"


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_added_names_have_the_reference_signature(name):
    sig = inspect.signature(getattr(framework_ttp.ttp_decorator, name))
    assert str(sig).split(" ->")[0].replace("'", "") == SIGNATURES[name]


def test_export_version_accepts_the_reference_frameworks_only(monkeypatch):
    from mindio.ttp import compat

    monkeypatch.setattr(compat, "_export_version", None)
    assert framework_ttp.ttp_decorator.get_mindio_export_version() is None
    with pytest.raises(ConfigError, match="MindSpeed-LLM"):
        framework_ttp.set_mindio_export_version("Megatron")
    framework_ttp.set_mindio_export_version("MindSpeed-LLM")
    assert framework_ttp.ttp_decorator.get_mindio_export_version() == "MindSpeed-LLM"


def test_wait_repair_action_needs_a_processor_and_takes_a_pending_decision(monkeypatch):
    monkeypatch.setattr(_runtime.state, "processor", None)
    with pytest.raises(RuntimeError, match="tft_init_processor"):
        framework_ttp.ttp_decorator.tft_wait_repair_action()

    class Parked:  # the two states tft_wait_repair_action tells apart
        def __init__(self, pending):
            self.pending = pending

        def decision_pending(self):
            return self.pending

        def wait_next_action(self):
            return framework_ttp.Action.EXIT, 76

    monkeypatch.setattr(_runtime.state, "processor", Parked(False))
    assert framework_ttp.ttp_decorator.tft_wait_repair_action() == framework_ttp.Action.RETRY.value
    monkeypatch.setattr(_runtime.state, "processor", Parked(True))
    assert framework_ttp.ttp_decorator.tft_wait_repair_action() == framework_ttp.Action.EXIT.value


def test_exception_handler_takes_a_report_state_name(monkeypatch):
    monkeypatch.setattr(_runtime.state, "user_patterns", [])
    framework_ttp.tft_register_exception_handler("PRECISION ERROR", "RS_RETRY", lambda err: None)
    assert _runtime.state.user_patterns[0][1] is framework_ttp.ReportState.RS_RETRY


def test_checkpoint_helper_saves_loads_and_writes_the_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDIO_ACP_DISABLE", "1")  # direct writes: the pool has its own tests (tests/acp)
    helper = mindio_acp.CheckpointHelper(0)
    assert helper is mindio_acp.CheckpointHelper(0) and helper is not mindio_acp.CheckpointHelper(1)
    folder = tmp_path / "iter_0000007"
    folder.mkdir()
    helper.save_model_checkpoint(str(folder / "model.pt"), {"w": torch.arange(4.0), "iteration": 7})
    helper.save_optimizer_checkpoint([str(folder / "optim.pt")], lambda notify_callback: {"m": torch.ones(2)})
    helper.save_optimizer_checkpoint(str(folder / "never.pt"), lambda: None)  # a rank holding no shard
    with pytest.raises(ConfigError, match="notify_callback"):
        helper.save_optimizer_checkpoint(str(folder / "x.pt"), lambda state: None)
    done = threading.Event()
    results = []
    helper.async_write_tracker_file(7, str(folder), 2, str(tmp_path / "latest_checkpointed_iteration.txt"),
                                    callback=lambda step, result: (results.append((step, result)), done.set()))
    assert done.wait(30) and results == [(7, 0)]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "7"
    got = helper.load_model_checkpoint(str(folder / "model.pt"), load_rank=0)
    assert torch.equal(got["w"], torch.arange(4.0)) and got["iteration"] == 7
    with pytest.raises(CheckpointError):
        helper.save_model_checkpoint(str(tmp_path / "missing-dir" / "model.pt"), {"w": torch.ones(1)})


def test_checkpoint_helper_waits_for_its_background_saves():
    helper = mindio_acp.CheckpointHelper(3)
    release, copied = threading.Event(), threading.Event()

    def save_in_background(value):
        release.wait(30)
        helper.async_checkpoint_count()  # the copy is done; the rest may go on
        copied.set()

    helper.async_save_checkpoint(save_in_background, {"value": 1})
    with pytest.raises(TimeoutError, match="still copying"):
        helper.wait_d2h_finished(timeout=0.2)
    release.set()
    helper.wait_d2h_finished(timeout=30)
    assert copied.wait(30)

"""The tft_* functions of MindIO TFT with the reference signatures (thin: they delegate).

Call order in a training script (rank r of w; the controller's rank also runs a processor)::

    if r == 0:                                    # or rank -1 in a launcher agent (a later issue)
        tft_init_controller(r, w, enable_local_copy=False)
        tft_start_controller(master_ip, port)
    tft_init_processor(r, w, enable_local_copy=False)
    tft_register_save_ckpt_handler(save); tft_register_rename_handler(rename)   # + stop/clean/exit
    tft_start_processor(master_ip, port)
    tft_set_optimizer_replica(r, [{"rank_list": dp_ranks, "replica_cnt": 2, "replica_shift": 0}])
    tft_exception_handler(train)(...)             # around each step: start/end_updating_os

The secret that signs control frames comes from MINDIO_SECRET or MINDIO_SECRET_FILE (mindio-run sets
it for its workers); without either, the controller's rank publishes one in the torch.distributed store
(call init_process_group first) and logs what that exposes (docs/security.md).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from .. import _knobs, _logging
from ..errors import ConfigError
from . import transport
from ._enums import ReportState
from ._runtime import state as _rt
from .brain import Brain, load_table
from .controller import Controller
from .processor import Processor

__all__ = [
    "tft_init_controller", "tft_start_controller", "tft_destroy_controller", "start_backup_controller",
    "tft_init_processor", "tft_start_processor", "tft_destroy_processor",
    "tft_start_updating_os", "tft_start_copy_os", "tft_end_updating_os", "tft_set_optimizer_replica",
    "tft_set_dp_group_info", "tft_set_step_args", "tft_register_save_ckpt_handler", "tft_register_rename_handler",
    "tft_register_exit_handler", "tft_register_stop_handler", "tft_register_clean_handler",
    "tft_register_rebuild_group_handler", "tft_register_repair_handler", "tft_register_rollback_handler",
    "tft_register_stream_sync_handler", "tft_register_zit_downgrade_rebuild_handler",
    "tft_register_zit_upgrade_rebuild_handler", "tft_register_zit_upgrade_repair_handler",
    "tft_register_zit_upgrade_rollback_handler", "tft_register_exception_handler", "tft_report_error",
    "tft_wait_next_action", "tft_get_repair_step", "tft_get_repair_type", "tft_is_reboot_node",
    "tft_get_reboot_type", "tft_reset_limit_step", "tft_report_load_ckpt_step", "tft_register_decrypt_handler",
    "tft_pause_train", "tft_can_do_uce_repair", "tft_set_update_start_time", "tft_set_update_end_time",
    "tft_notify_controller_dump", "tft_notify_controller_stop_train", "tft_notify_controller_on_global_rank",
    "tft_notify_controller_prepare_action", "tft_notify_controller_change_strategy",
    "tft_register_mindx_callback", "tft_query_high_availability_switch",
]

_log = logging.getLogger(__name__)
_STRATEGIES = ("retry", "downgrade", "upgrade", "recover", "dump", "continue", "migration", "exit")
_MINDX_ACTIONS = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")


def _proc() -> Processor:
    if _rt.processor is None:
        raise RuntimeError("no processor in this process: call tft_init_processor and tft_start_processor first")
    return _rt.processor


def _ctl() -> Controller:
    if _rt.controller is None:
        raise RuntimeError("no controller in this process: call tft_init_controller and tft_start_controller first")
    return _rt.controller



# ----------------------------------------------------------------------------- controller
def tft_init_controller(rank: int, world_size: int, enable_local_copy: bool, enable_arf=False, enable_zit=False):
    if not -1 <= rank < world_size or not 1 <= world_size <= 100000:
        raise ConfigError(f"tft_init_controller: rank {rank} must be in [-1, world_size) and world_size "
                          f"{world_size} in [1, 100000]")
    enabled = set(_knobs.get("HIGH_AVAILABILITY")) or (
        {"dump"} | ({"recover"} if enable_arf else set()) | ({"elastic-training"} if enable_zit else set()))
    _rt.controller_init = {"rank": rank, "world_size": world_size, "enabled": enabled}
    _logging.setup(rank=rank)


def _start(bind_ip, port, enable_tls, tls_info, primary=None):
    if _rt.controller_init is None:
        raise RuntimeError("call tft_init_controller before starting a controller")
    if not 1024 <= int(port) <= 65535 or bind_ip in ("", "0.0.0.0"):
        raise ConfigError(f"controller address {bind_ip}:{port}: need a concrete IP and a port in [1024, 65535]")
    curve = transport.curve_options(enable_tls, tls_info, server=True)
    table = load_table()  # a bad MINDIO_FAULT_TABLE fails here, not at the first fault
    client = None
    if primary and curve:  # the backup's link to the primary is a CURVE client
        try:
            client = transport.curve_options(enable_tls, tls_info, server=False)
        except ConfigError:  # no server_public given: the controller derives it from the shared keypair
            client = None
    ctl = Controller(key=transport.job_secret(create=primary is None), curve=curve, backup=primary is not None,
                     curve_client=client, curve_clients=transport.curve_clients(enable_tls, tls_info),
                     **_rt.controller_init)
    ctl.brain = Brain(table)
    ctl.start(bind_ip, int(port), primary=primary)
    _rt.controller = ctl


def tft_start_controller(bind_ip: str, port: int, enable_tls=True, tls_info=''):
    _start(bind_ip, port, enable_tls, tls_info)


def start_backup_controller(bind_ip: str, port: int, primary_ip: str, primary_port: int, enable_tls=True,
                            tls_info=''):
    """Start a passive backup controller (after tft_init_controller) that takes over when the primary at
    ``primary_ip:primary_port`` goes silent and more than half of the ranks registered with it."""
    _start(bind_ip, port, enable_tls, tls_info, primary=f"tcp://{primary_ip}:{int(primary_port)}")


def tft_destroy_controller():
    if _rt.controller is not None:
        _rt.controller.destroy()
        _rt.controller = None


# ----------------------------------------------------------------------------- processor
def tft_init_processor(rank: int, world_size: int, enable_local_copy: bool, enable_tls=True, tls_info='',
                       enable_uce=True, enable_arf=False, enable_zit=False):
    curve = transport.curve_options(enable_tls, tls_info, server=False)
    proc = Processor(rank, world_size, enable_uce=enable_uce, enable_arf=enable_arf, enable_zit=enable_zit,
                     curve=curve)
    proc.callbacks = _rt.callbacks
    _rt.processor = proc
    _logging.setup(rank=rank)


def tft_start_processor(master_ip: str, port: int, local_ip=''):
    if not 1024 <= int(port) <= 65535:
        raise ConfigError(f"controller port {port} must be in [1024, 65535]")
    _proc().start(f"tcp://{master_ip}:{int(port)}", transport.job_secret(create=False))


def tft_destroy_processor():
    if _rt.processor is not None:
        _rt.processor.destroy(reason="destroyed")
        _rt.processor = None


def tft_start_updating_os(backup_step: int = -1):
    _proc().start_updating_os(backup_step)


def tft_start_copy_os():
    _proc().start_copy_os()


def tft_end_updating_os(step: int):
    if step < 1:
        raise ConfigError(f"tft_end_updating_os: step {step} must be a positive integer")
    _proc().end_updating_os(step)


def tft_set_optimizer_replica(rank: int, replica_info: list):
    for i, entry in enumerate(replica_info):
        if not isinstance(entry, dict) or not {"rank_list", "replica_cnt"} <= set(entry):
            raise ConfigError(f"replica_info[{i}] must be a dict with rank_list, replica_cnt, replica_shift")
        if len(entry["rank_list"]) % max(1, int(entry["replica_cnt"])):
            raise ConfigError(f"replica_info[{i}]: DP group of {len(entry['rank_list'])} ranks is not divisible "
                              f"by replica_cnt {entry['replica_cnt']}")
    proc = _proc()
    proc.replica = [{"rank_list": [int(r) for r in e["rank_list"]], "replica_cnt": int(e["replica_cnt"]),
                     "replica_shift": int(e.get("replica_shift", 0))} for e in replica_info]
    proc.send_info()


def tft_set_dp_group_info(rank: int, dp_rank_list: list):
    proc = _proc()
    proc.dp_group = [int(r) for r in dp_rank_list]
    proc.send_info()


def tft_set_step_args(args):
    _proc().step_args = args


# ----------------------------------------------------------------------------- callbacks
def _register(name: str, func: Callable, ctx=None):
    if not callable(func):
        raise ConfigError(f"tft_register_{name}_handler needs a callable, got {type(func).__name__}")
    _rt.callbacks[name] = (func, ctx)


def tft_register_save_ckpt_handler(func: Callable, ctx=None): _register("save_ckpt", func, ctx)
def tft_register_rename_handler(func: Callable, ctx=None): _register("rename", func, ctx)
def tft_register_exit_handler(func: Callable, ctx=None): _register("exit", func, ctx)
def tft_register_stop_handler(func: Callable, ctx=None): _register("stop", func, ctx)
def tft_register_clean_handler(func: Callable, ctx=None): _register("clean", func, ctx)
def tft_register_rebuild_group_handler(func: Callable, ctx=None): _register("rebuild_group", func, ctx)
def tft_register_repair_handler(func: Callable, ctx=None): _register("repair", func, ctx)
def tft_register_rollback_handler(func: Callable, ctx=None): _register("rollback", func, ctx)
def tft_register_stream_sync_handler(func: Callable, ctx=None): _register("stream_sync", func, ctx)
def tft_register_zit_downgrade_rebuild_handler(func: Callable, ctx=None): _register("zit_downgrade_rebuild", func, ctx)
def tft_register_zit_upgrade_rebuild_handler(func: Callable, ctx=None): _register("zit_upgrade_rebuild", func, ctx)
def tft_register_zit_upgrade_repair_handler(func: Callable, ctx=None): _register("zit_upgrade_repair", func, ctx)
def tft_register_zit_upgrade_rollback_handler(func: Callable, ctx=None): _register("zit_upgrade_rollback", func, ctx)
def tft_register_decrypt_handler(decryptor: Callable): _register("decrypt", decryptor)


def tft_register_exception_handler(fault_pattern: str, fault_type, fault_handle=None):
    """Add a pattern (checked before the reference table); ``fault_handle(exc)`` runs when it matches."""
    if not isinstance(fault_pattern, str) or not fault_pattern:
        raise ConfigError("fault_pattern must be a non-empty string")
    _rt.user_patterns.append((fault_pattern, ReportState(fault_type), fault_handle))


# ----------------------------------------------------------------------------- main-thread helpers
def tft_report_error(error_type, error_code=''):
    _proc().report(ReportState(error_type), str(error_code) or ReportState(error_type).name)


def tft_wait_next_action() -> int:
    """Park until the controller decides: 0 = RETRY (train again), 1 = EXIT (see decorator)."""
    action, _code = _proc().wait_next_action()
    return int(action)


def tft_get_repair_step():
    return _proc().repair_step


def tft_get_repair_type():
    return _proc().repair_type


def tft_is_reboot_node():
    """True in a process started to replace a failed one (recover-in-place / recover; reboot.py)."""
    from . import reboot
    return reboot.is_reboot()


def tft_get_reboot_type():
    """"arf" (recover-in-place / recover) or "hot switch" in a replacement process, else ""."""
    from . import reboot
    return reboot.reboot_type()


def tft_reset_limit_step():
    _proc().reset_limit_step()


def tft_report_load_ckpt_step(step: int):
    if step < 0:
        raise ConfigError(f"tft_report_load_ckpt_step: step {step} must be >= 0")
    _rt.load_ckpt_step = step


def tft_pause_train(cur_step: int):
    _proc().pause_train(cur_step)


def tft_can_do_uce_repair(hbm_error_time: int, start_time: int = None, end_time: int = None):
    from .policy import can_do_uce_repair
    start = _rt.update_window[0] if start_time is None else start_time
    end = _rt.update_window[1] if end_time is None else end_time
    return can_do_uce_repair(hbm_error_time, start, end)


def tft_set_update_start_time(start_time: int = None):
    """Start of the optimizer update window (ns since the epoch, as ``time.time_ns()``)."""
    _rt.update_window[:] = [time.time_ns() if start_time is None else start_time, None]


def tft_set_update_end_time(end_time: int = None):
    _rt.update_window[1] = time.time_ns() if end_time is None else end_time


# ----------------------------------------------------------------------------- cluster brain
def tft_notify_controller_dump():
    return _ctl().notify_dump()


def _fault_ranks(fault_ranks) -> dict:
    if not isinstance(fault_ranks, dict):
        raise ConfigError(f"fault_ranks must be a dict {{rank: errorType (0 UCE, 1 other)}}, got "
                          f"{type(fault_ranks).__name__}")
    for rank, kind in fault_ranks.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 100000 or kind not in (0, 1):
            raise ConfigError(f"fault_ranks entry {rank!r}: {kind!r}: need rank in [0, 100000] and errorType "
                              f"0 (UCE) or 1 (other)")
    return fault_ranks


def tft_notify_controller_stop_train(fault_ranks: dict, stop_type: str = "stop", timeout: int = None):
    """"stop": the ranks in ``fault_ranks`` failed (incident flow). "pause": every rank pauses at one step
    inside tft_pause_train and waits up to ``timeout`` s (None/0: TTP_NORMAL_ACTION_TIME_LIMIT) for
    change_strategy("continue" | "dump" | "exit"); without an answer training continues (pause.py)."""
    if stop_type not in ("stop", "pause"):
        raise ConfigError(f"stop_type {stop_type!r}: use 'stop' or 'pause'")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        raise ConfigError(f"timeout {timeout!r}: use a non-negative number of seconds or None")
    ranks = _fault_ranks(fault_ranks or {} if stop_type == "pause" else fault_ranks)
    if stop_type == "pause":
        return _ctl().notify_pause(ranks, timeout)
    return _ctl().notify_stop_train(ranks)


def tft_notify_controller_on_global_rank(fault_ranks: dict, time: int = 1):
    """The global fault ranks; ``time`` (1-3600 s, set from MINDIO_WAIT_MINDX_TIME by the caller in the
    reference) bounds the wait for change_strategy in this incident's negotiation."""
    if isinstance(time, bool) or not isinstance(time, (int, float)) or not 1 <= time <= 3600:
        raise ConfigError(f"time {time!r}: use seconds in [1, 3600]")
    ranks = _fault_ranks(fault_ranks)
    return _ctl().notify_stop_train(ranks, wait=time)


def tft_notify_controller_prepare_action(action: str, fault_ranks: dict = None):
    """"hot switch": move the ranks in ``fault_ranks`` ({rank: errtype 0..2}) to backup processes at a step
    boundary, no step lost; "stop switch": cancel a hot switch waiting for its decision (hotswitch.py).
    0 accepted, 1 refused (logged: not in NORMAL training, no launcher agent to start backups, ...)."""
    if action not in ("hot switch", "stop switch"):
        raise ConfigError(f"prepare_action {action!r}: use 'hot switch' or 'stop switch'")
    ctl = _ctl()
    ranks = []
    if action == "hot switch":
        if not isinstance(fault_ranks, dict) or not fault_ranks:
            raise ConfigError("prepare_action('hot switch') needs fault_ranks {rank: errtype}: the ranks to move")
        for rank, kind in fault_ranks.items():
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ctl.world_size \
                    or kind not in (0, 1, 2):
                raise ConfigError(f"fault_ranks entry {rank!r}: {kind!r}: need a rank in [0, {ctl.world_size}) "
                                  f"(the job's world size) and errtype 0, 1 or 2")
        ranks = sorted(fault_ranks)
    return ctl.notify_prepare_action(action, ranks)


def tft_notify_controller_change_strategy(strategy: str, params: str = ""):
    if strategy not in _STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {list(_STRATEGIES)}")
    return _ctl().change_strategy(strategy)


def tft_register_mindx_callback(action: str, func: Callable):
    if action not in _MINDX_ACTIONS:
        raise ConfigError(f"mindx callback action {action!r} is not one of {list(_MINDX_ACTIONS)}")
    if not callable(func):
        raise ConfigError("tft_register_mindx_callback needs a callable")
    _ctl().mindx[action] = func
    return 0


def tft_query_high_availability_switch():
    return _rt.controller is not None or _rt.processor is not None

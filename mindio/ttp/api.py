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
import os
import time
from typing import Callable

from .. import _knobs, _logging
from ..errors import ConfigError
from ..vocab import MINDX_STRATEGIES, REPLACING
from .processor import preempt
from .wire import transport
from ._enums import ReportState
from ._runtime import state as _rt
from .controller.brain import Brain, load_table
from .controller.controller import Controller
from .processor.processor import Processor

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

from ..launch import failures as _failures  # noqa: E402

_failures.install_excepthook()  # a refused setting ends a rank with one line, not a traceback (torchrun too)
_STRATEGIES = MINDX_STRATEGIES
_MINDX_ACTIONS = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")


def _proc() -> Processor:
    if _rt.processor is None:
        raise RuntimeError("no processor in this process: call tft_init_processor and tft_start_processor first")
    return _rt.processor


def _ctl() -> Controller:
    if _rt.controller is None:
        raise RuntimeError("no controller in this process: call tft_init_controller and tft_start_controller first")
    return _rt.controller



# ----------------------------------------------------------------------------- launcher
_REPLACING = set(REPLACING)


def _hosted_elsewhere() -> bool:
    """Does a launcher (mindio-run's node-0 agent) or another process host this job's controller?
    (MINDIO_CONTROLLER_EXTERNAL, set for the workers with TTP_ADDR, TTP_PORT and MINDIO_SECRET)"""
    return bool(_knobs.get("MINDIO_CONTROLLER_EXTERNAL"))


def _check_replacer(asked_by: str) -> None:
    """Worker reboot (recover-in-place / recover) replaces a failed process, which only a launcher can:
    fail now, with what to change (mindio.launch.needs), instead of exiting with EXIT_CODE_FAULT at the
    first fault. As the reference: an ERROR log line, then the exception."""
    from ..launch.needs import require_replacer

    try:
        require_replacer(f"worker reboot ({asked_by})")
    except ConfigError as exc:
        _log.error("%s", exc)
        raise


# ----------------------------------------------------------------------------- controller
def tft_init_controller(rank: int, world_size: int, enable_local_copy: bool, enable_arf=False, enable_zit=False):
    """Prepare this process to host the job's controller; start it with :func:`tft_start_controller`.

    Args:
        rank: this process's training rank, or -1 when a launcher agent hosts the controller.
        world_size: number of training ranks, 1 to 100000.
        enable_local_copy: accepted for the reference; mindio keeps no local copy of the optimizer state
            (its copies are the replicas on other ranks, :func:`tft_set_optimizer_replica`).
        enable_arf: add ``recover-in-place`` and ``recover`` (process replacement) to the strategies.
        enable_zit: add ``elastic-training``.

    The strategies the controller may use are ``HIGH_AVAILABILITY`` (a comma list) when set, else ``dump``,
    plus what ``enable_arf`` / ``enable_zit`` add, plus what the processors ask for when they register
    (``enable_uce`` on every rank: ``retry``; docs/quickstart.md). Under ``mindio-run --high-availability``
    (``MINDIO_CONTROLLER_EXTERNAL=1``) the launcher hosts the controller: a training rank (``rank`` >= 0)
    then prepares none, and :func:`tft_start_controller` starts none. Also configures mindio's logging.

    Returns:
        None.
    Raises:
        ConfigError: ``rank`` outside [-1, world_size) or ``world_size`` outside [1, 100000];
            a malformed ``HIGH_AVAILABILITY``; worker reboot (``enable_arf`` or ``recover*`` in
            ``HIGH_AVAILABILITY``) without a launcher that replaces processes (the message says what to add).
    """
    if not -1 <= rank < world_size or not 1 <= world_size <= 100000:
        raise ConfigError(f"tft_init_controller: rank {rank} must be in [-1, world_size) and world_size "
                          f"{world_size} in [1, 100000]")
    _logging.setup(rank=rank)
    if rank >= 0 and _hosted_elsewhere():
        _log.info("tft_init_controller: this job's controller is hosted outside the training ranks "
                  "(MINDIO_CONTROLLER_EXTERNAL=1, mindio-run --high-availability); rank %d starts none", rank)
        _rt.controller_init = None
        _rt.controller_external = True
        return
    asked = set(_knobs.get("HIGH_AVAILABILITY"))
    if enable_arf:
        _check_replacer("tft_init_controller(enable_arf=True), --enable-worker-reboot")
    if asked & _REPLACING:
        _check_replacer(f"HIGH_AVAILABILITY={','.join(sorted(asked))}")
    # HIGH_AVAILABILITY and the flags both ask (the reference: the variable turns the script's flags on);
    # the processors' flags add theirs once they registered (Controller.job_strategies)
    enabled = (asked or {"dump"}) | (_REPLACING if enable_arf else set()) | (
        {"elastic-training"} if enable_zit else set())
    _rt.controller_init = {"rank": rank, "world_size": world_size, "enabled": enabled}


def _start(bind_ip, port, enable_tls, tls_info, primary=None):
    if _rt.controller_external:
        return  # tft_init_controller: the launcher hosts it
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
    transport.publish_secret()  # only once it listens: see job_secret
    _rt.controller = ctl


def tft_start_controller(bind_ip: str, port: int, enable_tls=True, tls_info=''):
    """Start the controller (after :func:`tft_init_controller`): it listens on ``bind_ip:port``,
    watches every rank's heartbeats and drives each recovery.

    Args:
        bind_ip: a concrete address of this host (not ``""`` or ``0.0.0.0``).
        port: 1024 to 65535 (``TTP_PORT`` in the examples).
        enable_tls: with CURVE keys in ``tls_info``, encrypt the control traffic and authenticate the
            controller. Without keys the frames are signed with the job secret but not encrypted, and a
            warning says so once (docs/ttp.md, "Encryption").
        tls_info: a dict, JSON, or the reference's ``"field: value; field: value"`` text with
            ``server_secret`` (needed here), ``server_public``, optional ``client_public`` / ``client_secret``;
            a value may be a z85 key or a file holding one.

    The job secret that signs every frame is ``MINDIO_SECRET``, else generated here and published in the
    torch.distributed store (so call ``init_process_group`` first). The fault table (``MINDIO_FAULT_TABLE``)
    is read now, so a bad one fails here and not at the first fault.

    Returns:
        None.
    Raises:
        RuntimeError: :func:`tft_init_controller` was not called.
        ConfigError: bad address or port, bad or missing keys, a bad fault table.
    """
    _start(bind_ip, port, enable_tls, tls_info)


def start_backup_controller(bind_ip: str, port: int, primary_ip: str, primary_port: int, enable_tls=True,
                            tls_info=''):
    """Start a passive backup controller (mindio's; the reference starts backups itself). Call
    :func:`tft_init_controller` first. It takes over when the primary at ``primary_ip:primary_port`` goes
    silent and more than half of the ranks registered with it.

    Args:
        bind_ip, port: where this backup listens (as :func:`tft_start_controller`).
        primary_ip, primary_port: the primary controller's address.
        enable_tls, tls_info: as :func:`tft_start_controller`; the backup's own link to the primary is a
            CURVE client too.

    Returns:
        None.
    Raises:
        RuntimeError, ConfigError: as :func:`tft_start_controller`.
    """
    _start(bind_ip, port, enable_tls, tls_info, primary=f"tcp://{primary_ip}:{int(primary_port)}")


def tft_destroy_controller():
    """Stop this process's controller (its threads and socket). A no-op when there is none.

    Returns:
        None.
    """
    if _rt.controller is not None:
        _rt.controller.destroy()
        _rt.controller = None


# ----------------------------------------------------------------------------- processor
def tft_init_processor(rank: int, world_size: int, enable_local_copy: bool, enable_tls=True, tls_info='',
                       enable_uce=True, enable_arf=False, enable_zit=False):
    """Create this rank's processor (the agent inside the training process); register the
    callbacks next, then :func:`tft_start_processor`.

    Args:
        rank: this process's rank, 0 <= rank < world_size.
        world_size: number of training ranks, at most 100000.
        enable_local_copy: accepted for the reference (see :func:`tft_init_controller`).
        enable_tls, tls_info: as :func:`tft_start_controller`; a processor needs ``server_public``.
        enable_uce: this rank may be repaired in place (step retry); with it on every rank the
            controller enables retry (which also needs the repair and rollback handlers on every rank).
        enable_arf: this rank may be replaced by a new process (recover / recover-in-place); needs
            ``mindio-run --high-availability`` (refused at once elsewhere, saying what to add).
        enable_zit: this rank takes part in elastic training (downgrade / upgrade).

    Returns:
        None.
    Raises:
        ConfigError: ``rank`` / ``world_size`` out of range, bad or missing CURVE keys; worker reboot
            asked for (``enable_arf``, ``recover*`` in ``HIGH_AVAILABILITY``) where no launcher replaces
            processes.
    """
    if enable_arf:
        _check_replacer("tft_init_processor(enable_arf=True), --enable-worker-reboot")
    if set(_knobs.get("HIGH_AVAILABILITY")) & _REPLACING:
        _check_replacer(f"HIGH_AVAILABILITY={','.join(_knobs.get('HIGH_AVAILABILITY'))}")
    curve = transport.curve_options(enable_tls, tls_info, server=False)
    proc = Processor(rank, world_size, enable_uce=enable_uce, enable_arf=enable_arf, enable_zit=enable_zit,
                     curve=curve)
    proc.callbacks = _rt.callbacks
    _rt.processor = proc
    _logging.setup(rank=rank)


def tft_start_processor(master_ip: str, port: int, local_ip=''):
    """Connect this rank's processor to the controller at ``master_ip:port`` and register; blocks
    until registered.

    Args:
        master_ip: the controller's address.
        port: the controller's port, 1024 to 65535.
        local_ip: accepted for the reference; the connection's own address is used.

    The job secret comes from ``MINDIO_SECRET`` or the torch.distributed store (``init_process_group``
    first). Under ``mindio-run --high-availability`` (``MINDIO_CONTROLLER_EXTERNAL=1``) the processor
    connects to the controller the launcher hosts (``TTP_ADDR``, ``TTP_PORT``) whatever is passed here.

    Called from the main thread, it also handles ``MINDIO_PREEMPT_SIGNAL`` (default SIGTERM) unless the
    script handles that signal itself: the signal asks the controller for a last-words checkpoint at the
    current step, after which this process exits with 75 (mindio.ttp.processor.preempt, docs/recovery.md).

    Returns:
        None.
    Raises:
        ConnectionError: no controller answered within ``TTP_RETRY_TIMES`` attempts (the message names the
            address and what to check).
        ConfigError: ``port`` out of range; no secret available.
    """
    if _hosted_elsewhere() and os.environ.get("TTP_PORT"):  # mindio-run tells its workers where it is
        hosted = (_knobs.get("TTP_ADDR") or _knobs.get("CONTROLLER_ADDR") or master_ip, _knobs.get("TTP_PORT"))
        if hosted != (master_ip, int(port)):
            _log.info("tft_start_processor: the controller is hosted at %s:%d (TTP_ADDR, TTP_PORT); connecting "
                      "there, not to %s:%s", hosted[0], hosted[1], master_ip, port)
        master_ip, port = hosted
    if not 1024 <= int(port) <= 65535:
        raise ConfigError(f"controller port {port} must be in [1024, 65535]")
    addr = f"tcp://{master_ip}:{int(port)}"
    if _hosted_elsewhere() and _knobs.get("MINDIO_RELAY_ADDR"):  # through the node agent's relay (wire/relay.py)
        addr = _knobs.get("MINDIO_RELAY_ADDR")
    _proc().start(addr, transport.job_secret(create=False, controller=addr))
    preempt.install()  # MINDIO_PREEMPT_SIGNAL (SIGTERM) -> a last-words checkpoint (preempt.py)


def tft_destroy_processor():
    """Leave: the processor says BYE (the controller counts this rank as finished, not failed)
    and closes its connection. A no-op when there is none; the decorator already did this when
    ``train()`` returned.

    Returns:
        None.
    """
    if _rt.processor is not None:
        _rt.processor.destroy(reason="destroyed")
        _rt.processor = None


def tft_start_updating_os(backup_step: int = -1):
    """Call right before the optimizer step: this rank's optimizer state becomes UPDATING.

    Blocks while the controller holds the step fence (a stop is in progress or a pause limit is reached);
    when the controller stops training on this rank it raises ``RuntimeError("FORCE STOP ...")``, which
    :func:`tft_exception_handler` reports as a stop, not as a fault.

    Args:
        backup_step: accepted for the reference (the step of a local backup copy); recorded.

    Returns:
        None.
    Raises:
        RuntimeError: no processor (call :func:`tft_init_processor` and :func:`tft_start_processor`), or
            "FORCE STOP" as above.
    """
    _proc().start_updating_os(backup_step)


def tft_start_copy_os():
    """Mark this rank's optimizer state COPYING (the reference: a local copy is being made).

    Returns:
        None.
    """
    _proc().start_copy_os()


def tft_end_updating_os(step: int):
    """Call right after the optimizer step: this rank's state is complete for ``step``
    (``step``, UPDATED). A dump or a repair uses only ranks whose state is UPDATED at the lock step.

    Args:
        step: the iteration just completed, >= 1.

    Returns:
        None.
    Raises:
        ConfigError: ``step`` < 1.
    """
    if step < 1:
        raise ConfigError(f"tft_end_updating_os: step {step} must be a positive integer")
    _proc().end_updating_os(step)


def tft_set_optimizer_replica(rank: int, replica_info: list):
    """Tell the controller where the copies of this rank's optimizer shards live; it decides
    from this who writes each shard in a dump and who repairs whom.

    Args:
        rank: this rank.
        replica_info: one dict per optimizer type (index 0: dense / ``OptimizerType.ATTENTION``, 1: MoE):
            ``rank_list`` (the ranks of the data-parallel group), ``replica_cnt`` (copies of each shard;
            the group's size must be divisible by it), ``replica_shift`` (default 0).

    Returns:
        None.
    Raises:
        ConfigError: a malformed entry, or a group not divisible by its ``replica_cnt``.
    """
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
    """Tell the controller this rank's data-parallel group.

    Args:
        rank: this rank.
        dp_rank_list: the ranks of its data-parallel group.

    Returns:
        None.
    """
    proc = _proc()
    proc.dp_group = [int(r) for r in dp_rank_list]
    proc.send_info()


def tft_set_step_args(args):
    """Set the object every callback receives as ``args`` (e.g. the model, optimizer and
    scheduler). Until it is called, the callbacks get the positional arguments of the decorated
    ``train()``, as in the reference.

    Args:
        args: any object.

    Returns:
        None.
    """
    _proc().step_args = args


# ----------------------------------------------------------------------------- callbacks
def _register(name: str, func: Callable, ctx=None):
    if not callable(func):
        raise ConfigError(f"tft_register_{name}_handler needs a callable, got {type(func).__name__}")
    _rt.callbacks[name] = (func, ctx)


def tft_register_save_ckpt_handler(func: Callable, ctx=None):
    """Register the **dump** callback (last-words checkpoint):
    ``func(step, save_info, args, ctx)``, run on the ranks the controller chose to save.

    ``step`` is the lock step; ``save_info`` is ``[{"type": optimizer type, "ranks": [ranks that save
    this type's shards]}, ...]``; ``args`` as :func:`tft_set_step_args`. Raise to fail the dump: the job
    then exits with ``EXIT_CODE_FAULT`` (76) instead of ``EXIT_CODE_DUMPED`` (75).

    Args:
        func: the callback.
        ctx: passed back to it as ``ctx``.

    Returns:
        None.
    Raises:
        ConfigError: ``func`` is not callable (the same for every ``tft_register_*_handler``).
    """
    _register("save_ckpt", func, ctx)
def tft_register_rename_handler(func: Callable, ctx=None):
    """Register the callback that makes a completed dump the latest checkpoint:
    ``func(step, args, ctx)`` (e.g. write the tracker file), run after every chosen rank saved.

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("rename", func, ctx)
def tft_register_exit_handler(func: Callable, ctx=None):
    """Register ``func(ctx)``, run on every rank before the process leaves after the
    controller's EXIT (after a dump, or when no strategy is possible).

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("exit", func, ctx)
def tft_register_stop_handler(func: Callable, ctx=None):
    """Register the **stop** callback ``func(args, ctx)``: the first half of a rank's
    teardown (stop the device's work), run by the decorator on a rank whose ``train()`` raised, and in
    the clean action of retry / recover.

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("stop", func, ctx)
def tft_register_clean_handler(func: Callable, ctx=None):
    """Register the **clean** callback ``func(is_uce_error, args, ctx)``: drop every
    reference the framework's own objects hold to process groups (a DDP module, a group kept in a
    global); after it mindio destroys every group still registered, the default one included, so peers
    blocked with this rank are released and new groups can be built (without a clean callback mindio does
    that alone). It returns 0 (ok), 1 (failed) or 2 (no rebuild needed).

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("clean", func, ctx)
def tft_register_rebuild_group_handler(func: Callable, ctx=None):
    """Register the **rebuild** callback ``func(fault_ranks, args, ctx)``: re-create the
    framework's process groups after mindio built the new default group (retry, recover).

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("rebuild_group", func, ctx)
def tft_register_repair_handler(func: Callable, ctx=None):
    """Register the **repair** callback ``func(step, need_rebuild, error_ranks,
    repair_info, args, ctx)``: a point-to-point transfer of one optimizer shard between a replica and the
    rank that lost it (retry, recover), called once per pair on both ends.

    ``repair_info`` is ``{"type": optimizer type, "repair_type": "RT_SEND" on the source, else
    "RT_UCE_LOWLEVEL", "RT_UCE_HIGHLEVEL" (``need_rebuild`` True: model and optimizer are rebuilt first) or
    "RT_RECV_REPAIR" (a replacement process), "src": [rank], "dst": [rank], "rank_list": [src, dst]}``.
    mindio passes the :class:`RepairType` *name*; the reference passes its value (docs/migration.md).

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("repair", func, ctx)
def tft_register_rollback_handler(func: Callable, ctx=None):
    """Register the **rollback** callback ``func(step, args, ctx)``: put the iteration,
    scheduler, data iterator and parameters back to the end of ``step`` (the lock step) before training
    resumes.

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("rollback", func, ctx)
def tft_register_stream_sync_handler(func: Callable, ctx=None):
    """Register ``func()``, run when a rank reaches a graceful pause (device streams
    synchronised before the job is held).

    Args:
        func: the callback.
        ctx: accepted for the reference; not passed.

    Returns:
        None.
    """
    _register("stream_sync", func, ctx)
def tft_register_zit_downgrade_rebuild_handler(func: Callable, ctx=None):
    """Register the elastic **downgrade** callback
    ``func(new_dp_ranks, new_world_ranks, args, ctx)``: rebuild the groups of the smaller job after the
    data-parallel slices holding the faulty ranks were removed.

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("zit_downgrade_rebuild", func, ctx)
def tft_register_zit_upgrade_rebuild_handler(func: Callable, ctx=None):
    """Register the elastic **upgrade** rebuild callback ``func(rank_list, args, ctx)``:
    rebuild the groups of the full-size job when removed ranks come back.

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("zit_upgrade_rebuild", func, ctx)
def tft_register_zit_upgrade_repair_handler(func: Callable, ctx=None):
    """Register the elastic **upgrade** repair callback, with the arguments of
    :func:`tft_register_repair_handler`: the returning ranks get their shards from replicas.

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("zit_upgrade_repair", func, ctx)
def tft_register_zit_upgrade_rollback_handler(func: Callable, ctx=None):
    """Register the elastic **upgrade** rollback callback ``func(step, args, ctx)``.

    Args:
        func: the callback.
        ctx: passed back to it.

    Returns:
        None.
    """
    _register("zit_upgrade_rollback", func, ctx)
def tft_register_decrypt_handler(decryptor: Callable):
    """Register ``decryptor``, accepted for the reference (it decrypts the reference's TLS
    private-key password). mindio's CURVE keys are not encrypted, so it is stored and not called.

    Args:
        decryptor: a callable.

    Returns:
        None.
    """
    _register("decrypt", decryptor)


def tft_register_exception_handler(fault_pattern: str, fault_type, fault_handle=None):
    """Add a fault pattern, checked before the built-in table when the decorated
    ``train()`` raises: an exception whose ``"Type: message"`` contains ``fault_pattern`` is reported as
    ``fault_type``; ``fault_handle(message)`` runs first when given.

    Args:
        fault_pattern: a non-empty substring of the error text.
        fault_type: a :class:`ReportState` member, value or name (``"RS_RETRY"``).
        fault_handle: optional callable taking the error text.

    Returns:
        None.
    Raises:
        ConfigError: an empty pattern. ValueError / KeyError: an unknown ``fault_type``.
    """
    if not isinstance(fault_pattern, str) or not fault_pattern:
        raise ConfigError("fault_pattern must be a non-empty string")
    state = ReportState[fault_type] if isinstance(fault_type, str) and fault_type in ReportState.__members__ \
        else ReportState(fault_type)  # a name ("RS_RETRY", as MindSpeed-LLM passes it), a member or a value
    _rt.user_patterns.append((fault_pattern, state, fault_handle))


# ----------------------------------------------------------------------------- main-thread helpers
def tft_report_error(error_type, error_code=''):
    """Report this rank's failure to the controller yourself (the decorator does it for you).

    Args:
        error_type: a :class:`ReportState` (``RS_UCE``, ``RS_HCCL_FAILED``, ``RS_UNKNOWN``, ...; ``RS_NORMAL``:
            this rank is fine, it was stopped or released by a peer's failure).
        error_code: free text sent with the report (default: the state's name).

    Returns:
        None.
    Raises:
        RuntimeError: no processor. ValueError: not a ReportState value.
    """
    _proc().report(ReportState(error_type), str(error_code) or ReportState(error_type).name)


def tft_wait_next_action() -> int:
    """Park the calling (main) thread until the controller decides what this rank does next.

    Returns:
        ``Action.RETRY`` (0): train again -- the groups are rebuilt, the state repaired and rolled back to
        the lock step (:func:`tft_get_repair_step`); ``Action.EXIT`` (1): leave (the decorator exits with the
        code the controller gave: 75 after a dump, 76 otherwise). EXIT too when no controller was reachable
        for 30 s.
    Raises:
        RuntimeError: no processor.
    """
    action, _code = _proc().wait_next_action()
    return int(action)


def tft_get_repair_step():
    """The step the last recovery rolled this rank back to (the lock step), 0 before any.

    Returns:
        int.
    """
    return _proc().repair_step


def tft_get_repair_type():
    """What the last recovery on this rank was.

    Returns:
        ``"retry"``, ``"recover"``, ``"dump"`` or ``"unknown"`` (none yet).
    """
    return _proc().repair_type


def tft_is_reboot_node():
    """Is this process a replacement for a failed one (recover-in-place, recover or a hot
    switch backup)? Such a process gets its state from replicas, not from a checkpoint.

    Returns:
        bool.
    """
    from .processor import reboot
    return reboot.is_reboot()


def tft_get_reboot_type():
    """Why this process was started.

    Returns:
        ``"arf"`` (recover-in-place / recover) or ``"hot switch"`` in a replacement process, ``""`` otherwise.
    """
    from .processor import reboot
    return reboot.reboot_type()


def tft_reset_limit_step():
    """Remove the step limit a graceful pause set on this rank (training may run past it).

    Returns:
        None.
    """
    _proc().reset_limit_step()


def tft_report_load_ckpt_step(step: int):
    """Report the step of the checkpoint this rank loaded (a repair that fell back to the
    periodic checkpoint).

    Args:
        step: >= 0.

    Returns:
        None.
    Raises:
        ConfigError: ``step`` < 0.
    """
    if step < 0:
        raise ConfigError(f"tft_report_load_ckpt_step: step {step} must be >= 0")
    _rt.load_ckpt_step = step


def tft_pause_train(cur_step: int):
    """Call at the end of every iteration: the point where a graceful pause or a hot switch
    holds this rank (it blocks here while the controller pauses the job at ``cur_step``).

    Args:
        cur_step: the iteration just completed.

    Returns:
        None.
    """
    _proc().pause_train(cur_step)


def tft_can_do_uce_repair(hbm_error_time: int, start_time: int = None, end_time: int = None):
    """Can a memory error at ``hbm_error_time`` be repaired from a replica? No when it falls
    inside the optimizer update window (the state may be half updated).

    Args:
        hbm_error_time: when the error happened, ns since the epoch (``time.time_ns()``).
        start_time, end_time: the update window; default: the one set by :func:`tft_set_update_start_time`
            / :func:`tft_set_update_end_time`.

    Returns:
        bool.
    """
    from .controller.policy import can_do_uce_repair
    start = _rt.update_window[0] if start_time is None else start_time
    end = _rt.update_window[1] if end_time is None else end_time
    return can_do_uce_repair(hbm_error_time, start, end)


def tft_set_update_start_time(start_time: int = None):
    """Mark the start of the optimizer update window (ns since the epoch, as
    ``time.time_ns()``; default: now). Clears the window's end.

    Args:
        start_time: optional time in ns.

    Returns:
        None.
    """
    _rt.update_window[:] = [time.time_ns() if start_time is None else start_time, None]


def tft_set_update_end_time(end_time: int = None):
    """Mark the end of the optimizer update window (ns since the epoch; default: now).

    Args:
        end_time: optional time in ns.

    Returns:
        None.
    """
    _rt.update_window[1] = time.time_ns() if end_time is None else end_time


# ----------------------------------------------------------------------------- cluster brain
def tft_notify_controller_dump():
    """Ask the controller for a graceful dump now (the cluster brain's call): every rank stops
    at one step, a checkpoint is written and the job exits with 75.

    Returns:
        0 accepted; 1 refused (the controller is not in NORMAL training).
    Raises:
        RuntimeError: no controller in this process.
    """
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
    """The cluster brain's stop.

    Args:
        fault_ranks: ``{rank: errorType}``, errorType 0 (UCE) or 1 (other): with ``stop_type="stop"``
            these ranks failed and an incident opens (or widens) for them.
        stop_type: ``"stop"``, or ``"pause"``: every rank parks at one step inside :func:`tft_pause_train`
            and waits for ``tft_notify_controller_change_strategy("continue" | "dump" | "exit")``.
        timeout: seconds a pause waits for that answer (None / 0: ``TTP_NORMAL_ACTION_TIME_LIMIT``); without
            an answer training continues.

    Returns:
        0 accepted, 1 refused.
    Raises:
        ConfigError: a bad ``stop_type``, ``timeout`` or ``fault_ranks``. RuntimeError: no controller.
    """
    if stop_type not in ("stop", "pause"):
        raise ConfigError(f"stop_type {stop_type!r}: use 'stop' or 'pause'")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        raise ConfigError(f"timeout {timeout!r}: use a non-negative number of seconds or None")
    ranks = _fault_ranks(fault_ranks or {} if stop_type == "pause" else fault_ranks)
    if stop_type == "pause":
        return _ctl().notify_pause(ranks, timeout)
    return _ctl().notify_stop_train(ranks)


def tft_notify_controller_on_global_rank(fault_ranks: dict, time: int = 1):
    """The cluster brain's list of the job's fault ranks (all hosts):
    opens or widens the incident like :func:`tft_notify_controller_stop_train`.

    Args:
        fault_ranks: ``{rank: errorType}`` as there.
        time: seconds (1 to 3600) this incident's negotiation waits for
            :func:`tft_notify_controller_change_strategy` (the reference sets it from ``MINDIO_WAIT_MINDX_TIME``).

    Returns:
        0.
    Raises:
        ConfigError: bad arguments. RuntimeError: no controller.
    """
    if isinstance(time, bool) or not isinstance(time, (int, float)) or not 1 <= time <= 3600:
        raise ConfigError(f"time {time!r}: use seconds in [1, 3600]")
    ranks = _fault_ranks(fault_ranks)
    return _ctl().notify_stop_train(ranks, wait=time)


def tft_notify_controller_prepare_action(action: str, fault_ranks: dict = None):
    """Start or cancel a hot switch.

    Args:
        action: ``"hot switch"``: move the ranks in ``fault_ranks`` (``{rank: errtype 0..2}``) to backup
            processes at a step boundary, losing no step; ``"stop switch"``: cancel a hot switch still
            waiting for its decision.
        fault_ranks: required for ``"hot switch"``.

    Returns:
        0 accepted; 1 refused (the reason is logged: not in NORMAL training, no launcher agent to start the
        backups, ...).
    Raises:
        ConfigError: bad arguments. RuntimeError: no controller.
    """
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
    """The cluster brain's answer: the strategy for the current incident (it
    answers the ``report_strategies`` callback) or the end of a pause.

    Args:
        strategy: ``retry``, ``downgrade``, ``upgrade``, ``recover``, ``dump``, ``continue``, ``migration``
            or ``exit``.
        params: accepted for the reference.

    Returns:
        0.
    Raises:
        ConfigError: an unknown strategy. RuntimeError: no controller.
    """
    if strategy not in _STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {list(_STRATEGIES)}")
    return _ctl().change_strategy(strategy)


def tft_register_mindx_callback(action: str, func: Callable):
    """Register a cluster-brain callback, called by the controller during an incident.

    Args:
        action: ``report_fault_ranks`` ``func(error_ranks)``, ``report_stop_complete``
            ``func(code, message, error_ranks)``, ``report_strategies`` ``func(error_ranks, strategies)`` (answer
            with :func:`tft_notify_controller_change_strategy`), ``report_result``
            ``func(code, message, error_ranks, strategy)``. ``error_ranks`` is ``{rank: 0 UCE | 1 other}``;
            codes: 0 ok, 404 not ready, 405 retry failed, 406 dump or exit only, 499 exit only.
        func: the callback.

    Returns:
        0.
    Raises:
        ConfigError: an unknown action or a non-callable. RuntimeError: no controller.
    """
    if action not in _MINDX_ACTIONS:
        raise ConfigError(f"mindx callback action {action!r} is not one of {list(_MINDX_ACTIONS)}")
    if not callable(func):
        raise ConfigError("tft_register_mindx_callback needs a callable")
    _ctl().mindx[action] = func
    return 0


def tft_query_high_availability_switch():
    """Is fault tolerance on in this process (a controller or a processor exists)?

    Returns:
        bool.
    """
    return _rt.controller is not None or _rt.processor is not None

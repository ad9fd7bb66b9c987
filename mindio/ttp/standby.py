"""Elastic training (MindIO ZIT), rank side: the standby process that offers a removed rank back after
a downgrade (:func:`start_standby`, called by the training script; public as
``mindio.ttp.elastic.start_standby``). It starts a processor through the ``tft_*`` facade, so it sits
above api.py: nothing inside mindio.ttp imports it.
"""
from __future__ import annotations

import os
from datetime import timedelta

from ..errors import ConfigError

__all__ = ["start_standby", "wait_for_scale_out"]


def start_standby(rank: int, world_size: int, controller_ip: str, controller_port: int, master_addr: str,
                  master_port: int, backend: str = "gloo", enable_tls: bool = False, tls_info: str = "",
                  register=None) -> None:
    """In a new process offering ``rank`` back after a downgrade: start a processor that registers with
    the controller for that (removed) rank, with the job's store (``master_addr:master_port``, the
    TCPStore the survivors' world lives on) remembered for the upgrade's rebuild. No process group exists
    yet; then park the main thread with ``tft_wait_next_action()`` and enter ``train()`` on 0 (RETRY).
    ``register()`` runs after the processor exists and before it registers: register the callbacks there
    (the upgrade may start as soon as the registration arrives).
    """
    import torch.distributed as dist

    from . import api
    from .processor import inplace

    if dist.is_initialized():
        raise ConfigError("start_standby: this process already has a process group; a standby joins the "
                          "job's world only when the controller scales out")
    if not 0 <= rank < world_size:
        raise ConfigError(f"start_standby: rank {rank} must be in [0, world_size={world_size})")
    # the survivors rebuild on the store of their first default group (inplace.World.remember): the
    # env:// TCPStore under torch's prefixes "default_pg" and "<group name>/" (the first group is "0");
    # without a secret of its own (MINDIO_SECRET / _FILE), the one the controller's rank published there
    tcp = dist.TCPStore(master_addr, int(master_port), is_master=False, timeout=timedelta(seconds=60))
    base = inplace.env_store(tcp)
    from .wire import transport

    if not transport.user_secret():
        os.environ["MINDIO_SECRET"] = transport.published_secret(
            base, f"tcp://{controller_ip}:{int(controller_port)}")
    api.tft_init_processor(rank, world_size, False, enable_tls=enable_tls, tls_info=tls_info, enable_zit=True)
    proc = api._proc()
    proc.standby = True
    proc.world.base_store = base
    proc.world.pg_settings = {"backend": backend}
    if register is not None:
        register()
    api.tft_start_processor(controller_ip, controller_port)


def wait_for_scale_out() -> None:
    """In a standby, after :func:`start_standby`: park until the scale-out has taken this process in and
    repaired it, then return (the script trains). If the job ends first -- the upgrade failed, the job
    dumped, training finished -- the process ends with the controller's code, as a rank's decorator does:
    75 after a last-words checkpoint, 76 otherwise (``SystemExit``), so that the launcher and the scheduler
    see the job's outcome, not a standby's own error."""
    from . import decorator
    from ._enums import Action
    from ._runtime import state

    if state.processor is None:
        raise RuntimeError("wait_for_scale_out: no processor (call start_standby first)")
    decorator.arm_fast_exit()  # a standby never entered train(): its exit must skip the teardown too
    action, code = state.processor.wait_next_action()
    if action is not Action.RETRY:
        decorator.exit_process(state.processor, code)

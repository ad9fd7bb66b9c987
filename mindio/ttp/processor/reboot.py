"""Processor side of the strategies that *replace* a process (recover-in-place, recover, hot switch).

A replacement process is started by its launcher agent (mindio.launch) with, in its environment,

* ``MINDIO_REBOOT_GEN=<g>``   the generation the survivors rebuild their groups under;
* ``MINDIO_REBOOT_TYPE``      ``arf`` (recover-in-place / recover) or ``hot switch``.

A hot-switch *backup* (``MINDIO_SWITCH_BACKUP=<key prefix>``, mindio/launch/switch.py) is started before
the job pauses: its ``init_process_group`` first registers it (:func:`await_switch`) and waits there, while
training goes on, until the switch releases it (``join``: go on below) or is cancelled (``leave``: exit 0).
So everything the script does before ``init_process_group`` (imports, data) is done before the pause.

Then, with no change to the training script beyond what MindIO already asks for:

1. :func:`install` (called by the launcher's bootstrap before the script runs) wraps
   ``torch.distributed.init_process_group`` so that the script's ordinary call joins the survivors'
   new world: the default group is created on ``PrefixStore("mindio/gen<g>/", base)`` where ``base``
   is the store of the survivors' first default group: ``<name>/`` over the store the script would
   have used (``default_pg`` over the env:// store, as torch does, or the store the script passes) --
   exactly the store the survivors re-create their world on (inplace.World.remember). The
   framework's normal init order then creates its subgroups, matching the survivors' rebuild handler.
   Once: later calls (mindio's own rebuilds of a later incident, inplace.py) pass through unchanged.
2. ``tft_is_reboot_node()`` is true and ``tft_get_reboot_type()`` names the type: the script skips
   loading a checkpoint (its state comes from the replicas).
3. The processor registers carrying generation ``g`` (:func:`adopt`); a rank of an older generation is
   refused by the controller.
4. The decorator parks the main thread before the first ``train()`` (:func:`should_park`); the
   controller's ``prerepair`` action (:func:`prerepair`) waits for that, then repair
   (RT_RECV_REPAIR), rollback and retry run as for the retry strategy (inplace.py).
"""
from __future__ import annotations

import functools
import logging
import os
import time

from ... import _knobs
from .._enums import ActionName, MainState

__all__ = ["install", "is_reboot", "reboot_type", "reboot_gen", "await_switch", "adopt", "should_park",
           "ACTIONS", "prerepair"]

_log = logging.getLogger("mindio.ttp.reboot")


class _State:
    base_store = None      # the store the survivors' world lives on (before the generation prefix)
    installed = False
    joined = False         # the script's own init_process_group joined the survivors' world
    parked_once = False
    switch_released = False  # a hot-switch backup was told to join (await_switch)


state = _State()


def reboot_gen() -> int:
    try:
        return int(os.environ.get("MINDIO_REBOOT_GEN", "0") or 0)
    except ValueError:
        return 0


def is_reboot() -> bool:
    return reboot_gen() > 0


def reboot_type() -> str:
    return os.environ.get("MINDIO_REBOOT_TYPE", "arf") if is_reboot() else ""


def install() -> None:
    """Wrap init_process_group for a replacement process (no-op for an ordinary start)."""
    if not is_reboot() or state.installed:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.init_process_group
    gen = reboot_gen()

    @functools.wraps(original)
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                           store=None, group_name="", pg_options=None, device_id=None, **kw):
        if state.joined:  # the script's first default group joined; later ones are mindio's own rebuilds
            return original(backend=backend, init_method=init_method, timeout=timeout, world_size=world_size,
                            rank=rank, store=store, group_name=group_name, pg_options=pg_options,
                            device_id=device_id, **kw)
        await_switch()  # a hot-switch backup: wait here (registered) until the switch releases it
        if store is None:
            from datetime import timedelta
            t = timeout or timedelta(seconds=_knobs.get("MINDIO_PG_TIMEOUT"))
            it = c10d.rendezvous(init_method or "env://", rank, world_size, timeout=t)
            store, rank, world_size = next(it)
            store.set_timeout(t)
            store = dist.PrefixStore("default_pg", store)  # what torch adds for its own rendezvous
        # the survivors' base is their first default group's store: torch keys it by the group's name
        # ("0" for the first group of a process), over the store above (inplace.World.remember)
        store = dist.PrefixStore(f"{group_name or '0'}/", store)
        state.base_store = store
        t0 = time.monotonic()
        _log.warning("replacement process (generation %d): joining the survivors' world as rank %s of %s",
                     gen, rank, world_size)
        kwargs = dict(backend=backend, timeout=timeout, world_size=world_size, rank=rank,
                      store=dist.PrefixStore(f"mindio/gen{gen}/", store), group_name=group_name,
                      pg_options=pg_options, device_id=device_id, **kw)
        if timeout is None:
            kwargs.pop("timeout")
        original(**kwargs)
        state.joined = True
        _log.info("joined generation %d in %.3f s", gen, time.monotonic() - t0)

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
    state.installed = True


def await_switch() -> None:
    """(a hot-switch backup, before it joins the world) Register as the backup of this rank, then wait --
    the job still trains -- until the switch releases it (return) or is cancelled (exit 0). Before
    registering it does the one non-collective part of a model build it can: the gc freeze of the
    start-up objects (device.freeze_startup_objects, ~0.3 s with megatron-core imported). Once only."""
    key = os.environ.get("MINDIO_SWITCH_BACKUP", "")
    if not key or state.switch_released:
        return
    import sys
    from datetime import timedelta

    from torch.distributed import TCPStore

    from . import device

    rank, t0 = int(os.environ["RANK"]), time.monotonic()
    device.freeze_startup_objects()
    host, _, port = os.environ["MINDIO_AGENT_STORE"].rpartition(":")
    wait = _knobs.get("MINDIO_SWITCH_BACKUP_WAIT")  # the agent kills it sooner at a round end
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=wait))
    store.set(f"{key}/ready/{rank}", str(os.getpid()))
    _log.warning("hot-switch backup of rank %d (pid %d) registered %.3f s after its start; waiting for the "
                 "switch", rank, os.getpid(), time.monotonic() - t0)
    try:
        order = store.get(f"{key}/order/{rank}").decode()
    except RuntimeError as exc:  # the store's timeout: nobody released or dismissed us
        order = f"no order from the switch (store key {key}/order/{rank}) within {wait:.0f} s (MINDIO_SWITCH_BACKUP_WAIT; {exc})"
    if order != "join":
        _log.warning("hot-switch backup of rank %d leaves (%s): the switch was cancelled", rank, order)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    state.switch_released = True
    _log.warning("hot-switch backup of rank %d released after %.3f s: joining generation %d", rank,
                 time.monotonic() - t0, reboot_gen())


def adopt(proc) -> None:
    """(tft_start_processor) A replacement's processor starts in generation ``g`` on the base store."""
    if not is_reboot():
        return
    if state.base_store is not None:
        proc.world.base_store = state.base_store
    proc.gen = reboot_gen()
    if proc.link is not None:
        proc.link.gen = proc.gen  # the REGISTER carries it: the controller refuses older generations


def should_park(proc) -> bool:
    """(decorator, first entry) A replacement parks before train() until repaired; once only."""
    if proc is None or not is_reboot() or state.parked_once:
        return False
    state.parked_once = True
    return True


def prerepair(p, timeout: float = 60.0) -> dict:
    """(an action; ``p``: the rank's RankState) Wait until the main thread parked before train() (model and optimizer
    built, groups made): the action only a replacement process receives."""
    main = p.wait_parked(timeout)
    if main != MainState.PARKED:
        raise TimeoutError(f"replacement rank {p.rank} did not reach train() within {timeout:.0f} s "
                           f"(main thread {main})")
    p.repair_type = "recover"
    return {"gen": p.gen, "pid": os.getpid()}


ACTIONS = {ActionName.PREREPAIR: prerepair}  # the processor's handler (Processor.ACTIONS takes it in)

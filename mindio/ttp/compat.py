"""Reference names that scripts written for MindIO TFT call, beyond the documented ``tft_*`` API.

MindSpeed-LLM, for one, calls ``set_mindio_export_version("MindSpeed-LLM")`` inside its decorated
``train()`` and imports ``get_device`` / ``get_mindio_export_version`` from
``mindio_ttp.framework_ttp.ttp_decorator``; the reference's own decorator calls
``tft_wait_repair_action`` after ``tft_wait_next_action``. The packages ``mindio_ttp`` and
``mindio_acp`` (top level, shipped with mindio) re-export these under the reference's module paths;
docs/migration.md says what maps where and what behaves differently.
"""
from __future__ import annotations

import logging

from ..errors import ConfigError
from ._enums import Action
from ._runtime import state as _rt

__all__ = ["set_mindio_export_version", "get_mindio_export_version", "tft_wait_repair_action", "get_device",
           "FRAMEWORKS"]

_log = logging.getLogger(__name__)

FRAMEWORKS = ("MindSpeed", "MindSpeed-LLM")
_export_version: str | None = None


def set_mindio_export_version(framework_type: str) -> None:
    """Name the framework driving the API: ``"MindSpeed"`` or ``"MindSpeed-LLM"`` (the reference
    accepts only these two and so does mindio).

    Effect: until :func:`tft_set_step_args` is called, the callbacks receive the decorated ``train()``'s
    positional arguments as a tuple (a list otherwise), as in the reference. Unlike the reference,
    ``tft_set_step_args`` still works after it, and it does not turn
    ``TTP_STOP_CLEAN_BEFORE_DUMP`` on (the reference needs the NPU stopped before a dump; mindio's
    ranks dump without a teardown): export it yourself if your save callback needs it.

    Args:
        framework_type: ``"MindSpeed"`` or ``"MindSpeed-LLM"``.

    Returns:
        None.
    Raises:
        ConfigError: another name.
    """
    global _export_version
    if framework_type not in FRAMEWORKS:
        raise ConfigError(f"set_mindio_export_version({framework_type!r}): the framework must be one of "
                          f"{list(FRAMEWORKS)} (as in MindIO TFT); other frameworks need no call")
    if _export_version != framework_type:
        _log.info("framework set to %s", framework_type)
    _export_version = framework_type


def get_mindio_export_version() -> str | None:
    """The name given to :func:`set_mindio_export_version`.

    Returns:
        The name, or None if it was never called.
    """
    return _export_version


def tft_wait_repair_action() -> int:
    """Wait until this rank's repair and rollback are done.

    The reference waits in two calls: :func:`tft_wait_next_action` until stop and clean finish, then
    this one until repair and rollback finish. mindio's ``tft_wait_next_action`` hands out RETRY only
    once every rank is repaired and rolled back, so after it this returns 0 at once; when a decision is
    still pending (``tft_wait_next_action`` was not called) it waits like ``tft_wait_next_action``.

    Returns:
        0 (``Action.RETRY``): train again; 1 (``Action.EXIT``): leave.
    Raises:
        RuntimeError: no processor in this process.
    """
    proc = _rt.processor
    if proc is None:
        raise RuntimeError("no processor in this process: call tft_init_processor and tft_start_processor first")
    if proc.decision_pending():
        action, _code = proc.wait_next_action()
        return int(action)
    return int(Action.RETRY)


def get_device():
    """The accelerator device index this rank uses (``torch.accelerator.current_device_index()``), or
    None on a CPU-only process. The reference returns the NPU device the processor was started on.

    Returns:
        int or None.
    """
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_device_index()
    return None

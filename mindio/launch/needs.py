"""What a job's strategies need from its launcher, checked when a rank starts (not at the first fault).

Worker reboot (MindIO ARF: ``enable_arf=True``, the scripts' ``--enable-worker-reboot``, strategies
``recover-in-place`` / ``recover``) replaces a failed process. Only a launcher can start a process, so
only a controller that ``mindio-run --high-availability ...`` hosts (node 0's agent, rank -1) can carry
it out; that controller enables it when ranks register with ``enable_arf`` (ha.py). A controller that a
training script starts itself -- under torchrun, or under mindio-run without ``--high-availability`` --
never can: without this check such a job trained normally and, at its first dead rank, ended with 76.

The agent tells its workers what it hosts: ``MINDIO_CONTROLLER_EXTERNAL=1`` (a hosted controller) and
``MINDIO_AGENT_STORE`` (running under mindio-run at all).
"""
from __future__ import annotations

import os

from ..errors import ConfigError

__all__ = ["require_replacer"]

_FLAG = "--high-availability dump,recover-in-place"


def require_replacer(what: str) -> None:
    """Raise ConfigError naming the launcher flag to add when ``what`` (e.g. "worker reboot
    (enable_arf)") needs processes replaced and no launcher here can replace them."""
    from .. import _knobs

    if _knobs.get("MINDIO_CONTROLLER_EXTERNAL"):
        return  # mindio-run hosts the controller: its agents replace processes
    if os.environ.get("MINDIO_AGENT_STORE"):
        raise ConfigError(f"{what} replaces failed processes, which only the launcher can do: add "
                          f"`{_FLAG}` to mindio-run (or set HIGH_AVAILABILITY=dump,recover-in-place)")
    raise ConfigError(f"{what} replaces failed processes, which torchrun cannot do: launch the job with "
                      f"`mindio-run {_FLAG}` (same flags as torchrun)")

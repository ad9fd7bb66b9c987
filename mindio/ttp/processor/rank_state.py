"""What an action handler of inplace.py, reboot.py and elastic_rank.py may see and change of its rank.

The processor passes a :class:`RankState` to those handlers (``handler(state, **params)``) instead of
itself: the handlers read and set the rank's recovery fields by name, and reach the main thread only
through :meth:`wait_parked` and :meth:`resume`; the processor's lock, main-thread state and fence stay
its own (tests/unit/test_composition.py keeps it so).
"""
from __future__ import annotations

from .._enums import MainState

__all__ = ["RankState"]


def _field(name: str, settable: bool = True) -> property:
    def get(self):
        return getattr(self._proc, name)

    def put(self, value):
        setattr(self._proc, name, value)
    return property(get, put if settable else None, doc=f"the processor's ``{name}``")


class RankState:
    """One rank's state as its action handlers see it (module docstring)."""

    __slots__ = ("_proc",)

    def __init__(self, proc):
        self._proc = proc

    rank = _field("rank", settable=False)
    world_size = _field("world_size", settable=False)
    world = _field("world", settable=False)  # inplace.World: the job's store, the default group's settings
    callbacks = _field("callbacks", settable=False)
    step_args = _field("step_args", settable=False)
    gen = _field("gen")
    step = _field("step")
    data_status = _field("data_status")
    repair_type = _field("repair_type")
    repair_step = _field("repair_step")
    rebuild_same_layout = _field("rebuild_same_layout")
    members = _field("members")  # the elastic world's job ranks (None: the full world)
    standby = _field("standby")

    def callback(self, name: str):
        """The registered ``name`` handler as ``(func, ctx)``; RuntimeError naming its tft_register_* if none."""
        if name not in self.callbacks:
            raise RuntimeError(f"no {name} callback registered (tft_register_{name}_handler)")
        return self.callbacks[name]

    def wait_parked(self, timeout: float, force: bool = False) -> MainState:
        """Wait up to ``timeout`` s for the main thread to park after a fault; ``force``: a main thread held
        at its fence gets FORCE STOP first. Returns where the main thread is then."""
        return self._proc.wait_parked(timeout, force)

    def resume(self) -> None:
        """Hand the parked main thread RETRY (train() runs again); RuntimeError if it is not parked."""
        self._proc.resume_parked()

"""The per-process singletons behind the tft_* functions (one controller, one processor at most)."""
from __future__ import annotations

__all__ = ["state"]


class _State:
    def __init__(self) -> None:
        self.controller = None          # controller.Controller, when this process hosts one
        self.controller_init = None     # kwargs of tft_init_controller until tft_start_controller
        self.controller_external = False  # tft_init_controller found the controller hosted elsewhere
        self.processor = None           # processor.Processor
        self.callbacks: dict = {}       # name -> (func, ctx); shared with the processor
        self.user_patterns: list = []   # [(pattern, ReportState, fault_handle)]
        self.update_window = [None, None]
        self.load_ckpt_step = None
        self.repeats = None             # processor/repeats.Repeats: this rank's generic exceptions (decorator)
        self.leaving = None             # the exit code the controller ordered, once this process leaves (decorator)


state = _State()

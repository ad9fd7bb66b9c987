"""``mindio_ttp.framework_ttp``: the MindIO TFT API as a training script imports it (mindio.ttp).

Same names as the reference's ``framework_ttp`` (its ``__all__`` plus ``set_mindio_export_version``),
each one mindio's own function. What behaves differently is in docs/migration.md.
"""
from ..controller_ttp import tft_destroy_controller, tft_init_controller, tft_start_controller
from ..utils import tft_can_do_uce_repair
from . import ttp_decorator
from .ttp_decorator import *  # noqa: F401,F403 -- the reference's names, listed in ttp_decorator.__all__

__all__ = ["tft_init_controller", "tft_start_controller", "tft_destroy_controller", "tft_can_do_uce_repair",
           *ttp_decorator.__all__]

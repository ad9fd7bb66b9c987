"""``mindio_ttp.utils``: the optimizer update-window helpers of MindIO TFT (mindio.ttp)."""
from mindio.ttp import tft_can_do_uce_repair, tft_set_update_end_time, tft_set_update_start_time

__all__ = ["tft_can_do_uce_repair", "tft_set_update_start_time", "tft_set_update_end_time"]

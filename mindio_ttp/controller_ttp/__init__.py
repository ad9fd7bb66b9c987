"""``mindio_ttp.controller_ttp``: the controller and cluster-brain functions of MindIO TFT (mindio.ttp)."""
from mindio.ttp import (tft_destroy_controller, tft_init_controller, tft_notify_controller_change_strategy,
                        tft_notify_controller_dump, tft_notify_controller_on_global_rank,
                        tft_notify_controller_prepare_action, tft_notify_controller_stop_train,
                        tft_query_high_availability_switch, tft_register_mindx_callback, tft_set_dp_group_info,
                        tft_start_controller)

from . import ttp_logger

__all__ = ["tft_init_controller", "tft_start_controller", "tft_destroy_controller", "tft_set_dp_group_info",
           "tft_notify_controller_dump", "tft_notify_controller_stop_train", "tft_notify_controller_on_global_rank",
           "tft_notify_controller_prepare_action", "tft_notify_controller_change_strategy",
           "tft_register_mindx_callback", "tft_query_high_availability_switch", "ttp_logger"]

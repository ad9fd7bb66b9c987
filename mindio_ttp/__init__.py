"""MindIO TFT's module paths, mapped onto :mod:`mindio.ttp` (a migration aid; docs/migration.md).

A script written for MindIO TFT runs unchanged against mindio::

    from mindio_ttp.framework_ttp import tft_init_processor, tft_exception_handler   # -> mindio.ttp
    from mindio_ttp.controller_ttp import tft_notify_controller_dump                   # -> mindio.ttp
    from mindio_ttp.utils import tft_set_update_start_time                             # -> mindio.ttp

Every name here is mindio's own function, re-exported; new code should import :mod:`mindio.ttp`.
Importing starts nothing.
"""
from mindio import __version__

__all__ = ["__version__"]

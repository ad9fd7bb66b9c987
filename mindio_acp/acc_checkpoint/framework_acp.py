"""``mindio_acp.acc_checkpoint.framework_acp.CheckpointHelper``: the reference's import path of
:class:`mindio.acp.CheckpointHelper`."""
from mindio.acp import CheckpointHelper

__all__ = ["CheckpointHelper"]

"""Reference module path ``mindio_acp.acc_checkpoint`` (see ``framework_acp``)."""

"""``ttp_logger.LOGGER``: the logger MindIO TFT's adaptors write to; here mindio's ``mindio.ttp`` logger
(its lines go where mindio's go: see docs/migration.md, "Logs")."""
import logging

LOGGER = logging.getLogger("mindio.ttp")

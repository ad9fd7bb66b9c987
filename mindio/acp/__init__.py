"""mindio.acp: the memory-backed asynchronous checkpoint store (MindIO ACP API).

``save`` copies a checkpoint into a node-local shared-memory pool owned by the ``mindio-acp-server``
daemon and returns; the daemon persists it to storage in the background, even if the trainer dies.
``load`` reads the newest version from memory when it is there, else from storage. See docs/acp.md.
Importing this package starts nothing; ``MINDIO_AUTO_PATCH_MEGATRON=1`` patches Megatron-core's
checkpointing on import (only if megatron.core is importable).
"""
from __future__ import annotations

from .. import _knobs
from . import _megatron
from ._helper import CheckpointHelper
from ._files import SaveHandle, async_save, create_file, open_file, register_checker
from .api import (convert, fallback_counts, flush, initialize, load, lost_checkpoints, multi_save, preload, save,
                  server_stat, shutdown_server)

__all__ = ["initialize", "save", "multi_save", "load", "preload", "flush", "register_checker", "convert",
           "open_file", "create_file", "async_save", "SaveHandle", "fallback_counts", "lost_checkpoints",
           "server_stat", "shutdown_server", "patch_megatron", "CheckpointHelper"]

patch_megatron = _megatron.install

if _knobs.get("MINDIO_AUTO_PATCH_MEGATRON"):   # documented opt-in, as in the reference
    _megatron.install()

"""MindIO ACP's module path, mapped onto :mod:`mindio.acp` (a migration aid; docs/migration.md).

``import mindio_acp; mindio_acp.save(obj, path)`` runs mindio's checkpoint store: the same functions
and return codes as the reference (``initialize``, ``save``, ``multi_save``, ``load``, ``preload``,
``flush``, ``register_checker``, ``convert``, ``open_file``, ``create_file``) and ``CheckpointHelper``.
New code should import :mod:`mindio.acp` (or use ``mindio.save`` / ``mindio.load``).
Importing starts nothing (``MINDIO_AUTO_PATCH_MEGATRON=1`` patches megatron-core, as the reference).
"""
from mindio import __version__
from mindio.acp import (CheckpointHelper, convert, create_file, flush, initialize, load, multi_save, open_file,
                        preload, register_checker, save)

__all__ = ["initialize", "save", "multi_save", "load", "preload", "flush", "register_checker", "convert",
           "open_file", "create_file", "CheckpointHelper", "__version__"]

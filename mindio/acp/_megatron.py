"""MINDIO_AUTO_PATCH_MEGATRON: route Megatron's torch.save/torch.load checkpoint files through mindio.

What is patched (megatron-core 0.16.1, and Megatron-LM's training package where installed): the
modules below call ``torch.save(obj, path)`` / ``torch.load(path, ...)`` through their module-level
name ``torch``. The patch rebinds that name, in those modules only, to a proxy whose ``save`` and
``load`` call ``mindio.acp.save`` / ``mindio.acp.load`` for path arguments (file objects and
buffers still go to torch) and which forwards every other attribute to the real torch module.

- ``megatron.core.dist_checkpointing.strategies.common``: ``common.pt`` and sharded-object files of
  every dist_checkpointing format;
- ``megatron.training.checkpointing`` (Megatron-LM, not part of megatron-core): the per-rank
  legacy checkpoint files.

Not patched: the tensor shards of the ``torch_dist`` format (``*.distcp``), which PyTorch DCP's
writer produces (Megatron already writes them asynchronously).

When the environment variable is 1, importing ``mindio.acp`` patches the modules already
imported and installs an import hook that patches the others the moment they are imported, so
megatron is never imported on mindio's behalf.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys

from ..errors import CheckpointError

__all__ = ["TARGETS", "patch", "unpatch", "install", "is_patched"]

log = logging.getLogger(__name__)
TARGETS = ("megatron.core.dist_checkpointing.strategies.common", "megatron.training.checkpointing")


class _TorchProxy:
    """Stands in for ``torch`` inside a patched module: save/load by path go to mindio."""

    def __init__(self, torch_module):
        self.__dict__["_torch"] = torch_module

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def save(self, obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and not args and not kwargs:
            from . import api

            rc = api.save(obj, os.fspath(f))
            if rc == -1:
                raise CheckpointError(f"mindio.save({os.fspath(f)!r}) failed; see the log")
            return None
        return self._torch.save(obj, f, *args, **kwargs)

    def load(self, f, map_location=None, *args, weights_only=None, **kwargs):
        if isinstance(f, (str, os.PathLike)) and not args and not kwargs:
            from . import api

            safe = True if weights_only is None else bool(weights_only)   # torch 2.6+'s default
            return api.load(os.fspath(f), map_location=map_location, weights_only=safe)
        if weights_only is not None:
            kwargs["weights_only"] = weights_only
        return self._torch.load(f, map_location, *args, **kwargs)


def is_patched(module) -> bool:
    return isinstance(getattr(module, "torch", None), _TorchProxy)


def _patch_module(module) -> None:
    real = getattr(module, "torch", None)
    if real is None or is_patched(module):
        return
    module.torch = _TorchProxy(real)
    log.info("MINDIO_AUTO_PATCH_MEGATRON: %s now saves and loads through mindio", module.__name__)


def patch() -> list:
    """Patch every target module that is already imported; returns their names."""
    done = []
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)
            done.append(name)
    return done


def unpatch() -> None:
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None and is_patched(module):
            module.torch = module.torch._torch
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of a target module so it is patched on import."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch_module(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patch imported targets now and the others when they are imported (idempotent)."""
    patch()
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())

"""mindio: fault tolerance for distributed PyTorch training.

``mindio.save`` / ``mindio.load`` are the memory-backed checkpoint store (the rest is in
``mindio.acp``); the training fault-tolerance API (``tft_*``) is in ``mindio.ttp``. Importing mindio
has no side effects: no daemon, thread or socket starts until you call something.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["save", "load", "__version__"]


def save(obj, path, open_way: str = "memfs"):
    """Save ``obj`` to ``path`` through the checkpoint store; see :func:`mindio.acp.save`."""
    from .acp import save as _save

    return _save(obj, path, open_way=open_way)


def load(path, open_way: str = "memfs", map_location=None, **kwargs):
    """Load a checkpoint written by :func:`save` or ``torch.save``; see :func:`mindio.acp.load`."""
    from .acp import load as _load

    return _load(path, open_way=open_way, map_location=map_location, **kwargs)

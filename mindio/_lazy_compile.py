"""Import megatron-core without paying for ``torch.compile`` until a compiled function is called.

megatron-core 0.16.1 binds ``megatron.core.jit.jit_fuser = torch.compile`` and decorates ~40 fused
kernels with it at import time (gelu/swiglu fusions, MoE router helpers, ...). ``torch.compile(fn)``
imports torch._dynamo and torch._inductor on the spot: about 1.4 CPU-seconds per process (the imports
of examples/megatron/pretrain_gpt.py: 4.3-4.6 CPU-s before, 2.8-3.2 after, on a loaded 2-core machine), paid by every rank (and every warm spare of mindio-run) although a
function is compiled only when it is first called, and most are never called (the fusions are off on
CPU and in most configurations).

:func:`deferred_compile` is a context manager under which ``torch.compile`` returns, for a plain
function, a wrapper that calls the real ``torch.compile`` on its first call and the compiled function
from then on: what runs is the same, compiled by the same call, only later. Modules, other targets
and the decorator-with-arguments form keep their exact behaviour (the last one also deferred).
megatron's ``jit_fuser`` keeps the wrapper after the block, so functions decorated by megatron
modules imported later are deferred too. Outside the block ``torch.compile`` is the real one.

Used by :func:`import_megatron_core` (``mindio.megatron`` and the worker bootstrap's preload).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading

__all__ = ["deferred_compile", "import_megatron_core"]

_lock = threading.Lock()


def _deferring(real):
    def compile(model=None, **kwargs):  # noqa: A001  (torch.compile's own name and signature)
        if model is None:  # @torch.compile(mode=...): the decorator it returns defers too
            return lambda fn: compile(fn, **kwargs)
        import torch

        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        compiled = None
        once = threading.Lock()

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                with once:
                    if compiled is None:
                        compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        call.__wrapped_compile__ = real  # for a reader: this is a deferred torch.compile
        return call

    return compile


@contextlib.contextmanager
def deferred_compile():
    """``torch.compile`` defers its work to the first call of each function decorated in the block."""
    import torch

    with _lock:
        real = torch.compile
        torch.compile = _deferring(real)
        try:
            yield
        finally:
            torch.compile = real


def import_megatron_core():
    """``import megatron.core`` under :func:`deferred_compile` (a no-op when it is imported already)."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    with deferred_compile():
        return importlib.import_module("megatron.core")

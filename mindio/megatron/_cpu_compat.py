"""Runtime patches that let megatron-core 0.16.1 run on a CPU-only torch with gloo.

megatron-core assumes CUDA everywhere: ``torch.cuda.current_device()`` as a device, tensor
factories called with ``device='cuda'``, dtype checks against ``'torch.cuda.FloatTensor'``,
an RNG tracker that saves and restores the CUDA generator, communication streams and
``torch.cuda.synchronize()``. :func:`apply` routes each of these to the CPU:

- ``torch.cuda.current_device()`` returns ``torch.device('cpu')``;
- ``torch.empty/zeros/ones/full/tensor/arange/rand/randn/...`` and ``Tensor.cuda()`` map a CUDA
  device to the CPU;
- ``Tensor.type()`` (no argument) reports ``torch.cuda.<X>Tensor`` for CPU tensors;
- ``torch.cuda.get_rng_state/set_rng_state/manual_seed`` and megatron's private
  ``_get_cuda_rng_state/_set_cuda_rng_state`` act on the CPU default generator;
- ``torch.cuda.Stream/Event/stream/current_stream/default_stream/synchronize/empty_cache``
  become no-ops;
- MoE without Transformer Engine: ``megatron.core.transformer.moe.moe_utils`` tests
  ``te_general_gemm is not None`` in the router's gating GEMM but never defines the name when TE
  is missing (``NameError`` in 0.16.1): it is defined as None, which selects the torch GEMM.

The patches are process-wide and idempotent. They are applied only by :func:`apply`, which the
Megatron adapter calls when ``torch.cuda.is_available()`` is False; importing mindio (or this
module) changes nothing. Measured needs: ARCHITECTURE.md section 7.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

__all__ = ["apply", "is_applied"]

_log = logging.getLogger(__name__)
_APPLIED = False

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "linspace",
)


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # an int device is a CUDA ordinal
    return torch.device(device).type == "cuda"


def _wrap_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return factory


class _DummyStream:
    """Stands in for ``torch.cuda.Stream``: every operation is immediate on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _DummyEvent()


class _DummyEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_CPU_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
}


def _patch_tensor_methods() -> None:
    orig_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig_type(self)
            return _CPU_TYPE_NAMES.get(name, name)
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    torch.Tensor.cuda = lambda self, *a, **k: self


def _cpu_get_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs):
    if isinstance(new_state, torch.Generator):
        new_state = new_state.get_state()
    torch.set_rng_state(new_state)


def _patch_cuda_namespace() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.current_stream = lambda *a, **k: _DummyStream()
    cuda.default_stream = lambda *a, **k: _DummyStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = lambda seed: torch.random.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = _cpu_set_rng_state


def _patch_moe_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    """Apply every CPU patch once. Call before building megatron-core objects on a CPU-only host."""
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "mindio.megatron._cpu_compat.apply() was called on a host with CUDA; "
            "the CPU patches are only for CPU-only runs. Do not call it when CUDA is available."
        )
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    _patch_tensor_methods()
    _patch_cuda_namespace()
    _patch_megatron_rng()
    _patch_moe_without_te()
    _APPLIED = True
    _log.debug("megatron-core CPU compatibility patches applied")


def is_applied() -> bool:
    return _APPLIED

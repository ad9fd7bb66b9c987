"""Restricted unpickling for ``load(weights_only=True)``: rebuild data, never run arbitrary code.

Only the globals listed here (plus those the user allowed through
``torch.serialization.add_safe_globals``) can be named by a skeleton; tensors themselves never go
through ``find_class`` because the mindio format stores them as persistent ids.
"""
from __future__ import annotations

import collections
import pickle

import torch

from ..errors import CheckpointError

__all__ = ["RestrictedUnpickler", "allowed_globals"]

_MODULE_NAMES = {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice"),
    ("builtins", "range"), ("builtins", "bytearray"), ("builtins", "tuple"), ("builtins", "list"),
    ("builtins", "dict"), ("builtins", "int"), ("builtins", "float"), ("builtins", "bool"), ("builtins", "str"),
    ("torch", "Size"), ("torch", "device"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}


def _is_numpy_dtype_class(module: str, name: str) -> bool:
    return module in ("numpy.dtypes",) and name.endswith("DType")


def allowed_globals() -> set:
    """The (module, name) pairs a weights-only load may reference."""
    names = set(_MODULE_NAMES)
    names.update(("torch", str(d).removeprefix("torch.")) for d in vars(torch).values() if isinstance(d, torch.dtype))
    return names


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` only resolves allow-listed, side-effect-free globals."""

    _allowed = None

    def find_class(self, module, name):
        if RestrictedUnpickler._allowed is None:
            RestrictedUnpickler._allowed = allowed_globals()
        if (module, name) in self._allowed or _is_numpy_dtype_class(module, name):
            return super().find_class(module, name)
        for obj in torch.serialization.get_safe_globals():
            target = obj[0] if isinstance(obj, tuple) else obj
            if getattr(target, "__module__", None) == module and getattr(target, "__qualname__", None) == name:
                return target
        raise CheckpointError(
            f"weights-only load refuses to import {module}.{name}: it could run code. "
            "Pass weights_only=False if you trust this file, or allow the type with "
            "torch.serialization.add_safe_globals([...]).")


# keep a reference so linters do not drop the import used by pickled OrderedDicts
_ = collections.OrderedDict

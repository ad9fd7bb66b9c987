"""Byte-moving primitives of the checkpoint store, native (Cython) when built, pure Python otherwise.

Public list (both backends, same results): ``copy_into(dst, dst_offset, src, nthreads, slice_bytes)``,
``copy_many(dst, [(dst_offset, src), ...], nthreads, slice_bytes)`` (one parallel pass over many
sources: what a save uses), ``crc32(buf, value=0)``, ``touch_pages(buf, write=False)``.
``BACKEND`` says which one is in use: "cython" or "python". Set ``MINDIO_NATIVE=python`` to force the fallback (read once, at first import).
"""
from __future__ import annotations

from .. import _knobs

__all__ = ["BACKEND", "copy_into", "copy_many", "crc32", "touch_pages", "fallback"]

from . import _fallback as fallback

if _knobs.get("MINDIO_NATIVE") == "python":
    _impl = fallback
    BACKEND = "python"
else:
    try:
        from . import _core as _impl  # type: ignore[attr-defined]

        BACKEND = "cython"
    except ImportError:
        _impl = fallback
        BACKEND = "python"

copy_into = _impl.copy_into
copy_many = _impl.copy_many
crc32 = _impl.crc32
touch_pages = _impl.touch_pages

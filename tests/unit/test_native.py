"""The Cython core and the pure-Python fallback expose the same functions with the same results."""
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mindio._native as native
from mindio._native import _fallback

BACKENDS = [_fallback]
try:
    from mindio._native import _core
    BACKENDS.append(_core)
except ImportError:  # pragma: no cover - the extension is optional
    _core = None


def test_backend_is_reported():
    assert native.BACKEND in ("cython", "python")
    assert set(native.__all__) >= {"copy_into", "crc32", "touch_pages", "BACKEND"}


@pytest.mark.parametrize("impl", BACKENDS, ids=lambda m: m.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=70000), offset=st.integers(0, 5000), threads=st.integers(1, 4),
       slice_kb=st.integers(4, 64))
def test_copy_into_matches_slicing(impl, data, offset, threads, slice_kb):
    dst = bytearray(b"\xaa" * (offset + len(data) + 7))
    expect = bytearray(dst)
    expect[offset: offset + len(data)] = data
    assert impl.copy_into(dst, offset, data, threads, slice_kb * 1024) == len(data)
    assert dst == expect


@pytest.mark.parametrize("impl", BACKENDS, ids=lambda m: m.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=20000), seed=st.integers(0, 2 ** 32 - 1))
def test_crc32_matches_zlib(impl, data, seed):
    assert impl.crc32(data, seed) == zlib.crc32(data, seed)


def test_backends_agree_on_large_parallel_copy():
    src = np.random.default_rng(0).integers(0, 256, size=(40 << 20) + 13, dtype=np.uint8)
    outs = []
    for impl in BACKENDS:
        dst = np.zeros(src.size + 4096, dtype=np.uint8)
        impl.copy_into(dst, 4096, src, 4, 1 << 20)
        outs.append(dst)
        assert impl.crc32(dst[4096:]) == zlib.crc32(src)
    for other in outs[1:]:
        assert np.array_equal(outs[0], other)


@pytest.mark.parametrize("impl", BACKENDS, ids=lambda m: m.__name__)
def test_copy_into_rejects_overflow_and_readonly(impl):
    with pytest.raises(ValueError, match="do not fit"):
        impl.copy_into(bytearray(10), 5, b"123456")
    with pytest.raises((TypeError, ValueError, BufferError)):
        impl.copy_into(b"0123456789", 0, b"12")


@pytest.mark.parametrize("impl", BACKENDS, ids=lambda m: m.__name__)
def test_touch_pages_counts_pages_and_keeps_data(impl):
    buf = bytearray(np.arange(3 * 4096 + 5, dtype=np.uint8).tobytes())
    before = bytes(buf)
    assert impl.touch_pages(buf) == 4
    assert impl.touch_pages(buf, True) == 4
    assert bytes(buf) == before
    assert impl.touch_pages(bytearray()) == 0


@pytest.mark.parametrize("impl", BACKENDS, ids=lambda m: m.__name__)
def test_crc32_every_length_and_alignment_near_the_simd_block(impl):
    """The native CRC folds 64-byte blocks with PCLMULQDQ and finishes the tail with zlib: every
    length around those boundaries, at every misalignment, must give zlib's answer."""
    data = np.random.default_rng(3).integers(0, 256, size=400, dtype=np.uint8).tobytes()
    for start in range(17):
        for n in list(range(0, 200)) + [255, 256, 257, 383]:
            chunk = data[start: start + n]
            assert impl.crc32(chunk, 0xDEADBEEF) == zlib.crc32(chunk, 0xDEADBEEF), (start, n)
            assert impl.crc32(chunk) == zlib.crc32(chunk), (start, n)

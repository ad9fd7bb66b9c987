"""copy_many (the save's one-pass parallel copy) gives the same bytes in the Cython core and the fallback.

The native copy uses streaming stores for pieces of 1 MiB and more, with an unaligned head and tail
copied by memcpy; the sizes and offsets below make every piece start and end off a 64-byte line.
"""
import zlib

import numpy as np
import pytest

from mindio._native import _fallback

BACKENDS = [_fallback]
try:
    from mindio._native import _core
    BACKENDS.append(_core)
except ImportError:  # pragma: no cover - the extension is optional
    _core = None


def _jobs(rng):
    sizes = [(3 << 20) + 77, 0, 5, (1 << 20) - 1, (1 << 20) + 1, 4097, (9 << 20) + 255]
    jobs, off = [], 13                      # odd offsets: unaligned heads everywhere
    for n in sizes:
        jobs.append((off, rng.integers(0, 256, size=n, dtype=np.uint8)))
        off += n + 3
    return jobs, off


@pytest.mark.parametrize("impl", BACKENDS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("threads,slice_mb", [(1, 16), (2, 1), (4, 2), (3, 16)])
def test_copy_many_places_every_job(impl, threads, slice_mb):
    jobs, end = _jobs(np.random.default_rng(threads * 7 + slice_mb))
    dst = np.full(end + 100, 0xAA, dtype=np.uint8)
    expect = dst.copy()
    for off, src in jobs:
        expect[off: off + src.size] = src
    assert impl.copy_many(dst, jobs, threads, slice_mb << 20) == sum(src.size for _, src in jobs)
    assert np.array_equal(dst, expect)
    assert zlib.crc32(dst) == zlib.crc32(expect)


def test_backends_agree_on_copy_many():
    jobs, end = _jobs(np.random.default_rng(5))
    outs = []
    for impl in BACKENDS:
        dst = np.zeros(end, dtype=np.uint8)
        impl.copy_many(dst, jobs, 2, 1 << 20)
        outs.append(dst)
    for other in outs[1:]:
        assert np.array_equal(outs[0], other)


@pytest.mark.parametrize("impl", BACKENDS, ids=lambda m: m.__name__)
def test_copy_many_checks_every_job_before_copying(impl):
    dst = bytearray(b"\x00" * 16)
    with pytest.raises(ValueError, match="do not fit"):
        impl.copy_many(dst, [(0, b"abcd"), (14, b"xyz")])
    assert dst == bytearray(16)                       # nothing copied: the second job did not fit
    with pytest.raises(ValueError, match="do not fit"):
        impl.copy_many(dst, [(-1, b"a")])
    assert impl.copy_many(dst, []) == 0
    with pytest.raises((TypeError, ValueError, BufferError)):
        impl.copy_many(b"read-only buffer", [(0, b"ab")])


@pytest.mark.skipif(_core is None, reason="the native core is not built")
def test_parallel_copy_works_in_a_forked_child():
    """A child forked after the parent copied in parallel copies in parallel too (an OpenMP pool hung here)."""
    import os
    import signal
    import time

    src = np.arange(8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    _core.copy_many(dst, [(0, src)], 2, 1 << 20)
    pid = os.fork()
    if pid == 0:                                    # child: only copy and exit, never return to pytest
        code = 3
        try:
            dst[:] = 0
            _core.copy_many(dst, [(0, src)], 2, 1 << 20)
            code = 0 if np.array_equal(dst, src) else 4
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("copy_many in a forked child did not finish within 60 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0

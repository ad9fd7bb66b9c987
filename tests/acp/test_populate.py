"""The pool's page tables are put in place in the background at the lowest CPU priority, in small chunks, not
on the path of initialize() (a relaunch's: 1.1 s per rank at 1g); a save first does the chunks it writes
(mindio/acp/client.py)."""
from __future__ import annotations

import mmap
import os
import tempfile
import threading

from mindio.acp import client


def _pool(nbytes: int):
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    os.close(fd)
    return m


def test_a_save_faults_in_only_the_chunks_it_writes_and_keeps_the_data(monkeypatch):
    monkeypatch.setattr(client, "_CHUNK", 1 << 20)
    pool = _pool(5 << 20)
    pool[:4] = b"keep"
    chunks = bytearray(5)
    client._fault_in(pool, chunks, (1 << 20) + 10, 1 << 20)  # touches chunks 1 and 2
    assert list(chunks) == [0, 1, 1, 0, 0]
    client._fault_in(pool, chunks, 0, 5 << 20)
    assert list(chunks) == [1] * 5 and pool[:4] == b"keep"
    pool.close()


def test_the_background_fault_in_runs_at_the_lowest_priority_and_says_when_done(monkeypatch):
    monkeypatch.setattr(client, "_CHUNK", 1 << 20)
    seen = []
    real = client._fault_in

    def spy(mapping, chunks, offset, size):
        if mapping is pool:  # a client an earlier test left open may still populate its own pool in this process
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        real(mapping, chunks, offset, size)
    monkeypatch.setattr(client, "_fault_in", spy)
    pool, chunks, halt, done = _pool(3 << 20), bytearray([0, 1, 0]), threading.Event(), threading.Event()
    t = threading.Thread(target=client._populate, args=(pool, chunks, halt, done))
    t.start()
    assert done.wait(30)
    t.join(30)
    assert list(chunks) == [1, 1, 1] and seen == [19, 19]  # chunk 1 (a save did it) is not done again
    pool.close()

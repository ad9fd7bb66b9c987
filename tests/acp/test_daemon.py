"""Daemon-level behaviour: allocator invariants, protocol robustness, configuration hand-over."""
import logging
import os
import socket
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mindio import acp
from mindio.acp import _wire, api
from mindio.acp import format as fmt
from mindio.acp._pool import BlockAllocator

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 5 * 4096)), max_size=60))
def test_allocator_never_overlaps_and_frees_exactly(ops):
    alloc = BlockAllocator(16 * 4096, 4096)
    live = []
    for do_alloc, size in ops:
        if do_alloc or not live:
            off = alloc.allocate(size)
            if off is None:
                assert alloc.largest_free() < alloc.blocks_for(size) * 4096
                continue
            span = (off, off + alloc.blocks_for(size) * 4096)
            assert all(span[1] <= a or b <= span[0] for a, b, _ in live)
            assert off % 4096 == 0 and span[1] <= 16 * 4096
            live.append((*span, size))
        else:
            a, _, size = live.pop(0)
            alloc.free(a, size)
    used = sum(alloc.blocks_for(s) for _, _, s in live) * 4096
    assert alloc.free_bytes() == 16 * 4096 - used
    with pytest.raises(ValueError):
        alloc.free(15 * 4096 + 1, 10)


def test_malformed_frames_do_not_hurt_the_daemon(acp_env):
    assert acp.initialize() == 0
    sock_path = os.path.join(acp_env["run"], "acp.sock")
    for junk in (b"\xff\xff\xff\xff", struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", b"\x00"):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(sock_path)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            try:
                s.recv(100)
            except OSError:
                pass
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(sock_path)
        _wire.send(s, {"op": "no-such-op"})
        assert "unknown op" in _wire.recv(s)["error"]
        _wire.send(s, {"op": "alloc"})                     # missing field: an error reply, not a crash
        assert not _wire.recv(s)["ok"]
    path = os.path.join(acp_env["ck"], "after.pt")
    assert acp.save({"w": torch.ones(3)}, path) == 1 and acp.flush() == 0


def test_server_info_reaches_the_daemon_and_mismatch_is_said(acp_env, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "mindio.acp.client")
    monkeypatch.delenv("MINDIO_ACP_POOL_MB")
    assert acp.initialize({"memfs.data_block_pool_capacity_in_gb": "1", "memfs.data_block_size_in_mb": "4",
                           "background.backup.thread_num": "2"}) == 0
    config = api._client.hello["config"]
    assert config["pool_bytes"] == 1 << 30 and config["block_bytes"] == 4 << 20 and config["backup_threads"] == 2
    api.reset()
    assert acp.initialize({"memfs.data_block_size_in_mb": "8", "memfs.data_block_pool_capacity_in_gb": "1"}) == 0
    assert any("not applied" in r.message for r in caplog.records)
    assert api._client.hello["config"]["block_bytes"] == 4 << 20      # the running daemon's pool stays


_LATER_JOB = """
import logging, sys, torch
from mindio import acp
logging.basicConfig(level=logging.INFO)
assert acp.initialize() == 0
print("RC", acp.save({"w": torch.ones(96 << 18)}, sys.argv[1]), acp.server_stat()["pool_bytes"] >> 20, flush=True)
assert acp.flush() == 0
"""


@pytest.mark.slow
def test_pool_grows_when_a_later_client_asks_for_more(acp_env, monkeypatch, caplog):
    """A daemon started for a 64 MiB job grows for a later job that asks for 160 MiB; a client that
    connected before keeps working past its old mapping; a size the node cannot give is said at initialize."""
    monkeypatch.setenv("MINDIO_ACP_POOL_MB", "64")
    assert acp.initialize() == 0
    first = os.path.join(acp_env["ck"], "first.pt")
    assert acp.save({"w": torch.randn(1 << 20)}, first) == 1
    later = os.path.join(acp_env["ck"], "later.pt")
    job = subprocess.run([sys.executable, "-c", _LATER_JOB, later], capture_output=True, text=True, timeout=90,
                         env=dict(os.environ, MINDIO_ACP_POOL_MB="160"))
    assert job.returncode == 0, job.stderr
    assert "RC 1 160" in job.stdout                     # its 96 MiB save went to the pool, not to storage
    assert "WARNING" not in job.stderr and "grew" not in job.stderr
    assert "grew the pool from 64 MiB to 160 MiB" in open(os.path.join(acp_env["run"], "server.log")).read()
    assert torch.equal(acp.load(later)["w"], torch.ones(96 << 18))     # past this client's first mapping
    big = {"w": torch.randn(96 << 18)}
    mine = os.path.join(acp_env["ck"], "mine.pt")
    assert acp.save(big, mine) == 1 and torch.equal(acp.load(mine)["w"], big["w"])
    assert acp.flush() == 0 and torch.equal(acp.load(mine, open_way="fopen")["w"], big["w"])
    assert acp.server_stat()["pool_bytes"] == 160 << 20 and api.fallback_counts() == {}
    api.reset()
    monkeypatch.setenv("MINDIO_ACP_POOL_MB", str(1 << 20))      # 1 TiB: more than this node's /dev/shm
    caplog.clear()
    assert acp.initialize() == 0
    said = [r.getMessage() for r in caplog.records if "less than the" in r.getMessage()]
    assert len(said) == 1 and "160 MiB pool" in said[0] and "cannot grow the pool" in said[0], said
    assert acp.save({"w": torch.ones(3)}, first) == 1 and acp.server_stat()["pool_bytes"] == 160 << 20


def test_disk_file_and_pool_image_load_identically(acp_env):
    path = os.path.join(acp_env["ck"], "m.pt")
    obj = {"a": torch.randn(100, 3), "b": [torch.arange(4), {"c": torch.tensor(1.5)}]}
    assert acp.save(obj, path) == 1
    pooled = acp.load(path)
    assert acp.flush() == 0
    stored = acp.load(path, open_way="fopen")
    assert torch.equal(pooled["a"], stored["a"]) and torch.equal(pooled["b"][0], stored["b"][0])
    with acp.open_file(path) as f:
        head = f.read(0, fmt.SNIFF)
    assert fmt.is_container(head) and torch.equal(torch.load(path, weights_only=True)["a"], obj["a"])


def test_pool_larger_than_shared_memory_is_refused_before_allocating(tmp_path):
    from mindio.acp.server import check_pool_fits
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    check_pool_fits(str(tmp_path), min(free, 1 << 20))
    with pytest.raises(OSError, match="does not fit|memory available"):
        check_pool_fits(str(tmp_path), free + (1 << 30))      # checked with statvfs: nothing is allocated


def test_bad_commits_are_refused_and_free_their_blocks(acp_env):
    """A client (of our uid) committing a path the daemon could never write, an unknown kind or a mode
    with more than permission bits gets an error; its blocks come back and nothing is counted."""
    assert acp.initialize() == 0
    free = acp.server_stat()["free"]
    good = os.path.join(acp_env["ck"], "x.pt")
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(os.path.join(acp_env["run"], "acp.sock"))
        for commit in ({"paths": ["relative.pt"]}, {"paths": ["/a/../b.pt"]}, {"paths": ["/a/" + "x" * 256]},
                       {"paths": [good], "kind": "exe"}, {"paths": [good], "mode": 0o4755}):
            _wire.send(s, {"op": "alloc", "size": 4096})
            alloc = _wire.recv(s)["alloc"]
            _wire.send(s, dict({"op": "commit", "alloc": alloc, "kind": "raw", "mode": 0o600}, **commit))
            reply = _wire.recv(s)
            assert not reply["ok"] and "commit refused" in reply["error"], commit
    stat = acp.server_stat()
    assert stat["free"] == free and stat["state"] == "ok" and stat["persist_failures"] == 0
    assert acp.flush() == 0 and os.listdir(acp_env["ck"]) == []
    with open(os.path.join(acp_env["run"], "server.log")) as f:
        assert f.read().count("refused commit of") == 5          # each refusal logged with its reason


def test_a_client_arriving_while_the_daemon_exits_gets_a_new_one(acp_env, monkeypatch):
    """The daemon stopped listening and is still persisting before it exits (it holds the runtime
    directory's lock): a client arriving now launches daemons until the old one has left and is
    served by a new one within seconds (it used to wait 60 s for a socket that no daemon would open)."""
    import time

    monkeypatch.setenv("MINDIO_ACP_PERSIST_DELAY", "3")
    assert acp.initialize() == 0
    path = os.path.join(acp_env["ck"], "m.pt")
    assert acp.save({"w": torch.ones(3)}, path) == 1           # persisted only after 3 s
    old = api._client.hello["pid"]
    acp.shutdown_server()                                      # leaves once the file is persisted
    monkeypatch.setenv("MINDIO_ACP_PERSIST_DELAY", "0")
    started = time.monotonic()
    assert acp.initialize() == 0
    assert api._client.hello["pid"] != old and time.monotonic() - started < 30
    assert torch.equal(acp.load(path, open_way="fopen")["w"], torch.ones(3))



def test_open_stream_reads_ranges_of_the_pooled_bytes_in_place_then_of_the_file(acp_env, monkeypatch):
    """open_stream (the torch_dist reader's stream): seek/readinto over the pooled bytes without copying
    the file first; the same bytes from storage once the pool no longer holds them."""
    from mindio.acp._files import open_stream
    path = os.path.join(acp_env["ck"], "data.distcp")
    data = os.urandom(3 * 4096 + 123)
    assert acp.initialize() == 0
    with acp.create_file(path) as f:
        f.write(data)
    for pooled in (True, False):
        with open_stream(path) as s:
            assert s.seekable() and s.readable()
            assert type(s).__name__ == ("_ViewStream" if pooled else "FileIO")
            s.seek(4000)
            buf = bytearray(200)
            assert s.readinto(buf) == 200 and bytes(buf) == data[4000:4200] and s.tell() == 4200
            assert s.read(5) == data[4200:4205]
            assert s.seek(-10, os.SEEK_END) == len(data) - 10 and s.read() == data[-10:]
            assert s.read(7) == b"" and s.readinto(bytearray(3)) == 0   # at the end: nothing, no error
            s.seek(0)
            assert s.read() == data
            if pooled:
                with pytest.raises(ValueError, match="negative"):
                    s.seek(-1)
        if pooled:
            assert acp.flush() == 0
            acp.shutdown_server()
            api.reset()
            monkeypatch.setenv("MINDIO_ACP_DISABLE", "1")   # no daemon: the file on storage
    with pytest.raises(ValueError, match="closed"):
        s.readinto(bytearray(1))

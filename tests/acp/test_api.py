"""The ACP API against a real daemon: return codes, memory hits, persistence, fallbacks, file access."""
import io
import os
import threading
import time

import pytest
import torch

import mindio
from mindio import acp
from mindio.acp import _storage, api
from mindio.acp import format as fmt
from mindio.errors import ConfigError, CorruptCheckpoint

pytestmark = pytest.mark.timeout(120)


def _sd(scale=1.0, n=1000):
    return {"w": torch.randn(n, 64) * scale, "b": torch.arange(10), "step": 7, "nested": {"m": torch.ones(3, 3)}}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in ("w", "b")) and a["step"] == b["step"] and \
        torch.equal(a["nested"]["m"], b["nested"]["m"])


def test_save_load_memory_then_storage(acp_env):
    path = os.path.join(acp_env["ck"], "model.pt")
    assert acp.initialize() == 0
    sd = _sd()
    assert mindio.save(sd, path) == 1
    assert _same(mindio.load(path), sd)                 # from the pool
    assert acp.flush() == 0
    assert os.path.exists(path) and not os.path.exists(_storage.marker_path(path))
    with open(path, "rb") as f:
        info = fmt.header_info(f.read(), path)
    assert info["flags"] == fmt.FLAG_CHECKSUMS           # the daemon added the checksums
    assert _same(acp.load(path, open_way="fopen"), sd)   # from storage, verified
    stat = acp.server_stat()
    assert stat["persisted"] >= 1 and stat["state"] == "ok"


def test_loaded_tensors_are_private_copies(acp_env):
    path = os.path.join(acp_env["ck"], "m.pt")
    sd = _sd()
    assert acp.save(sd, path) == 1
    first = acp.load(path)
    first["w"].add_(1.0)                                 # copy-on-write: the pooled version is unchanged
    assert _same(acp.load(path), sd)


def test_load_view_off_maps_each_load_afresh(acp_env, monkeypatch):
    """MINDIO_ACP_LOAD_VIEW=0 (big pools, many trainers): no second mapping of the pool; loads still
    come from memory, equal what was saved, and stay private to the caller."""
    monkeypatch.setenv("MINDIO_ACP_LOAD_VIEW", "0")
    path = os.path.join(acp_env["ck"], "m.pt")
    sd = _sd()
    assert acp.save(sd, path) == 1
    assert api._client.loadview is None
    first = acp.load(path)
    assert _same(first, sd)
    first["w"].add_(1.0)
    assert _same(acp.load(path), sd)


@pytest.mark.parametrize("pagemap", [True, False])
def test_load_view_survives_writes_to_loaded_tensors(acp_env, pagemap):
    """Loads view the client's pre-faulted copy-on-write pool view; writes to loaded tensors must
    reach neither the pool, nor the persisted file, nor a later load of the same bytes."""
    import gc

    path = os.path.join(acp_env["ck"], "m.pt")
    sd = _sd()
    assert acp.save(sd, path) == 1
    view = api._client.loadview
    assert view is not None
    if not pagemap:                                       # no /proc/self/pagemap: reset every time
        os.close(view._pagemap)
        view._pagemap = None
    first = acp.load(path)
    assert len([x for x in view._live if x[2]() is not None]) == 1   # served from the shared view
    first["w"].add_(1.0)
    first["nested"]["m"].zero_()
    second = acp.load(path)                               # first still alive: a fresh mapping
    assert _same(second, sd) and torch.equal(first["w"], sd["w"] + 1.0)
    assert acp.flush() == 0
    assert _same(acp.load(path, open_way="fopen"), sd)    # the daemon persisted the saved bytes
    del first, second
    gc.collect()
    third = acp.load(path)                                # same range again: private pages dropped
    assert _same(third, sd)
    third["w"].mul_(-3.0)
    del third
    gc.collect()
    newer = _sd(scale=5.0)
    assert acp.save(newer, path) == 1                     # may reuse the blocks just released
    assert _same(acp.load(path), newer)


def test_new_client_faults_in_saved_regions_first(acp_env):
    """A restarted trainer's client learns from hello where checkpoints lie and loads them zero-copy."""
    path = os.path.join(acp_env["ck"], "m.pt")
    sd = _sd()
    assert acp.save(sd, path) == 1
    api.reset()                                           # a new process's view of the same daemon
    assert acp.initialize() == 0
    regions = api._client.hello["regions"]
    assert len(regions) == 1 and regions[0][1] > sd["w"].numel() * 4
    loaded = acp.load(path)
    assert _same(loaded, sd)
    assert any(x[0] == regions[0][0] and x[2]() is not None for x in api._client.loadview._live)


def test_newest_version_wins(acp_env):
    path = os.path.join(acp_env["ck"], "m.pt")
    versions = [_sd(scale=i + 1) for i in range(5)]
    for v in versions:
        assert acp.save(v, path) == 1
    assert _same(acp.load(path), versions[-1])
    assert acp.flush() == 0
    assert _same(acp.load(path, open_way="fopen"), versions[-1])


def test_fopen_disable_and_torch_files(acp_env, monkeypatch):
    p1, p2, p3 = (os.path.join(acp_env["ck"], n) for n in ("a.pt", "b.pt", "c.pt"))
    sd = _sd()
    assert acp.save(sd, p1, open_way="fopen") == 2
    assert _same(acp.load(p1), sd)
    torch.save(sd, p2)
    assert _same(acp.load(p2), sd)                       # plain torch.save files load too
    monkeypatch.setenv("MINDIO_ACP_DISABLE", "1")
    api.reset()
    assert acp.save(sd, p3) == 2 and api.fallback_counts() == {"direct write": 1}
    assert _same(acp.load(p3), sd)
    with pytest.raises(ConfigError):
        acp.save(sd, p3, open_way="mmap")


def test_unsupported_object_falls_back_to_torch_save(acp_env, caplog):
    path = os.path.join(acp_env["ck"], "sparse.pt")
    obj = {"s": torch.eye(4).to_sparse()}
    assert acp.save(obj, path) == 0 and acp.save(obj, path) == 0
    assert api.fallback_counts()["torch.save"] == 2
    assert sum("fallback to torch.save" in r.message for r in caplog.records) == 1   # logged once
    assert torch.equal(acp.load(path)["s"].to_dense(), torch.eye(4))


def test_bad_paths_and_server_info(acp_env):
    assert acp.save(_sd(), "/nonexistent-dir/x.pt") == -1
    assert acp.multi_save(_sd(), ["/nonexistent-dir/x.pt"]) is None
    with pytest.raises(ConfigError, match="unknown key"):
        acp.initialize({"memfs.capacity": "1"})
    with pytest.raises(ConfigError, match="out of range"):
        acp.initialize({"memfs.write.parallel.slice_in_mb": "2048"})
    with pytest.raises(FileNotFoundError):
        acp.load(os.path.join(acp_env["ck"], "missing.pt"))


def test_multi_save_convert_preload(acp_env):
    paths = [os.path.join(acp_env["ck"], f"r{i}.pt") for i in range(3)]
    sd = _sd()
    assert acp.multi_save(sd, paths) == 1
    assert all(_same(acp.load(p), sd) for p in paths)
    assert acp.flush() == 0 and all(os.path.exists(p) for p in paths)
    dst = os.path.join(acp_env["ck"], "plain.pt")
    assert acp.convert(paths[0], dst) == 0
    assert _same(torch.load(dst, weights_only=True), sd)          # a plain torch.save file
    assert acp.convert(os.path.join(acp_env["ck"], "nope.pt"), dst) == -1
    assert acp.preload(dst) == 0
    before = acp.server_stat()["entries"]
    assert _same(acp.load(dst), sd) and acp.server_stat()["entries"] == before
    assert acp.preload(os.path.join(acp_env["ck"], "nope.pt")) == 1


def test_stale_pool_entry_is_not_served(acp_env):
    path = os.path.join(acp_env["ck"], "m.pt")
    assert acp.save(_sd(1), path) == 1 and acp.flush() == 0
    newer = _sd(2)
    torch.save(newer, path)                               # someone replaced the file behind mindio
    assert _same(acp.load(path), newer)


def test_open_file_create_file_drop(acp_env):
    path = os.path.join(acp_env["ck"], "blob.ckpt")
    with acp.create_file(path, mode=0o640) as f:
        assert f.write(b"0123456789") == 10
    with acp.open_file(path) as f:
        assert f.read() == b"0123456789" and f.read(2, 3) == b"234" and f.read(offset=9) == b"9"
        with pytest.raises(ValueError):
            f.read(5, 6)
    assert acp.flush() == 0
    assert open(path, "rb").read() == b"0123456789" and os.stat(path).st_mode & 0o777 == 0o640
    w = acp.create_file(path)
    w.write(b"x")
    w.drop()
    assert acp.flush() == 0 and not os.path.exists(path)
    with pytest.raises(TypeError):
        acp.create_file(path).write("not bytes")
    with pytest.raises(ConfigError):
        acp.create_file(path, mode=0o1777)


def test_register_checker_success_and_timeout(acp_env):
    d = os.path.join(acp_env["ck"], "iter_1")
    os.mkdir(d)
    results = []
    done = threading.Event()

    def cb(result, ctx):
        results.append((result, ctx))
        done.set()

    assert acp.register_checker(cb, {d: 2}, "ctx", 30) == 1
    for i in range(2):
        assert acp.save(_sd(), os.path.join(d, f"rank{i}.pt")) == 1
    assert done.wait(40) and results == [(0, "ctx")]
    done.clear()
    assert acp.register_checker(cb, {d: 5}, "ctx2", 1) == 1
    assert done.wait(20) and results[-1] == (1, "ctx2")
    assert acp.register_checker(cb, {d: 1}, None, 0) is None
    assert acp.register_checker("nope", {d: 1}, None, 5) is None


def test_async_handle(acp_env, monkeypatch):
    path = os.path.join(acp_env["ck"], "a.pt")
    handle = acp.async_save(_sd(), path)
    assert handle.rc == 1
    assert handle.wait(timeout=60) and handle.done() and os.path.exists(path)
    monkeypatch.setenv("MINDIO_ACP_DISABLE", "1")
    api.reset()
    direct = acp.async_save(_sd(), path)
    assert direct.rc == 2 and direct.done()


def test_eviction_keeps_unpersisted_data(acp_env, monkeypatch):
    big = {"w": torch.randn((20 << 20) // 4)}              # 20 MiB each, 256 MiB pool, 16 MiB blocks
    paths = [os.path.join(acp_env["ck"], f"e{i}.pt") for i in range(20)]
    rcs = []
    for p in paths:                                       # each persisted before the next: LRU eviction
        rcs.append(acp.save(big, p))
        assert acp.flush() == 0
    assert rcs == [1] * len(paths)
    assert sum(acp.server_stat()["entries"].values()) < len(paths)      # older ones were evicted
    assert torch.equal(acp.load(paths[-1])["w"], big["w"])
    for p in paths:                                       # everything reached storage, nothing lost
        assert torch.equal(acp.load(p, open_way="fopen")["w"], big["w"])
    # now fill the pool with data that cannot be persisted yet: saves must fall back, not drop data
    api.reset()
    from tests.acp.conftest import stop_daemon
    stop_daemon(acp_env["run"])
    monkeypatch.setenv("MINDIO_ACP_PERSIST_DELAY", "5")
    acp.initialize()
    rcs = [acp.save(big, p) for p in paths[:14]]
    assert rcs[:6] == [1] * 6 and 2 in rcs                # pool full of unpersisted data -> direct write
    assert api.fallback_counts()["direct write"] >= 1
    for p, rc in zip(paths[:14], rcs):
        assert torch.equal(acp.load(p)["w"], big["w"])


def test_daemon_exits_when_idle(acp_env, monkeypatch):
    monkeypatch.setenv("MINDIO_ACP_IDLE_EXIT", "1")
    assert acp.initialize() == 0
    assert acp.save(_sd(), os.path.join(acp_env["ck"], "x.pt")) == 1
    api.reset()                                           # disconnect: the daemon is now idle
    sock = os.path.join(acp_env["run"], "acp.sock")
    deadline = time.monotonic() + 30
    while os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(sock)
    assert os.path.exists(os.path.join(acp_env["ck"], "x.pt"))   # persisted before exiting


def test_saved_files_are_torch_load_files(acp_env):
    """What mindio.save persists (daemon or direct write) is a file torch.load reads as it is, mmap too;
    mindio.load reads it from memory and from storage; a file of the old layout (version 1) still loads."""
    sd = {**_sd(), "p": torch.nn.Parameter(torch.randn(3)), "empty": torch.empty(0, 2), "half": torch.ones(5).half()}
    sd["row"] = sd["w"][3]
    pooled, direct, old = (os.path.join(acp_env["ck"], n) for n in ("pooled.pt", "direct.pt", "v1.pt"))
    assert acp.save(sd, pooled) == 1 and acp.save(sd, direct, open_way="fopen") == 2 and acp.flush() == 0
    for path in (pooled, direct):
        for loaded in (torch.load(path, weights_only=True), torch.load(path, weights_only=True, mmap=True),
                       acp.load(path), acp.load(path, open_way="fopen")):
            assert _same(loaded, sd) and torch.equal(loaded["row"], sd["row"]) and torch.equal(loaded["p"], sd["p"])
            assert isinstance(loaded["p"], torch.nn.Parameter) and loaded["half"].dtype == torch.float16
            assert loaded["row"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    plan = fmt.plan(sd, torch_zip=False)
    _storage.atomic_write(old, plan.file_chunks())
    assert _same(acp.load(old), sd)
    with open(pooled, "r+b") as f:                  # one tensor byte changed on disk: mindio.load says so
        f.seek(fmt.header_info(f.read(), pooled)["data_off"] + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch in tensor storage"):
        acp.load(pooled, open_way="fopen")


def test_damaged_and_foreign_files_name_the_path(acp_env):
    """mindio.load of garbage or of a cut torch.save file: CorruptCheckpoint with the path and the reason."""
    good = os.path.join(acp_env["ck"], "good.pt")
    torch.save({"w": torch.randn(1000), "l": [torch.ones(3), 5]}, good)
    whole = open(good, "rb").read()
    cases = {"garbage": os.urandom(5000), "zeros": bytes(300), "text": b"hello world\n" * 20,
             **{f"cut-{n}": whole[:n] for n in (30, 200, len(whole) // 2, len(whole) - 30)}}
    for name, data in cases.items():
        path = os.path.join(acp_env["ck"], f"{name}.pt")
        with open(path, "wb") as f:
            f.write(data)
        for weights_only in (True, False):
            with pytest.raises(CorruptCheckpoint) as err:
                acp.load(path, weights_only=weights_only)
            assert err.value.path == path and err.value.reason and "\n" not in str(err.value), (name, err.value)


def test_file_objects_go_through_torch_save(acp_env, caplog):
    buf = io.BytesIO()
    sd = _sd()
    assert acp.save(sd, buf) == 0 and api.fallback_counts() == {"torch.save": 1}
    assert sum("file-like object" in r.message for r in caplog.records) == 1
    buf.seek(0)
    assert _same(torch.load(buf, weights_only=True), sd)
    buf.seek(0)
    assert _same(acp.load(buf), sd)


def test_quantized_fallback_names_quantization(acp_env, caplog):
    path = os.path.join(acp_env["ck"], "q.pt")
    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
    assert acp.save({"q": q}, path) == 0 and api.fallback_counts() == {"torch.save": 1}
    said = [r.message for r in caplog.records if "fallback to torch.save" in r.message]
    assert len(said) == 1 and "quantized tensors (torch.qint8" in said[0] and "strided" not in said[0], said
    assert torch.equal(acp.load(path, weights_only=False)["q"].int_repr(), q.int_repr())


@pytest.mark.slow
def test_mindio_convert_command(acp_env):
    """`mindio convert SRC DST`: a version-1 container (which torch.load cannot read) becomes a torch.save
    file; a damaged source is one line on stderr and exit 1."""
    import subprocess
    import sys

    sd = _sd()
    old, dst, bad = (os.path.join(acp_env["ck"], n) for n in ("v1.pt", "plain.pt", "bad.pt"))
    _storage.atomic_write(old, fmt.plan(sd, torch_zip=False).file_chunks())
    with pytest.raises(Exception):
        torch.load(old, weights_only=True)
    run = subprocess.run([sys.executable, "-m", "mindio.cli", "convert", old, dst], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert _same(torch.load(dst, weights_only=True), sd)
    with open(bad, "wb") as f:
        f.write(b"\0" * 100)
    run = subprocess.run([sys.executable, "-m", "mindio.cli", "convert", bad, dst], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and bad in run.stderr and "corrupt" in run.stderr

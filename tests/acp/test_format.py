"""The container format: exact round trips, verification of every byte region, safe unpickling."""
import collections
import os
import struct

import numpy as np
import pytest
import torch

from mindio.acp import _config
from mindio.acp import format as fmt
from mindio.errors import CheckpointError, ConfigError, CorruptCheckpoint


def _image(obj, checksummed=True, torch_zip=True) -> bytearray:
    plan = fmt.plan(obj, torch_zip=torch_zip)
    buf = bytearray(plan.total_len)
    plan.write_into(buf)
    if checksummed:
        header = fmt.checksummed_header(buf)
        buf[: len(header)] = header
    return buf


def _sample():
    w = torch.randn(8, 16)
    return {
        "w": w, "row": w[3], "t": w.t(), "param": torch.nn.Parameter(torch.ones(4)),
        "grad": torch.zeros(3, requires_grad=True), "bf16": torch.arange(6, dtype=torch.bfloat16),
        "i64": torch.arange(5), "bool": torch.tensor([True, False]), "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5), "od": collections.OrderedDict(a=1, b=[1, 2, (3, "x")]),
        "np": np.arange(4, dtype=np.float32), "size": torch.Size([2, 3]), "dtype": torch.float16,
        "none": None, "bytes": b"\x00\x01", "set": {1, 2},
    }


def test_round_trip_preserves_values_types_and_sharing():
    obj = _sample()
    out = fmt.load_buffer(_image(obj), "x.pt")
    for key in ("w", "row", "t", "bf16", "i64", "bool", "empty", "scalar"):
        assert out[key].dtype == obj[key].dtype and torch.equal(out[key], obj[key]), key
    assert isinstance(out["param"], torch.nn.Parameter) and out["param"].requires_grad
    assert out["grad"].requires_grad and not out["i64"].requires_grad
    assert out["t"].stride() == obj["t"].stride()
    assert out["od"] == obj["od"] and type(out["od"]) is collections.OrderedDict
    assert np.array_equal(out["np"], obj["np"]) and out["size"] == obj["size"] and out["dtype"] == torch.float16
    assert out["set"] == {1, 2} and out["bytes"] == b"\x00\x01" and out["none"] is None
    out["w"][3, 0] = 1234.0                      # views share one storage, as with torch.save
    assert out["row"][0] == 1234.0 and out["t"][0, 3] == 1234.0


def test_layout_is_aligned_and_flagged():
    buf = _image({"a": torch.ones(3), "b": torch.ones(100, dtype=torch.float64)})
    info = fmt.header_info(buf)
    assert info["data_off"] % 4096 == 0 and info["flags"] == fmt.FLAG_CHECKSUMS
    assert all(crc != 0 for crc in info["crcs"]) and info["total_len"] == len(buf)
    unflagged = _image({"a": torch.ones(3)}, checksummed=False)
    assert fmt.header_info(unflagged)["flags"] == 0


def test_file_chunks_equal_checksummed_pool_image():
    obj = {"a": torch.randn(1000), "b": torch.randn(7, 3).half()}
    assert b"".join(bytes(c) for c in fmt.plan(obj).file_chunks()) == bytes(_image(obj))


def _flip(buf, pos):
    buf[pos] ^= 0x10
    return buf


@pytest.mark.parametrize("torch_zip", [True, False], ids=["v2-zip", "v1"])
@pytest.mark.parametrize("where", ["magic", "version", "preamble", "meta", "table", "data"])
def test_any_flipped_bit_is_detected(where, torch_zip):
    """Every byte mindio reads is verified (version 2: its own record; the zip bytes are torch's)."""
    obj = {"a": torch.randn(100), "b": torch.randn(50)}
    buf = _image(obj, torch_zip=torch_zip)
    info = fmt.header_info(buf)
    base = 128 if torch_zip else 0
    table_off = struct.unpack_from("<Q", buf, base + 24)[0]
    pos = {"magic": base + 1, "version": base + 8, "preamble": base + 20, "meta": base + 70, "table": table_off + 17,
           "data": info["data_off"] + 250}[where]
    with pytest.raises(CorruptCheckpoint) as err:
        fmt.load_buffer(_flip(buf, pos), "/ckpt/model.pt")
    assert "/ckpt/model.pt" in str(err.value) and err.value.path == "/ckpt/model.pt"


@pytest.mark.parametrize("torch_zip", [True, False], ids=["v2-zip", "v1"])
@pytest.mark.parametrize("keep", [0, 10, 64, 136, 4096, -1])
def test_truncation_is_detected(keep, torch_zip):
    buf = _image({"a": torch.randn(2000)}, torch_zip=torch_zip)
    cut = buf[:keep] if keep >= 0 else buf[:-1]
    with pytest.raises(CorruptCheckpoint, match="truncated|bad magic"):
        fmt.load_buffer(cut, "short.pt")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/mindio-pwned",))


def test_weights_only_load_refuses_code(tmp_path):
    buf = _image({"x": _Evil()})
    with pytest.raises(CheckpointError, match="refuses to import"):
        fmt.load_buffer(buf, "evil.pt")
    assert not os.path.exists("/tmp/mindio-pwned")


def test_trusted_load_rebuilds_arbitrary_objects():
    import argparse
    ns = argparse.Namespace(lr=0.1, layers=2)
    out = fmt.load_buffer(_image({"args": ns, "w": torch.ones(2)}), "m.pt", weights_only=False)
    assert out["args"] == ns


def test_map_location_forms():
    buf = _image({"w": torch.ones(2)})
    assert fmt.load_buffer(buf, "m", map_location="cpu")["w"].device.type == "cpu"
    assert fmt.load_buffer(buf, "m", map_location={"cpu": "cpu"})["w"].device.type == "cpu"
    seen = []
    out = fmt.load_buffer(buf, "m", map_location=lambda t, loc: seen.append(loc) or t * 2)
    assert seen == ["cpu"] and torch.equal(out["w"], torch.full((2,), 2.0))


def test_unsupported_tensors_raise_type_error():
    with pytest.raises(TypeError):
        fmt.plan({"s": torch.eye(3).to_sparse()})


def test_server_info_validation():
    cfg = _config.parse_server_info({"memfs.data_block_size_in_mb": "8", "memfs.write.parallel.enabled": "false",
                                     "background.backup.thread_num": 4}, environ={})
    assert cfg.block_bytes == 8 << 20 and not cfg.parallel and cfg.copy_threads() == 1
    assert cfg.persist_threads() == 4
    for bad in ({"memfs.unknown": "1"}, {"memfs.data_block_size_in_mb": "0"},
                {"memfs.write.parallel.thread_num": "97"}, {"memfs.write.parallel.enabled": "maybe"},
                {"memfs.data_block_pool_capacity_in_gb": "abc"}, {"background.backup.thread_num": "0"},
                {"memfs.data_block_pool_capacity_in_gb": "1024"}):
        with pytest.raises(ConfigError):
            _config.parse_server_info(bad, environ={})
    with pytest.raises(ConfigError):
        _config.parse_server_info(["not", "a", "dict"], environ={})
    assert _config.parse_server_info(None, environ={"MINDIO_ACP_POOL_MB": "64"}).pool_bytes == 64 << 20


def _rebuild(buf, *, edit_meta=None) -> bytearray:
    """``buf``'s image with its metadata edited and every CRC recomputed: a crafted file, which only
    the structure checks can catch (no checksum fails)."""
    import msgpack

    _, _, flags, n0, meta_len, table_off, data_off, total = struct.unpack_from("<8sHHIQQQQ", buf, 0)
    meta = msgpack.unpackb(bytes(buf[64: 64 + meta_len]), raw=False)
    if edit_meta:
        edit_meta(meta)
    packed = meta if isinstance(meta, bytes) else msgpack.packb(meta, use_bin_type=True)
    table = bytes(buf[table_off: table_off + 24 * n0])
    new_table_off = 64 + len(packed)
    new_data_off = -(-(new_table_off + len(table)) // 4096) * 4096
    data = bytes(buf[data_off: total])
    pre = fmt._preamble(flags, n0, packed, new_table_off, new_data_off, new_data_off + len(data), table)
    head = pre + packed + table
    return bytearray(head + b"\0" * (new_data_off - len(head)) + data)


def _set_tensor(field, value):
    def edit(meta):
        meta["tensors"][0][field] = value
    return edit


@pytest.mark.parametrize("case", [
    "storage-count", "storages-field", "not-msgpack", "meta-not-a-map", "skeleton-garbage", "skeleton-attribute",
    "shape-past-storage", "negative-offset", "dtype-not-a-dtype", "storage-index", "float-shape", "short-desc",
    "junk-appended"])
def test_crafted_containers_raise_corrupt_checkpoint(case):
    """Files whose checksums all match but whose structure lies: never a struct/msgpack/torch error,
    never a resized storage, always CorruptCheckpoint naming the file."""
    buf = _image({"a": torch.randn(100), "b": torch.arange(10)}, torch_zip=False)     # the structure checks
    edits = {
        "storages-field": lambda m: m.update(storages=99),
        "skeleton-garbage": lambda m: m.update(skeleton=b"\x80\x04\x95garbage"),
        "skeleton-attribute": lambda m: m.update(skeleton=b"\x80\x04K\x01K\x02a."),   # APPEND to an int
        "shape-past-storage": _set_tensor(2, [10 ** 6]),
        "negative-offset": _set_tensor(1, -1),
        "dtype-not-a-dtype": _set_tensor(4, "save"),
        "storage-index": _set_tensor(0, 7),
        "float-shape": _set_tensor(2, [1.5]),
        "short-desc": lambda m: m["tensors"].__setitem__(0, m["tensors"][0][:7]),
    }
    if case == "storage-count":          # table CRC taken over what a reader of 10**6 entries slices
        bad = _rebuild(buf)
        bad[12:16] = struct.pack("<I", 10 ** 6)
        bad[:64] = fmt._preamble(*_fields_for_preamble(bad))
    elif case == "junk-appended":
        bad = buf + b"junk" * 100
    elif case in ("not-msgpack", "meta-not-a-map"):
        import msgpack
        bad = _rebuild(buf)
        meta_len = struct.unpack_from("<Q", bad, 16)[0]
        # 0xc1: a byte msgpack never uses; or a valid msgpack value that is not a map (bin 8 + bytes)
        junk = b"\xc1" * meta_len if case == "not-msgpack" else msgpack.packb(b"\0" * (meta_len - 2))
        assert len(junk) == meta_len
        bad[64: 64 + meta_len] = junk
        bad[:64] = fmt._preamble(*_fields_for_preamble(bad))
    else:
        bad = _rebuild(buf, edit_meta=edits[case])
    with pytest.raises(CorruptCheckpoint) as err:
        fmt.load_buffer(bad, "/ckpt/crafted.pt")
    assert err.value.path == "/ckpt/crafted.pt"


def _fields_for_preamble(buf):
    """_preamble's arguments for ``buf`` as it now is (CRCs recomputed over its current bytes)."""
    _, _, flags, n, meta_len, table_off, data_off, total = struct.unpack_from("<8sHHIQQQQ", buf, 0)
    return flags, n, bytes(buf[64: 64 + meta_len]), table_off, data_off, total, bytes(buf[table_off: table_off + 24 * n])


@pytest.mark.parametrize("content", ["empty", "5-bytes", "magic-only", "torch-truncated", "container-junk"])
def test_damaged_files_raise_corrupt_checkpoint(tmp_path, content):
    """Through mindio.load of a file: every damaged or mis-sized file is CorruptCheckpoint naming it."""
    from mindio import acp

    path = str(tmp_path / "model.pt")
    torch.save({"w": torch.randn(1000)}, path)
    whole = open(path, "rb").read()
    data = {"empty": b"", "5-bytes": b"PK\x03\x04\x00", "magic-only": b"MINDIOCK",
            "torch-truncated": whole[: len(whole) // 2],
            "container-junk": bytes(_image({"w": torch.randn(10)})) + b"\0" * 7}[content]
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptCheckpoint) as err:
        acp.load(path, open_way="fopen")
    assert err.value.path == path and path in str(err.value)


@pytest.mark.parametrize("where", ["first-header", "data.pkl", "storage-header", "directory", "end-record"])
def test_flipped_zip_bytes_are_detected(where):
    """Version 2: the zip bytes torch.load reads (headers, torch's data.pkl, the central directory) are
    checked by mindio.load as well, so a file mindio.load accepts is one torch.load can read."""
    buf = _image({"a": torch.randn(100), "b": torch.randn(50)})
    info = fmt.header_info(buf)
    pkl = bytes(buf).index(b"archive/data.pkl") + 100
    pos = {"first-header": 10, "data.pkl": pkl, "storage-header": info["data_off"] + 448 + 10,
           "directory": len(buf) - 200, "end-record": len(buf) - 5}[where]
    with pytest.raises(CorruptCheckpoint, match="zip structure"):
        fmt.load_buffer(_flip(buf, pos), "/ckpt/model.pt")

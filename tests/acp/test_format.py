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


def _image(obj, checksummed=True) -> bytearray:
    plan = fmt.plan(obj)
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


@pytest.mark.parametrize("where", ["magic", "version", "preamble", "meta", "table", "data"])
def test_any_flipped_bit_is_detected(where):
    obj = {"a": torch.randn(100), "b": torch.randn(50)}
    buf = _image(obj)
    info = fmt.header_info(buf)
    table_off = struct.unpack_from("<Q", buf, 24)[0]
    pos = {"magic": 1, "version": 8, "preamble": 20, "meta": 70, "table": table_off + 17,
           "data": info["data_off"] + 250}[where]
    with pytest.raises(CorruptCheckpoint) as err:
        fmt.load_buffer(_flip(buf, pos), "/ckpt/model.pt")
    assert "/ckpt/model.pt" in str(err.value) and err.value.path == "/ckpt/model.pt"


@pytest.mark.parametrize("keep", [0, 10, 64, 4096, -1])
def test_truncation_is_detected(keep):
    buf = _image({"a": torch.randn(2000)})
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

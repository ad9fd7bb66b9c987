"""The JSON index of mindio's torch_dist writer (mindio/megatron/torch_dist.py), in one process: the
pieces rebuild DCP's plans exactly, the merge is DCP's own (it refuses a missing chunk), a piece of
another save or a missing writer is named, and an index never points outside its directory."""
import json

import pytest
import torch

from _mgt_launch import have_megatron

pytestmark = pytest.mark.skipif(not have_megatron(), reason="megatron-core is not installed")


def _piece(rank, save_id, writers, rows):
    """A writer's piece: ``rows`` of (fqn, offset, size) chunks of a 1-D float32 tensor of 8 elements."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from mindio.megatron import torch_dist as td

    items, results = [], []
    for fqn, off, size in rows:
        index = MetadataIndex(fqn, torch.Size([off]), 0)
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([off]), torch.Size([size])),
            properties=TensorProperties(dtype=torch.float32), size=torch.Size([8]))))
        results.append(WriteResult(index=index, size_in_bytes=size * 4,
                                   storage_data=_StorageInfo(f"__{rank}_0.distcp", off * 4, size * 4)))
    return {"save_id": save_id, "rank": rank, "writers": writers,
            "items": [td._item_to_json(i) for i in items], "results": [td._result_to_json(r) for r in results]}


def _write(d, piece):
    (d / f"__{piece['rank']}.mindio.json").write_text(json.dumps(piece))


def test_pieces_merge_into_dcp_metadata(tmp_path):
    from mindio.megatron import torch_dist as td

    _write(tmp_path, _piece(0, "s", [0, 3], [("w", 0, 5)]))
    _write(tmp_path, _piece(3, "s", [0, 3], [("w", 5, 3)]))
    _write(tmp_path, _piece(1, "old", [0, 1], [("w", 0, 8)]))  # left by another save: never merged
    md = td._metadata(td._pieces(tmp_path, "s", [0, 3]))
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["w"].chunks)
    assert chunks == [((0,), (5,)), ((5,), (3,))] and md.state_dict_metadata["w"].size == torch.Size([8])
    assert sorted(i.relative_path for i in md.storage_data.values()) == ["__0_0.distcp", "__3_0.distcp"]


def test_missing_or_foreign_piece_is_named(tmp_path):
    from mindio.megatron import torch_dist as td

    _write(tmp_path, _piece(0, "s", [0, 3], [("w", 0, 5)]))
    with pytest.raises(FileNotFoundError, match="rank 3 did not finish"):
        td._pieces(tmp_path, "s", [0, 3])
    _write(tmp_path, _piece(3, "other", [0, 3], [("w", 5, 3)]))
    with pytest.raises(ValueError, match="belongs to another save"):
        td._pieces(tmp_path, "s", [0, 3])


def test_a_chunk_nobody_wrote_fails_the_merge(tmp_path):
    from mindio.megatron import torch_dist as td

    _write(tmp_path, _piece(0, "s", [0, 3], [("w", 0, 5)]))
    _write(tmp_path, _piece(3, "s", [0, 3], [("w", 6, 2)]))  # element 5 is missing
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        td._metadata(td._pieces(tmp_path, "s", [0, 3]))


def test_index_never_points_outside_its_directory():
    from mindio.megatron import torch_dist as td

    for name in ("../x.distcp", "/etc/passwd", ".metadata"):
        with pytest.raises(ValueError, match="outside its directory"):
            td._result_from_json({"index": ["w", [0], 0], "size": 4, "file": name, "offset": 0, "length": 4})
    with pytest.raises(ValueError, match="unknown dtype"):
        td._dtype("torch.Tensor")


@pytest.mark.timeout(120)
def test_a_dump_written_into_the_pool_is_what_megatron_reads(tmp_path):
    """Issue 33: the last-words checkpoint's data file goes straight into a region of the checkpoint store's
    pool (sized first, each tensor's bytes in place; views of bigger buffers and bf16 included) and megatron-
    core's own dist_checkpointing.load reads every tensor back equal."""
    import os
    import subprocess
    import sys

    from _mgt_launch import REPO

    env = dict(os.environ, MINDIO_ACP_DIR=str(tmp_path / "run"), MINDIO_ACP_POOL_MB="64", MINDIO_ACP_IDLE_EXIT="30",
               PYTHONPATH=str(REPO))
    env.pop("MINDIO_ACP_DISABLE", None)
    out = subprocess.run([sys.executable, str(REPO / "tests" / "megatron" / "_pooled_dump_child.py"),
                          str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "POOLED True" in out.stdout and "ROUNDTRIP True" in out.stdout, out.stdout + out.stderr[-3000:]


def test_a_checkpoints_small_files_are_durable_before_the_tracker_names_it(tmp_path, monkeypatch):
    """The index pieces, common.pt, its checksum record and .metadata are renamed into place without an
    fsync (one during a dump waited behind the store persisting the data); write_tracker fsyncs each
    of them and their directory after the store's flush, and only then writes the tracker."""
    import os

    from mindio.megatron import checkpoint
    from mindio.megatron import torch_dist as td

    d = checkpoint.checkpoint_dir(tmp_path, 3)
    d.mkdir()
    synced, order = [], []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    td._atomic_write(d / "__0.mindio.json", b"{}", durable=False)
    td.write_common({"iteration": 3}, d)
    td._atomic_write(d / ".metadata", b"x", durable=False)
    td._atomic_write(d / td.CONFIG, b"{}", durable=False)
    assert synced == []  # nothing synced while a dump writes
    import mindio.acp._storage as storage

    inner = storage.atomic_write

    def tracked(path, *a, **k):
        order.append((path, list(synced)))
        return inner(path, *a, **k)

    monkeypatch.setattr(storage, "atomic_write", tracked)
    checkpoint.write_tracker(tmp_path, 3)  # the tracker's own write: an atomic_write, looked up when called
    names = {"__0.mindio.json", td.COMMON, td.COMMON_SUM, ".metadata", td.CONFIG}
    (tracker, before), = order
    assert tracker.endswith(checkpoint.TRACKER)
    assert {os.path.basename(p) for p in before} >= names and str(d) in before  # each file, then the directory
    assert checkpoint.read_tracker(tmp_path) == 3

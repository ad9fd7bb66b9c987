"""Megatron's ``torch_dist`` checkpoint format, written by any subset of ranks without collectives.

``megatron.core.dist_checkpointing.save`` is collective over the world (rank 0 plans, every rank
takes part in a gather and a barrier), so it cannot write a dump, which only the ranks the controller
picked take part in while the others are parked or dead. This module writes the same format with
megatron-core's and PyTorch DCP's own pieces, split at the one point that needs communication:

1. :func:`write_local` (each writing rank, alone): megatron's ``save_preprocess`` (factories,
   common part), its ShardedTensor -> PyTorch conversion, its ``MCoreSavePlanner`` for the local plan,
   DCP's ``FileSystemWriter`` for the data -> ``__<rank>_0.distcp`` (the file Megatron's own writer
   produces), plus ``__<rank>.mindio.json``: the local plan and the write results, as JSON.
2. :func:`finalize` (one rank, once every writer is done): reads the JSON pieces of the writers of
   this save, rebuilds their plans and lets DCP merge them exactly as Megatron's coordinator does
   (``create_global_plan``, which also validates that the chunks of every tensor cover it without
   overlap), then writes ``.metadata`` (DCP's pickle, what Megatron and torch read) and
   ``metadata.json`` (megatron's backend record).

Which rank writes which item is decided before (``replica_id``: the main replica of every item
is written, the others are dropped, as Megatron does); see checkpoint.py.

I/O path: the data files go through the mindio checkpoint store (a region of its memory pool, persisted
in the background) when it runs, else they are written to storage atomically; they are the exact bytes
PyTorch's writer produces. ``common.pt`` and the small metadata files are renamed into storage at once
(another rank reads them) and fsynced by :func:`persist` after the store's flush, before the tracker.

Verification: every item's bytes carry an XXH3-64 hash (``xxh3`` of its entry in the JSON piece, computed
from the bytes written; ``crc32`` in checkpoints written before, still checked), ``common.pt`` a CRC-32 in
``common.mindio.json``; reading checks each item it reads, and ``common.pt``, before using them and raises
:class:`CorruptCheckpoint` naming the file and the reason (a checkpoint written before the checksums existed
is read unchecked). XXH3-64 (the ``xxhash`` package) hashes at ~30 GB/s on one core here, the CRC-32 at
~7.5 GB/s on this machine's host: at 1 GiB per rank the CRC-32 was a third of a dump's data time.

Reading (:func:`read_local`, one rank, no collectives) never unpickles: the DCP metadata is rebuilt
from the JSON pieces, ``common.pt`` and the sharded objects are read with ``torch.load(weights_only=
True)`` (plus argparse.Namespace and numpy's RNG state arrays, which Megatron's own files contain).
Data is read in place (``mindio.acp._files.open_stream``: a view of the pooled bytes, else the file), each
item's range only; small files through ``mindio.acp.open_file`` (the pool first, then storage).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import pickle
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (FileSystem, FileSystemReader, FileSystemWriter,
                                                     _StorageInfo, _StoragePrefix)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties)
from torch.distributed.checkpoint.planner import (BytesIOWriteData, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult

from mindio import _logging
import xxhash

from mindio._native import crc32
from mindio.acp._storage import atomic_write, file_mode, fsync_files

__all__ = ["COMMON", "write_local", "write_common", "finalize", "read_local", "read_common",
           "has_index", "is_complete", "SAFE_GLOBALS", "CorruptCheckpoint"]

_log = logging.getLogger(__name__)

COMMON = "common.pt"
COMMON_SUM = "common.mindio.json"  # the CRC-32 and size of common.pt


class CorruptCheckpoint(ValueError):
    """A checkpoint file whose bytes are not those written (hash or size differ), or whose index is
    unreadable. ``path``: the file; ``reason``: what differs."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason
CONFIG = "metadata.json"  # megatron's CheckpointingConfig
_PIECE = "__{rank}.mindio.json"
_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}


def _safe_globals() -> list:
    import numpy as np

    out = [argparse.Namespace, np.ndarray, np.dtype, np.core.multiarray._reconstruct]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out.append(dtypes.UInt32DType)
    return out


#: What ``weights_only`` loading accepts beyond tensors and containers (Megatron's common.pt holds an
#: argparse.Namespace, its RNG state numpy's MT19937 arrays).
SAFE_GLOBALS = _safe_globals()


# ---------------------------------------------------------------------------- byte I/O
def _acp():
    try:
        from mindio import acp

        return acp
    except ImportError:  # pragma: no cover
        return None


def _store(path: Path, data: bytes) -> None:
    """``data`` to ``path``: through the mindio store when available, else atomically to storage."""
    acp = _acp()
    if acp is not None:
        with acp.create_file(str(path), mode=file_mode()) as f:
            f.write(data)
        return
    _atomic_write(path, data)


def _atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """The store's atomic write: exclusive temp file, fsync, rename, directory fsync, the umask's mode.
    ``durable=False``: no fsync yet -- a checkpoint's small files (its index pieces, its checksum records,
    ``.metadata``) are made durable by :func:`persist`, after the store's flush, before the tracker
    points at the checkpoint. An fsync while the store persists a dump's data waited behind it: 60-120 ms
    per file at 1 GiB per rank, a third of a dump."""
    atomic_write(str(path), [data], file_mode(), durable=durable)


def persist(directory: Path) -> None:
    """fsync the small files this module wrote to ``directory`` without it (every rank's index piece,
    ``common.pt`` and its checksum record, ``.metadata``, ``metadata.json``) and the directory: call after the
    store's flush, before the tracker names the checkpoint. Pieces of writers on other hosts are on shared
    storage: their writer's close() sent them there."""
    d = Path(directory)
    names = list(d.glob("__*.mindio.json")) + [d / n for n in (COMMON, COMMON_SUM, ".metadata", CONFIG)]
    fsync_files([str(p) for p in names])  # one that is not there is skipped


def _fetch(path: Path) -> bytes:
    """The newest bytes of ``path``: the mindio store's pool first, then storage."""
    acp = _acp()
    if acp is not None:
        with acp.open_file(str(path)) as f:
            return f.read()
    return Path(path).read_bytes()


def _open_read(path: Path):
    """A seekable stream of the newest bytes of ``path`` (the store's pooled bytes read in place, else the
    file): DCP reads each item's range from it, so a rank reads only what it loads, with one copy."""
    acp = _acp()
    if acp is not None:
        from mindio.acp._files import open_stream

        return open_stream(str(path))
    return open(path, "rb", buffering=0)


class _StoredBuffer(io.BytesIO):
    """A write stream whose bytes go to :func:`_store` when it is closed (DCP closes it itself); they are
    also handed to ``sink`` (path, bytes), which checksums the items in them."""

    def __init__(self, path: Path, sink=None):
        super().__init__()
        self._path, self._sink = path, sink

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            _store(self._path, data)
            if self._sink is not None:
                self._sink(self._path, data)
        super().close()


class _RegionStream(io.RawIOBase):
    """A write-only stream over a region of the store's pool: torch.save hands it each record as a
    memoryview of the tensor's own bytes, which lands in the region in place -- records of 1 MiB and more
    by the store's parallel copy -- so a tensor is copied once, pool-bound."""

    def __init__(self, buf, copy_many):
        super().__init__()
        self._buf, self._copy_many, self._pos = buf, copy_many, 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        end = self._pos + mv.nbytes
        if end > len(self._buf):
            raise ValueError(f"a record of {mv.nbytes} B does not fit the region sized for it ({len(self._buf)} B)")
        if mv.nbytes >= _PARALLEL_MIN:
            self._copy_many(self._buf, [(self._pos, mv)])
        else:
            self._buf[self._pos:end] = mv
        self._pos = end
        return mv.nbytes


class _Counter(io.RawIOBase):
    """The sizing pass: counts what torch.save writes (each record a view of the tensor: nothing copied)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.n

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n


_PARALLEL_MIN = 1 << 20


@contextmanager
def _crc32(on: bool):
    """torch.save's CRC32 of each record on or off while a dump writes: off, a tensor is written at memory
    speed (the CRC ran at ~1.4 GB/s here, twice with the sizing pass); torch.load reads either."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(on)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _signature(t: torch.Tensor) -> tuple:
    """What the size of ``torch.save(t)`` depends on: its record layout (one storage of exactly these bytes,
    the pickled rebuild arguments), not its values. Tensors of one signature -- the same weight of every
    layer -- are sized once; the write pass checks every item's size against it all the same."""
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(),
            t.requires_grad, t.is_conj(), t.is_neg())


def warm() -> None:
    """Import what a dump's :func:`write_local` needs (megatron's dist_checkpointing strategies: ~0.3 CPU-s
    cold) now, at start-up, instead of on the critical path of the job's last words (the adapter calls it;
    mindio-run's fork server does it once for every rank it forks)."""
    from megatron.core.dist_checkpointing import state_dict_utils  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as _strategies  # noqa: F401


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU with a storage of exactly its own bytes (torch.save writes a tensor's whole
    storage): a contiguous view of a bigger buffer (a distributed optimizer's shard) is aliased, not
    copied; a non-contiguous one is cloned, as DCP's writer does."""
    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
        return t
    if not t.is_contiguous() or t.numel() == 0:
        return t.clone()
    try:
        import numpy as np  # noqa: F401  (from_numpy: a storage of the view's own extent)

        same = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
        raw = same.get(t.dtype)
        return torch.from_numpy((t.view(raw) if raw else t).numpy()).view(t.dtype)
    except (TypeError, RuntimeError, ImportError):
        return t.clone()


def _write_pooled(final: SavePlan, planner, directory: Path, rank: int, crc: bool,
                  digests: list) -> Optional[list]:
    """This rank's data file ``__<rank>_0.distcp`` written straight into a region of the store's pool: a
    sizing pass (torch.save into a counter), one region of exactly that size, then each item's bytes in
    place (DCP's order and record format: what its reader and Megatron's read). The WriteResults, or None
    when the store has no pool to write into (the caller uses DCP's writer). ``digests`` gets the XXH3-64 of
    each result's bytes as they lie in the region (mindio's check at load; ``crc``: torch's own per record)."""
    from mindio.acp._files import write_region

    name = f"__{rank}_0.distcp"
    items = [i for i in final.items if i.type == WriteItemType.BYTE_IO] + \
        [i for i in final.items if i.type != WriteItemType.BYTE_IO]
    datas = [planner.resolve_data(i) if i.type == WriteItemType.BYTE_IO else _exact(planner.resolve_data(i))
             for i in items]
    sizes, sized = [], {}  # torch.save's size of each tensor signature (_signature): sized once
    with _crc32(crc):
        for data in datas:
            if isinstance(data, io.BytesIO):
                sizes.append(data.getbuffer().nbytes)
                continue
            key = _signature(data)
            if key not in sized:
                counter = _Counter()
                torch.save(data, counter)
                sized[key] = counter.n
            sizes.append(sized[key])
        results: list = []

        def write(buf, copy_many):
            stream = _RegionStream(buf, copy_many)
            for item, data, size in zip(items, datas, sizes):
                offset = stream.tell()
                if isinstance(data, io.BytesIO):
                    stream.write(data.getbuffer())
                else:
                    torch.save(data, stream)
                if stream.tell() - offset != size:
                    raise RuntimeError(f"{item.index.fqn}: torch.save wrote {stream.tell() - offset} B, sized {size} B")
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data=_StorageInfo(name, offset, size)))
                digests.append(_digest(memoryview(buf)[offset:offset + size]))

        if not write_region(str(directory / name), sum(sizes), write, mode=file_mode()):
            return None
    return results


class _StoreFileSystem(FileSystem):
    """DCP's file system with every data file written and read through :func:`_store`/:func:`_fetch`.
    ``written`` keeps the bytes of each file written (by name) until the items' checksums are taken."""

    def __init__(self):
        super().__init__()
        self.written: dict = {}

    def _keep(self, path: Path, data: bytes) -> None:
        self.written[path.name] = data

    @contextmanager
    def create_stream(self, path, mode):
        if mode == "wb":
            with _StoredBuffer(Path(path), self._keep) as buf:
                yield buf
        elif mode == "rb":
            with _open_read(Path(path)) as stream:
                yield stream
        else:  # pragma: no cover - DCP uses only these two
            raise ValueError(f"unsupported mode {mode!r}")


# ------------------------------------------------------------- plans <-> JSON (no pickle)
def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint index")
    return value


def _index_to_json(index: MetadataIndex) -> list:
    return [index.fqn, None if index.offset is None else list(index.offset), index.index]


def _index_from_json(raw: list) -> MetadataIndex:
    fqn, offset, hint = raw
    return MetadataIndex(str(fqn), None if offset is None else torch.Size(int(x) for x in offset),
                         None if hint is None else int(hint))


def _item_to_json(item: WriteItem) -> dict:
    out = {"index": _index_to_json(item.index), "type": item.type.name}
    if item.bytes_io_data is not None:
        out["nbytes"] = item.bytes_io_data.nbytes
    if item.tensor_data is not None:
        td = item.tensor_data
        out["tensor"] = {"offsets": list(td.chunk.offsets), "sizes": list(td.chunk.sizes),
                         "size": list(td.size), "dtype": str(td.properties.dtype),
                         "requires_grad": bool(td.properties.requires_grad)}
    return out


def _item_from_json(raw: dict) -> WriteItem:
    tensor = raw.get("tensor")
    td = None
    if tensor is not None:
        td = TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(tensor["offsets"]), sizes=torch.Size(tensor["sizes"])),
            properties=TensorProperties(dtype=_dtype(tensor["dtype"]), requires_grad=tensor["requires_grad"]),
            size=torch.Size(tensor["size"]))
    nbytes = raw.get("nbytes")
    return WriteItem(index=_index_from_json(raw["index"]), type=WriteItemType[raw["type"]],
                     bytes_io_data=None if nbytes is None else BytesIOWriteData(int(nbytes)), tensor_data=td)


def _result_to_json(res: WriteResult) -> dict:
    info: _StorageInfo = res.storage_data
    if info.transform_descriptors:
        raise ValueError(f"{res.index.fqn}: storage transforms are not supported")
    return {"index": _index_to_json(res.index), "size": res.size_in_bytes,
            "file": info.relative_path, "offset": info.offset, "length": info.length}


@dataclasses.dataclass
class _CheckedInfo(_StorageInfo):
    """DCP's storage info of an item plus the hash of its bytes: XXH3-64, or the CRC-32 of a checkpoint
    written before (reading only: never pickled into ``.metadata``, which Megatron and torch unpickle
    without mindio)."""

    crc32: Optional[int] = None
    xxh3: Optional[int] = None


def _digest(data) -> int:
    """What an item's bytes are checked with: their XXH3-64."""
    return xxhash.xxh3_64_intdigest(data)


def _result_from_json(raw: dict, checked: bool = False) -> WriteResult:
    name = str(raw["file"])
    if "/" in name or name.startswith("."):
        raise ValueError(f"checkpoint index names a file outside its directory: {name!r}")
    where = (name, int(raw["offset"]), int(raw["length"]))
    info = _CheckedInfo(*where, crc32=raw.get("crc32"), xxh3=raw.get("xxh3")) if checked else \
        _StorageInfo(*where)
    return WriteResult(index=_index_from_json(raw["index"]), size_in_bytes=int(raw["size"]), storage_data=info)


def _checksums(results: List[dict], written: dict) -> None:
    """Add the hash of each written item's bytes to its JSON result (``written``: file name -> bytes)."""
    for raw in results:
        data = written.get(raw["file"])
        if data is not None:
            raw["xxh3"] = _digest(memoryview(data)[raw["offset"]:raw["offset"] + raw["length"]])


# ------------------------------------------------------------------------------- writing
@contextmanager
def _default_group(rank: int, world: Optional[int]):
    """megatron-core's conversion to DCP's ShardedTensors reads the rank and world size from the
    default process group. A dump runs after mindio's teardown destroyed every group (the default one
    too, to release ranks blocked in a collective with the failed one): then a communication-free
    stand-in (torch's "fake" backend) answers with this rank's coordinates while the pieces are
    written, and is destroyed afterwards. Nothing is sent anywhere."""
    if dist.is_initialized() or world is None:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def write_local(sharded_state_dict: dict, directory: Path, rank: int, save_id: str,
                writers: Iterable[int], world: Optional[int] = None, last_words: bool = False) -> dict:
    """Write this rank's main-replica items of ``sharded_state_dict`` (megatron ShardedTensors and
    ShardedObjects whose replica_id was set by the caller) to ``directory``; no collectives.

    ``writers``: every rank that writes this save (the finalizer reads exactly their pieces); ``save_id``
    names the save, so that a piece left by another save in the same directory is never merged.
    ``last_words`` (a dump): the records carry no torch CRC32 (written at memory speed; torch.load reads
    them); every item still gets mindio's hash in the index (XXH3-64), checked at load.
    With the checkpoint store running, the data file is written straight into a region of its pool
    (:func:`_write_pooled`); the rate is logged (event ``data_written``).
    Returns the common (non-sharded) part of the state dict."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    with _default_group(rank, world):  # no default group after mindio's teardown: a stand-in
        pyt = mcore_to_pyt_state_dict(flat, False)
        planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
        writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=False, thread_count=1,
                                  overwrite=True)
        writer.fs = fs = _StoreFileSystem()
        planner.set_up_planner(pyt, is_coordinator=True)
        writer.set_up_storage_writer(True)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{rank}_"))
        final = planner.finish_plan(plan)
        t0 = time.perf_counter()
        t_plan = t0 - t_begin
        pooled_digests: list = []
        results = _write_pooled(final, planner, directory, rank, crc=not last_words, digests=pooled_digests) \
            if _acp() is not None else None
        pooled = results is not None
        if not pooled:
            results = writer.write_data(final, planner).wait()
        took = time.perf_counter() - t0
    nbytes = sum(r.storage_data.length for r in results)
    t_index = time.perf_counter()
    written = [_result_to_json(r) for r in results]
    if pooled:  # the hash of each item's bytes in the region (_write_pooled), else of the bytes DCP wrote
        for raw, digest in zip(written, pooled_digests):
            raw["xxh3"] = digest
    else:
        _checksums(written, fs.written)
    fs.written.clear()
    piece = {"save_id": save_id, "rank": rank, "writers": sorted(set(int(w) for w in writers)),
             "items": [_item_to_json(i) for i in final.items], "results": written}
    _atomic_write(directory / _PIECE.format(rank=rank), json.dumps(piece).encode(), durable=False)  # persist()
    t_index = time.perf_counter() - t_index
    (_log.warning if last_words else _log.info)(  # a dump's rate is printed: it is the job's last words
        "rank %d wrote %d B of %s data in %.3f s (%.2f GB/s)%s; its plan (%d items) took %.3f s before, its "
        "index %.3f s after", rank, nbytes, "last-words checkpoint" if last_words else "checkpoint", took,
        nbytes / max(took, 1e-9) / 1e9, " into the store's pool" if pooled else "", len(results), t_plan, t_index)
    _logging.event("data_written", bytes=nbytes, s=round(took, 6), pooled=pooled, last_words=last_words,
                   plan_s=round(t_plan, 6), index_s=round(t_index, 6), items=len(results))
    return common


def write_common(common: dict, directory: Path) -> None:
    """``common.pt`` (torch.save bytes, read by Megatron with ``torch.load``) and its CRC-32
    (``common.mindio.json``), both to storage, made durable by :func:`persist`. A few KB: through the store
    it took 20-55 ms of a dump at 1 GiB per rank (the store busy persisting the data)."""
    buf = io.BytesIO()
    torch.save(common, buf)
    data = buf.getvalue()
    _atomic_write(Path(directory) / COMMON, data, durable=False)
    _atomic_write(Path(directory) / COMMON_SUM, json.dumps({"crc32": crc32(data), "size": len(data)}).encode(),
                  durable=False)


def _pieces(directory: Path, save_id: str, writers: Optional[List[int]]) -> List[dict]:
    directory = Path(directory)
    if writers is None:  # the finalizer's own piece names the writers of its save
        raise ValueError("the writers of a save must be known")
    out = []
    for r in writers:
        path = directory / _PIECE.format(rank=r)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: rank {r} did not finish writing its part of "
                                    f"checkpoint {directory}")
        piece = json.loads(path.read_text())
        if piece.get("save_id") != save_id or piece.get("rank") != r:
            raise ValueError(f"{path} belongs to another save ({piece.get('save_id')!r}, rank "
                             f"{piece.get('rank')}), not {save_id!r}: rank {r} did not write its part")
        out.append(piece)
    return out


def _metadata(pieces: List[dict], checked: bool = False) -> Metadata:
    """The global DCP metadata of the pieces, merged and validated by DCP itself."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    plans = [SavePlan(items=[_item_from_json(i) for i in p["items"]],
                      storage_data=_StoragePrefix(f"__{p['rank']}_"), planner_data={}) for p in pieces]
    planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
    _, metadata = planner.create_global_plan(plans)  # raises on a missing or overlapping chunk
    storage = {}
    for p in pieces:
        for raw in p["results"]:
            res = _result_from_json(raw, checked)
            storage[res.index] = res.storage_data
    metadata.storage_data = storage
    return metadata


def finalize(directory: Path, rank: int) -> None:
    """Merge the pieces of the save that this rank's piece belongs to into ``.metadata`` (what Megatron
    and torch read) and write ``metadata.json``. Call once every writer has returned."""
    directory = Path(directory)
    own = json.loads((directory / _PIECE.format(rank=rank)).read_text())
    metadata = _metadata(_pieces(directory, own["save_id"], own["writers"]))
    metadata.version = "1.0.0"
    metadata.storage_meta = StorageMeta(checkpoint_id=str(directory), save_id=own["save_id"])
    if not (directory / COMMON).exists() and _acp() is None:
        raise FileNotFoundError(f"{directory / COMMON} is missing: the checkpoint is incomplete")
    buf = io.BytesIO()
    pickle.dump(metadata, buf)
    _atomic_write(directory / ".metadata", buf.getvalue(), durable=False)
    _atomic_write(directory / CONFIG, json.dumps(_BACKEND).encode(), durable=False)


def has_index(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint this module wrote (its JSON pieces)."""
    return any(Path(directory).glob("__*.mindio.json"))


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds a finished checkpoint of this module: its pieces, ``common.pt`` and the
    files :func:`finalize` writes last."""
    d = Path(directory)
    return has_index(d) and all((d / name).exists() for name in (COMMON, ".metadata", CONFIG))


# ------------------------------------------------------------------------------- reading
class _IndexReader(FileSystemReader):
    """DCP reader whose metadata comes from the JSON pieces (never from the pickled ``.metadata``)."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self.fs = _StoreFileSystem()
        self._dir = Path(directory)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        raw = []
        for path in sorted(self._dir.glob("__*.mindio.json")):
            try:
                raw.append(json.loads(path.read_text()))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CorruptCheckpoint(path, f"unreadable index ({exc})") from None
        if not raw:
            raise FileNotFoundError(f"{self._dir} holds no mindio checkpoint index (__<rank>.mindio.json)")
        newest = max(raw, key=lambda p: os.path.getmtime(self._dir / _PIECE.format(rank=p["rank"])))
        metadata = _metadata(_pieces(self._dir, newest["save_id"], newest["writers"]), checked=True)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def _slice_file(self, file, sinfo):
        """One item, its bytes checked against the hash its writer recorded first (XXH3-64, or an older
        checkpoint's CRC-32): the store's pooled bytes in place (then read in place, as before), a file's
        read once into memory."""
        want, name, fn, width = getattr(sinfo, "xxh3", None), "XXH3-64", _digest, 16
        if want is None:
            want, name, fn, width = getattr(sinfo, "crc32", None), "CRC-32", crc32, 8
        if want is None:  # written before the checksums existed
            return super()._slice_file(file, sinfo)
        pooled = getattr(file, "_view", None)  # the store's pooled bytes: checked in place, then read in place
        if pooled is not None:
            with pooled[sinfo.offset:sinfo.offset + sinfo.length] as part:  # released before the stream closes
                got, size = fn(part), len(part)
        else:
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            got, size = fn(data), len(data)
        if size != sinfo.length or got != want:
            raise CorruptCheckpoint(self._dir / sinfo.relative_path,
                                    f"bytes {sinfo.offset}..{sinfo.offset + sinfo.length} have {name} "
                                    f"{got:0{width}x} ({size} bytes), written with {want:0{width}x}")
        return super()._slice_file(file, sinfo) if pooled is not None else io.BytesIO(data)


def _safe_load(data) -> Any:
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(data, map_location="cpu", weights_only=True)


def read_common(directory: Path) -> dict:
    """``common.pt``, checked against ``common.mindio.json`` when that exists (:class:`CorruptCheckpoint`)."""
    path = Path(directory) / COMMON
    data = _fetch(path)
    sums = Path(directory) / COMMON_SUM
    if sums.exists():
        try:
            want = json.loads(sums.read_text())
            crc, size = int(want["crc32"]), int(want["size"])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(sums, f"unreadable checksum record ({exc})") from None
        got = crc32(data)
        if len(data) != size or got != crc:
            raise CorruptCheckpoint(path, f"CRC-32 {got:08x} ({len(data)} bytes), written with {crc:08x} "
                                          f"({size} bytes)")
    return _safe_load(io.BytesIO(data))


def read_local(sharded_state_dict: dict, directory: Path) -> dict:
    """Load ``sharded_state_dict`` (megatron's, ``is_loading=True``) from ``directory`` on this rank alone.

    The steps of megatron-core's ``dist_checkpointing.load`` with its torch_dist strategy, without the
    collectives (DCP with ``no_dist``) and without unpickling (see the module docstring)."""
    from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner, _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys, _restore_dict_types, _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict)
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    class SafeLoadPlanner(MCoreLoadPlanner):
        def load_bytes(self, read_item, value):  # DCP's own unpickles without restriction
            self.original_state_dict[read_item.dest_index.fqn] = _safe_load(value)

    common = read_common(directory)
    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    merge(common, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)
    shapes = [t for t in nested_values(sharded) if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
    orig = sharded
    flat, flat_mapping, rename = _replace_state_dict_keys_with_sharded_keys(sharded)
    pyt = mcore_to_pyt_state_dict(flat, True)
    try:
        dcp.load(pyt, storage_reader=_IndexReader(directory),
                 planner=SafeLoadPlanner(shapes_validation_sharded_tensors=shapes, flatten_state_dict=False),
                 no_dist=True)
    except CheckpointException as exc:  # DCP wraps what the reader raised: a corrupt file is said as such
        corrupt = [e for e, _ in exc.failures.values() if isinstance(e, CorruptCheckpoint)]
        if corrupt:
            raise corrupt[0] from None
        raise
    loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}
    loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename)
    _restore_dict_types(loaded, orig)
    merge(common, loaded)
    return apply_factory_merges(common, factories)

"""The mindio checkpoint container: the only module that knows its bytes.

Layout (all integers little-endian)::

    [0, 64)              preamble: magic b"MINDIOCK", version u16, flags u16, n_storages u32,
                         meta_len u64, table_off u64, data_off u64, total_len u64,
                         meta_crc u32, table_crc u32, reserved u32, preamble_crc u32 (CRC-32 of bytes 0..59)
    [64, 64+meta_len)    meta: msgpack {"skeleton": pickle bytes, "tensors": [...], "storages": n}
    [table_off, +24*n)   storage table: n x (offset u64, nbytes u64, crc32 u32, reserved u32)
    [data_off, total_len) storage bytes; data_off is page aligned, each storage 64-byte aligned

A file is written in two steps. ``Plan.write_into`` fills a buffer (a pool region) with flags = 0 and
zero storage CRCs: that is the cheap, blocking part of a save. ``checksummed_header`` computes the
per-storage CRCs later (in the daemon, off the trainer's path) and returns the first ``data_off``
bytes with the table CRCs filled in and ``FLAG_CHECKSUMS`` set; the persisted file is that header
followed by the unchanged data. ``load_buffer`` verifies preamble, meta and table always, and every
storage's CRC when the flag is set; the buffer must be exactly ``total_len`` bytes, the regions must
nest as laid out above, and every tensor descriptor must stay inside its storage. Any violation
raises CorruptCheckpoint naming the file and what failed, never a raw struct/msgpack/torch error.

The object skeleton is a pickle in which every tensor is replaced by a persistent id (an index into
meta["tensors"]); storages are shared exactly as torch.save shares them. Loading with
``weights_only=True`` (the default) uses a restricted unpickler that only rebuilds plain containers,
tensors, dtypes, devices and numpy arrays; it never imports or calls anything else.
"""
from __future__ import annotations

import functools
import io
import pickle
import struct
from dataclasses import dataclass, field

import msgpack

from .. import _native
from ..errors import CheckpointError, CorruptCheckpoint
from . import _device, _zip

__all__ = ["MAGIC", "VERSION", "FLAG_CHECKSUMS", "HEADER_SIZE", "SNIFF", "Plan", "plan", "is_container",
           "checksummed_header", "load_buffer", "verify", "header_info"]

MAGIC = b"MINDIOCK"
VERSION = 2          # torch's zip layout (mindio.acp._zip); version 1 (the bare container) still loads
FLAG_CHECKSUMS = 1
_PRE = struct.Struct("<8sHHIQQQQIII")  # 60 bytes, then preamble_crc u32
HEADER_SIZE = 64
_ENTRY = struct.Struct("<QQII")
_PAGE = 4096
_ALIGN = 64
SNIFF = _zip.BASE + len(MAGIC)      # the first bytes is_container needs


def _round(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Plan:
    """What a save will write: computed from the object before any byte is copied."""

    header: bytes                      # preamble + meta + table (zero CRCs), exactly data_off bytes long
    storages: list = field(default_factory=list)  # [(uint8 tensor on the storage's device, offset from data_off)]
    data_off: int = 0
    total_len: int = 0
    extras: list = field(default_factory=list)     # [(offset, bytes)] past data_off: zip headers, directory

    def write_into(self, buf, copy_many=None, to_host=None) -> None:
        """Write the whole file image into ``buf`` (len >= total_len).

        ``copy_many(dst, [(offset, src), ...])`` moves the CPU storage bytes, all in one call (so that
        one parallel pass copies every tensor; default: mindio._native.copy_many on one thread).
        ``to_host(dst, [(offset, device tensor), ...])`` starts the copies of the accelerator storages
        and returns a callable that waits for them, or None (default: synchronous copies,
        mindio.acp._device.to_host); they run while the CPU storages are copied.
        """
        copy_many = copy_many or _native.copy_many
        view = memoryview(buf).cast("B")
        view[: len(self.header)] = self.header
        host, dev = [], []
        for src, off in self.storages:
            if src.numel():
                (host if src.is_cpu else dev).append((self.data_off + off, src))
        for off, raw in self.extras:
            view[off: off + len(raw)] = raw
        wait = (to_host or _device.to_host)(view, dev) if dev else None
        try:
            copy_many(view, [(off, src.numpy()) for off, src in host])
        finally:
            if wait is not None:
                wait()      # never leave a copy running into a region the caller may give back


    def file_chunks(self):
        """The checksummed file image as a list of byte chunks (for writing storage directly)."""
        h = _parse(memoryview(self.header), "<plan>", complete=False)
        pieces, entries = list(self.extras), []
        for src, off in self.storages:
            data = src.cpu().numpy() if src.numel() else b""
            entries.append(_ENTRY.pack(off, len(data), _native.crc32(data), 0))
            pieces.append((self.data_off + off, data))
        header = bytearray(self.header)
        _fill_crcs(header, h, b"".join(entries))
        chunks, pos = [bytes(header)], self.data_off
        for off, data in sorted((p for p in pieces if len(p[1])), key=lambda p: p[0]):
            if off > pos:
                chunks.append(b"\0" * (off - pos))
            chunks.append(data)
            pos = off + len(data)
        if pos < self.total_len:
            chunks.append(b"\0" * (self.total_len - pos))
        return chunks


class _Pickler(pickle.Pickler):
    def __init__(self, f, tensors, storages, ids=None):
        super().__init__(f, protocol=4)
        self._tensors, self._storages = tensors, storages
        self._ids = {} if ids is None else ids      # id(tensor) -> its index in tensors

    def persistent_id(self, obj):
        import torch

        if not isinstance(obj, torch.Tensor):
            return None
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"tensor subclass {type(obj).__name__} is not supported by the mindio format")
        if obj.is_quantized:    # strided, but its scale and zero point live outside the storage
            raise TypeError(f"quantized tensors ({obj.dtype}, {obj.qscheme()}) are not supported by the mindio "
                            "format")
        if obj.layout != torch.strided:
            raise TypeError(f"{obj.layout} tensors are not supported by the mindio format")
        st = obj.untyped_storage()
        key = (st.device.type, st.device.index, st.data_ptr(), st.nbytes())
        if key not in self._storages:
            self._storages[key] = (len(self._storages), st)
        index = self._storages[key][0]
        desc = [index, obj.storage_offset(), list(obj.shape), list(obj.stride()),
                str(obj.dtype).removeprefix("torch."), bool(obj.requires_grad),
                isinstance(obj, torch.nn.Parameter), str(obj.device)]
        self._tensors.append(desc)
        self._ids[id(obj)] = len(self._tensors) - 1
        return ("t", len(self._tensors) - 1)


def plan(obj, torch_zip: bool = True) -> Plan:
    """Serialize ``obj``'s skeleton and lay out its storages; raises TypeError for unsupported objects.

    The layout is torch's zip (version 2, a file torch.load reads); an object torch.save refuses but
    the mindio format holds (one storage viewed as two dtypes), or ``torch_zip=False``, gets the bare
    container (version 1)."""
    tensors: list = []
    storages: dict = {}
    ids: dict = {}
    skel = io.BytesIO()
    _Pickler(skel, tensors, storages, ids).dump(obj)
    ordered = [st for _, st in sorted(storages.values(), key=lambda item: item[0])]
    meta = msgpack.packb({"skeleton": skel.getvalue(), "tensors": tensors, "storages": len(ordered)},
                         use_bin_type=True)
    try:
        if not torch_zip:
            raise TypeError("the bare container was asked for")
        records, empty = _zip.torch_records(obj, _storage_facts(tensors, ordered, ids))
    except Exception:   # noqa: BLE001 -- whatever torch's pickling refuses, the bare container holds
        return _layout(meta, ordered, 0, None, [])
    return _layout(meta, ordered, _zip.BASE, records, empty)


def _storage_facts(tensors: list, ordered: list, ids: dict):
    """tensor -> (storage index, its nbytes, torch's location tag), from what _Pickler recorded."""
    from torch.serialization import location_tag

    nbytes = [st.nbytes() for st in ordered]
    tags: dict = {}

    def facts(t):
        index = tensors[ids[id(t)]][0]
        if index not in tags:
            tags[index] = location_tag(ordered[index])
        return index, nbytes[index], tags[index]
    return facts


def _sources(ordered: list) -> list:
    """Per storage: a uint8 tensor over its bytes (on its device; other devices' copied to the CPU)."""
    import torch

    srcs = []
    for st in ordered:
        src = torch.empty(0, dtype=torch.uint8)
        if st.nbytes():
            # CPU and accelerator storages are viewed where they are (an accelerator's are copied
            # straight into the pool by write_into); other devices' are copied to the CPU here
            if st.device.type != "cpu":
                if st.device.type not in _device.BACKENDS:
                    st = st.cpu()
                src = torch.empty(0, dtype=torch.uint8, device=st.device)
            src = src.set_(st, 0, (st.nbytes(),), (1,))
        srcs.append(src)
    return srcs


def _layout(meta: bytes, ordered: list, base: int, records, empty: list) -> Plan:
    """Lay out a container: bare (base 0, version 1), or torch's zip (base _zip.BASE, version 2: the
    archive/.mindio record, torch's small records, one record per storage, the central directory)."""
    slot = _zip.SLOT if base else 0
    table_off = base + HEADER_SIZE + len(meta)
    pos = table_off + _ENTRY.size * len(ordered)
    pieces, entries = [], []          # [(offset, bytes)]; zip records [(name, size, header offset)]
    if base:
        entries.append((".mindio", pos - base, 0))
        pieces.append((0, _zip.local_header(".mindio", pos - base)))
        for name, raw in list(records) + [(f"data/{key}", b"") for key in empty]:
            at = _round(pos, _ALIGN)
            entries.append((name, len(raw), at))
            pieces += [(at, _zip.local_header(name, len(raw))), (at + slot, raw)]
            pos = at + slot + len(raw)
    data_off = _round(pos + slot, _PAGE)
    srcs, table, off = [], [], 0
    for i, src in enumerate(_sources(ordered)):
        if base:
            entries.append((f"data/{i}", src.numel(), data_off + off - slot))
            pieces.append((data_off + off - slot, _zip.local_header(f"data/{i}", src.numel())))
        srcs.append((src, off))
        table.append(_ENTRY.pack(off, src.numel(), 0, 0))
        off = _round(off + src.numel(), _ALIGN) + slot
    total = data_off + off - slot if ordered else data_off
    if base:
        pieces.append((total, _zip.directory(entries, total)))
        total += len(pieces[-1][1])
    table = b"".join(table)
    header = bytearray(data_off)
    for at, raw in [(base + HEADER_SIZE, meta), (table_off, table)] + [p for p in pieces if p[0] < data_off]:
        header[at: at + len(raw)] = raw
    extras = [p for p in pieces if p[0] >= data_off]
    zip_crc = _zip_crc(header, table_off + len(table), [raw for _, raw in extras]) if base else 0
    header[base: base + HEADER_SIZE] = _preamble(0, len(ordered), meta, table_off, data_off, total, table, base,
                                                 zip_crc)
    return Plan(header=bytes(header), storages=srcs, data_off=data_off, total_len=total, extras=extras)


def _zip_crc(header, table_end: int, tail: list) -> int:
    """Version 2: CRC-32 of the zip bytes (what torch.load reads besides the storages): the first
    record's header, everything between the table and data_off, each later storage's record header and
    the central directory. Kept in the preamble's reserved field: mindio.load checks them too."""
    crc = _native.crc32(memoryview(header)[: _zip.BASE])
    crc = _native.crc32(memoryview(header)[table_end: len(header)], crc)
    for raw in tail:
        crc = _native.crc32(raw, crc)
    return crc


def _preamble(flags, n, meta, table_off, data_off, total, table, base=0, zip_crc=0) -> bytes:
    body = _PRE.pack(MAGIC, VERSION if base else 1, flags, n, len(meta), table_off, data_off, total,
                     _native.crc32(meta), _native.crc32(table), zip_crc)
    return body + struct.pack("<I", _native.crc32(body))


def is_container(head: bytes) -> bool:
    """True when ``head`` (the first SNIFF bytes of a file) starts a mindio container (either version)."""
    head = bytes(head[:SNIFF])
    return head[:8] == MAGIC or (head[:4] == _zip.ZIP_MAGIC and head[_zip.BASE:] == MAGIC)


@dataclass
class _Header:
    flags: int
    n: int
    meta: dict
    table: list
    data_off: int
    total_len: int
    base: int = 0
    table_off: int = 0
    meta_len: int = 0
    zip_crc: int = 0


def _parse(view: memoryview, name, complete: bool = True) -> _Header:
    """Verify and decode the header; ``complete=False``: ``view`` holds only the first data_off bytes."""
    base = _zip.BASE if bytes(view[:4]) == _zip.ZIP_MAGIC and bytes(view[_zip.BASE: SNIFF]) == MAGIC else 0
    if len(view) < base + HEADER_SIZE:
        raise CorruptCheckpoint(name, f"truncated: {len(view)} bytes, shorter than the {HEADER_SIZE}-byte preamble")
    fields = _PRE.unpack_from(view, base)
    magic, version, flags, n, meta_len, table_off, data_off, total, meta_crc, table_crc, zip_crc = fields
    if magic != MAGIC:
        raise CorruptCheckpoint(name, "not a mindio checkpoint (bad magic)")
    (pre_crc,) = struct.unpack_from("<I", view, base + _PRE.size)
    if _native.crc32(view[base: base + _PRE.size]) != pre_crc:
        raise CorruptCheckpoint(name, "preamble checksum mismatch")
    if version != (2 if base else 1):
        raise CorruptCheckpoint(name, f"format version {version} is not supported here (this mindio reads "
                                f"version 1 and the zip layout of version 2)")
    size = len(view) if complete else total
    if total > size:
        raise CorruptCheckpoint(name, f"truncated: {len(view)} bytes, header says {total}")
    if total < size:
        raise CorruptCheckpoint(name, f"{len(view) - total} bytes after the end the header records ({total}): "
                                "data appended to the file, or a damaged header")
    if not (base + HEADER_SIZE + meta_len <= table_off and table_off + _ENTRY.size * n <= data_off <= total
            and data_off % _PAGE == 0 and data_off <= len(view)):
        raise CorruptCheckpoint(name, f"inconsistent layout: {meta_len} bytes of metadata, a table of {n} storages "
                                f"at {table_off}, data at {data_off}, {total} bytes in all")
    meta = view[base + HEADER_SIZE: base + HEADER_SIZE + meta_len]
    table = view[table_off: table_off + _ENTRY.size * n]
    if _native.crc32(meta) != meta_crc:
        raise CorruptCheckpoint(name, "metadata checksum mismatch")
    if _native.crc32(table) != table_crc:
        raise CorruptCheckpoint(name, "tensor table checksum mismatch")
    entries = [e[:3] for e in _ENTRY.iter_unpack(table)]
    for off, nbytes, _ in entries:
        if data_off + off + nbytes > total:
            raise CorruptCheckpoint(name, "tensor table points past the end of the file")
    try:
        meta = msgpack.unpackb(meta, raw=False)
    except Exception as exc:    # msgpack raises several types for malformed bytes
        raise CorruptCheckpoint(name, f"metadata cannot be decoded: {exc}") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("skeleton"), bytes)
            and isinstance(meta.get("tensors"), list) and meta.get("storages") == n):
        raise CorruptCheckpoint(name, "metadata lacks the skeleton, tensor list or storage count it must have")
    if base and complete:
        ends = [off + nbytes for off, nbytes, _ in entries]
        tail = [view[data_off + off - _zip.SLOT: data_off + off] for off, _, _ in entries[1:]]
        tail.append(view[data_off + _round(ends[-1], _ALIGN) if entries else data_off: total])
        if _zip_crc(view[:data_off], table_off + _ENTRY.size * n, tail) != zip_crc:
            raise CorruptCheckpoint(name, "zip structure checksum mismatch (the bytes torch.load reads besides "
                                    "the tensors)")
    return _Header(flags, n, meta, entries, data_off, total, base, table_off, meta_len, zip_crc)


def header_info(buf, name="<buffer>") -> dict:
    """Parsed header fields (for tests and tools)."""
    h = _parse(memoryview(buf).cast("B"), name)
    return {"flags": h.flags, "storages": h.n, "data_off": h.data_off, "total_len": h.total_len,
            "crcs": [e[2] for e in h.table]}


def checksummed_header(buf, name="<pool>") -> bytes:
    """Compute every storage CRC of the image in ``buf``; return its header with CRCs and the flag set."""
    view = memoryview(buf).cast("B")
    h = _parse(view, name)
    entries = []
    for off, nbytes, _ in h.table:
        start = h.data_off + off
        entries.append(_ENTRY.pack(off, nbytes, _native.crc32(view[start: start + nbytes]), 0))
    out = bytearray(view[: h.data_off])
    _fill_crcs(out, h, b"".join(entries))
    return bytes(out)


def _fill_crcs(header: bytearray, h: _Header, table: bytes) -> None:
    """Write ``table`` (with CRCs) and a preamble flagged FLAG_CHECKSUMS into ``header`` (parsed as ``h``)."""
    meta = bytes(header[h.base + HEADER_SIZE: h.base + HEADER_SIZE + h.meta_len])
    header[h.base: h.base + HEADER_SIZE] = _preamble(h.flags | FLAG_CHECKSUMS, h.n, meta, h.table_off, h.data_off,
                                                     h.total_len, table, h.base, h.zip_crc)
    header[h.table_off: h.table_off + len(table)] = table


def _chunks(view: memoryview, h: _Header, name, verify: bool) -> list:
    """Each storage's bytes, its CRC checked when the file carries CRCs (and ``verify``)."""
    chunks = []
    for i, (off, nbytes, crc) in enumerate(h.table):
        chunk = view[h.data_off + off: h.data_off + off + nbytes]
        if verify and h.flags & FLAG_CHECKSUMS and _native.crc32(chunk) != crc:
            raise CorruptCheckpoint(name, f"checksum mismatch in tensor storage {i} ({nbytes} bytes)")
        chunks.append(chunk)
    return chunks


def verify(buf, name) -> None:
    """Check everything but the skeleton (which only loading may unpickle): raises CorruptCheckpoint."""
    view = memoryview(buf).cast("B")
    _chunks(view, _parse(view, name), name, True)


def load_buffer(buf, name, *, weights_only: bool = True, map_location=None, verify: bool = True,
                to_device=None):
    """Rebuild the saved object from ``buf`` (a writable buffer the tensors will view, not copy).

    Storages that load to an accelerator (by ``map_location``, else the device they were saved from)
    are copied there once each, shared by their views: ``to_device([(start, nbytes, device), ...])``
    returns the device tensors (default: synchronous copies from ``buf``; a client passes copies from
    its page-locked mapping of the pool, mindio.acp._device.DevicePool.to_device).
    """
    import torch

    from ._unpickle import RestrictedUnpickler

    view = memoryview(buf).cast("B")
    h = _parse(view, name)
    tensors = h.meta["tensors"]
    places = _placement(tensors, h.n, map_location)
    storages, moves = [], []
    for i, chunk in enumerate(_chunks(view, h, name, verify)):
        if places[i] is not None:
            if len(chunk):
                moves.append((i, h.data_off + h.table[i][0], len(chunk), places[i]))
            else:
                places[i] = None       # an empty storage: its tensors are placed by _relocate
        storages.append(torch.frombuffer(chunk, dtype=torch.uint8).untyped_storage() if len(chunk)
                        else torch.UntypedStorage(0))
    if moves:
        copied = (to_device or functools.partial(_device.to_device, view))([m[1:] for m in moves])
        for (i, *_), t in zip(moves, copied):
            storages[i] = t.untyped_storage()
    built: dict = {}

    def persistent_load(pid):
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "t" and 0 <= pid[1] < len(tensors)):
            raise CorruptCheckpoint(name, f"bad tensor reference {pid!r}")
        if pid[1] not in built:
            built[pid[1]] = _tensor(tensors[pid[1]], storages, places, map_location, name)
        return built[pid[1]]

    unpickler_cls = RestrictedUnpickler if weights_only else pickle.Unpickler
    up = unpickler_cls(io.BytesIO(h.meta["skeleton"]))
    up.persistent_load = persistent_load
    # with the restricted unpickler any failure means malformed bytes; a trusted (full) unpickle may
    # also fail for the user's own reasons (a module that is not importable), which stay as they are
    malformed = Exception if weights_only else (pickle.UnpicklingError, EOFError, ValueError, IndexError,
                                                struct.error)
    try:
        return up.load()
    except CheckpointError:
        raise
    except malformed as exc:
        raise CorruptCheckpoint(name, f"object skeleton cannot be rebuilt: {type(exc).__name__}: {exc}") from exc


def _is_index(value) -> bool:
    return type(value) is int and value >= 0


def _tensor(desc, storages, places, map_location, name):
    import torch

    try:
        index, offset, shape, stride, dtype_name, requires_grad, is_param, device = desc
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        ok = isinstance(dtype, torch.dtype) and _is_index(index) and index < len(storages) and _is_index(offset) \
            and isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride) \
            and all(map(_is_index, shape)) and all(map(_is_index, stride)) and isinstance(device, str)
    except (TypeError, ValueError):
        ok = False
    if ok:   # the elements it spans must lie inside its storage
        span = 0 if 0 in shape else offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        ok = span * dtype.itemsize <= storages[index].nbytes()
    if not ok:
        raise CorruptCheckpoint(name, f"bad tensor descriptor {desc!r:.200}")
    st = storages[index]
    if places[index] is not None:      # already on its target device (load_buffer's placement)
        t = torch.empty(0, dtype=dtype, device=st.device).set_(st, offset, shape, stride)
    else:
        try:
            t = _relocate(torch.empty(0, dtype=dtype).set_(st, offset, shape, stride), device, map_location)
        except Exception as exc:    # e.g. saved on a device this process does not have
            raise CheckpointError(f"{name}: cannot place a tensor saved on {device!r} "
                                  f"({type(exc).__name__}: {exc}); pass map_location") from exc
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _placement(tensors, n: int, map_location) -> list:
    """Per storage: the accelerator device it loads to, or None (viewed on the CPU, then placed per
    tensor by _relocate: CPU targets, other devices, a callable map_location). Malformed descriptors
    are left to _tensor to report."""
    import torch

    places: list = [None] * n
    if callable(map_location) or (isinstance(map_location, (str, torch.device))
                                  and torch.device(map_location).type not in _device.BACKENDS):
        return places
    targets: dict = {}                 # saved device string -> accelerator device or None

    def target(saved):
        if saved not in targets:
            if map_location is None:
                dev = saved
            elif isinstance(map_location, dict):
                dev = map_location.get(saved, saved)
            else:
                dev = map_location
            dev = torch.device(dev)
            targets[saved] = dev if dev.type in _device.BACKENDS else None
        return targets[saved]

    for desc in tensors:
        try:
            index, dev = desc[0], target(desc[7])
        except (TypeError, ValueError, IndexError, KeyError, RuntimeError):
            continue
        if dev is not None and isinstance(index, int) and 0 <= index < n:
            places[index] = dev
    return places


def _relocate(t, saved_device: str, map_location):
    """Place a CPU tensor the way torch.load would: map_location wins, else the device it was saved from."""
    if map_location is None:
        return t if saved_device == "cpu" else t.to(saved_device)
    if callable(map_location):
        out = map_location(t, saved_device)
        return t if out is None else out
    if isinstance(map_location, dict):
        target = map_location.get(saved_device, saved_device)
        return t if target == "cpu" else t.to(target)
    import torch

    target = torch.device(map_location)
    return t if target.type == "cpu" else t.to(target)

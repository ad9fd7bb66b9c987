"""torch's zip layout for mindio containers (format version 2): a file torch.load reads as it is.

A version-2 container is an uncompressed zip archive laid out as torch.save lays out its own
(``archive/data.pkl``, ``archive/data/<key>`` with each storage's bytes 64-byte aligned,
``archive/version``, ``archive/byteorder``, ...) with one more record first, ``archive/.mindio``: the
mindio header (preamble, metadata, storage table) from byte ``BASE``. torch.load reads the torch records
and ignores that one; mindio.load reads that one and the storage bytes in place and never unpickles
``data.pkl`` (its own skeleton is in the metadata, as in version 1).

Every local header fills one ``SLOT`` of 128 bytes (zip64 sizes, then an 'FB' padding field as torch
pads), so that a record's bytes start exactly where the layout puts them. Sizes and offsets are always
zip64 fields: one code path for small and for >4 GiB files. The zip CRC-32 fields are 0, as in
torch.save's own files under ``torch.serialization.set_crc32_options(False)``; torch.load does not read
them. Integrity is mindio's own check (the storage CRCs of its table).
"""
from __future__ import annotations

import io
import pickle
import struct
import sys

__all__ = ["SLOT", "BASE", "ZIP_MAGIC", "local_header", "directory", "torch_records"]

SLOT = 128
BASE = SLOT                  # the mindio preamble: the bytes of the first record, archive/.mindio
ZIP_MAGIC = b"PK\x03\x04"
ARCHIVE = "archive/"
_FF = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_UTF8 = 0x0800


def local_header(name: str, size: int) -> bytes:
    """The SLOT-byte local file header of a stored record of ``size`` bytes (its bytes follow it)."""
    raw = (ARCHIVE + name).encode()
    z64 = struct.pack("<HHQQ", 1, 16, size, size)
    pad = SLOT - _LOCAL.size - len(raw) - len(z64) - 4
    if pad < 0:
        raise ValueError(f"record name {name!r} too long for the layout")
    extra = z64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad      # 'FB' padding, as torch's writer
    return _LOCAL.pack(0x04034B50, 45, _UTF8, 0, 0, 0, 0, _FF, _FF, len(raw), len(extra)) + raw + extra


def directory(records: list, at: int) -> bytes:
    """Central directory, zip64 end record and locator, end record, for ``records`` [(name, size,
    local header offset)] when written at offset ``at``."""
    cd = bytearray()
    for name, size, offset in records:
        raw = (ARCHIVE + name).encode()
        extra = struct.pack("<HHQQQ", 1, 24, size, size, offset)
        cd += _CENTRAL.pack(0x02014B50, 45, 45, _UTF8, 0, 0, 0, 0, _FF, _FF, len(raw), len(extra), 0, 0, 0, 0,
                            _FF) + raw + extra
    n, size, end = len(records), len(cd), at + len(cd)
    cd += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, size, at)      # zip64 end record
    cd += struct.pack("<IIQI", 0x07064B50, 0, end, 1)                                  # its locator
    cd += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(size, _FF),
                      min(at, _FF), 0)
    return bytes(cd)


class _Ref:
    """A storage's persistent id in torch's data.pkl (what torch.save's persistent_id returns)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple):
        self.pid = pid


class _Data:
    """A Parameter's data inside its ``_rebuild_parameter`` call (reduced as the tensor it is)."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def torch_records(obj, storage_of) -> tuple:
    """torch.save's ``data.pkl`` for ``obj`` and its small records.

    ``storage_of(tensor)`` gives (mindio storage index, its nbytes, torch's location tag) of a tensor
    of ``obj``; a non-empty storage's ``archive/data/<index>`` record is that storage's bytes. Returns
    (records, empty): records is [(name, bytes)] of data.pkl and the small records torch writes;
    ``empty`` the keys of empty storages (each a 0-byte record of its own, as torch gives them).
    Raises TypeError for what torch.save refuses (one storage viewed as two dtypes).

    Tensors are reduced as torch's ``Tensor._reduce_ex_internal`` reduces a plain strided tensor
    (``_rebuild_tensor_v2`` with a typed storage's persistent id, ``_rebuild_tensor_v3`` for the dtypes
    typed storages lack, ``_rebuild_parameter`` around a Parameter's data), through a dispatch table
    and the storage facts mindio's own pickling pass found: no TypedStorage objects are made
    (mindio.acp.format.plan has already refused every other kind of tensor).
    """
    import collections
    import copyreg

    import torch
    from torch._utils import _rebuild_parameter, _rebuild_tensor_v2, _rebuild_tensor_v3

    get_tensor_metadata = torch._C._get_tensor_metadata     # the conj/neg bits, as torch.save records them

    names = torch.storage._dtype_to_storage_type_map()
    v3 = set(torch.storage._new_dtypes())
    dtypes: dict = {}
    empty: list = []
    no_hooks = collections.OrderedDict()

    def reduce_tensor(t):
        index, nbytes, location = storage_of(t)
        dtype = t.dtype
        if nbytes == 0:
            key = f"e{len(empty)}"
            empty.append(key)
        else:
            key = str(index)
            if dtypes.setdefault(key, dtype) != dtype:
                raise TypeError("one storage viewed as two dtypes (torch.save refuses it)")
        if dtype in v3:
            pid = ("storage", torch.UntypedStorage, key, location, nbytes)
            args = (_Ref(pid), t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad, no_hooks, dtype)
        else:
            pid = ("storage", getattr(torch, names[dtype]), key, location, nbytes // t.element_size())
            args = (_Ref(pid), t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad, no_hooks)
        metadata = get_tensor_metadata(t)
        if metadata:
            args += (metadata,)
        return (_rebuild_tensor_v3 if dtype in v3 else _rebuild_tensor_v2), args

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    pickler.dispatch_table = {
        **copyreg.dispatch_table, torch.Tensor: reduce_tensor, _Data: lambda d: reduce_tensor(d.t),
        torch.nn.Parameter: lambda p: (_rebuild_parameter, (_Data(p), p.requires_grad, no_hooks))}
    pickler.persistent_id = lambda o: o.pid if type(o) is _Ref else None
    pickler.dump(obj)
    records = [("data.pkl", buf.getvalue()), (".format_version", b"1"), (".storage_alignment", b"64"),
               ("byteorder", sys.byteorder.encode()), ("version", b"3\n")]
    return records, empty

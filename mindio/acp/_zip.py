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


def torch_records(obj, storage_index) -> tuple:
    """torch.save's ``data.pkl`` for ``obj`` and its small records.

    ``storage_index(untyped_storage)`` gives the mindio storage index of a non-empty storage: its
    ``archive/data/<index>`` record is that storage's bytes. Returns (records, empty): records is
    [(name, bytes)] of data.pkl and the small records torch writes; ``empty`` the keys of empty
    storages (each a 0-byte record of its own, as torch gives them). Raises TypeError for what
    torch.save refuses (one storage viewed as two dtypes)."""
    import torch
    from torch.serialization import location_tag

    dtypes: dict = {}
    empty: list = []

    def persistent_id(o):
        if not isinstance(o, torch.storage.TypedStorage):
            return None
        st = o._untyped_storage
        if st.nbytes() == 0:
            key = f"e{len(empty)}"
            empty.append(key)
        else:
            key = str(storage_index(st))
            if dtypes.setdefault(key, o.dtype) != o.dtype:
                raise TypeError("one storage viewed as two dtypes (torch.save refuses it)")
        return ("storage", getattr(torch, o._pickle_storage_type()), key, location_tag(st), o._size())

    class Pickler(pickle.Pickler):
        pass

    buf = io.BytesIO()
    pickler = Pickler(buf, protocol=2)
    pickler.persistent_id = persistent_id
    pickler.dump(obj)
    records = [("data.pkl", buf.getvalue()), (".format_version", b"1"), (".storage_alignment", b"64"),
               ("byteorder", sys.byteorder.encode()), ("version", b"3\n")]
    return records, empty

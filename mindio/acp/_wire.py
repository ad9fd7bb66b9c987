"""Framing of the daemon's Unix-socket protocol: u32 big-endian length + one msgpack map.

Requests are ``{"op": name, ...}``; every reply is ``{"ok": bool, ...}`` with ``"error"`` when not ok.
No pickle ever crosses the socket. Frames above 16 MiB are refused as malformed. A file descriptor
(the pool, after a ``hello`` that asked for it) travels as one byte with SCM_RIGHTS after the reply.
"""
from __future__ import annotations

import os
import socket
import struct

import msgpack

from ..errors import ProtocolError

__all__ = ["send", "recv", "send_fd", "recv_fd", "MAX_FRAME"]

MAX_FRAME = 16 << 20
_LEN = struct.Struct(">I")


def send(sock: socket.socket, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    sock.sendall(_LEN.pack(len(body)) + body)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> dict:
    (length,) = _LEN.unpack(_read_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    try:
        message = msgpack.unpackb(_read_exact(sock, length), raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed frame: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame body is not a map")
    return message


def send_fd(sock: socket.socket, fd: int) -> None:
    socket.send_fds(sock, [b"F"], [fd])


def recv_fd(sock: socket.socket) -> int:
    """The descriptor sent with send_fd (close-on-exec); raises ProtocolError when none came."""
    data, fds, _, _ = socket.recv_fds(sock, 1, 1, socket.MSG_CMSG_CLOEXEC)
    if data != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"expected one file descriptor, got {len(fds)} with {data!r}")
    return fds[0]

"""The errors mindio raises. Every message says what is wrong and what to do about it."""
from __future__ import annotations


class MindIOError(Exception):
    """Base class of every error raised by mindio."""


class ConfigError(MindIOError, ValueError):
    """A setting (argument, server_info key, environment variable) is missing, unknown or out of range."""


# --- control plane (mindio.ttp) -------------------------------------------------------------------


class ProtocolError(MindIOError):
    """A frame could not be decoded: wrong version, unknown type, malformed or oversize body."""

    reason = "protocol"  # the DropCounter's category (mindio.ttp.wire.protocol)


class AuthError(ProtocolError):
    """A frame failed authentication (bad or missing HMAC)."""

    reason = "auth"


class SessionError(ProtocolError):
    """An authentic frame that belongs to no live session of this connection (``reason`` "session"),
    repeats or precedes one already received (``"replay"``), or asks for something this side does not
    allow (``"refused"``): protocol v3, mindio/ttp/wire/session.py."""

    def __init__(self, message: str, reason: str = "session"):
        super().__init__(message)
        self.reason = reason


class LostPeer(MindIOError):
    """The other side of a connection stopped answering (missed heartbeats or closed socket)."""


class NoController(MindIOError, ConnectionError):
    """A processor found no controller within its bound; the message names the address it tried and the
    knob that sets the bound."""


class RemoteError(MindIOError):
    """A remote rank or the controller reported a failure; ``rank`` names it when known."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class IllegalTransition(MindIOError):
    """The controller state machine was asked for a transition its table does not allow."""


class ActionTimeout(MindIOError):
    """An action's replies did not all arrive before its deadline (TTP_NORMAL_ACTION_TIME_LIMIT)."""


class AbortTraining(BaseException):
    """Stop this process's training now; do not retry.

    A ``BaseException`` so that a broad ``except Exception`` in user code cannot swallow it.
    """


# --- checkpoint store (mindio.acp) ----------------------------------------------------------------


class CheckpointError(MindIOError):
    """A checkpoint could not be written or read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file is truncated or its contents fail verification; ``path`` names the file."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: corrupt checkpoint: {reason}")
        self.path = str(path)
        self.reason = reason


class InsecurePath(CheckpointError):
    """A directory or file the checkpoint store would use is not private to the caller (another user
    owns it, others can access it, or it is a symbolic link); ``path`` names it."""

    def __init__(self, path, problem: str, remedy: str):
        super().__init__(f"{path} {problem}: refusing to use it; {remedy}")
        self.path = str(path)


class ServerUnavailable(CheckpointError):
    """The mindio-acp-server daemon cannot be reached or declared itself unserviceable."""


def describe(exc: BaseException, where: bool = True) -> str:
    """``"Type: message"`` for a log or a reply, never an empty ``"AssertionError: "``: with no message
    the failing source line stands in for it, and ``where`` adds the innermost frame
    (``file:line in function``) -- which callback failed, and where, is what a reader needs."""
    import linecache
    import os
    import traceback

    text = str(exc)
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    last = frames[-1] if frames else None
    if not text and last is not None:
        text = (last.line or linecache.getline(last.filename, last.lineno)).strip() or "(no message)"
    elif not text:
        text = "(no message)"
    out = f"{type(exc).__name__}: {text}"
    if where and last is not None:
        out += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return out

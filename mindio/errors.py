"""The errors mindio raises. Every message says what is wrong and what to do about it."""
from __future__ import annotations


class MindIOError(Exception):
    """Base class of every error raised by mindio."""


class ConfigError(MindIOError, ValueError):
    """A setting (argument, server_info key, environment variable) is missing, unknown or out of range."""


# --- control plane (mindio.ttp) -------------------------------------------------------------------


class ProtocolError(MindIOError):
    """A frame could not be decoded: wrong version, unknown type, malformed or oversize body."""

    reason = "protocol"  # the DropCounter's category (mindio.ttp.protocol)


class AuthError(ProtocolError):
    """A frame failed authentication (bad or missing HMAC)."""

    reason = "auth"


class SessionError(ProtocolError):
    """An authentic frame that belongs to no live session of this connection (``reason`` "session"),
    repeats or precedes one already received (``"replay"``), or asks for something this side does not
    allow (``"refused"``): protocol v3, mindio/ttp/session.py."""

    def __init__(self, message: str, reason: str = "session"):
        super().__init__(message)
        self.reason = reason


class LostPeer(MindIOError):
    """The other side of a connection stopped answering (missed heartbeats or closed socket)."""


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


class ServerUnavailable(CheckpointError):
    """The mindio-acp-server daemon cannot be reached or declared itself unserviceable."""

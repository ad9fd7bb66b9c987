"""The job secret a user gives: MINDIO_SECRET, or a private file MINDIO_SECRET_FILE (no zmq, no torch: the
launcher's agents import this too). How the secret travels otherwise: mindio/ttp/wire/transport.py (job_secret)
and mindio/launch/secret.py."""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile

from . import _knobs
from .errors import ConfigError

__all__ = ["read_secret_file", "user_secret", "secret_key", "one_node", "share", "shared"]

_log = logging.getLogger("mindio.secret")
_FILE = "file:"  # a store value naming a private file that holds the secret (one node), not the secret

_MIN_SECRET = 16


def read_secret_file(path: str) -> str:
    """The secret in ``path``: a regular file of the caller's own uid, no symlink, no group/other access
    (checked on the opened file, so it cannot be swapped in between). Raises ConfigError naming the file
    and what to do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"MINDIO_SECRET_FILE {path}: cannot open it ({exc.strerror}; a symlink is refused): "
                          "give a regular file of your own, mode 0600") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"MINDIO_SECRET_FILE {path}: must be a regular file owned by uid {os.geteuid()} with "
                              f"no group/other access (it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); "
                              f"fix: chmod 600 {path}")
        text = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return _checked(text, f"MINDIO_SECRET_FILE {path}")


def _checked(text: str, where: str) -> str:
    if len(text) < _MIN_SECRET:
        raise ConfigError(f"{where}: the job secret has {len(text)} characters; give at least {_MIN_SECRET} "
                          "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return text


def user_secret() -> str:
    """The job secret the user gave (MINDIO_SECRET, else MINDIO_SECRET_FILE), or ""."""
    text = _knobs.get("MINDIO_SECRET")
    if text:
        return _checked(text, "MINDIO_SECRET")
    path = _knobs.get("MINDIO_SECRET_FILE")
    return read_secret_file(path) if path else ""


def secret_key(text: str) -> bytes:
    """The 32-byte HMAC key of the control plane made from the secret text."""
    return hashlib.sha256(text.encode()).digest()


def one_node(environ=None) -> bool:
    """Whether every rank of the job runs on this node: torchrun's (and mindio-run's) LOCAL_WORLD_SIZE
    equals WORLD_SIZE. False when the launcher does not say."""
    env = os.environ if environ is None else environ
    local, world = env.get("LOCAL_WORLD_SIZE", ""), env.get("WORLD_SIZE", "")
    return local.isdigit() and local == world


def share(store, key: str, text: str, where: str) -> None:
    """(the controller's rank, zero configuration) Hand the job secret ``text`` to the job's other ranks
    through ``store`` under ``key``. On one node (:func:`one_node`) the ranks share a user and a
    filesystem: the secret goes into a new private file (mode 0600, removed when this process ends) and
    only ``file:PATH`` into the store, which anyone who reaches its port can read. On several nodes the
    secret itself goes into the store, said in one line (``where``: the store's address)."""
    if one_node():
        fd, path = tempfile.mkstemp(prefix="mindio-secret-")  # O_EXCL, mode 0600 whatever the umask
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        from .ttp import shutdown

        shutdown.remove_at_exit(path)  # also by the fast exit after an ordered EXIT, which skips atexit
        store.set(key, _FILE + path)
        return
    store.set(key, text)
    _log.warning("the job secret is published in the torch.distributed store at %s (anyone who reaches it can "
                 "read it): give every node the same MINDIO_SECRET_FILE (mode 0600) to keep it private", where)


def shared(value: str) -> str:
    """The secret from what :func:`share` put in the store: the private file's content, or the text."""
    if not value.startswith(_FILE):
        return value
    path = value[len(_FILE):]
    if not os.path.lexists(path):  # removed when the controller's process ended
        raise ConfigError(f"the job secret's file {path}, which the controller's rank wrote, is gone: that "
                          "process has ended (see its error); restart the job")
    return read_secret_file(path)

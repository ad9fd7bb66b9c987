"""Private directories and files, verified before use (docs/security.md): the checkpoint store's, and the
peer checks of mindio's other Unix sockets (the fork-server host).

The threat is another user of the same machine. The runtime directory (socket, lock, journal, logs)
and the pool directory (shared memory) hold a user's checkpoint bytes and the daemon's instructions,
so each must be a real directory, owned by the caller, with no group or other access, under parents
that no other user can rename it out of. ``private_dir`` creates such a directory (0700) or verifies
an existing one; anything else raises :class:`mindio.errors.InsecurePath` naming the directory and
what to do. Files inside are opened with ``O_NOFOLLOW`` and checked by their descriptor
(``open_private``). ``peer_uid`` reads a Unix socket's peer credentials (``SO_PEERCRED``).
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import struct

from .errors import InsecurePath

__all__ = ["private_dir", "open_private", "check_private_fd", "peer_uid", "umask"]

_CRED = struct.Struct("3i")   # struct ucred: pid, uid, gid


def _who(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _check_dir(path: str, st: os.stat_result) -> None:
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise InsecurePath(path, "is a symbolic link, not a directory",
                           "remove the link, or set MINDIO_ACP_DIR to a directory of your own")
    if not stat.S_ISDIR(st.st_mode):
        raise InsecurePath(path, "is not a directory", "remove it, or set MINDIO_ACP_DIR to another directory")
    if st.st_uid != me:
        raise InsecurePath(path, f"is owned by {_who(st.st_uid)}, not by you ({_who(me)}); another user may "
                           "have created it to read or redirect your checkpoints",
                           "ask its owner or an administrator to remove it, or set MINDIO_ACP_DIR (or "
                           "XDG_RUNTIME_DIR) to a directory of your own")
    if st.st_mode & 0o077:
        raise InsecurePath(path, f"has mode {stat.S_IMODE(st.st_mode):04o}: other users have access",
                           f"run 'chmod 700 {path}' if every file in it is yours, or remove it")


def _check_parents(path: str, sticky: bool) -> None:
    """No ancestor may let another user rename or replace ``path``: each is owned by root or the
    caller, and (``sticky``) one writable by others must be sticky (as /tmp and /dev/shm are)."""
    me = os.geteuid()
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, me):
            raise InsecurePath(path, f"lies in {parent}, owned by {_who(st.st_uid)}, who can replace it",
                               "set MINDIO_ACP_DIR to a directory under a parent owned by you or root")
        if sticky and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise InsecurePath(path, f"lies in {parent} (mode {stat.S_IMODE(st.st_mode):04o}), which other "
                               "users can write without the sticky bit: they can replace it",
                               "set MINDIO_ACP_DIR to a directory under a private parent")
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def private_dir(path: str, sticky_parents: bool = True) -> str:
    """Create ``path`` with mode 0700 (parents as needed), or verify the existing one; return it
    with every symbolic link of its parents resolved. Raises InsecurePath when it is not private.

    ``sticky_parents=False`` (the pool directory) accepts a parent others may write without the
    sticky bit, as Kubernetes mounts /dev/shm (emptyDir, 0777): the pool reaches clients as a
    descriptor and every file in it is opened checked by descriptor, so a renamed directory can
    only make mindio refuse, never read or write someone else's bytes."""
    path = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _check_dir(path, os.lstat(path))        # raises: a link, or not a directory
        raise
    try:
        if created:
            os.fchmod(fd, 0o700)                    # the umask may have removed our own bits
        _check_dir(path, os.fstat(fd))
    finally:
        os.close(fd)
    _check_parents(path, sticky_parents)
    return path


def check_private_fd(fd: int, path: str) -> os.stat_result:
    """Verify an open file: a regular file owned by the caller. Group/other bits (a file an older
    mindio created 0644 in the private directory) are removed."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise InsecurePath(path, f"is not a file of yours (owner {_who(st.st_uid)}, "
                           f"mode {stat.S_IMODE(st.st_mode):04o})", "remove it")
    if st.st_mode & 0o077:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
    return st


def open_private(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open without following a symbolic link, checked by descriptor (see check_private_fd)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:    # the last component is a symbolic link
            raise InsecurePath(path, "is a symbolic link", "remove it") from None
        raise
    try:
        check_private_fd(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def peer_uid(sock: socket.socket) -> tuple:
    """(pid, uid) of the process at the other end of a connected Unix socket, from the kernel."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def umask() -> int:
    """The process's current umask, read without changing it (Linux >= 4.7), else by setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o077)
    os.umask(old)
    return old

"""An agent's private temporary directories (its workers' log files, its relay's socket), and the ones a
killed agent left behind.

A directory is made by :func:`make`: ``tempfile.mkdtemp`` (mode 0700), then a lock file inside it that this
process holds (``flock``) for as long as it lives. The kernel releases the lock whenever the process ends,
SIGKILL included, when nothing of the agent could remove the directory. :func:`sweep`, called when an agent
starts, removes the directories of a prefix that a process of this user made and no process holds any
more. It trusts nothing it did not verify: a directory (not a symlink) owned by this user, mode 0700, whose
``.lock`` is a regular file of this user; a directory without a lock (another mindio release's, or one
being made right now) is left alone. The lock file appears under its final name only once it is locked (it
is made under another name and renamed), so a sweep never takes a directory that is being made.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile

__all__ = ["make", "sweep", "LOCK"]

_log = logging.getLogger(__name__)
LOCK = ".lock"
_held: list[int] = []  # the lock files' descriptors: open (and locked) until this process ends


def make(prefix: str, root: str | None = None) -> str:
    """A new private directory ``<root>/<prefix>XXXXXXXX`` (root: the temporary directory), locked by this
    process for its lifetime."""
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    staged = os.path.join(path, LOCK + ".new")
    fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: never held by anyone else
    os.rename(staged, os.path.join(path, LOCK))
    _held.append(fd)
    return path


def sweep(prefix: str, root: str | None = None) -> int:
    """Remove the directories ``<root>/<prefix>*`` of this user whose making process has ended (their lock
    is free); returns how many. Never raises: a directory that cannot be checked or removed is left."""
    root = root or tempfile.gettempdir()
    uid, removed = os.getuid(), 0
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix)]
    except OSError:
        return 0
    for entry in entries:
        path = entry.path
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700:
                continue
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone, not ours, no lock yet (or another release's): left alone
            continue
        try:
            lst = os.fstat(fd)
            if not stat.S_ISREG(lst.st_mode) or lst.st_uid != uid:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its process (or a child of it) still runs
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed += not os.path.lexists(path)
        finally:
            os.close(fd)
    if removed:
        _log.info("removed %d temporary director%s %s* of agents that ended without removing them (SIGKILL)",
                  removed, "y" if removed == 1 else "ies", os.path.join(root, prefix))
    return removed

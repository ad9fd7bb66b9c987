"""An agent's temporary directories (mindio/launch/tmpdirs.py): those of an agent SIGKILLed from outside go at
the next agent's start; nothing a live process holds, nothing of another user, no symlink and no directory
without mindio's lock is ever removed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mindio.launch import tmpdirs

# a process that makes its directory the way an agent does, says where, then waits to be killed
_MAKER = textwrap.dedent("""
    import sys, time
    from mindio.launch import tmpdirs
    print(tmpdirs.make("mindio-run-", sys.argv[1]), flush=True)
    time.sleep(120)
""")


def _maker(root):
    p = subprocess.Popen([sys.executable, "-c", _MAKER, str(root)], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def test_a_killed_makers_directory_is_swept_a_live_ones_is_not(tmp_path):
    killed, killed_dir = _maker(tmp_path)
    live, live_dir = _maker(tmp_path)
    try:
        assert os.path.isdir(killed_dir) and os.path.isdir(live_dir)
        (tmp_path / "mindio-run-unlocked").mkdir(mode=0o700)  # another release's, or one being made
        (tmp_path / "mindio-run-link").symlink_to(killed_dir)
        open_dir = tmp_path / "mindio-run-open"
        open_dir.mkdir(mode=0o755)  # not private: not one of ours
        (open_dir / tmpdirs.LOCK).touch()
        assert tmpdirs.sweep("mindio-run-", str(tmp_path)) == 0  # both makers run: nothing to take
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
        assert tmpdirs.sweep("mindio-run-", str(tmp_path)) == 1
        assert not os.path.exists(killed_dir)
        assert os.path.isdir(live_dir) and os.path.isdir(tmp_path / "mindio-run-unlocked") and open_dir.is_dir()
        assert (tmp_path / "mindio-run-link").is_symlink()  # the link itself is left (its target is gone)
    finally:
        for p in (killed, live):
            if p.poll() is None:
                p.kill()
            p.wait(30)
    assert live.returncode == -signal.SIGKILL
    assert tmpdirs.sweep("mindio-run-", str(tmp_path)) == 1  # the second maker ended too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mindio-run-link", "mindio-run-open", "mindio-run-unlocked"]


def test_a_directory_of_another_user_is_never_swept(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can make a directory another user owns")
    d = tmp_path / "mindio-run-theirs"  # as another user's agent leaves it: private, its lock free
    d.mkdir(mode=0o700)
    (d / tmpdirs.LOCK).touch()
    for p in (d, d / tmpdirs.LOCK):
        os.chown(p, 65534, 65534)
    assert tmpdirs.sweep("mindio-run-", str(tmp_path)) == 0 and d.is_dir()

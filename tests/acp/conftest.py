"""Fixtures: every test gets a private runtime directory, a small pool, and no daemon left behind."""
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from mindio.acp import _config, api


def stop_daemon(run_dir, timeout=20.0):
    """Stop the daemon of run_dir: ask it politely, then SIGKILL the pid its own log names."""
    sock = os.path.join(run_dir, "acp.sock")
    if os.path.exists(sock):
        try:
            import socket

            from mindio.acp import _wire
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(sock)
                _wire.send(s, {"op": "shutdown"})
                _wire.recv(s)
        except OSError:
            pass
    pids = set()
    try:
        with open(os.path.join(run_dir, "server.log")) as f:
            for line in f:
                if "mindio-acp-server[" in line:
                    pids.add(int(line.split("mindio-acp-server[")[1].split("]")[0]))
    except FileNotFoundError:
        pass
    deadline = time.monotonic() + timeout
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(_config.pool_dir(run_dir), ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def acp_env(monkeypatch):
    run_dir = tempfile.mkdtemp(prefix="mioacp-", dir="/tmp")
    ckpt_dir = tempfile.mkdtemp(prefix="mioacp-ck-", dir="/tmp")
    monkeypatch.setenv("MINDIO_ACP_DIR", run_dir)
    monkeypatch.setenv("MINDIO_ACP_POOL_MB", "256")
    monkeypatch.setenv("MINDIO_ACP_IDLE_EXIT", "60")
    monkeypatch.delenv("MINDIO_ACP_DISABLE", raising=False)
    monkeypatch.delenv("MINDIO_ACP_PERSIST_DELAY", raising=False)
    api.reset()
    yield {"run": run_dir, "ck": ckpt_dir}
    api.reset()
    stop_daemon(run_dir)
    if not os.environ.get("MINDIO_TEST_KEEP"):
        shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB tmpfs (root only): storage that fills up or can be remounted read-only."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root); the RLIMIT_FSIZE test covers storage limits")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

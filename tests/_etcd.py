"""A real etcd server for the tests of mindio-run's etcd store (``--rdzv-backend etcd``): started on free
loopback ports with its v2 API on, in a directory of the test's; stopped (SIGTERM) at the end, its exit
code checked. Tests that need it are skipped, with the reason, where the ``etcd`` binary (Debian's
``etcd-server``; scripts/install.sh installs it as root) or python-etcd (``mindio[etcd]``) is missing."""
from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time

import pytest

from mindio._ports import free_port

__all__ = ["etcd_server", "etcd_cluster", "skip_without_etcd"]

skip_without_etcd = pytest.mark.skipif(
    shutil.which("etcd") is None or not __import__("importlib").util.find_spec("etcd"),
    reason="needs an etcd server binary (apt-get install etcd-server; scripts/install.sh does as root) and "
           "python-etcd (pip install -c constraints.txt -e '.[etcd]')")


@contextlib.contextmanager
def etcd_server(workdir):
    """Yield HOST:PORT of a fresh etcd server (v2 API on) whose data lives in ``workdir``."""
    import etcd

    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    log = open(workdir / "etcd.log", "w")
    p = subprocess.Popen(["etcd", "--name", "t", "--data-dir", str(workdir / "etcd-data"), "--enable-v2=true",
                          "--listen-client-urls", url, "--advertise-client-urls", url,
                          "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 30
        while True:  # bounded: the server answers its v2 API, or the test fails with its log
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()  # listening (no client retries)
                etcd.Client(host="127.0.0.1", port=client, read_timeout=2).get("/")
                break
            except (OSError, etcd.EtcdException):
                if p.poll() is not None or time.monotonic() > end:
                    raise AssertionError(f"etcd did not start within 30 s (exit {p.poll()}):\n"
                                         f"{(workdir / 'etcd.log').read_text()[-3000:]}")
                time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            code = p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            code = p.wait()
        log.close()
    # etcd ends on SIGTERM by shutting down, then re-raising the signal (its pkg/osutil): -SIGTERM is its clean stop
    assert code in (0, -signal.SIGTERM), f"etcd exited with {code}:\n{(workdir / 'etcd.log').read_text()[-3000:]}"


@contextlib.contextmanager
def etcd_cluster(workdir, n: int = 3):
    """Yield ``(endpoints, kill)`` of a fresh ``n``-member etcd cluster on loopback (v2 API on): the comma
    list of the members' client HOST:PORT, and ``kill(i)``, which SIGKILLs member ``i`` (its host dies)
    and waits for it. Every member still running is stopped (SIGTERM) at the end; each exit code is
    checked (-SIGKILL for the ones the test killed)."""
    import etcd

    clients, peers = [free_port() for _ in range(n)], [free_port() for _ in range(n)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peers[i]}" for i in range(n))
    procs, logs, killed = [], [], set()
    try:
        for i in range(n):
            url = f"http://127.0.0.1:{clients[i]}"
            logs.append(open(workdir / f"etcd{i}.log", "w"))
            procs.append(subprocess.Popen(
                ["etcd", "--name", f"m{i}", "--data-dir", str(workdir / f"etcd{i}-data"), "--enable-v2=true",
                 "--listen-client-urls", url, "--advertise-client-urls", url,
                 "--listen-peer-urls", f"http://127.0.0.1:{peers[i]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peers[i]}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],  # a leader sooner (loopback)
                stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
        end = time.monotonic() + 60
        for i in range(n):  # bounded: every member answers a quorum read, or the test fails with the logs
            while True:
                try:
                    etcd.Client(host="127.0.0.1", port=clients[i], read_timeout=2).read("/", quorum=True)
                    break
                except (OSError, etcd.EtcdException):
                    if procs[i].poll() is not None or time.monotonic() > end:
                        raise AssertionError(f"etcd member {i} did not start within 60 s (exit {procs[i].poll()}):\n"
                                             f"{(workdir / f'etcd{i}.log').read_text()[-3000:]}")
                    time.sleep(0.1)
        def kill(i: int) -> None:
            killed.add(i)
            procs[i].send_signal(signal.SIGKILL)
            procs[i].wait(timeout=20)

        yield ",".join(f"127.0.0.1:{c}" for c in clients), kill
    finally:
        codes = []
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                codes.append(p.wait(timeout=20))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        for f in logs:
            f.close()
    want = [(-signal.SIGKILL,) if i in killed else (0, -signal.SIGTERM) for i in range(len(codes))]
    assert all(c in w for c, w in zip(codes, want)), f"etcd members exited with {codes}"

"""When may node 1's backup controller take over? (mindio/launch/backup.py, issue 16)

On node 0's TCPStore a failing store is not proof of node 0's loss: after a healed partition node 1's
store connection may break while node 0 goes on without it. The backup takes over only when node 0's
controller does not accept a connection either (``primary_answers``). A job keeps one backup by default
(``count``); on node 0's TCPStore it is provisional unless MINDIO_BACKUP_CONTROLLERS asks for backups
(``provisional``: its dump is never made the latest), on etcd the leader key settles a partition."""
from __future__ import annotations

import socket
import types

import pytest

from mindio._ports import free_port
from mindio.launch import backup


def _ctl(addr: str):
    return types.SimpleNamespace(_primary_link=types.SimpleNamespace(address=addr))


def test_a_listening_primary_answers_a_closed_port_does_not():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert backup.primary_answers(_ctl(f"tcp://127.0.0.1:{port}")) == f"127.0.0.1:{port}"
    assert backup.primary_answers(_ctl(f"tcp://127.0.0.1:{free_port()}")) == ""
    assert backup.primary_answers(types.SimpleNamespace(_primary_link=None)) == ""


@pytest.mark.parametrize("etcd,env,want,provisional", [
    ("", None, 1, True), ("127.0.0.1:2379", None, 1, False), ("", "1", 1, False), ("127.0.0.1:2379", "0", 0, False),
    ("", "0", 0, False), ("", "2", 2, False)])
def test_one_backup_by_default_provisional_where_no_leader_key_settles_a_partition(monkeypatch, etcd, env, want,
                                                                                    provisional):
    if env is None:
        monkeypatch.delenv("MINDIO_BACKUP_CONTROLLERS", raising=False)
    else:
        monkeypatch.setenv("MINDIO_BACKUP_CONTROLLERS", env)
    cfg = types.SimpleNamespace(high_availability=("recover",), nnodes=3, etcd_endpoint=etcd)
    assert backup.count(cfg) == want
    assert backup.provisional(cfg) is provisional
    assert backup.count(types.SimpleNamespace(high_availability=(), nnodes=3, etcd_endpoint=etcd)) == 0
    assert backup.count(types.SimpleNamespace(high_availability=("recover",), nnodes=1, etcd_endpoint=etcd)) == 0

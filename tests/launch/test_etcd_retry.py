"""The agents' etcd store under a loaded etcd (issue 13): etcd answers "Raft Internal Error: request timed
out" when its raft cannot commit in time (seen under the full suite's load, where one such answer ended
an agent's job). Requests that may be repeated are asked again for up to MINDIO_ETCD_RETRY s; a create
whose answer was lost reads back as its own; ``add`` is not repeated; past the bound the error names the
knob. And the controller's leader key is a lease: held for sure only ``ttl`` s after the last refresh
that got through was sent.

A real etcd server (tests/_etcd.py) behind a real HTTP proxy of the test's that forwards every request
and answers some with etcd's own raft-timeout error (before forwarding them, or after: the write
happened, its answer was lost).
"""
from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests._etcd import etcd_cluster, etcd_server, skip_without_etcd

pytestmark = skip_without_etcd

RAFT_TIMEOUT = {"errorCode": 300, "message": "Raft Internal Error", "cause": "request timed out", "index": 0}


class FlakyEtcd:
    """HTTP proxy on a free loopback port in front of etcd at ``upstream``. ``fail(n, after=False)``: the
    next ``n`` requests get etcd's raft-timeout answer (HTTP 500, errorCode 300), without reaching etcd
    or (``after``) once etcd did what they asked; only requests of ``method`` if given, after ``skip`` of them."""

    def __init__(self, upstream: str):
        self.upstream, self._lock, self.failed = upstream, threading.Lock(), 0
        self._fail, self._after, self._method, self._skip = 0, False, None, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    fail = proxy._fail > 0 and proxy._method in (None, self.command)
                    if fail and proxy._skip:
                        proxy._skip, fail = proxy._skip - 1, False
                    after = proxy._after
                    if fail:
                        proxy._fail -= 1
                        proxy.failed += 1
                if fail and not after:
                    return self._answer(500, {"Content-Type": "application/json"}, json.dumps(RAFT_TIMEOUT).encode())
                req = urllib.request.Request(f"http://{proxy.upstream}{self.path}", data=body or None,
                                             method=self.command,
                                             headers={k: v for k, v in self.headers.items()
                                                      if k.lower() in ("content-type", "authorization")})
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        status, headers, data = resp.status, resp.headers, resp.read()
                except urllib.error.HTTPError as exc:
                    status, headers, data = exc.code, exc.headers, exc.read()
                if fail:
                    return self._answer(500, {"Content-Type": "application/json"}, json.dumps(RAFT_TIMEOUT).encode())
                self._answer(status, {k: v for k, v in headers.items()
                                      if k.lower() not in ("content-length", "transfer-encoding", "connection")}, data)

            def _answer(self, status, headers, data):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def fail(self, n: int, after: bool = False, method: str | None = None, skip: int = 0) -> None:
        with self._lock:
            self._fail, self._after, self._method, self._skip = n, after, method, skip

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


@pytest.fixture(scope="module")
def etcd_upstream(tmp_path_factory):
    with etcd_server(tmp_path_factory.mktemp("etcd")) as endpoint:
        yield endpoint


@pytest.fixture
def flaky(etcd_upstream):
    with FlakyEtcd(etcd_upstream) as proxy:
        yield proxy


def _store(endpoint: str, run_id: str, create: bool = True):
    from mindio.launch import etcdstore

    return etcdstore.connect(endpoint, run_id, 5.0, create=create)


def test_reads_sets_and_creates_are_asked_again_after_a_raft_timeout(flaky, caplog, monkeypatch):
    monkeypatch.setenv("MINDIO_ETCD_RETRY", "10")
    store = _store(flaky.endpoint, "retry-reads")
    caplog.set_level(logging.INFO, logger="mindio.launch.etcdstore")
    for i, call in enumerate([lambda: store.set("a", "1"), lambda: store.get("a"), lambda: store.check(["a"]),
                              lambda: store.multi_get(["a"]), lambda: store.compare_set("b", "", "mine")]):
        flaky.fail(2)
        before = flaky.failed
        assert call() in (None, b"1", True, [b"1"], b"mine"), i
        assert flaky.failed == before + 2, i  # both timeouts answered, then the call got through
    assert store.get("b") == b"mine"
    said = [r.getMessage() for r in caplog.records if "asking again" in r.getMessage()]
    assert said and all("Raft Internal Error" in m and "MINDIO_ETCD_RETRY" in m for m in said), said


def test_a_create_whose_answer_was_lost_reads_back_as_its_own(flaky):
    """The write reached etcd, its answer did not: asked again, the create finds the key and reads it
    back -- ``desired`` (this caller's), not "somebody else's"; an existing other value is still refused."""
    from mindio.launch import etcdstore

    store = _store(flaky.endpoint, "retry-create")
    flaky.fail(1, after=True)
    assert store.compare_set("claim", "", "standby-1") == b"standby-1"
    assert flaky.failed == 1
    assert store.compare_set("claim", "", "standby-2") == b"standby-1"

    lead = etcdstore.Leader(0, 3.0)
    flaky.fail(1, after=True)
    assert lead.take(store) is True and lead.holder(store) == "node 0"
    assert not lead.lapsed()
    assert etcdstore.Leader(1, 3.0).take(store) is False  # held by node 0


def test_add_is_not_asked_again(flaky):
    """A timed out increment may have happened: asking again could count twice. The error stands."""
    from torch.distributed import DistStoreError

    store = _store(flaky.endpoint, "retry-add")
    assert store.add("n", 1) == 1
    flaky.fail(1, after=True, method="PUT", skip=1)  # the increment's compare-and-swap (after its create try)
    with pytest.raises(DistStoreError, match="Raft Internal Error"):
        store.add("n", 1)
    assert store.add("n", 0) == 2  # it did happen: a repeat would have made it 3


def test_past_the_bound_the_error_names_the_knob(flaky, monkeypatch):
    from torch.distributed import DistStoreError

    monkeypatch.setenv("MINDIO_ETCD_RETRY", "1")
    store = _store(flaky.endpoint, "retry-bound")
    flaky.fail(1000)
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match=r"asked again for 1 s: MINDIO_ETCD_RETRY"):
        store.get("a")
    took = time.monotonic() - t0
    flaky.fail(0)
    assert 0.5 < took < 5, took


def test_the_leader_key_is_held_for_sure_only_ttl_after_a_refresh_was_sent(flaky):
    from mindio.launch import etcdstore

    store = _store(flaky.endpoint, "lease")
    lead = etcdstore.Leader(0, 3.0)
    assert lead.lapsed()  # never taken
    sent = time.monotonic()
    assert lead.take(store)
    assert lead.sent_ok >= sent and not lead.lapsed(now=lead.sent_ok + 2.9) and lead.lapsed(now=lead.sent_ok + 3.1)
    before = lead.sent_ok
    assert lead.refresh(store) and lead.sent_ok > before
    flaky.fail(1)  # a refresh asked again after a timeout dates the lease from the attempt that got through
    t = time.monotonic()
    assert lead.refresh(store) and lead.sent_ok > t


def test_a_cluster_member_that_dies_is_left_for_the_next(tmp_path, caplog):
    """``--rdzv-endpoint A,B,C`` (an etcd cluster): the agents' store asks the first member that answers
    and, when it dies, the next one -- keys and the leader key live on; etcd's own quorum keeps them."""
    from mindio.launch import etcdstore

    caplog.set_level(logging.INFO, logger="mindio.launch.etcdstore")
    with etcd_cluster(tmp_path) as (endpoints, kill):
        store = _store(endpoints, "cluster")
        assert store.members == endpoints.split(",")
        store.set("a", "1")
        lead = etcdstore.Leader(0, 3.0)
        assert lead.take(store)
        used = store.members.index(f"127.0.0.1:{store.client.port}")
        kill(used)  # the member in use dies (its host)
        assert store.get("a") == b"1"
        assert lead.refresh(store) and lead.holder(store) == "node 0"
        assert store.compare_set("claim", "", "standby-1") == b"standby-1"
        now = f"127.0.0.1:{store.client.port}"
        assert now != store.members[used], now
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("etcd member")]
        assert said and said[0].startswith(f"etcd member {store.members[used]} failed"), said

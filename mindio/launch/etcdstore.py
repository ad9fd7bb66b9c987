"""The agents' store on an etcd server (``--rdzv-backend etcd --rdzv-endpoint HOST:PORT``): a store
that outlives every node of the job, node 0 included (issue 16).

torch.distributed.elastic's :class:`EtcdStore` (the store of torch's ``etcd`` rendezvous, on etcd's v2
API through python-etcd) with what the agents use of a c10d store besides: ``compare_set`` in its
``""`` -> value form (an atomic create: etcd's ``prevExist=false``), failures as torch's store errors
(``DistNetworkError`` when etcd cannot be reached, ``DistStoreError`` when a key never came), so the
agent's handling of a lost store is the same for both stores; and the leader key of the controller
(:class:`Leader`), an etcd key with a TTL.

The job's keys live under ``/mindio/<rdzv id>/``. Node 0 creates that directory (a job id that a
previous job used on the same server is refused while its keys are there: they would mislead this one);
the agent that leaves last says the job ended (``job/ended``: waiting standby agents leave) and the
keys expire a minute later (stores.py). etcd must serve its v2 API (``etcd --enable-v2=true``; etcd 3.4, Debian's
``etcd-server``). Needs ``python-etcd`` (``pip install mindio[etcd]``).
"""
from __future__ import annotations

import datetime
import functools
import logging
import time

from .. import _knobs
from ..errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["connect", "Leader", "PREFIX"]

PREFIX = "/mindio"


def _etcd():
    try:
        import etcd
    except ImportError:
        raise ConfigError("--rdzv-backend etcd needs python-etcd: pip install 'mindio[etcd]' "
                          "(python-etcd==0.4.5)") from None
    return etcd


def _transient(etcd, exc) -> bool:
    """Worth asking again: the connection failed or timed out, or etcd could not commit in time (its
    "Raft Internal Error: request timed out", code 300, is a plain EtcdException) or elects a leader."""
    if isinstance(exc, (etcd.EtcdConnectionFailed, etcd.EtcdLeaderElectionInProgress)):
        return True
    return type(exc) is etcd.EtcdException  # not a key/value/compare error: those are answers


def _as_store_errors(fn=None, *, repeat: bool = True):
    """etcd's exceptions as torch's store errors (what the agent and its threads handle). A call that
    may be repeated (``repeat``: reads, sets, the create-if-absent forms, which read back what they find)
    is asked again on a transient error for up to MINDIO_ETCD_RETRY s: an etcd under load answers "request
    timed out" now and then, and one such answer must not end a job. ``add`` is not repeated (a timed
    out increment may have happened)."""
    if fn is None:
        return functools.partial(_as_store_errors, repeat=repeat)

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        from torch.distributed import DistNetworkError, DistStoreError

        etcd = _etcd()
        store = self if hasattr(self, "endpoint") else args[0]  # a store's method, or Leader's (store first)
        deadline, pause, said, moved = time.monotonic() + store.retry_for, 0.05, False, 0
        while True:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                if not isinstance(exc, (etcd.EtcdException, LookupError)):
                    raise
                first = exc
            if repeat and isinstance(first, etcd.EtcdException) and _transient(etcd, first) \
                    and time.monotonic() + pause < deadline:
                if isinstance(first, etcd.EtcdConnectionFailed) and len(store.members) > 1:
                    store.next_member(first)  # an etcd cluster: ask the next member, at once unless
                    moved += 1                # every member failed since the last pause
                    if moved % len(store.members):
                        continue
                if not said:
                    log.info("etcd at %s: %s: %s; asking again for up to %g s (MINDIO_ETCD_RETRY)",
                             store.endpoint, type(first).__name__, first, store.retry_for)
                    said = True
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            tried = f" (asked again for {store.retry_for:g} s: MINDIO_ETCD_RETRY)" if said else ""
            if isinstance(first, etcd.EtcdConnectionFailed):
                raise DistNetworkError(f"etcd at {store.endpoint} is unreachable: {first}{tried}") from None
            if isinstance(first, LookupError):  # EtcdStore.get/wait: the key did not come within the store's timeout
                raise DistStoreError(f"{first} (etcd at {store.endpoint}; waited "
                                     f"{store.timeout.total_seconds():g} s)") from None
            raise DistStoreError(f"etcd at {store.endpoint}: {type(first).__name__}: {first}{tried}") from None
    return call


def _store_class():
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    class AgentEtcdStore(EtcdStore):
        """EtcdStore plus compare_set, multi_get and torch's store errors (see the module docstring)."""

        def __init__(self, client, prefix: str, timeout: datetime.timedelta, endpoint: str, retry_for: float,
                     member: int = 0):
            super().__init__(client, prefix, timeout)
            self.endpoint, self.retry_for = endpoint, retry_for
            self.members, self._member = members(endpoint), member

        def next_member(self, why) -> None:
            """(an etcd cluster) The member in use failed: the next one's client from now on."""
            old = self.members[self._member]
            self._member = (self._member + 1) % len(self.members)
            self.client = _client(self.members[self._member], self.client._read_timeout)
            log.info("etcd member %s failed (%s): asking %s", old, str(why)[:200], self.members[self._member])

        def key(self, key: str) -> str:
            """The etcd key behind the store key ``key``."""
            return self.prefix + self._encode(key)

        set = _as_store_errors(EtcdStore.set)
        get = _as_store_errors(EtcdStore.get)
        add = _as_store_errors(EtcdStore.add, repeat=False)
        check = _as_store_errors(EtcdStore.check)
        wait = _as_store_errors(EtcdStore.wait)

        @_as_store_errors
        def multi_get(self, keys):
            return [EtcdStore.get(self, k) for k in keys]

        @_as_store_errors
        def compare_set(self, key, expected, desired) -> bytes:
            """c10d's compare_set in the form the agents use: ``expected`` empty -- create ``key`` with
            ``desired`` unless it exists (atomic: etcd's prevExist=false); returns the value it holds. Asked
            again after a transient error, a create that did happen reads back as ``desired``: the agents'
            values are their own (a standby's name, a node's)."""
            etcd = _etcd()
            if expected not in ("", b""):
                raise NotImplementedError("compare_set on etcd: only the create form (expected '') is used")
            try:
                self.client.write(self.key(key), self._encode(desired), prevExist=False)
                return desired.encode() if isinstance(desired, str) else bytes(desired)
            except etcd.EtcdAlreadyExist:
                return self._decode(self.client.get(self.key(key)).value)

    return AgentEtcdStore


def members(endpoint: str) -> list:
    """``HOST:PORT[,HOST:PORT...]``: the members of an etcd cluster to ask, in order."""
    return [e.strip() for e in endpoint.split(",") if e.strip()]


def _client(endpoint: str, read_timeout: float):
    """A python-etcd client of the one member ``endpoint`` (mindio moves to the next member itself:
    AgentEtcdStore.next_member)."""
    etcd = _etcd()
    host, _, port = endpoint.rpartition(":")
    return etcd.Client(host=host.strip("[]"), port=int(port), read_timeout=read_timeout, allow_reconnect=False)


PROBE_S = 1.0  # one probe of an etcd member while connecting: a stop signal waits at most this


def connect(endpoint: str, run_id: str, timeout: float, create: bool = False, wait: float | None = None,
            stopping=None):
    """A client of the job's keys on the etcd server at ``endpoint`` (HOST:PORT, or the members of an etcd
    cluster, HOST:PORT,HOST:PORT,...: the first that answers, the next one whenever the one in use
    fails); its calls wait up to ``timeout`` s for a key. Waits up to ``wait`` s (default ``timeout``)
    for a member to answer, one probe of at most ``PROBE_S`` at a time, so that ``stopping()`` (a stop
    signal, checked between probes) ends the wait at once: :class:`InterruptedError`. ``create`` (node 0,
    once): create the job's directory, refusing one a previous job left."""
    etcd = _etcd()
    hosts = members(endpoint)
    deadline = time.monotonic() + (timeout if wait is None else wait)
    member, said = 0, False
    while True:
        if stopping is not None and stopping():
            raise InterruptedError(f"stopped while waiting for etcd at {endpoint}")
        try:
            _client(hosts[member], read_timeout=PROBE_S).get("/")  # the v2 API answers (etcd 3.4: --enable-v2=true)
            client = _client(hosts[member], read_timeout=max(timeout, 5.0))
            break
        except etcd.EtcdConnectionFailed as exc:
            if time.monotonic() > deadline:
                raise ConfigError(f"etcd at {endpoint} did not answer within {timeout:g} s (--rdzv-conf "
                                  f"join_timeout=S sets it): start it, or check --rdzv-endpoint ({exc})") from None
            if not said:  # one line for the whole wait (python-etcd's own retries say nothing)
                said = True
                log.info("etcd at %s does not answer yet; trying again for %.0f s more (--rdzv-conf join_timeout=S)",
                         endpoint, deadline - time.monotonic())
            member = (member + 1) % len(hosts)
            if member == 0:
                time.sleep(0.1)
        except etcd.EtcdException as exc:
            raise ConfigError(f"etcd at {endpoint} does not serve its v2 API ({type(exc).__name__}: {exc}): "
                              f"run it with --enable-v2=true") from None
    prefix = f"{PREFIX}/{run_id}"
    store = _store_class()(client, prefix, datetime.timedelta(seconds=timeout), endpoint,
                           _knobs.get("MINDIO_ETCD_RETRY"), member)
    if create:
        try:
            client.write(prefix, None, dir=True, prevExist=False)
        except etcd.EtcdAlreadyExist:
            raise ConfigError(f"--rdzv-id {run_id}: etcd at {endpoint} holds the keys of a job with that id "
                              f"({prefix}): give this job its own --rdzv-id, or remove them "
                              f"(ETCDCTL_API=2 etcdctl rm -r {prefix})") from None
    return store


def expire(store, ttl: float) -> None:
    """(the job's end) The job's keys go in ``ttl`` s (etcd removes the directory then)."""
    etcd = _etcd()
    try:
        store.client.write(store.prefix.rstrip("/"), None, dir=True, ttl=int(ttl), prevExist=True)
    except etcd.EtcdException as exc:
        log.info("could not set the expiry of the job's keys %s on etcd: %s", store.prefix, exc)


class Leader:
    """The controller's leader key (``controller/leader`` = "node <k>"): held by the node whose agent
    hosts the controller in charge, with a TTL of ``ttl`` s, refreshed (test-and-set on its value) every
    monitor interval by that agent's beat thread. Another node's backup takes over only by creating it,
    so only once it expired: the side of a partition that cannot refresh it stops acting, and the other
    cannot take it while it is refreshed. Each call takes the store client of the calling thread."""

    KEY = "controller/leader"

    def __init__(self, node: int, ttl: float):
        self.node, self.ttl = node, max(1, round(ttl))
        self.sent_ok: float | None = None  # (monotonic) when the last take/refresh that succeeded was sent

    def lapsed(self, now: float | None = None) -> bool:
        """Held no longer for sure: no take or refresh sent in the last ``ttl`` s succeeded (etcd's TTL runs
        from when it applied the write, later than its sending), so another node may have taken the key
        while this one could not reach etcd or was stalled: this node stops acting (agent._ha_tick)."""
        now = time.monotonic() if now is None else now
        return self.sent_ok is None or now - self.sent_ok > self.ttl

    def _value(self, store) -> str:
        return store._encode(f"node {self.node}")

    def _extend(self, store) -> bool | None:
        """The test-and-set that keeps the key while it holds this node's value, dating the lease from its
        sending: True; False when another node's value is there; None when there is no key."""
        etcd = _etcd()
        value, sent = self._value(store), time.monotonic()
        try:
            store.client.write(store.key(self.KEY), value, ttl=self.ttl, prevValue=value)
        except etcd.EtcdCompareFailed:
            return False
        except etcd.EtcdKeyNotFound:
            return None
        self.sent_ok = sent
        return True

    @_as_store_errors
    def take(self, store) -> bool:
        """Create the key (it does not exist, or expired); False when another node holds it (True when it
        holds this node's value: a create asked again after a transient error, or taken already)."""
        etcd = _etcd()
        for _ in range(3):  # the key may expire between the create and the extend: create it again
            sent = time.monotonic()
            try:
                store.client.write(store.key(self.KEY), self._value(store), ttl=self.ttl, prevExist=False)
            except etcd.EtcdAlreadyExist:
                # ours if it holds this node's value (a create asked again after a transient error): extend
                # it, which also dates the lease (the create's TTL ran from a sending not known here)
                held = self._extend(store)
                if held is None:
                    continue
                return held
            self.sent_ok = sent
            return True
        return False

    @_as_store_errors
    def refresh(self, store) -> bool:
        """Extend the TTL while this node still holds the key (or take it again when it expired and nobody
        took it); False when another node holds it."""
        held = self._extend(store)
        return self.take(store) if held is None else held

    @_as_store_errors
    def holder(self, store) -> str:
        """Who holds the key now ("" when nobody)."""
        etcd = _etcd()
        try:
            return store._decode(store.client.get(store.key(self.KEY)).value).decode()
        except etcd.EtcdKeyNotFound:
            return ""

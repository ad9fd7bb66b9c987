"""The agents' store: node 0's TCPStore on --master-port (default), or the job's keys on an etcd server
(``--rdzv-backend etcd``: etcdstore.py), which outlives node 0. Every agent thread that talks to it
(the main loop, the beat thread, the hosted controller's driver) has a client of its own."""
from __future__ import annotations

import datetime

__all__ = ["client", "where", "on_etcd"]


def on_etcd(cfg) -> bool:
    return bool(cfg.etcd_endpoint)


def where(cfg) -> str:
    """The agents' store, in words (for messages)."""
    if on_etcd(cfg):
        return f"the agents' store (etcd at {cfg.etcd_endpoint})"
    return f"node 0's agents' store at {cfg.master_addr}:{cfg.master_port}"


def client(cfg, timeout: float):
    """A new client of the agents' store; its calls wait up to ``timeout`` s."""
    if on_etcd(cfg):
        from . import etcdstore

        return etcdstore.connect(cfg.etcd_endpoint, cfg.run_id, timeout)
    from torch.distributed import TCPStore

    return TCPStore(cfg.master_addr, cfg.master_port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout))


ENDED = "job/ended"
KEEP_ENDED_S = 60
"""etcd: how long the job's keys stay after its end, for standby agents to read that it ended."""


def end_job(store, cfg, why: str) -> None:
    """(the agent that leaves last) Say that the job ended: a waiting standby agent leaves. On etcd the
    job's keys then expire after KEEP_ENDED_S (a TCPStore goes with node 0's agent)."""
    if not on_etcd(cfg):
        return
    from . import etcdstore

    store.set(ENDED, why)
    etcdstore.expire(store, KEEP_ENDED_S)


def ended(store, cfg) -> bool:
    """(a waiting standby agent) Has the job ended? On etcd: said so, or its keys are gone."""
    return on_etcd(cfg) and (store.check([ENDED]) or not store.check(["job/secret-mode"]))

"""The job secret under mindio-run: where the agents get it, and how their workers get it privately.

The secret signs every control-plane frame (mindio/ttp/wire/protocol.py); whoever holds it can control the
job. Workers get it as MINDIO_SECRET in the assignment their warm interpreter reads from its stdin pipe
(spares.py, _bootstrap.py): never through a store, and not in the environment block the interpreter was
started with (which only processes of the same uid could read anyway, through /proc). Where an agent
gets it:

* the user gave one (MINDIO_SECRET, or MINDIO_SECRET_FILE: a file of the user's own with no group/other
  access, e.g. on a shared home directory, or a secret the cluster's scheduler provides): that one.
  Every node must be given the same; node 0 says that it was (key ``job/secret-mode`` = ``given``).
* a single-node job: node 0's agent draws one (``private``); it never leaves the agent and its workers.
  A ``--standby`` agent cannot join such a job: it is told to give every node the same secret.
* several nodes and none given (``store``): node 0 draws one and publishes it in its agent store under
  ``job/secret``, where the other agents read it. That store answers anyone who reaches --master-port, so
  this is the one case in which the secret is exposed; node 0 says so once, in a warning. There is no
  way around it without a credential the nodes share: an exchange between agents that hold nothing in
  common cannot tell an agent from anyone else on the network.
"""
from __future__ import annotations

import logging
import secrets

from ..errors import ConfigError
from .._secret import user_secret

log = logging.getLogger(__name__)

__all__ = ["resolve"]

_MODE, _SECRET = "job/secret-mode", "job/secret"


def resolve(cfg, store) -> str:
    """The job secret for this agent (``cfg``: its LaunchConfig, ``store``: the agent store)."""
    given = user_secret()  # ConfigError if MINDIO_SECRET_FILE is not a private file of ours
    if cfg.node_rank == 0 and not cfg.standby:
        if given:
            store.set(_MODE, "given")
            return given
        if cfg.nnodes == 1:
            store.set(_MODE, "private")
            return secrets.token_hex(32)
        text = secrets.token_hex(32)
        store.set(_SECRET, text)
        store.set(_MODE, "store")
        log.warning("the control-plane secret of this %d-node job is published in the agent store on "
                    "--master-port, which answers any client without a credential: whoever reaches that port "
                    "can read it and control the job (forge fault reports, end it). To keep it private give every "
                    "node's mindio-run the same MINDIO_SECRET_FILE (a file of mode 0600) or MINDIO_SECRET; "
                    "docs/security.md", cfg.nnodes)
        return text
    mode = store.get(_MODE).decode()  # waits for node 0 (bounded by the store's timeout, --rdzv-conf timeout)
    if given:
        return given
    if mode == "store":
        return store.get(_SECRET).decode()
    raise ConfigError(
        "node 0's mindio-run was given a job secret (MINDIO_SECRET / MINDIO_SECRET_FILE) and this agent was not: give "
        "every node the same" if mode == "given" else
        "node 0 runs a single-node job whose secret stays on node 0: to add a --standby node, give every node's "
        "mindio-run the same MINDIO_SECRET_FILE (a file of mode 0600) or MINDIO_SECRET")

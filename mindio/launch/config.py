"""The launcher's configuration: what one mindio-run agent needs to know (torchrun's flags), checked
on construction (a bad value raises ConfigError saying which flag and why)."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["LaunchConfig"]


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What one agent needs to know. Mirrors torchrun's flags."""

    entrypoint: str
    """Training script path, or module name when ``is_module``."""
    args: tuple = ()
    is_module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    min_nodes: int = 0
    """``--nnodes MIN:MAX``: MIN (``nnodes`` is MAX); 0: ``nnodes`` (a fixed count). Each round runs with
    the agents that joined it (agent.py, ``round/<n>/nodes``)."""
    last_call: float = 30.0
    """``--rdzv-conf last_call_timeout``: with MIN:MAX, seconds node 0 waits for more agents once MIN
    joined (after the last one that came)."""
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    """Whole-job restarts allowed after a failure (torchrun semantics)."""
    monitor_interval: float = 0.1
    """Seconds between checks of the workers and the other agents."""
    rdzv_timeout: float = 600.0
    """Seconds to wait for all agents to join a round, or for node 0's store (``--rdzv-conf join_timeout``,
    torchrun's default)."""
    node_lost_after: float = 3.0
    """Seconds without a beat from an agent before its node is declared lost."""
    term_grace: float = 3.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    warm_spares: int = 1
    standby: bool = False
    """Offer this node as a spare: wait until a node is lost, take over its node rank, join the next round."""
    run_id: str = "mindio"
    etcd_endpoint: str = ""
    """``--rdzv-backend etcd --rdzv-endpoint HOST:PORT``: the agents' store is the job's keys on this etcd
    server (etcdstore.py), which outlives node 0; empty: node 0's TCPStore on ``--master-port``."""
    high_availability: tuple = ()
    """Strategies of the controller that node 0 hosts (HIGH_AVAILABILITY); empty: no controller here
    (the training script starts one in rank 0, as under torchrun)."""
    recover_timeout: float = 60.0
    """Seconds for a replacement process to join the survivors and park (recover-in-place / recover)."""
    decision_timeout: float = 300.0
    """Seconds a worker death may stay without a decision of the controller (replace it, or end the job)
    before the agent fails the round anyway (``MINDIO_DECISION_TIMEOUT``)."""
    leave_timeout: float = 10.0
    """Seconds node 0 waits, at the end, for the other agents to leave before it takes the stores down."""
    extra_env: dict = field(default_factory=dict)
    # --- torchrun's flags beyond the node layout (torch.distributed.run) ---
    role: str = "default"
    """``--role``: ROLE_NAME of the workers, and the prefix of their tee'd lines ``[<role><local rank>]:``."""
    local_addr: str | None = None
    """``--local-addr``: this node's address; picks the interface gloo uses (GLOO_SOCKET_IFNAME)."""
    dynamic_rank: bool = False
    """``--rdzv-backend c10d`` without ``--node-rank``: the agent hosting the endpoint is node 0, the
    others take node ranks in the order they arrive; an agent beyond ``--nnodes`` waits as a standby."""
    is_host: bool | None = None
    """``--rdzv-conf is_host=``: whether this agent hosts the c10d endpoint (None: it tries)."""
    log_dir: str | None = None
    """``--log-dir``: base of the per-rank log files, in torchrun's layout (logs.py)."""
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset | None = None
    logs_specs: str | None = None
    duplicate_stdout_filters: tuple = ()
    duplicate_stderr_filters: tuple = ()
    no_python: bool = False
    """``--no-python``: the entrypoint is a program, started as is (no warm start)."""
    virtual_local_rank: bool = False
    """``--virtual-local-rank``: every worker sees LOCAL_RANK=0 and only its own device."""
    signals: tuple = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    """``--signals-to-handle``: signals that stop the agent; it forwards them to its workers."""
    preempt_signals: tuple = ("SIGTERM",)
    """``--preempt-signal`` (MINDIO_PREEMPT_SIGNAL): signals that mean preemption: a last-words checkpoint
    at the current step, then the agent exits with its code, 75 (agent.py, Preemption)."""
    preempt_timeout: float = 20.0
    """``--preempt-timeout`` (MINDIO_PREEMPT_TIMEOUT): seconds from a preemption signal to the end of the
    checkpoint and of every worker; past it the workers are stopped as for any other signal."""

    def __post_init__(self):
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not self.standby and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is outside [0, {self.nnodes - 1}] for --nnodes {self.nnodes}")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port {self.master_port} is not a valid port (1-65535)")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.monitor_interval <= 0 or self.monitor_interval * 3 > self.node_lost_after:
            raise ConfigError(
                f"--monitor-interval {self.monitor_interval} must be > 0 and at most a third of the "
                f"node-loss timeout ({self.node_lost_after} s), or live nodes would be declared lost"
            )
        if not self.is_module and not self.no_python and not os.path.exists(self.entrypoint):
            raise ConfigError(f"training script {self.entrypoint!r} does not exist")
        if self.is_module and self.no_python:
            raise ConfigError("--module and --no-python exclude each other (as in torchrun)")
        from torch.distributed.elastic.multiprocessing.api import Std

        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee)):
            try:
                Std.from_str(value)
            except ValueError:
                raise ConfigError(f"{flag} {value}: expected 0-3 for every local rank, or LOCAL_RANK:0-3 "
                                  f"pairs (e.g. 3, or 0:3,1:1); 1 stdout, 2 stderr, 3 both") from None
        if self.preempt_timeout <= 0:
            raise ConfigError(f"--preempt-timeout must be > 0 seconds, got {self.preempt_timeout}")
        for name in self.signals + self.preempt_signals:
            if not hasattr(signal, name) or not name.startswith("SIG"):
                raise ConfigError(f"--signals-to-handle: {name!r} is not a signal name (e.g. SIGTERM,SIGUSR1)")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

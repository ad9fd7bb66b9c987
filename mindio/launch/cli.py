"""``mindio-run``: torchrun's command line, with mindio's fault tolerance. See :mod:`mindio.launch.agent`.

    mindio-run --nproc-per-node 4 train.py --lr 1e-3
    mindio-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 8 train.py

The parser IS torchrun's (``torch.distributed.run.get_args_parser()``): every torchrun flag, its
defaults and its ``PET_*`` environment variables, with mindio's own flags added. A torchrun flag that
mindio-run cannot honour fails with one line saying so (:data:`_REFUSED`).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from .. import _logging
from ..errors import ConfigError

__all__ = ["main", "parse_args", "build_parser"]

DESCRIPTION = ("mindio-run: torchrun's launcher with mindio's fault tolerance (warm worker starts, standby "
               "nodes, a controller that replaces failed ranks in place). Takes every torchrun flag.")

# torchrun flag -> (the value(s) mindio-run honours, why others are refused)
_REFUSED = {
    "rdzv_backend": (("static", "c10d", "etcd", "etcd-v2"),
                     "mindio-run's agents meet in node 0's TCPStore (static, c10d) or on an etcd server (etcd)"),
    "event_log_handler": (("null",), "mindio-run writes its events to MINDIO_EVENT_LOG (JSON lines) instead"),
    "numa_binding": ((None,), "NUMA binding of workers is not supported by mindio-run"),
}


def _plain(text: str | None) -> str | None:
    """torchrun's help text without its Sphinx markup (``x`` and `x`)."""
    if text is None or text is argparse.SUPPRESS:
        return text
    return re.sub(r"`{1,2}([^`]*)`{1,2}", r"\1", text).replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    import mindio

    p = get_args_parser()
    p.prog, p.description = "mindio-run", DESCRIPTION  # abbreviations allowed, as torchrun's parser
    for action in p._actions:
        action.help = _plain(action.help)
    notes = {
        "training_script_args": "arguments of the training script",
        "start_method": "accepted for torchrun compatibility: a script entrypoint always runs in its own "
                        "process (as in torchrun)",
        "run_path": "as torchrun: run the script with runpy.run_path (what mindio-run's warm workers always do)",
        "shutdown_timeout": "seconds between the stop signal and SIGKILL when workers are stopped (default: "
                            "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 3 s; torchrun: 30 s)",
        "nnodes": "number of nodes, or MIN:MAX (with --rdzv-backend c10d: a round starts once MIN agents "
                  "joined and --rdzv-conf last_call_timeout=S (30) passed, or MAX joined; an agent that comes "
                  "later restarts every worker with it, up to MAX)",
    }
    for action in p._actions:
        if action.dest == "node_rank" and "PET_NODE_RANK" not in os.environ:
            action.default = None  # None: not given (c10d then assigns node ranks; static: node 0)
        if action.dest in notes:
            action.help = notes[action.dest]
        if action.dest == "rdzv_backend":
            action.help = "rendezvous backend: static (default; --node-rank says which node this is), c10d " \
                          "(node ranks in arrival order; the agent hosting --rdzv-endpoint is node 0) or etcd " \
                          "(etcd-v2: the agents' store is the etcd server at --rdzv-endpoint, v2 API, which " \
                          "outlives node 0; --node-rank or --standby; node 0's address is --master-addr)"
    g = p.add_argument_group("mindio")
    g.add_argument("--version", action="version", version=f"mindio-run (mindio {mindio.__version__})")
    g.add_argument("--standby", action=check_env,
                   help="offer this node as a spare: it takes over the node rank of a lost node (for the next "
                        "round; with --high-availability in the running round, on the controller's order)")
    g.add_argument("--high-availability", action=env, default=os.environ.get("HIGH_AVAILABILITY", ""),
                   metavar="LIST",
                   help="strategies (dump,retry,recover-in-place,recover,elastic-training,exit; default: "
                        "$HIGH_AVAILABILITY): node 0's agent hosts the controller as rank -1, reports worker "
                        "deaths to it at once and restarts only the ranks it names; empty: no controller in the "
                        "launcher (the script may start one in rank 0, as under torchrun)")
    g.add_argument("--recover-timeout", action=env, type=float, default=60.0, metavar="S",
                   help="seconds for a replacement process to join the survivors (recover-in-place/recover)")
    g.add_argument("--preempt-signal", action=env, default=os.environ.get("MINDIO_PREEMPT_SIGNAL", "SIGTERM"),
                   metavar="LIST",
                   help="signals that mean preemption (default: $MINDIO_PREEMPT_SIGNAL, else SIGTERM; none: off): "
                        "mindio-run, or a worker, that receives one has the controller write a last-words checkpoint "
                        "at the current step; the workers and mindio-run then exit with 75 (rerun the job to resume)")
    g.add_argument("--preempt-timeout", action=env, type=float, default=None, metavar="S",
                   help="seconds from a preemption signal to the end of that checkpoint and of every worker, after "
                        "which they are stopped as for any other signal (default: $MINDIO_PREEMPT_TIMEOUT, else 20; "
                        "with --shutdown-timeout 3 it fits a 30 s grace period)")
    g.add_argument("--warm-spares", action=env, type=int, default=1, metavar="N",
                   help="pre-started interpreters kept per node (torch imported, waiting for a rank); none "
                        "without --high-availability, --max-restarts or --standby (no worker is ever started "
                        "again), and none where the agent forks its workers from its fork server (CPU-only torch; "
                        "MINDIO_FORK_SERVER)")
    return p


def _check_refused(p, a) -> None:
    for dest, (ok, why) in _REFUSED.items():
        value = getattr(a, dest)
        if value not in ok:
            flag = "--" + dest.replace("_", "-")
            p.error(f"{flag} {value}: not supported; {why}")


def _unquote(text: str) -> str:
    """``text`` without one pair of enclosing quotes (``'5'``, ``"a=1,b=2"``): a value quoted for a shell
    reaches us quoted when no shell removed them (a job file, a list of arguments)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].strip()
    return text


def _rdzv_conf(p, text: str) -> dict:
    """torchrun's ``--rdzv-conf KEY=VALUE,...``; quotes around the whole or around a value are dropped;
    the timeouts must be numbers (one line otherwise)."""
    out = {}
    for item in filter(None, (i.strip() for i in _unquote(text).split(","))):
        key, sep, value = item.partition("=")
        key, value = _unquote(key), _unquote(value)
        if not sep or not key or not value:
            p.error(f"--rdzv-conf {text!r}: expected KEY=VALUE,... (e.g. join_timeout=600)")
        if key in ("join_timeout", "timeout", "read_timeout", "last_call_timeout", "close_timeout"):
            try:
                if float(value) <= 0:
                    raise ValueError
            except ValueError:
                p.error(f"--rdzv-conf {key}={value}: expected a number of seconds > 0")
        out[key] = value
    return out


def _endpoint(p, text: str, default_port: int) -> tuple:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", str(default_port))
    host = host.strip("[]")
    if not host or not port.isdigit():
        p.error(f"--rdzv-endpoint {text!r}: expected HOST:PORT")
    return host, int(port)


def parse_args(argv=None):
    """The LaunchConfig of this agent, from torchrun's flags (and PET_* variables) plus mindio's."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    from .._knobs import _ha_list
    from .config import LaunchConfig

    from . import slurm

    p = build_parser()
    a = slurm.parse_args(p, argv)  # inside an srun step: --nnodes, --node-rank, --rdzv-endpoint from SLURM_*
    _check_refused(p, a)
    try:
        lo, hi = parse_min_max_nnodes(a.nnodes)
    except (RuntimeError, ValueError):
        p.error(f"--nnodes {a.nnodes!r}: expected a number of nodes")
    if lo != hi and not (a.rdzv_backend == "c10d" and a.rdzv_endpoint and a.node_rank is None):
        p.error(f"--nnodes {a.nnodes}: a MIN:MAX range needs --rdzv-backend c10d --rdzv-endpoint HOST:PORT and no "
                f"--node-rank (node ranks come from the rendezvous, as torchrun's)")
    if lo != hi and (a.high_availability or a.standby):
        p.error(f"--nnodes {a.nnodes}: a MIN:MAX range is not supported with --high-availability or --standby; "
                f"give a fixed count (spare nodes: --standby)")
    try:
        nproc = determine_local_world_size(a.nproc_per_node)
    except ValueError as exc:
        p.error(f"--nproc-per-node {a.nproc_per_node}: {exc}")
    conf = _rdzv_conf(p, a.rdzv_conf)
    node_rank, dynamic, etcd = a.node_rank, False, ""
    if a.standalone:
        from .._ports import free_port

        addr, port, run_id = "127.0.0.1", free_port(), a.rdzv_id
    elif a.rdzv_backend in ("etcd", "etcd-v2"):
        if not a.rdzv_endpoint:
            p.error(f"--rdzv-backend {a.rdzv_backend} needs --rdzv-endpoint HOST:PORT (the etcd server; "
                    f"several members of an etcd cluster: HOST:PORT,HOST:PORT,...)")
        if node_rank is None and not a.standby and hi > 1:
            p.error(f"--rdzv-backend {a.rdzv_backend}: give each agent its --node-rank (or --standby)")
        etcd = ",".join("%s:%d" % _endpoint(p, e.strip(), 2379) for e in a.rdzv_endpoint.split(","))
        addr, port, run_id = a.master_addr, a.master_port or 29500, a.rdzv_id
    elif a.rdzv_backend == "c10d" or a.rdzv_endpoint:
        if not a.rdzv_endpoint:
            p.error("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (node 0's store)")
        addr, port = _endpoint(p, a.rdzv_endpoint, 29400)
        run_id = a.rdzv_id
        dynamic = a.rdzv_backend == "c10d" and node_rank is None and hi > 1
    elif a.master_port is None and hi == 1:  # torchrun: a single node without a port gets a free one
        from .._ports import free_port

        addr, port, run_id = "127.0.0.1", free_port(), a.rdzv_id
    else:
        addr, port, run_id = a.master_addr, a.master_port or 29500, a.rdzv_id
    timeout = float(conf.get("join_timeout", conf.get("timeout", 600)))
    is_host = conf.get("is_host")
    try:
        strategies = _ha_list(a.high_availability)
    except (ValueError, ConfigError) as exc:
        p.error(f"--high-availability {a.high_availability!r}: {exc}")
    ranks = None
    if a.local_ranks_filter:
        try:
            ranks = frozenset(int(x) for x in a.local_ranks_filter.split(","))
        except ValueError:
            p.error(f"--local-ranks-filter {a.local_ranks_filter!r}: expected a comma list of local ranks, e.g. 0,1")
    from .. import _knobs

    try:
        preempt = _knobs.get("MINDIO_PREEMPT_SIGNAL", {"MINDIO_PREEMPT_SIGNAL": a.preempt_signal})
        preempt_timeout = a.preempt_timeout if a.preempt_timeout is not None else _knobs.get("MINDIO_PREEMPT_TIMEOUT")
    except ConfigError as exc:
        p.error(str(exc).replace("MINDIO_PREEMPT_SIGNAL=", "--preempt-signal "))
    grace = a.shutdown_timeout
    if grace is None:
        try:
            grace = _knobs.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        except ConfigError as exc:
            p.error(str(exc))

    try:
        return LaunchConfig(
            entrypoint=a.training_script, args=tuple(a.training_script_args), is_module=a.module,
            nproc_per_node=nproc, nnodes=hi, min_nodes=lo, node_rank=node_rank or 0,
            last_call=float(conf.get("last_call_timeout", 30)),
            master_addr=addr, master_port=port, max_restarts=a.max_restarts,
            monitor_interval=a.monitor_interval, rdzv_timeout=timeout, warm_spares=a.warm_spares,
            run_id=run_id, etcd_endpoint=etcd, standby=a.standby, high_availability=strategies,
            recover_timeout=a.recover_timeout, term_grace=float(grace),
            decision_timeout=_knobs.get("MINDIO_DECISION_TIMEOUT"),
            # one outage tolerance for ranks (controller) and nodes (agents): docs/recovery.md
            node_lost_after=max(3.0, _knobs.get("MINDIO_HEARTBEAT_MISSES") * _knobs.get("MINDIO_HEARTBEAT_INTERVAL")),
            role=a.role, local_addr=a.local_addr, dynamic_rank=dynamic,
            is_host=None if is_host is None else is_host.lower() in ("1", "true", "yes"),
            log_dir=a.log_dir, redirects=a.redirects, tee=a.tee, local_ranks_filter=ranks,
            logs_specs=a.logs_specs, duplicate_stdout_filters=tuple(a.duplicate_stdout_filters),
            duplicate_stderr_filters=tuple(a.duplicate_stderr_filters), no_python=a.no_python,
            virtual_local_rank=a.virtual_local_rank,
            signals=tuple(s.strip() for s in a.signals_to_handle.split(",") if s.strip()),
            preempt_signals=preempt, preempt_timeout=float(preempt_timeout),
            # the workers' own handlers (mindio.ttp.processor.preempt) read the same settings
            extra_env={"MINDIO_PREEMPT_SIGNAL": ",".join(preempt) or "none",
                       "MINDIO_PREEMPT_TIMEOUT": repr(float(preempt_timeout))},
        )
    except ConfigError as exc:
        p.error(str(exc))


def main(argv=None) -> None:
    cfg = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # tee'd worker lines reach the console as they come
    # the agent's lines: "[<node>/agent]" ("[-/standby]" until a standby takes a node)
    _logging.set_context(node="-" if cfg.standby or cfg.dynamic_rank else cfg.node_rank,
                         rank="standby" if cfg.standby else "agent")
    _logging.setup()
    from . import tmpdirs

    for prefix in ("mindio-run-", "mindio-relay-"):  # what agents SIGKILLed earlier could not remove
        tmpdirs.sweep(prefix)
    from .agent import Agent

    try:
        code = Agent(cfg).run()
    except ConfigError as exc:  # found at start (interfaces, ports): one line, no traceback
        print(f"mindio-run: error: {exc}", file=sys.stderr)
        code = 1
    # The agent has stopped its workers and spares, closed its files and left the stores: what remains is
    # the interpreter's teardown of torch & co. (1-3 s on a loaded host), which the job's end must not wait for.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

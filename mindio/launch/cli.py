"""``mindio-run``: a torchrun-compatible launcher. See :mod:`mindio.launch.agent` for what it does.

    mindio-run --nproc-per-node 4 train.py --lr 1e-3
    mindio-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 8 train.py
"""
from __future__ import annotations

import argparse
import os
import sys

from .. import _logging
from ..errors import ConfigError
from .agent import Agent, LaunchConfig

__all__ = ["main", "parse_args"]


def _nnodes(text: str) -> int:
    # torchrun accepts MIN:MAX for elastic jobs; mindio-run's node count is fixed (spares use --standby).
    lo, _, hi = text.partition(":")
    if hi and hi != lo:
        raise argparse.ArgumentTypeError(
            f"--nnodes {text}: elastic ranges are not supported; give a fixed count and add spare nodes with --standby"
        )
    return int(lo)


def parse_args(argv=None) -> LaunchConfig:
    p = argparse.ArgumentParser(prog="mindio-run", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--nnodes", type=_nnodes, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29500)
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    p.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="HOST:PORT of node 0's store (overrides --master-addr/--master-port)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static", choices=["static", "c10d"],
                   help="accepted for torchrun compatibility; agents always rendezvous through node 0's store")
    p.add_argument("--rdzv-id", "--rdzv_id", default="mindio")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="", help="comma list; timeout=SECONDS is honoured")
    p.add_argument("--standalone", action="store_true", help="single node on a free local port")
    p.add_argument("--standby", action="store_true",
                   help="offer this node as a spare: it takes over the node rank of a lost node (for the next "
                        "round; with --high-availability in the running round, on the controller's order)")
    p.add_argument("--high-availability", default=os.environ.get("HIGH_AVAILABILITY", ""), metavar="LIST",
                   help="strategies (dump,retry,recover-in-place,recover,...; default: $HIGH_AVAILABILITY): node "
                        "0's agent hosts the controller as rank -1, reports worker deaths to it at once and "
                        "restarts only the ranks it names; empty: no controller in the launcher")
    p.add_argument("--recover-timeout", type=float, default=60.0,
                   help="seconds for a replacement process to join the survivors (recover-in-place/recover)")
    p.add_argument("--warm-spares", type=int, default=1, help="pre-started interpreters kept per node")
    p.add_argument("-m", "--module", action="store_true", help="run the entrypoint as a module (python -m)")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="not supported: mindio-run starts Python training scripts only")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.no_python:
        p.error("--no-python is not supported: mindio-run starts Python scripts (use torchrun for other programs)")
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint:
        addr, _, port_text = a.rdzv_endpoint.rpartition(":")
        if not addr or not port_text.isdigit():
            p.error(f"--rdzv-endpoint {a.rdzv_endpoint!r}: expected HOST:PORT")
        port = int(port_text)
    if a.standalone:
        from .._ports import free_port

        addr, port = "127.0.0.1", free_port()
    timeout = 300.0
    for item in filter(None, a.rdzv_conf.split(",")):
        key, _, value = item.partition("=")
        if key.strip() in ("timeout", "join_timeout"):
            timeout = float(value)
    from .._knobs import _ha_list

    try:
        strategies = _ha_list(a.high_availability)
    except (ValueError, ConfigError) as exc:
        p.error(f"--high-availability {a.high_availability!r}: {exc}")
    try:
        return LaunchConfig(
            entrypoint=a.training_script, args=tuple(a.training_script_args), is_module=a.module,
            nproc_per_node=a.nproc_per_node, nnodes=a.nnodes, node_rank=a.node_rank,
            master_addr=addr, master_port=port, max_restarts=a.max_restarts,
            monitor_interval=a.monitor_interval, rdzv_timeout=timeout, warm_spares=a.warm_spares,
            run_id=a.rdzv_id, standby=a.standby, high_availability=strategies,
            recover_timeout=a.recover_timeout,
        )
    except ConfigError as exc:
        p.error(str(exc))


def main(argv=None) -> None:
    cfg = parse_args(argv)
    _logging.setup(rank="standby" if cfg.standby else f"agent{cfg.node_rank}")
    sys.exit(Agent(cfg).run())


if __name__ == "__main__":
    main()

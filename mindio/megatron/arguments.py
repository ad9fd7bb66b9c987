"""mindio's training-script flags (MindSpeed-LLM names) and the HIGH_AVAILABILITY env var.

    --enable-high-availability        master switch (dump / last-words checkpoint)
    --enable-hbmfault-repair          step retry (UCE); implies high availability
    --enable-worker-reboot            process replacement (ARF); implies high availability
    --enable-elastic-training         shrink/grow DP on faults; implies high availability
    --distributed-optimizer-no-replica  no optimizer replicas (repairs fall back to checkpoints)
    --replica-cnt R                   copies of every optimizer shard (default 2 with HA, else 1)
    --no-dump                         high availability without a last-words checkpoint (no --save needed)

High availability plans a last-words checkpoint (dump) into ``--save``: without ``--save`` it is refused at
start with one line, unless the job asks for no dump (``--no-dump``, or ``HIGH_AVAILABILITY`` without
``dump``): then a fault that retry/recover cannot repair ends the job with exit 76.

``HIGH_AVAILABILITY=dump,retry,recover,elastic-training`` turns the same flags on.
"""

from __future__ import annotations

import argparse

from mindio import _knobs

__all__ = ["add_high_availability_args", "resolve_high_availability", "replica_count", "wants_dump"]

_ENV_TO_FLAG = {
    "dump": "enable_high_availability",
    "retry": "enable_hbmfault_repair",
    "recover": "enable_worker_reboot",
    "recover-in-place": "enable_worker_reboot",
    "elastic-training": "enable_elastic_training",
}


def add_high_availability_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("high availability (mindio)")
    g.add_argument("--enable-high-availability", action="store_true",
                   help="fault tolerance: controller, processors, last-words dump")
    g.add_argument("--enable-hbmfault-repair", action="store_true",
                   help="step-level online repair (retry) from optimizer replicas")
    g.add_argument("--enable-worker-reboot", action="store_true",
                   help="replace a failed process (recover / recover-in-place)")
    g.add_argument("--enable-elastic-training", action="store_true",
                   help="continue with fewer DP replicas when no spare exists")
    g.add_argument("--distributed-optimizer-no-replica", action="store_true",
                   help="keep one copy of each optimizer shard (repair falls back to checkpoints)")
    g.add_argument("--replica-cnt", type=int, default=None,
                   help="copies of each optimizer shard (default: 2 with high availability, "
                        "else 1)")
    g.add_argument("--no-dump", action="store_true",
                   help="high availability without a last-words checkpoint: no --save needed; a fault "
                        "that cannot be repaired in place ends the job (exit 76)")
    return parser


def wants_dump(args: argparse.Namespace) -> bool:
    """Does this high-availability job plan a last-words checkpoint? Yes unless --no-dump, or
    HIGH_AVAILABILITY names strategies without ``dump``."""
    env = _knobs.get("HIGH_AVAILABILITY")
    return args.enable_high_availability and not args.no_dump and (not env or "dump" in env)


def replica_count(args: argparse.Namespace) -> int:
    """Effective copies of each optimizer shard: 1 without a distributed optimizer or with
    --distributed-optimizer-no-replica; else --replica-cnt, or 2 with high availability."""
    if args.distributed_optimizer_no_replica or not args.use_distributed_optimizer:
        return 1
    if args.replica_cnt is not None:
        return args.replica_cnt
    return 2 if args.enable_high_availability else 1


def resolve_high_availability(args: argparse.Namespace) -> argparse.Namespace:
    """Apply HIGH_AVAILABILITY, make sub-features imply the master switch, validate."""
    for item in _knobs.get("HIGH_AVAILABILITY") or ():
        setattr(args, _ENV_TO_FLAG[item], True)
    if args.enable_hbmfault_repair or args.enable_worker_reboot or args.enable_elastic_training:
        args.enable_high_availability = True
    if args.replica_cnt is not None and args.replica_cnt < 1:
        raise SystemExit(f"--replica-cnt must be >= 1, got {args.replica_cnt}")
    if args.enable_high_availability and not args.use_distributed_optimizer:
        raise SystemExit("--enable-high-availability needs --use-distributed-optimizer "
                         "(the replica optimizer is a distributed optimizer)")
    if "save" in vars(args) and not args.save and wants_dump(args):
        raise SystemExit("--enable-high-availability needs --save DIR: the last-words checkpoint of a fault "
                         "is written there; give --save, or --no-dump to run without one (a fault that "
                         "cannot be repaired in place then ends the job with exit 76)")
    return args

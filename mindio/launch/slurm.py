"""``mindio-run`` inside a Slurm job step: the node count, this node's rank and node 0's endpoint from
``SLURM_*``, so one line runs it on every node of an allocation (docs/slurm.md)::

    srun --ntasks-per-node=1 mindio-run --nproc-per-node 8 --high-availability ... train.py

Inside an ``srun`` step (``SLURM_STEP_ID`` set, one task per node), flags that are not given (on the
command line or as ``PET_*``) are filled in; the command line always wins:

- ``--nnodes``: the number of nodes of the step (``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``);
- ``--node-rank``: this node's index in the step's node list (``SLURMD_NODENAME`` in
  ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``, expanded as ``scontrol show hostnames`` does; else
  ``SLURM_NODEID``). A node whose index is ``--nnodes`` or more becomes a ``--standby`` agent;
- ``--rdzv-endpoint``: the first node (its ``NodeAddr`` as ``scontrol show node`` says, else its name)
  on port ``--master-port``, else 29400 + job id mod 1000 (two jobs sharing a node do not collide);
  with ``--rdzv-backend etcd`` the endpoint is the etcd server: ``--master-addr`` is filled instead.

``--standalone`` and a batch script's own shell (no step) are left alone.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["expand_nodelist", "Allocation", "allocation", "parse_args"]

# flags this module fills when the user did not give them: argparse dest -> torchrun's PET_* variable
_FILLED = {"nnodes": "PET_NNODES", "node_rank": "PET_NODE_RANK", "rdzv_endpoint": "PET_RDZV_ENDPOINT",
           "master_addr": "PET_MASTER_ADDR", "master_port": "PET_MASTER_PORT"}
_NODEADDR_TIMEOUT = 10.0  # seconds for `scontrol show node` (asks slurmctld)


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError("'[' without ']'")
    return out + [cur]


def _range(item: str) -> list[str]:
    lo, sep, hi = item.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise ValueError(f"bad range {item!r}")
    if not sep:
        return [lo]
    if int(hi) < int(lo):
        raise ValueError(f"bad range {item!r} (end before start)")
    width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
    return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]


def _expand_one(name: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", name)
    if not m:
        return [name]
    head, body, tail = m.groups()
    values = [v for item in body.split(",") for v in _range(item.strip())]
    return [head + v + t for v in values for t in _expand_one(tail)]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[1-3,5]``, ``gpu[01-02]-ib,login``, ``r[1-2]n[1-2]``) as
    the node names, in the order ``scontrol show hostnames`` prints them. ValueError when malformed."""
    text = text.strip()
    if not text:
        raise ValueError("empty node list")
    names = [n for part in _split_top(text) if part.strip() for n in _expand_one(part.strip())]
    if not names or any(not n or "[" in n or "]" in n for n in names):
        raise ValueError(f"malformed node list {text!r}")
    return names


@dataclass(frozen=True)
class Allocation:
    """What a Slurm step says about this node: the step's nodes and this node's index among them."""
    job_id: str
    nodes: tuple
    index: int

    def port(self) -> int:
        return 29400 + (int(self.job_id) % 1000 if self.job_id.isdigit() else 0)


def allocation(environ=None) -> Allocation | None:
    """This step's allocation, or None outside a Slurm step (no ``SLURM_STEP_ID``: the batch script's
    own shell, a login node). ValueError for a step this cannot run in (several tasks on a node)."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_STEP_ID") is None or env.get("SLURM_JOB_ID") is None:
        return None
    text = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    try:
        nodes = expand_nodelist(text)
    except ValueError as exc:
        raise ValueError(f"SLURM_STEP_NODELIST/SLURM_JOB_NODELIST={text!r}: {exc}") from None
    tasks, count = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
    if count and count.isdigit() and int(count) != len(nodes):
        raise ValueError(f"the node list {text!r} names {len(nodes)} nodes, SLURM_STEP_NUM_NODES says {count}")
    if tasks and tasks.isdigit() and int(tasks) != len(nodes):
        raise ValueError(f"the step runs {tasks} tasks on {len(nodes)} nodes: run one mindio-run per node "
                         f"(srun --ntasks-per-node=1); it starts the node's workers itself (--nproc-per-node)")
    name = env.get("SLURMD_NODENAME", "")
    if name in nodes:
        index = nodes.index(name)
    else:
        node_id = env.get("SLURM_NODEID", "")
        if not node_id.isdigit() or int(node_id) >= len(nodes):
            raise ValueError(f"cannot tell which node of {text!r} this is (SLURMD_NODENAME={name!r}, "
                             f"SLURM_NODEID={node_id!r})")
        index = int(node_id)
    return Allocation(job_id=env["SLURM_JOB_ID"], nodes=tuple(nodes), index=index)


def node_addr(name: str) -> str:
    """The address Slurm reaches node ``name`` by (``NodeAddr``), else the name itself."""
    if shutil.which("scontrol") is None:
        return name
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True,
                             timeout=_NODEADDR_TIMEOUT).stdout
    except subprocess.TimeoutExpired:
        print(f"mindio-run: slurm: `scontrol show node {name}` did not answer in {_NODEADDR_TIMEOUT:.0f} s; "
              f"using the node name as node 0's address", file=sys.stderr)
        return name
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else name


def _not_given(parser) -> None:
    """Defaults of the flags this module fills set to None, where no PET_* variable gives them, so that
    after parsing None means 'not given'."""
    for action in parser._actions:
        if action.dest in _FILLED and _FILLED[action.dest] not in os.environ:
            action.default = None


def parse_args(parser, argv=None):
    """``parser.parse_args(argv)`` with the flags a Slurm step implies filled in (see the module doc)."""
    if os.environ.get("SLURM_STEP_ID") is None or "--standalone" in (argv if argv is not None else sys.argv[1:]):
        return parser.parse_args(argv)
    defaults = {a.dest: a.default for a in parser._actions if a.dest in _FILLED}
    _not_given(parser)
    try:
        a = parser.parse_args(argv)
    finally:
        for action in parser._actions:
            if action.dest in defaults:
                action.default = defaults[action.dest]
    if a.standalone:
        return parser.parse_args(argv)
    missing = a.nnodes is None or (a.node_rank is None and not a.standby) or \
        (a.master_addr is None if a.rdzv_backend in ("etcd", "etcd-v2") else not a.rdzv_endpoint and a.master_addr is None)
    if not missing:  # every flag given: the step's shape is the user's business
        for dest, value in defaults.items():
            if getattr(a, dest) is None:
                setattr(a, dest, value)
        return a
    try:
        alloc = allocation()
    except ValueError as exc:
        parser.error(f"slurm: {exc}")
    if alloc is None:
        return parser.parse_args(argv)
    filled = []
    if a.nnodes is None:
        a.nnodes = str(len(alloc.nodes))
        filled.append(f"--nnodes {a.nnodes}")
    try:
        nnodes = int(a.nnodes.split(":")[-1])
    except ValueError:
        nnodes = 0  # cli.py refuses it with its own message
    if a.node_rank is None and not a.standby:
        if alloc.index >= nnodes > 0:
            a.standby = True
            filled.append("--standby")
        else:
            a.node_rank = alloc.index
            filled.append(f"--node-rank {a.node_rank}")
    port = a.master_port if a.master_port is not None else alloc.port()
    if a.rdzv_backend in ("etcd", "etcd-v2"):
        if a.master_addr is None:
            a.master_addr = node_addr(alloc.nodes[0])
            filled.append(f"--master-addr {a.master_addr}")
    elif not a.rdzv_endpoint and a.master_addr is None:
        a.rdzv_endpoint = f"{node_addr(alloc.nodes[0])}:{port}"
        filled.append(f"--rdzv-endpoint {a.rdzv_endpoint}")
    for dest, value in defaults.items():
        if getattr(a, dest) is None:
            setattr(a, dest, value)
    if filled:
        print(f"mindio-run: slurm job {alloc.job_id}: node {alloc.nodes[alloc.index]} ({alloc.index + 1} of "
              f"{len(alloc.nodes)}): {' '.join(filled)}", file=sys.stderr)
    return a

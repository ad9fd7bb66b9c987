"""Fault injection for drills and tests: ``--inject "kill:rank=3,step=7; uce:rank=1,step=9"``.

A spec is one or more faults separated by ``;`` or ``,`` (a token with a ``:`` starts a new fault)::

    KIND:rank=R,step=S[,seconds=T]      KIND in raise, uce, net, hang, kill
    slow:rank=R,step=S,factor=F
    kill-node:node=N,step=S             (or kill-node:rank=R,step=S: the node that hosts rank R)
    flip:rank=R,step=S[,state=param|exp_avg|exp_avg_sq][,bit=B]

=========  =====================================================================================
kind       what rank R does while computing step S
=========  =====================================================================================
raise      ``RuntimeError("injected fault ...")``: an unknown error (dump / recover)
uce        ``corrupt()`` if given (destroy this rank's optimizer shard, as the memory error did),
           then ``RuntimeError("UCE ERROR ...")``: an uncorrectable memory error (retry + repair)
net        ``RuntimeError("HCCL OP RETRY FAILED ...")``: a network-class error (retry, no repair)
hang       sleeps ``seconds`` (default 3600) without progress, outside any collective
hold       as hang, but ends as soon as the file ``<MINDIO_DRILL_DIR>/release`` (or ``release-S``, for this
           hold only) exists: a step held from outside (a test holds training until a hot switch's backups
           registered)
kill       SIGKILL of its own process (recover-in-place)
slow       from step S on, every step: burns (F-1) x the CPU time its main thread used in the step before
           (a busy loop), a straggler whose peers wait for it (controller/slow.py names it; F > 1)
flip       ``flip(state, bit)`` if given: flips mantissa bit B (default 0, the lowest) of one fp32 element
           of this rank's optimizer shard -- its master weights (``state=param``, default) or an Adam
           moment -- a silent corruption (no error; a plausible value, never a NaN) that only the
           replica cross-check (MINDIO_CROSSCHECK_STEPS) finds
kill-node  SIGKILL of its node's launcher agent (mindio-run: every worker of the node dies with
           it through PR_SET_PDEATHSIG), then of itself; fired by local rank 0 of node N
=========  =====================================================================================

**Once per job.** A fault fires at most once: not again when ``train()`` is re-entered in the same
process (retry), not in a relaunched job (``TORCHELASTIC_RESTART_COUNT`` > 0), and -- when
``MINDIO_DRILL_DIR`` names a directory shared by the job's processes -- not in a replacement
process either: the firing rank creates ``<dir>/fired-<i>-<kind>`` (O_EXCL) *before* firing.
Set MINDIO_DRILL_DIR for strategies that replace processes (recover-in-place, recover); without it a
replacement process (``MINDIO_REBOOT_GEN`` set by mindio-run) fires nothing.

Each firing prints ``[rank R] injecting KIND at step S`` and records a ``fault_injected`` event
(MINDIO_EVENT_LOG) just before the fault, so tools can time the recovery from it.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from . import _knobs, _logging
from .errors import ConfigError

__all__ = ["Fault", "parse", "Drill", "inject", "MESSAGES"]

KINDS = ("raise", "uce", "net", "hang", "hold", "kill", "kill-node", "flip", "slow")
FLIP_STATES = ("param", "exp_avg", "exp_avg_sq")
MESSAGES = {
    "raise": "injected fault at step {step}",
    "uce": "UCE ERROR: injected uncorrectable memory error at step {step}",
    "net": "HCCL OP RETRY FAILED: injected network error at step {step}",
}
_KEYS = {"rank", "step", "node", "seconds", "state", "bit", "factor"}
_USAGE = ("use KIND:rank=R,step=S (KIND: raise, uce, net, hang, hold, kill, flip), slow:rank=R,step=S,factor=F "
          "or kill-node:node=N,step=S; "
          "separate several faults with ';'")


@dataclass(frozen=True)
class Fault:
    index: int  # position in the spec: names the once-per-job marker
    kind: str
    step: int
    rank: Optional[int] = None
    node: Optional[int] = None
    seconds: float = 3600.0
    state: str = "param"  # flip: which part of the shard
    bit: int = 0  # flip: which mantissa bit
    factor: float = 2.0  # slow: each step takes this many times its compute

    def targets(self, rank: int, node: Optional[int], local_rank: int) -> bool:
        if self.kind == "kill-node" and self.node is not None:
            return node == self.node and local_rank == 0
        return rank == self.rank


def parse(spec: str) -> List[Fault]:
    """Parse a spec; raise :class:`ConfigError` saying what is wrong and the accepted syntax."""
    if not spec or not spec.strip():
        raise ConfigError(f"--inject: empty fault spec; {_USAGE}")
    groups: List[List[str]] = []
    for token in (t.strip() for t in re.split(r"[;,]", spec)):
        if not token:
            continue
        if ":" in token:
            groups.append([token])
        elif not groups:
            raise ConfigError(f"--inject {spec!r}: {token!r} comes before any KIND:; {_USAGE}")
        else:
            groups[-1].append(token)
    faults = []
    for index, (head, *rest) in enumerate(groups):
        kind, _, first = head.partition(":")
        kind = kind.strip().lower()
        if kind not in KINDS:
            raise ConfigError(f"--inject {spec!r}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        fields: Dict[str, str] = {}
        for kv in ([first] if first.strip() else []) + rest:
            key, eq, value = (s.strip() for s in kv.partition("="))
            if not eq or key not in _KEYS:
                raise ConfigError(f"--inject {spec!r}: bad field {kv!r} in {kind}; fields: rank=, step=, "
                                  f"node= (kill-node), seconds= (hang), state=, bit= (flip), factor= (slow)")
            if key in fields:
                raise ConfigError(f"--inject {spec!r}: {key}= given twice for {kind}")
            fields[key] = value
        state = fields.pop("state", None)
        if state is not None and (kind != "flip" or state not in FLIP_STATES):
            raise ConfigError(f"--inject {spec!r}: state= is only for flip, one of {', '.join(FLIP_STATES)}")
        try:
            values = {k: (float(v) if k in ("seconds", "factor") else int(v)) for k, v in fields.items()}
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: {fields} has a non-number value; {_USAGE}") from None
        if "step" not in values or values["step"] < 1:
            raise ConfigError(f"--inject {spec!r}: {kind} needs step=S with S >= 1 (the step "
                              f"being computed when the fault fires)")
        if kind == "kill-node":
            if ("node" in values) == ("rank" in values):
                raise ConfigError(f"--inject {spec!r}: kill-node needs exactly one of node=N or rank=R")
        elif "node" in values:
            raise ConfigError(f"--inject {spec!r}: node= is only for kill-node; use rank=R for {kind}")
        elif "rank" not in values:
            raise ConfigError(f"--inject {spec!r}: {kind} needs rank=R")
        if values.get("rank", 0) < 0 or values.get("node", 0) < 0 or values.get("seconds", 1) <= 0:
            raise ConfigError(f"--inject {spec!r}: rank, node must be >= 0 and seconds > 0")
        if "seconds" in values and kind not in ("hang", "hold"):
            raise ConfigError(f"--inject {spec!r}: seconds= is only for hang and hold")
        if ("factor" in values) != (kind == "slow") or values.get("factor", 2.0) <= 1:
            raise ConfigError(f"--inject {spec!r}: factor=F (> 1) is for slow only, and slow needs it")
        if "bit" in values and (kind != "flip" or not 0 <= values["bit"] < 23):
            raise ConfigError(f"--inject {spec!r}: bit= is only for flip, a mantissa bit of fp32 (0..22)")
        if state is not None:
            values["state"] = state
        faults.append(Fault(index=index, kind=kind, **{k: values[k] for k in values}))
    return faults


class Drill:
    """The faults of one spec for this process; call :meth:`maybe_fire` once per step."""

    def __init__(self, spec: str, environ=None):
        env = os.environ if environ is None else environ
        self.faults = parse(spec)
        self._fired: set = set()
        self._slowing: List[Fault] = []  # slow faults fired in this process: they act every step after
        self._cpu = time.thread_time()  # the main thread's CPU clock at the end of the last call
        self._restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        # a replacement process (recover-in-place / recover) re-runs the step its predecessor faulted at:
        # without a shared MINDIO_DRILL_DIR it cannot know what fired, so it fires nothing (no fault loop)
        self._reboot = bool(env.get("MINDIO_REBOOT_GEN"))
        self._dir = _knobs.get("MINDIO_DRILL_DIR", env) or None
        node = env.get("MINDIO_NODE_RANK", env.get("GROUP_RANK"))
        self._node = int(node) if node not in (None, "") else None
        self._local_rank = int(env.get("LOCAL_RANK", "0") or 0)
        agent = env.get("MINDIO_AGENT_PID")
        self._agent_pid = int(agent) if agent else None
        if self._dir is not None and not os.path.isdir(self._dir):
            raise ConfigError(f"MINDIO_DRILL_DIR={self._dir!r} is not a directory; create it first")

    def maybe_fire(self, step: int, rank: int, corrupt: Optional[Callable[[], object]] = None,
                   flip: Optional[Callable[[str, int], str]] = None) -> None:
        """Fire every fault aimed at ``rank`` and ``step`` that has not fired in this job.
        ``corrupt`` (framework-specific) destroys this rank's state before a ``uce`` error; ``flip(state,
        bit)`` flips one bit of its optimizer shard and says what it flipped (``flip``)."""
        if self._restart > 0 or (self._reboot and self._dir is None):
            return
        for f in self._slowing:  # the step before used (now - self._cpu) s of CPU: take F-1 times that more
            end = time.thread_time() + (f.factor - 1) * max(0.0, time.thread_time() - self._cpu)
            while time.thread_time() < end:
                pass
        for f in self.faults:
            if f.step == step and f.index not in self._fired and f.targets(rank, self._node, self._local_rank):
                self._fired.add(f.index)
                if self._claim(f):
                    self._fire(f, step, rank, corrupt, flip)
        self._cpu = time.thread_time()

    def _claim(self, f: Fault) -> bool:
        if self._dir is None:
            return True
        path = os.path.join(self._dir, f"fired-{f.index}-{f.kind}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.write(fd, f"{os.getpid()} {time.time()}\n".encode())
        os.fsync(fd)
        os.close(fd)
        return True

    def _fire(self, f: Fault, step: int, rank: int, corrupt=None, flip=None) -> None:
        if f.kind == "flip":
            if flip is None:
                raise ConfigError("--inject flip: this training loop passes no flip function to mindio.drill.inject")
            what = flip(f.state, f.bit)
            print(f"[rank {rank}] injecting flip at step {step}: {what}", flush=True)
            _logging.event("fault_injected", fault=f.kind, step=step, target_rank=rank, node=self._node,
                           flipped=what)
            return
        print(f"[rank {rank}] injecting {f.kind} at step {step}", flush=True)
        _logging.event("fault_injected", fault=f.kind, step=step, target_rank=rank, node=self._node)
        if f.kind == "slow":
            self._slowing.append(f)
            return
        if f.kind == "uce" and corrupt is not None:
            corrupt()
        if f.kind in MESSAGES:
            raise RuntimeError(MESSAGES[f.kind].format(step=step))
        if f.kind in ("hang", "hold"):
            deadline = time.monotonic() + f.seconds
            release = [os.path.join(self._dir or ".", n) for n in ("release", f"release-{step}")] \
                if f.kind == "hold" else []
            while time.monotonic() < deadline and not any(os.path.exists(r) for r in release):
                time.sleep(min(0.01 if release else 1.0, max(0.0, deadline - time.monotonic())))
            return
        if f.kind == "kill-node":
            agent = self._agent_pid
            if agent is None:
                sys.stderr.write("--inject kill-node: MINDIO_AGENT_PID is not set (not under "
                                 "mindio-run); killing the parent process as the node's agent\n")
                agent = os.getppid()
            sys.stderr.flush()
            os.kill(agent, signal.SIGKILL)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


_drills: Dict[str, Drill] = {}


def inject(spec: Optional[str], step: int, rank: int, corrupt: Optional[Callable[[], object]] = None,
           flip: Optional[Callable[[str, int], str]] = None) -> None:
    """One-line use from a training loop: ``inject(args.inject, iteration + 1, dist.get_rank())``;
    ``corrupt``, ``flip``: see :meth:`Drill.maybe_fire`."""
    if not spec:
        return
    drill = _drills.get(spec)
    if drill is None:
        drill = _drills[spec] = Drill(spec)
    drill.maybe_fire(step, rank, corrupt, flip)

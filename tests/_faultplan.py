"""The fault plan of the toy jobs (tests/ttp/_toy_train.py, tests/recovery/_recover_toy.py): one object
instead of fault strings and ``TOY_*`` environment variables.

A test builds a :class:`FaultPlan` and passes ``plan.argv()`` (``--plan <json>``) on the toy's command
line; the toy reads it back with :meth:`FaultPlan.loads` (its argparse ``type``), in one place for both
toys. Under mindio-run the argument reaches every worker, a replacement or a backup too.

* ``faults``: :class:`Fault` (kind, rank, step) -- fired once per process (the recover toy: once per
  job) on that rank at the start of that iteration, or inside its optimizer update window for
  ``raise-uce-update`` / ``kill-update``. Kinds: ``raise-uce`` (the shard is overwritten with NaN
  first), ``raise-uce-update`` (half written), ``raise-net``, ``raise-unknown`` (a generic exception
  outside the update window: retried when retry is on), ``raise-unknown-update`` (one inside the window),
  ``raise-always`` (a generic exception every time its step runs, in every process: a bug), ``kill``,
  ``kill-update`` (SIGKILL), ``hang``, ``stop`` (SIGSTOP), ``freeze`` (SIGSTOP, SIGCONT ``freeze_s``
  s later); the recover toy adds ``hold`` (wait for ``<out>/release``), ``kill-node`` and
  ``stop-node`` (rank R's launcher agent with its workers).
* ``fenced_late``: ranks that reach their fence of iteration ``fence_step`` only once the controller's
  stop reached them (a stop that catches the ranks on both sides of their fence, deterministically).
* ``fail_repair``: the repair source's repair handler ``raise``\\ s or ``kill``\\ s itself (a second fault
  during the recovery).
* ``fail_save``: ranks whose save handler (the dump's ``save``) raises, as a rank that cannot write holds
  no trained state to write (mindio.megatron refuses on a replacement process or a UCE rank) or has a
  failing disk: the controller must take another holder of the shard.
* ``replacement_fails``: a replacement process (``tft_is_reboot_node()``; the recover toy) exits at
  ``start`` (before its init_process_group) or once ``joined`` (right after it).
* the toy's registration: ``enable_uce`` (False: the processor refuses step retry), ``enable_arf``
  (worker reboot), ``declared_replicas`` (how many copies of each shard the ranks declare to mindio;
  None: the toy's 2).

:meth:`FaultPlan.sent` names the ranks the plan kills (tests/_exits.py: a death by a signal the test
did not cause fails the test).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["Fault", "FaultPlan"]

# faults after which the rank dies by SIGKILL: killed by the fault itself, or by its own processor on
# the controller's order (hang), or with its node's agent (kill-node: its workers get PDEATHSIG), or
# stopped (stop: SIGSTOP, then SIGKILLed by the agent that replaces it or ends the job); tests/_exits.py
# reads the same kinds in an example's --inject
KILLING = ("kill", "kill-update", "kill-update-alone", "hang", "kill-node", "stop")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple = ()
    fenced_late: tuple = ()
    fence_step: int = -1
    freeze_s: float = 0.0
    fail_repair: str = ""         # "", "raise", "kill"
    fail_save: tuple = ()         # ranks whose save handler raises
    replacement_fails: str = ""   # "", "start", "joined"
    enable_uce: bool = True
    enable_arf: bool = False
    declared_replicas: int | None = None

    @classmethod
    def of(cls, *faults: tuple, **settings) -> "FaultPlan":
        """``FaultPlan.of(("kill", 1, 7), ("hang", 2, 7), fail_repair="raise")``."""
        return cls(faults=tuple(Fault(*f) for f in faults), **settings)

    def argv(self) -> list:
        """The toy's command-line arguments that carry this plan."""
        return ["--plan", self.dumps()]

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "FaultPlan":
        """(the toys) The plan of ``--plan``; an unknown key is an error, not ignored."""
        d = json.loads(text or "{}")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown keys in the fault plan: {sorted(unknown)}")
        d["faults"] = tuple(Fault(**f) if isinstance(f, dict) else Fault(*f) for f in d.get("faults", ()))
        d["fenced_late"] = tuple(d.get("fenced_late", ()))
        d["fail_save"] = tuple(d.get("fail_save", ()))
        return cls(**d)

    def tuples(self) -> list:
        """(the toys) Every fault as (kind, rank, step), in the plan's order."""
        return [(f.kind, f.rank, f.step) for f in self.faults]

    def sent(self, also: dict | None = None, per_node: int | None = None) -> dict:
        """rank -> {"SIGKILL"} for every rank a fault of the plan kills (``kill-node``: every rank of
        that node, ``per_node`` ranks a node), plus ``also`` ({rank: signal name})."""
        sent: dict = {r: {s} if isinstance(s, str) else set(s) for r, s in (also or {}).items()}
        for f in self.faults:
            if f.kind not in KILLING:
                continue
            if f.kind == "kill-node" and per_node:
                n = f.rank // per_node
                ranks = range(n * per_node, (n + 1) * per_node)
            else:
                ranks = [f.rank]
            for r in ranks:
                sent.setdefault(r, set()).add("SIGKILL")
        return sent

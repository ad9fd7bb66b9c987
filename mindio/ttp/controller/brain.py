"""The built-in cluster brain: which strategies, in what order, for one incident (no I/O but the table file).

A user without a cluster scheduler gets every strategy from here; an external decider (the reference's
MindCluster, through ``tft_register_mindx_callback``) may still choose among the list this returns.

1. **Classify** each faulty rank: its fault key is the ReportState name of its report (``RS_UCE``,
   ``RS_HCCL_FAILED``, ``RS_UCE_CORRUPTED``, ``RS_UNKNOWN``, ...) or ``DEAD`` (process lost, killed as
   hung). ``patterns`` (substring of the report message -> level, first match wins) come first, then
   ``faults`` (key -> level). A key the table does not name gets the most severe level.
2. **Escalate** like faultCustomization.json: ``frequency`` rules (the same rank had a matching fault
   ``times`` times within ``time_window`` s, this one included) and ``duration`` rules (the fault was
   first seen at least ``timeout`` s before the decision) raise the rank's level; the most severe of the
   base level and every matching rule wins; the incident takes the most severe level of its ranks.
3. **Order**: the level's ``strategies`` ∩ the job's ``recover-strategy`` list (the table's
   ``recover_strategy``, else HIGH_AVAILABILITY / the init flags) ∩ what is possible now
   (:func:`mindio.ttp.controller.policy.feasible_strategies`), in the fallback order retry -> recover-in-place ->
   recover -> elastic-training (downgrade) -> dump -> exit. Strategies this build cannot run yet are
   skipped with a log line. ``exit`` always closes the list: a job can always be stopped.

Table format: ``fault_table.json`` next to this module is the default; ``MINDIO_FAULT_TABLE`` (a JSON
file) or :func:`load_table` with a dict overlays it section by section (``levels`` by level name, every
other section replaced whole). Unknown keys and invalid values raise :class:`mindio.errors.ConfigError`
naming the key or value and what is allowed.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ... import _knobs
from ...errors import ConfigError
from ...vocab import HA_STRATEGIES
from .._enums import ReportState, ResultCode

__all__ = ["STRATEGIES", "FAULT_KEYS", "DEFAULT_TABLE_PATH", "Level", "Rule", "FaultTable", "RankFault",
           "Verdict", "load_table", "parse_table", "fault_key", "order_strategies", "result_code", "Brain"]

_log = logging.getLogger("mindio.ttp.brain")
DEFAULT_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_table.json")
STRATEGIES = HA_STRATEGIES  # fallback order
_POLICY_NAME = {"elastic-training": "downgrade"}       # policy.feasible_strategies says "downgrade"
_NOT_FAULTS = {"RS_NORMAL", "RS_INIT_FINISH", "RS_PREREPAIR_FINISH", "RS_STEP_FINISH"}
FAULT_KEYS = tuple(s.name for s in ReportState if s.name not in _NOT_FAULTS) + ("DEAD",)
_TOP = {"levels", "faults", "patterns", "frequency", "duration", "recover_strategy"}


@dataclass(frozen=True)
class Level:
    name: str
    severity: int
    strategies: tuple


@dataclass(frozen=True)
class Rule:
    """An escalation: ``faults`` keys ("*" = any), then either a frequency (time_window, times) or a
    duration (timeout) condition, and the level it raises to."""
    faults: frozenset
    level: str
    time_window: float = 0.0
    times: int = 0
    timeout: float = 0.0

    def covers(self, key: str) -> bool:
        return "*" in self.faults or key in self.faults


@dataclass(frozen=True)
class FaultTable:
    levels: Mapping[str, Level]
    faults: Mapping[str, str]
    patterns: tuple = ()              # ((substring, level), ...)
    frequency: tuple = ()             # (Rule, ...)
    duration: tuple = ()
    recover_strategy: tuple | None = None

    def severest(self) -> str:
        return max(self.levels.values(), key=lambda lv: lv.severity).name


def _fail(where: str, msg: str):
    raise ConfigError(f"fault table ({where}): {msg}")


def _keys(obj, allowed: set, where: str, path: str) -> None:
    if not isinstance(obj, dict):
        _fail(where, f"{path} must be a JSON object, got {type(obj).__name__}")
    bad = sorted(set(obj) - allowed)
    if bad:
        _fail(where, f"unknown key {bad[0]!r} in {path}; allowed: {', '.join(sorted(allowed))}")


def _number(obj: dict, key: str, lo: float, hi: float, where: str, path: str, integer: bool = False):
    if key not in obj:
        _fail(where, f"{path} needs {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)) \
            or not lo <= v <= hi:
        _fail(where, f"{path}.{key} = {v!r} is not valid; allowed: {'an integer' if integer else 'a number'} "
                     f"in [{lo}, {hi}]")
    return v


def _strategies(value, where: str, path: str) -> tuple:
    if not isinstance(value, list) or not value:
        _fail(where, f"{path} must be a non-empty list of strategies ({', '.join(STRATEGIES)})")
    for s in value:
        if s not in STRATEGIES:
            _fail(where, f"{path}: unknown strategy {s!r}; allowed: {', '.join(STRATEGIES)}")
    return tuple(s for s in STRATEGIES if s in value)


def parse_table(data: Mapping, base: FaultTable | None = None, where: str = "dict") -> FaultTable:
    """Validate ``data`` and overlay it on ``base`` (``levels`` merged by name, other sections replaced)."""
    _keys(data, _TOP, where, "the table")
    levels = dict(base.levels) if base else {}
    for name, spec in (data.get("levels") or {}).items():
        _keys(spec, {"severity", "strategies"}, where, f"levels.{name}")
        sev = _number(spec, "severity", 0, 1000, where, f"levels.{name}", integer=True)
        levels[name] = Level(name, sev, _strategies(spec.get("strategies"), where, f"levels.{name}.strategies"))
    if not levels:
        _fail(where, "no levels defined")

    def level(value, path):
        if value not in levels:
            _fail(where, f"{path} = {value!r} is not a defined level; allowed: {', '.join(sorted(levels))}")
        return value

    def fault_list(value, path):
        if not isinstance(value, list) or not value:
            _fail(where, f"{path} must be a non-empty list of fault keys")
        for k in value:
            if k != "*" and k not in FAULT_KEYS:
                _fail(where, f"{path}: unknown fault key {k!r}; allowed: *, {', '.join(FAULT_KEYS)}")
        return frozenset(value)

    faults = dict(base.faults) if base and "faults" not in data else {}
    if "faults" in data:
        _keys(data["faults"], set(FAULT_KEYS), where, "faults")
    for k, v in (data.get("faults") or {}).items():
        faults[k] = level(v, f"faults.{k}")
    patterns = base.patterns if base and "patterns" not in data else ()
    if "patterns" in data:
        if not isinstance(data["patterns"], list):
            _fail(where, "patterns must be a list of {\"pattern\", \"level\"} objects")
        out = []
        for i, p in enumerate(data["patterns"]):
            _keys(p, {"pattern", "level"}, where, f"patterns[{i}]")
            if not isinstance(p.get("pattern"), str) or not p["pattern"]:
                _fail(where, f"patterns[{i}].pattern must be a non-empty string")
            out.append((p["pattern"], level(p.get("level"), f"patterns[{i}].level")))
        patterns = tuple(out)
    rules = {}
    for section, spec_keys in (("frequency", {"faults", "time_window", "times", "level"}),
                               ("duration", {"faults", "timeout", "level"})):
        if section not in data:
            rules[section] = getattr(base, section) if base else ()
            continue
        if not isinstance(data[section], list):
            _fail(where, f"{section} must be a list of rules")
        out = []
        for i, r in enumerate(data[section]):
            path = f"{section}[{i}]"
            _keys(r, spec_keys, where, path)
            fl, lv = fault_list(r.get("faults"), f"{path}.faults"), level(r.get("level"), f"{path}.level")
            if section == "frequency":
                out.append(Rule(fl, lv, time_window=_number(r, "time_window", 1, 864000, where, path),
                                times=_number(r, "times", 1, 100, where, path, integer=True)))
            else:
                out.append(Rule(fl, lv, timeout=_number(r, "timeout", 0, 600, where, path)))
        rules[section] = tuple(out)
    recover = base.recover_strategy if base and "recover_strategy" not in data else None
    if data.get("recover_strategy") is not None:
        recover = _strategies(data["recover_strategy"], where, "recover_strategy")
    return FaultTable(levels, faults, patterns, rules["frequency"], rules["duration"], recover)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ConfigError(f"fault table {path}: cannot read it ({exc.strerror}); check the path") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"fault table {path}: not valid JSON ({exc})") from None


def load_table(source: str | Mapping | None = None) -> FaultTable:
    """The default table overlaid with ``source`` (a dict or a JSON file path); with no source, with the
    file named by MINDIO_FAULT_TABLE, if set."""
    table = parse_table(_read(DEFAULT_TABLE_PATH), where=DEFAULT_TABLE_PATH)
    if source is None:
        source = _knobs.get("MINDIO_FAULT_TABLE") or None
    if source is None:
        return table
    if isinstance(source, Mapping):
        return parse_table(source, table)
    return parse_table(_read(str(source)), table, where=str(source))


def fault_key(state: ReportState | None, alive: bool = True) -> str:
    """The table key of one faulty rank: DEAD for a lost process, else its report's state name."""
    if not alive:
        return "DEAD"
    return ReportState(state).name if state is not None else "RS_UNKNOWN"


@dataclass(frozen=True)
class RankFault:
    rank: int
    key: str                 # fault_key()
    message: str = ""
    first_seen: float | None = None  # clock of the Brain (time.monotonic by default); None: now


@dataclass(frozen=True)
class Verdict:
    level: str | None                       # None: no fault (a graceful dump or pause)
    allowed: tuple                          # strategies the level allows, fallback order
    ranks: Mapping[int, tuple] = field(default_factory=dict)   # rank -> (level, [reasons])


def order_strategies(allowed: Iterable[str], feasible: Iterable[str], implemented: Iterable[str] = STRATEGIES):
    """(order, skipped): ``feasible`` (policy names, already limited to the enabled strategies) that the
    level allows, in fallback order; ``skipped`` are allowed and feasible but not implemented. Always ends
    with "exit"."""
    allowed = {_POLICY_NAME.get(s, s) for s in allowed}
    implemented = {_POLICY_NAME.get(s, s) for s in implemented}
    feasible = list(feasible)
    order = [_POLICY_NAME.get(s, s) for s in STRATEGIES if _POLICY_NAME.get(s, s) in feasible]
    order = [s for s in order if s in allowed and s != "exit"]
    skipped = [s for s in order if s not in implemented]
    return [s for s in order if s in implemented] + ["exit"], skipped


def result_code(remaining: Iterable[str]) -> ResultCode:
    """report_result code after a strategy failed, from what is still possible (reference table 4):
    405 another recovery is possible, 406 only dump or exit, 499 only exit."""
    rest = set(remaining) - {"exit"}
    if rest - {"dump"}:
        return ResultCode.RETRY_FAILED
    return ResultCode.DUMP_OR_EXIT if "dump" in rest else ResultCode.EXIT_ONLY


class Brain:
    """Classification + escalation with a per-rank fault history (kept across incidents of one job)."""

    def __init__(self, table: FaultTable | None = None, clock=time.monotonic):
        self.table = table or load_table()
        self.clock = clock
        self.history: dict[int, collections.deque] = {}

    def enabled(self, job_enabled: Iterable[str]) -> set:
        """The job's recover-strategy list: the table's, else HIGH_AVAILABILITY / the init flags."""
        return set(self.table.recover_strategy) if self.table.recover_strategy is not None else set(job_enabled)

    def base_level(self, fault: RankFault) -> tuple[str, str]:
        for pattern, level in self.table.patterns:
            if pattern in fault.message:
                return level, f"pattern {pattern!r}"
        if fault.key in self.table.faults:
            return self.table.faults[fault.key], f"fault {fault.key}"
        return self.table.severest(), f"fault {fault.key} not in the table"

    def judge(self, faults: Iterable[RankFault], now: float | None = None) -> Verdict:
        """Level per rank and for the incident; records each fault in the rank's history."""
        now = self.clock() if now is None else now
        sev = {name: lv.severity for name, lv in self.table.levels.items()}
        longest = max([r.time_window for r in self.table.frequency], default=0)
        ranks = {}
        for f in faults:
            hist = self.history.setdefault(f.rank, collections.deque())
            hist.append((now, f.key))
            while hist and now - hist[0][0] > longest:
                hist.popleft()
            level, why = self.base_level(f)
            reasons = [why]
            for rule in self.table.frequency:
                n = sum(1 for t, k in hist if now - t <= rule.time_window and rule.covers(k))
                if rule.covers(f.key) and n >= rule.times and sev[rule.level] > sev[level]:
                    level = rule.level
                    reasons.append(f"{n} faults within {rule.time_window:g} s -> {rule.level}")
            for rule in self.table.duration:
                lasted = 0.0 if f.first_seen is None else now - f.first_seen
                if rule.covers(f.key) and lasted >= rule.timeout and sev[rule.level] > sev[level]:
                    level = rule.level
                    reasons.append(f"lasted {lasted:.1f} s >= {rule.timeout:g} s -> {rule.level}")
            ranks[f.rank] = (level, reasons)
        if not ranks:
            return Verdict(None, STRATEGIES, {})
        worst = max((lv for lv, _ in ranks.values()), key=lambda name: sev[name])
        return Verdict(worst, self.table.levels[worst].strategies, ranks)

    def plan(self, faults: Iterable[RankFault], feasible: Iterable[str], implemented: Iterable[str] = STRATEGIES,
             now: float | None = None) -> tuple[list, Verdict]:
        """Which strategies, in what order, for this incident (see the module docstring)."""
        verdict = self.judge(faults, now)
        order, skipped = order_strategies(verdict.allowed, feasible, implemented)
        if skipped:
            _log.warning("strategies %s are allowed and possible but not implemented in this build; skipped",
                         skipped)
        return order, verdict

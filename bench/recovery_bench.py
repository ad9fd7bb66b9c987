"""Recovery benchmark: time from a fault to the first completed step after recovery, and steps lost.

    .venv/bin/python bench/recovery_bench.py                 # all strategies, tiny GPT, ~4 min on 2 cores
    .venv/bin/python bench/recovery_bench.py --size 1g       # >= 1 GiB of state per rank (bench/_sizes.py)
    .venv/bin/python bench/recovery_bench.py --only baseline,dump --json out.json

The job is examples/megatron/pretrain_gpt.py (through bench/_job.py): 4 ranks, DP=4, distributed
optimizer with 2 replicas, the GPT of ``--size`` (bench/_sizes.py: tiny, 128m, 1g), gloo on CPU. A
fault-free run of the same job comes first (``reference``: its final state digest is what every
recovered run must end with, bit for bit, and its step time prices lost steps). A fault is injected
with ``--inject`` (mindio.drill) on rank 1 while it computes step F (``--fault-step``). Strategies:

=================  ===========================================================================
baseline           what everyone uses today: the whole job restarted, resuming from the last
                   periodic checkpoint written with plain torch.save every ``--save-interval``
                   steps. The job runs under ``torchrun``; when it fails, the benchmark submits it
                   again at once, as a cluster scheduler would (``--baseline-torchrun-restart``:
                   torchrun's own ``--max-restarts 1`` instead -- on this machine its second
                   round failed to re-form the gloo group: "connectFullMesh ... Connection
                   refused" with the static rendezvous, a hang with c10d; see docs/recovery.md)
dump               mindio today: ``--enable-high-availability`` under ``mindio-run --max-restarts
                   1``; the controller dumps the last-words checkpoint at the lock step, the job
                   exits 75, mindio-run relaunches it (warm interpreters), it loads the dump
retry              in-process step retry after ``UCE ERROR`` (processes stay up)
retry-raise        rank 1 raises a generic exception outside the optimizer update: retried in place
                   once (HIGH_AVAILABILITY=retry,dump; a repeat would end in the dump)
recover-in-place   only the SIGKILLed process is replaced, its state repaired from a replica
recover            a SIGKILLed node's ranks move to a ``--standby`` agent
=================  ===========================================================================

A strategy runs only when the controller implements it (:func:`implemented`); otherwise it is
reported as "n/a (not implemented)".
A strategy that ran but whose controller decided something else (the ``decision`` event) is
reported with what actually happened, never as the strategy asked for.

Timeline points (wall clock, all processes on this machine): the ``fault_injected`` event; the
controller hearing of it (``report_received`` / ``rank_dead``); the ``stop`` and ``rename``
actions finishing (events with durations); mindio-run's ``round_failed`` event (it saw a worker
exit non-zero) and torchrun's "closing signal" line; ``bench-job: start`` / ``imports`` of the relaunched rank 0;
the example's ``loaded checkpoint`` line; and the first ``iteration N`` line after the fault.
Lines are time-stamped when the benchmark reads them (a few ms after they are written).

Bytes moved: the job wrapper (bench/_job.py, ``BENCH_TIMINGS=1``) times the data path where it moves
state -- periodic save and load (rank 0), the dump of each holder, each repair send -- and prints the
bytes and seconds; the rate is bytes / seconds of one such transfer (the slowest when several run at
once), the total is over all ranks. The recovery's own phases (``repair`` = the controller's repair
action, control round trips included) are separate columns.

"again" = fault -> the first step after the recovery completed, less one fault-free step (that much
compute would have run anyway), at least fault -> train() re-entered: the time the fault cost. At the
end the run checks the targets of issue 18 on it and prints PASS / FAIL for each (recover-in-place
<= 2 s + state bytes / 1 GB/s and bitwise equal to the reference; retry <= 1 s + repair bytes / 1 GB/s;
dump loses <= 1 step; each >= 5x sooner than the baseline) with the load average it ran under: the
targets are for an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from mindio._ports import free_port as _free_port  # outside the ephemeral range (mindio/_ports.py)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _sizes  # noqa: E402  (bench/_sizes.py)

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "bench" / "_job.py"
STRATEGIES = ("baseline", "dump", "retry", "retry-raise", "recover-in-place", "recover")
REFERENCE = "reference"  # the fault-free run
DECIDES = {"retry-raise": "retry"}  # a bench row whose controller decision has another name
TIMEOUT_S = {"tiny": 300, "128m": 450, "1g": 900}  # per run, default of --timeout (generous: a shared machine)
EXIT_GRACE_S = 15.0
PHASES = ("detect", "stop", "dump", "clean", "rebuild", "start", "repair", "rollback", "resume", "exit",
          "restart", "imports", "init+build", "load", "first step")
# controller actions (``action`` events, logged when every reply is in) -> phase they end
_ACTION_PHASE = {"stop": "stop", "save": "dump", "rename": "dump", "clean": "clean",
                 "rebuild": "rebuild", "repair": "repair", "rollback": "rollback", "retry": "resume",
                 "prerepair": "start"}  # recover-in-place / recover: the replacement built and parked


def implemented() -> tuple:
    """The bench rows that can run: baseline, plus the strategies the controller carries out.

    ``mindio.ttp.controller.controller.IMPLEMENTED_STRATEGIES`` when the module exports one; else what
    ``Controller.implemented_strategies()`` finds (its ``STRATEGIES`` table); else
    dump, plus retry once its flow (mindio.ttp.controller.retry) exists. A new strategy shows up here as soon as
    the controller can run it; give it a ``scenario()`` branch to measure it."""
    import importlib.util

    try:
        from mindio.ttp.controller import controller
    except ImportError:
        return ("baseline",)
    declared = getattr(controller, "IMPLEMENTED_STRATEGIES", None)
    if declared is None and hasattr(controller.Controller, "STRATEGIES"):  # its strategy table, in policy's order
        from mindio.ttp.controller import policy
        declared = tuple(s for s in policy.STRATEGY_ORDER if s in controller.Controller.STRATEGIES)
    if declared is None:
        declared = ("dump",) + (("retry",) if importlib.util.find_spec("mindio.ttp.controller.retry") else ())
    declared = tuple(declared) + (("retry-raise",) if "retry" in declared else ())  # the retry of a raise
    return ("baseline",) + tuple(s for s in STRATEGIES if s in declared and s != "baseline")


@dataclass
class Scenario:
    name: str
    commands: List[List[str]]  # one per launcher process (several agents for "recover")
    env: Dict[str, str]
    inject: Optional[str]  # None: the fault-free reference run
    resubmit: int = 0  # times the bench starts the commands again after a failed exit


def pool_mb(size: _sizes.Size) -> int:
    """Checkpoint-store pool for one job: a whole periodic checkpoint (every item once: the model's fp32
    params 4 B x P and the optimizer's 12 B x P) with room to spare. A dump writes less (its holders' shards);
    sized for the dump alone (12 B x P), the fault-free 1g run's last periodic save found the pool full
    ("1145340158 bytes needed, 1140850688 free": rank 0 writes the model and its shard) and fell back to a
    direct write that outlasted the bench's exit grace."""
    return max(64, int(16 * size.params * 1.3 / 2**20) + 64)


def scenario(name: str, a, work: Path) -> Scenario:
    F = a.fault_step
    ck = work / "ckpt"
    size = _sizes.get(a.size)
    common = ["--use-distributed-optimizer", "--replica-cnt", "2", "--train-iters", str(a.steps),
              "--save", str(ck), *size.args()]
    ha = ["--enable-high-availability"]
    env = {"BENCH_RESUME_DIR": str(ck), "BENCH_TIMINGS": "1", "BENCH_PHASES": "1",
           "MINDIO_ACP_POOL_MB": str(pool_mb(size))}
    run = [sys.executable, "-m", "mindio.launch.cli", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "--max-restarts", "1", "--warm-spares", "4"]  # relaunch (dump, or a fallback to it) into warm ranks
    if name == REFERENCE:  # the dump configuration without a fault
        cmd = run + [str(JOB), *common, *ha]
        return Scenario(name, [cmd], {**env, "HIGH_AVAILABILITY": "dump"}, None)
    if name == "baseline":
        own = a.baseline_torchrun_restart
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--max-restarts", "1" if own else "0", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "--monitor-interval", "0.1", str(JOB),
               *common, "--save-interval", str(a.save_interval)]
        return Scenario(name, [cmd], {**env, "BENCH_TORCH_SAVE": "1"}, f"{a.fault}:rank=1,step={F}",
                        resubmit=0 if own else 1)
    if name == "dump":
        cmd = run + [str(JOB), *common, *ha]
        return Scenario(name, [cmd], {**env, "HIGH_AVAILABILITY": "dump"}, f"{a.fault}:rank=1,step={F}")
    if name == "retry":
        cmd = run + [str(JOB), *common, *ha, "--enable-hbmfault-repair"]
        return Scenario(name, [cmd], {**env, "HIGH_AVAILABILITY": "retry,dump"}, f"uce:rank=1,step={F}")
    if name == "retry-raise":
        cmd = run + [str(JOB), *common, *ha]
        return Scenario(name, [cmd], {**env, "HIGH_AVAILABILITY": "retry,dump"}, f"raise:rank=1,step={F}")
    if name == "recover-in-place":
        cmd = run + [str(JOB), *common, *ha, "--enable-worker-reboot"]
        return Scenario(name, [cmd], {**env, "HIGH_AVAILABILITY": "recover-in-place,dump"},
                        f"kill:rank=1,step={F}")
    if name == "recover":  # two nodes of 2 ranks, plus a standby node
        port = str(_free_port())
        base = [sys.executable, "-m", "mindio.launch.cli", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", port, "--max-restarts", "1"]
        tail = [str(JOB), *common, *ha, "--enable-worker-reboot"]
        cmds = [base + ["--node-rank", "0"] + tail, base + ["--node-rank", "1"] + tail,
                base + ["--standby", "--warm-spares", "2"] + tail]  # both ranks of the node start warm
        return Scenario(name, cmds, {**env, "HIGH_AVAILABILITY": "recover,dump"},
                        f"kill-node:node=1,step={F}")
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")


@dataclass
class Run:
    lines: List[tuple] = field(default_factory=list)  # (time, text)
    events: List[dict] = field(default_factory=list)
    codes: List[Optional[int]] = field(default_factory=list)
    wall_s: float = 0.0
    timed_out: bool = False
    exit_hang: bool = False  # the job finished training but had not exited EXIT_GRACE_S later


def execute(sc: Scenario, work: Path, timeout: float) -> Run:
    events = work / "events.jsonl"
    drill_dir = work / "drill"
    drill_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "MINDIO_EVENT_LOG": str(events), "MINDIO_DRILL_DIR": str(drill_dir),
           "TTP_PORT": str(_free_port()), "TTP_LOG_PATH": str(work / "logs"),
           "TTP_NORMAL_ACTION_TIME_LIMIT": "60", "MINDIO_ACP_DIR": str(work / "acp"),
           "MINDIO_ACP_IDLE_EXIT": "60", "MINDIO_ACP_POOL_MB": "64", **sc.env}
    run, lock = Run(), threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + timeout
    for attempt in range(sc.resubmit + 1):
        codes = _launch(sc, env, run, lock, deadline)
        run.codes += codes
        if run.timed_out or all(c == 0 for c in codes):
            break
    run.wall_s = time.monotonic() - t0
    time.sleep(0.2)  # the pump threads drain the pipes
    with lock:
        (work / "output.log").write_text("".join(f"{t:.6f} {s}\n" for t, s in run.lines))
    if events.exists():
        for line in events.read_text().splitlines():
            try:
                run.events.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a SIGKILL
    return run


def _launch(sc: Scenario, env: dict, run: Run, lock, deadline: float) -> list:
    """Start the scenario's launcher(s), pump their output into ``run``, wait; exit codes."""
    procs = []
    for i, cmd in enumerate(sc.commands):
        inject = ["--inject", sc.inject] if sc.inject else []
        p = subprocess.Popen([*cmd, *inject], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                             start_new_session=True, bufsize=1)
        procs.append(p)

        def pump(p=p):
            for line in p.stdout:
                with lock:
                    run.lines.append((time.time(), line.rstrip("\n")))
        threading.Thread(target=pump, daemon=True).start()
        if i == 0 and len(sc.commands) > 1:
            time.sleep(1.0)  # node 0 hosts the agents' store
    main = procs[:2] if len(procs) > 2 else procs  # a standby that never took over just waits
    first_line = len(run.lines)
    finished_at = None
    try:
        while any(p.poll() is None for p in main):
            now = time.monotonic()
            if now > deadline:
                run.timed_out = True
                break
            if finished_at is None and any(s.startswith("max-rss-MiB:") for _, s in run.lines[first_line:]):
                finished_at = now  # rank 0 printed its last line: the job should exit now
            if finished_at is not None and now - finished_at > EXIT_GRACE_S:
                run.exit_hang = True  # reported; the figures are complete, do not wait any longer
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
    return [p.returncode for p in procs]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it (torchrun's workers have their own sessions)."""
    try:
        import psutil

        victims = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing or the launcher already gone
        victims = []
    for v in victims:
        try:
            v.kill()
        except Exception:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


_ITER = re.compile(r"^iteration\s+(\d+)/\d+ \|")
_T = re.compile(r"\bt=([0-9.]+)")


# not anchored: another process's unterminated output (a rank's stderr) can precede the line in the pipe
_DATA = re.compile(r"bench-job: (save|load|dump|repair-send|repair-recv) rank=(\d+) bytes=(\d+) s=([0-9.]+)")
_STEP_MS = re.compile(r"^iteration\s+(\d+)/\d+ \|.*\| step ([0-9.]+) ms")
_STATE = re.compile(r"optimizer-state-bytes: (\d+) on rank 0 \(P=(\d+), R=(\d+), d=(\d+)")


def transfers(lines) -> Dict[str, List[tuple]]:
    """``bench-job: <label> rank= bytes= s=`` lines (bench/_job.py) -> {label: [(rank, bytes, s)]}."""
    out: Dict[str, List[tuple]] = {}
    for _, s in lines:
        m = _DATA.search(s)
        if m:
            out.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3)), float(m.group(4))))
    return out


def job_facts(lines, before: Optional[float] = None) -> dict:
    """What a run says about the job itself: parameters and state bytes per rank, median step time
    (steps 2.. before the fault; the first step warms up), periodic save size and time."""
    out: dict = {}
    m = next((m for _, s in lines if (m := _STATE.search(s))), None)
    if m:
        shard, params, r, d = (int(x) for x in m.groups())
        out.update(params=params, shard_bytes=shard, state_bytes=4 * params + shard, replicas=r, dp=d)
    early = [(t, s) for t, s in lines if before is None or t < before]
    steps = [float(m.group(2)) for _, s in early if (m := _STEP_MS.match(s)) and int(m.group(1)) > 1]
    if steps:
        out["step_s"] = round(statistics.median(steps) / 1000, 4)
    saves = transfers(early).get("save", [])
    if saves:
        out["save"] = {"bytes": saves[0][1], "s": round(statistics.median(x[2] for x in saves), 4)}
    return out


def moved(tr: Dict[str, List[tuple]], dp: int) -> List[dict]:
    """The recovery's data movement from its transfer lines: per kind, bytes over all ranks and the rate
    of one transfer (bytes / seconds; the slowest when several ran at once). Loads are timed on rank 0
    only: every rank reads its own shard, so the total is ``dp`` x rank 0's."""
    out = []
    for label, what, ranks in (("dump", "dump write", 1), ("load", "load", dp), ("repair-send", "repair", 1)):
        xs = tr.get(label, [])
        if xs:
            total = sum(b for _, b, _ in xs) * ranks
            slow = max(xs, key=lambda x: x[2])
            out.append({"what": what, "bytes": total, "s": round(slow[2], 4),
                        "gbps": round(slow[1] / slow[2] / 1e9, 3) if slow[2] > 0 else None})
    return out


def analyse_reference(run: Run) -> dict:
    """The fault-free run: its final digest, step time and state sizes."""
    digests = [s.split()[-1] for _, s in run.lines if s.startswith("state-digest:")]
    out = {"ok": bool(digests) and all(c == 0 for c in run.codes), "exit_codes": run.codes,
           "wall_s": round(run.wall_s, 1), "final_digest": digests[-1] if digests else None}
    out.update(job_facts(run.lines))
    if not out["ok"]:
        out["error"] = "the fault-free run did not finish"
    return out


def training_again(r: dict, step_s: Optional[float]) -> float:
    """Fault -> training again: the first step after the recovery completed, less one fault-free step
    (that much compute would have run anyway; what the first step takes beyond it -- new connections,
    cold caches -- stays in); never less than fault -> train() re-entered (the ``first step`` phase's
    start). Without a step time: fault -> first step."""
    if not step_s:
        return r["recovery_s"]
    resumed = r["recovery_s"] - r.get("phases", {}).get("first step", 0.0)
    return round(max(resumed, r["recovery_s"] - step_s), 3)


def analyse(run: Run, fault_step: int) -> dict:
    """Timeline and phase durations of one run (see the module docstring)."""
    ev = sorted(run.events, key=lambda e: e["t"])
    lines = run.lines
    fault = next((e["t"] for e in ev if e["kind"] == "fault_injected"), None)
    if fault is None:
        fault = next((t for t, s in lines if " injecting " in s), None)
    out: dict = {"ok": False, "exit_codes": run.codes, "wall_s": round(run.wall_s, 1)}
    out.update(job_facts(lines, before=fault))
    if fault is None:
        out["error"] = "the fault never fired"
        return out
    after = [(t, s) for t, s in lines if t >= fault]

    def first_line(pattern: str, src=after):
        return next(((t, s) for t, s in src if re.search(pattern, s)), (None, None))

    def first_event(kinds, **match):
        return next((e for e in ev if e["t"] >= fault and e["kind"] in kinds
                     and all(e.get(k) == v for k, v in match.items())), None)

    # what was done: a replacement flow's recover_done names the strategy it carried out (the decision
    # event can name another: at 1g a killed node was decided as recover-in-place, then a standby took it)
    decision = first_event(("recover_done",)) or first_event(("decision",))
    detect = first_event(("report_received", "rank_dead"))
    stop = first_event(("action",), action="stop")
    rename = first_event(("action",), action="rename")
    _, start_line = first_line(r"bench-job: start ")  # a relaunched (or resubmitted) rank 0
    _, imports_line = first_line(r"bench-job: imports ")
    loaded_t, loaded = first_line(r"^loaded checkpoint iteration (\d+)")
    launcher_detect, _ = first_line(r"closing signal|round \d+ failed")
    failed_round = first_event(("round_failed",))  # mindio-run saw a worker exit non-zero
    workers_gone, _ = first_line(r"^mindio-run: round \d+ failed")  # printed after its workers stopped
    digests = [s.split()[-1] for _, s in lines if s.startswith("state-digest:")]
    # the first step *after the recovery*: not a line of a step that completed before the fault and was
    # read late (lines are stamped when read), so after the relaunch / the last rank resuming train()
    resumed = [e["t"] for e in ev if e["kind"] == "train_resumed" and e["t"] >= fault]
    floor = max([loaded_t or 0.0, max(resumed, default=0.0)]
                + [float(_T.search(x).group(1)) for x in (start_line, imports_line) if x])
    first = next(((t, int(m.group(1))) for t, s in after if t >= floor and (m := _ITER.match(s))), None)
    points = {
        "fault": fault,
        "detected": detect["t"] if detect else launcher_detect,
        "stopped": stop["t"] if stop else None,
        "dumped": rename["t"] if rename else None,
        "exited": (failed_round["t"] if failed_round else workers_gone) if rename else None,
        "restarted": float(_T.search(start_line).group(1)) if start_line else None,
        "imported": float(_T.search(imports_line).group(1)) if imports_line else None,
        "loaded": loaded_t,
        "first_step": first[0] if first else None,
    }
    end = points["first_step"] or float("inf")
    steps = [("detect", points["detected"])]
    steps += [(_ACTION_PHASE[e["action"]], e["t"]) for e in ev if e["kind"] == "action"
              and e.get("action") in _ACTION_PHASE and fault <= e["t"] <= end]
    # the relaunch's checkpoint read: rank 0's timed load_checkpoint (bench/_job.py) ends at "loaded"
    read = transfers([(t, s) for t, s in after if t <= (loaded_t or 0.0)]).get("load", [])
    points["building"] = loaded_t - read[-1][2] if loaded_t and read else None
    steps += [("exit", points["exited"]), ("restart", points["restarted"]),
              ("imports", points["imported"]), ("init+build", points["building"]), ("load", points["loaded"]),
              ("first step", points["first_step"])]
    phases, prev = {}, fault
    for phase, t in steps:
        if t is not None and t >= prev:
            phases[phase] = round(phases.get(phase, 0.0) + t - prev, 3)
            prev = t
    out.update(points={k: v for k, v in points.items() if v is not None}, phases=phases,
               decision=decision.get("strategy") if decision else None,
               final_digest=digests[-1] if digests else None)
    if first is None:
        out["error"] = "no step completed after the fault"
        return out
    resumed_from = first[1] - 1
    out["moved"] = moved(transfers([(t, s) for t, s in after if t <= first[0]]), out.get("dp", 4))
    out.update(ok=True, recovery_s=round(first[0] - fault, 3), first_step_after=first[1],
               steps_lost=(fault_step - 1) - resumed_from,
               loaded_iteration=int(re.search(r"(\d+)", loaded).group(1)) if loaded else None)
    return out


def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def report(results: Dict[str, dict], a) -> str:
    ref = results.get(REFERENCE, {})
    facts = next((r for r in (ref, *results.values()) if r.get("params")), {})
    size = _sizes.get(a.size)
    rows = [f"recovery bench: examples/megatron/pretrain_gpt.py, 4 ranks DP=4 R=2, gloo/CPU, fault on "
            f"rank 1 at step {a.fault_step} of {a.steps}; load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs at the end (the targets are for an idle machine)",
            size.describe()]
    if facts:
        rows.append(f"measured: P={facts['params']} params, optimizer shard {facts['shard_bytes']} B + model "
                    f"{4 * facts['params']} B = state {facts['state_bytes']} B ({facts['state_bytes'] / 2**30:.3f} GiB) "
                    f"per rank; fault-free step {ref.get('step_s', float('nan')):.3f} s (median)")
    base = results.get("baseline", {}).get("again_s")
    shown = [p for p in PHASES if any(p in r.get("phases", {}) for r in results.values())]
    rows.append(f"{'strategy':18} {'fault->step':>12} {'again':>8} {'vs base':>8} {'lost':>5} {'moved':>10} "
                f"{'rate':>11}  " + "  ".join(f"{p:>10}" for p in shown))
    for name, r in results.items():
        if name == REFERENCE:
            continue
        if r.get("na"):
            rows.append(f"{name:18} {r['na']}")
            continue
        if not r.get("ok"):
            rows.append(f"{name:18} FAILED: {r.get('error')} (exit codes {r.get('exit_codes')}, "
                        f"{r.get('wall_s')} s{', timed out' if r.get('timed_out') else ''})")
            continue
        ratio = "1.00x" if name == "baseline" else f"{base / r['again_s']:.2f}x" if base else "-"
        label = name if r.get("decision") in (None, name, DECIDES.get(name)) else f"{name}->{r['decision']}"
        mv = r.get("moved", [])
        total = sum(m["bytes"] for m in mv) if mv else None
        rate = min((m["gbps"] for m in mv if m.get("gbps")), default=None)
        rows.append(f"{label:18} {r['recovery_s']:>10.2f} s {r['again_s']:>6.2f} s {ratio:>8} {r['steps_lost']:>5} "
                    f"{_gb(total):>10} "
                    f"{(f'{rate:.2f} GB/s' if rate else '-'):>11}  "
                    + "  ".join(f"{r['phases'][p]:>9.2f}s" if p in r["phases"] else f"{'-':>10}"
                                for p in shown))
    for name, r in results.items():
        for m in r.get("moved", []) if r.get("ok") else []:
            rows.append(f"  {name}: {m['what']} {_gb(m['bytes'])} in all; one transfer {m['s']:.3f} s"
                        + (f" = {m['gbps']:.2f} GB/s" if m.get("gbps") else ""))
    rows += baseline_note(results, a)
    hung = [n for n, r in results.items() if r.get("exit_hang")]
    if hung:
        rows.append(f"NOTE: {', '.join(hung)}: training finished but the job had not exited "
                    f"{EXIT_GRACE_S:.0f} s later (killed by the bench; an exit-path hang to fix)")
    finals = {n: r.get("final_digest") for n, r in results.items() if r.get("final_digest")}
    if ref.get("final_digest"):
        differ = [n for n, d in finals.items() if d != ref["final_digest"]]
        rows.append(f"final state digests: {', '.join(n for n in finals if n not in differ and n != REFERENCE) or 'none'} "
                    f"bitwise equal to the fault-free reference" + (f"; DIFFER: {', '.join(differ)}" if differ else ""))
    elif len(finals) > 1:
        same = len(set(finals.values())) == 1
        rows.append(f"final state digests {'identical' if same else 'DIFFER'} across {', '.join(finals)}")
    rows.append("fault->step: fault to the first step completed after the recovery; again: the same less one "
                "fault-free step (its compute would have run anyway), at least fault -> train() re-entered: "
                "the time the fault cost, which the targets use; vs base = baseline again / strategy again "
                "(higher is better); lost = steps lost; moved/rate: the data path of the "
                "recovery (dump writes, loads, repair sends; rate of the slowest single transfer); phases: "
                "time from the previous point; '-' = no such phase in this strategy")
    rows += [f"target {line}" for line in targets(results)]
    return "\n".join(rows)


def baseline_note(results: Dict[str, dict], a) -> List[str]:
    """The work the baseline loses per fault at its checkpoint interval, and what its checkpoints cost."""
    b, ref = results.get("baseline", {}), results.get(REFERENCE, {})
    step = ref.get("step_s") or b.get("step_s")
    if not b.get("ok") or not step:
        return []
    out = [f"baseline: torch.save checkpoint every {a.save_interval} steps; a fault at a random step loses "
           f"on average {a.save_interval / 2:.1f} steps = {a.save_interval / 2 * step:.2f} s of training "
           f"(step {step:.3f} s) on top of its {b['recovery_s']:.2f} s restart; this run lost "
           f"{b['steps_lost']} steps ({b['steps_lost'] * step:.2f} s)"]
    if b.get("save"):
        sv = b["save"]
        out.append(f"baseline: each periodic save wrote {_gb(sv['bytes'])} per holder rank in {sv['s']:.3f} s "
                   f"({sv['bytes'] / sv['s'] / 1e9:.2f} GB/s), {sv['s'] / (a.save_interval * step) * 100:.1f} % "
                   f"of the training time at this interval")
    return out


def targets(results: Dict[str, dict]) -> List[str]:
    """Issue 18's targets, each PASS / FAIL / n/a with the figures it compared."""
    ref, base = results.get(REFERENCE, {}), results.get("baseline", {}).get("again_s")
    out = []

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    def repair_bytes(r):
        return sum(m["bytes"] for m in r.get("moved", []) if m["what"] == "repair")

    compared = bool(ref.get("final_digest"))  # False with --no-reference: no final state to compare with

    def same(r) -> bool:  # the final state equals the reference's (True when there is none to compare)
        return not compared or r.get("final_digest") == ref["final_digest"]

    def final(r) -> str:
        if not compared:
            return "not compared (no fault-free reference run: --no-reference)"
        return f"{'bitwise equal to' if same(r) else 'NOT equal to'} the fault-free run"
    r = results.get("recover-in-place", {})
    if r.get("ok"):
        bound = 2 + r.get("state_bytes", 0) / 1e9
        out.append(f"{verdict(r['again_s'] <= bound and same(r))}: recover-in-place {r['again_s']:.2f} s "
                   f"<= 2 s + {r.get('state_bytes', 0)} B / 1 GB/s = {bound:.2f} s, final state {final(r)}")
    r = results.get("retry", {})
    if r.get("ok"):
        bound = 1 + repair_bytes(r) / 1e9
        out.append(f"{verdict(r['again_s'] <= bound and same(r))}: retry {r['again_s']:.2f} s <= 1 s + "
                   f"{repair_bytes(r)} B / 1 GB/s = {bound:.2f} s, final state {final(r)}")
    r = results.get("dump", {})
    if r.get("ok"):
        out.append(f"{verdict(r['steps_lost'] <= 1 and same(r))}: dump + relaunch lost {r['steps_lost']} "
                   f"step(s) <= 1, final state {final(r)}")
    r = results.get("dump", {})
    rate = min((m["gbps"] for m in r.get("moved", []) if m["what"] == "dump write" and m.get("gbps")),
               default=None)
    if r.get("ok") and rate:
        out.append(f"{verdict(rate >= 5)}: dump write rate {rate:.2f} GB/s per rank (slowest rank) >= 5 GB/s")
    if r.get("ok") and base:
        out.append(f"{verdict(r['again_s'] / base <= 0.4)}: dump + relaunch {r['again_s']:.2f} s = "
                   f"{r['again_s'] / base:.2f}x the whole-job restart ({base:.2f} s) <= 0.4x")
    for name in ("dump", "retry", "recover-in-place"):
        r = results.get(name, {})
        if r.get("ok") and base:
            out.append(f"{verdict(base / r['again_s'] >= 5)}: {name} {base / r['again_s']:.1f}x sooner "
                       f"than the whole-job restart baseline ({r['again_s']:.2f} s vs {base:.2f} s) >= 5x")
    missing = [n for n in ("baseline", "dump", "retry", "recover-in-place") if not results.get(n, {}).get("ok")]
    if missing:
        out.append(f"n/a: no figure for {', '.join(missing)} (not run, or failed above)")
    return out


def run_all(names: List[str], a) -> Dict[str, dict]:
    """The fault-free reference (unless --no-reference), then each strategy; results by name."""
    have = implemented()
    results: Dict[str, dict] = {}
    timeout = a.timeout or TIMEOUT_S.get(a.size, 900)
    root = Path(tempfile.mkdtemp(prefix="mindio-recovery-bench-"))
    print(f"[bench] {_sizes.get(a.size).describe()}; work in {root}", flush=True)
    try:
        for name in ([] if a.no_reference else [REFERENCE]) + names:
            if name != REFERENCE and name not in have and not a.force:
                results[name] = {"na": "n/a (not implemented)"}
                continue
            work = root / name
            work.mkdir()
            sc = scenario(name, a, work)
            print(f"[bench] {name}: {' '.join(sc.commands[0][1:4])} ... --inject {sc.inject}", flush=True)
            run = execute(sc, work, timeout)
            r = analyse_reference(run) if name == REFERENCE else analyse(run, a.fault_step)
            r["timed_out"] = run.timed_out
            r["exit_hang"] = run.exit_hang
            if run.timed_out and not r["ok"]:
                r["error"] = f"timed out after {timeout:.0f} s ({r.get('error')})"
            results[name] = r
            print(f"[bench] {name}: {json.dumps({k: r.get(k) for k in ('ok', 'recovery_s', 'steps_lost', 'phases', 'moved', 'step_s', 'exit_codes', 'error')})}",
                  flush=True)
            if not r["ok"]:
                tail = "\n".join(s for _, s in run.lines[-25:])
                print(f"[bench] {name}: last output lines:\n{tail}", flush=True)
    finally:
        if a.keep:
            print(f"[bench] work directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    add_training_again(results)
    return results


def add_training_again(results: Dict[str, dict]) -> None:
    """``again_s`` of every finished strategy, with the reference's step time (else the run's own)."""
    ref_step = results.get(REFERENCE, {}).get("step_s")
    for name, r in results.items():
        if name != REFERENCE and r.get("ok"):
            r["again_s"] = training_again(r, ref_step or r.get("step_s"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=list(_sizes.SIZES), help="model size (bench/_sizes.py)")
    p.add_argument("--only", default=",".join(STRATEGIES), help="comma list of strategies")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fault-step", type=int, default=8)
    p.add_argument("--save-interval", type=int, default=5, help="baseline periodic checkpoint interval (steps)")
    p.add_argument("--fault", default="raise", choices=["raise", "kill"],
                   help="fault for baseline and dump (retry: uce, recover-in-place: kill, recover: kill-node)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds per run (default by size: {TIMEOUT_S})")
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free reference run")
    p.add_argument("--baseline-torchrun-restart", action="store_true",
                   help="baseline: torchrun --max-restarts 1 instead of resubmitting the job")
    p.add_argument("--force", action="store_true", help="run strategies the controller does not list")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directories (logs, events)")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    names = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    if not 1 < a.fault_step <= a.steps or a.save_interval >= a.fault_step:
        p.error("need save-interval < fault-step <= steps (so the baseline has a checkpoint to resume)")
    results = run_all(names, a)
    text = report(results, a)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok") or r.get("na") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Recovery benchmark: time from a fault to the first completed step after recovery, and steps lost.

    .venv/bin/python bench/recovery_bench.py                 # all strategies, ~3 min on 2 cores
    .venv/bin/python bench/recovery_bench.py --only baseline,dump --json out.json

The job is examples/megatron/pretrain_gpt.py (through bench/_job.py): 4 ranks, DP=4, distributed
optimizer with 2 replicas, the tiny default GPT, gloo on CPU. A fault is injected with
``--inject`` (mindio.drill) on rank 1 while it computes step F (``--fault-step``). Strategies:

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
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from mindio._ports import free_port as _free_port  # outside the ephemeral range (mindio/_ports.py)

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "bench" / "_job.py"
STRATEGIES = ("baseline", "dump", "retry", "recover-in-place", "recover")
EXIT_GRACE_S = 15.0
PHASES = ("detect", "stop", "dump", "clean", "rebuild", "start", "repair", "rollback", "resume", "exit",
          "restart", "imports", "init+load", "first step")
# controller actions (``action`` events, logged when every reply is in) -> phase they end
_ACTION_PHASE = {"stop": "stop", "save": "dump", "rename": "dump", "clean": "clean",
                 "rebuild": "rebuild", "repair": "repair", "rollback": "rollback", "retry": "resume",
                 "prerepair": "start"}  # recover-in-place / recover: the replacement built and parked


def implemented() -> tuple:
    """The bench rows that can run: baseline, plus the strategies the controller carries out.

    ``mindio.ttp.controller.IMPLEMENTED_STRATEGIES`` when the module exports one; else what
    ``Controller.implemented_strategies()`` finds (its ``STRATEGIES`` table); else
    dump, plus retry once its flow (mindio.ttp.retry) exists. A new strategy shows up here as soon as
    the controller can run it; give it a ``scenario()`` branch to measure it."""
    import importlib.util

    try:
        from mindio.ttp import controller
    except ImportError:
        return ("baseline",)
    declared = getattr(controller, "IMPLEMENTED_STRATEGIES", None)
    if declared is None and hasattr(controller.Controller, "implemented_strategies"):
        declared = controller.Controller.implemented_strategies(controller.Controller)  # class-level probe
    if declared is None:
        declared = ("dump",) + (("retry",) if importlib.util.find_spec("mindio.ttp.retry") else ())
    return ("baseline",) + tuple(s for s in STRATEGIES if s in declared and s != "baseline")


@dataclass
class Scenario:
    name: str
    commands: List[List[str]]  # one per launcher process (several agents for "recover")
    env: Dict[str, str]
    inject: str
    resubmit: int = 0  # times the bench starts the commands again after a failed exit


def scenario(name: str, a, work: Path) -> Scenario:
    F = a.fault_step
    ck = work / "ckpt"
    common = ["--use-distributed-optimizer", "--replica-cnt", "2", "--train-iters", str(a.steps),
              "--save", str(ck)]
    ha = ["--enable-high-availability"]
    env = {"BENCH_RESUME_DIR": str(ck)}
    run = [sys.executable, "-m", "mindio.launch.cli", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "--max-restarts", "1", "--warm-spares", "4"]  # relaunch (dump, or a fallback to it) into warm ranks
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
        p = subprocess.Popen([*cmd, "--inject", sc.inject], stdout=subprocess.PIPE,
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


def analyse(run: Run, fault_step: int) -> dict:
    """Timeline and phase durations of one run (see the module docstring)."""
    ev = sorted(run.events, key=lambda e: e["t"])
    lines = run.lines
    fault = next((e["t"] for e in ev if e["kind"] == "fault_injected"), None)
    if fault is None:
        fault = next((t for t, s in lines if " injecting " in s), None)
    out: dict = {"ok": False, "exit_codes": run.codes, "wall_s": round(run.wall_s, 1)}
    if fault is None:
        out["error"] = "the fault never fired"
        return out
    after = [(t, s) for t, s in lines if t >= fault]

    def first_line(pattern: str, src=after):
        return next(((t, s) for t, s in src if re.search(pattern, s)), (None, None))

    def first_event(kinds, **match):
        return next((e for e in ev if e["t"] >= fault and e["kind"] in kinds
                     and all(e.get(k) == v for k, v in match.items())), None)

    decision = first_event(("decision",))
    detect = first_event(("report_received", "rank_dead"))
    stop = first_event(("action",), action="stop")
    rename = first_event(("action",), action="rename")
    _, start_line = first_line(r"^bench-job: start ")  # a relaunched (or resubmitted) rank 0
    _, imports_line = first_line(r"^bench-job: imports ")
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
    steps += [("exit", points["exited"]), ("restart", points["restarted"]),
              ("imports", points["imported"]), ("init+load", points["loaded"]),
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
    state = next((int(m.group(1)) for _, s in lines if (m := re.match(r"optimizer-state-bytes: (\d+)", s))), None)
    if state and phases.get("repair"):  # one shard per repaired rank (recover-in-place: one rank)
        out.update(state_bytes=state, repair_gbps=round(state / phases["repair"] / 1e9, 4))
    out.update(ok=True, recovery_s=round(first[0] - fault, 3), first_step_after=first[1],
               steps_lost=(fault_step - 1) - resumed_from,
               loaded_iteration=int(re.search(r"(\d+)", loaded).group(1)) if loaded else None)
    return out


def report(results: Dict[str, dict], a) -> str:
    rows = [f"recovery bench: examples/megatron/pretrain_gpt.py, 4 ranks DP=4 R=2, gloo/CPU, fault on "
            f"rank 1 at step {a.fault_step}, {a.steps} steps, periodic checkpoint every "
            f"{a.save_interval} (baseline); load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs at the end"]
    base = results.get("baseline", {}).get("recovery_s")
    shown = [p for p in PHASES if any(p in r.get("phases", {}) for r in results.values())]
    rows.append(f"{'strategy':18} {'fault->first step':>18} {'vs baseline':>12} {'steps lost':>10}  "
                + "  ".join(f"{p:>10}" for p in shown))
    for name, r in results.items():
        if r.get("na"):
            rows.append(f"{name:18} {r['na']}")
            continue
        if not r.get("ok"):
            rows.append(f"{name:18} FAILED: {r.get('error')} (exit codes {r.get('exit_codes')}, "
                        f"{r.get('wall_s')} s{', timed out' if r.get('timed_out') else ''})")
            continue
        ratio = "1.00x" if name == "baseline" else f"{base / r['recovery_s']:.2f}x" if base else "-"
        label = name if r.get("decision") in (None, name) else f"{name}->{r['decision']}"
        rows.append(f"{label:18} {r['recovery_s']:>16.2f} s {ratio:>12} {r['steps_lost']:>10}  "
                    + "  ".join(f"{r['phases'][p]:>9.2f}s" if p in r["phases"] else f"{'-':>10}"
                                for p in shown))
    for name, r in results.items():
        if r.get("ok") and r.get("repair_gbps") and name in ("recover-in-place", "recover"):
            rows.append(f"{name}: repair moved {r['state_bytes']} B of optimizer shard per rank in "
                        f"{r['phases']['repair']:.3f} s ({r['repair_gbps']:.3f} GB/s incl. control round trips)")
    hung = [n for n, r in results.items() if r.get("exit_hang")]
    if hung:
        rows.append(f"NOTE: {', '.join(hung)}: training finished but the job had not exited "
                    f"{EXIT_GRACE_S:.0f} s later (killed by the bench; an exit-path hang to fix)")
    finals = {n: r.get("final_digest") for n, r in results.items() if r.get("final_digest")}
    if len(finals) > 1:
        same = len(set(finals.values())) == 1
        rows.append(f"final state digests {'identical' if same else 'DIFFER'} across "
                    f"{', '.join(finals)}" + ("" if same else f": {finals}"))
    rows.append("ratio = baseline time / strategy time (higher is better); phases: time from the "
                "previous point; '-' = no such phase in this strategy")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(STRATEGIES), help="comma list of strategies")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fault-step", type=int, default=8)
    p.add_argument("--save-interval", type=int, default=5, help="baseline periodic checkpoint interval")
    p.add_argument("--fault", default="raise", choices=["raise", "kill"],
                   help="fault for baseline and dump (retry: uce, recover-in-place: kill, recover: kill-node)")
    p.add_argument("--timeout", type=float, default=150, help="seconds per strategy run")
    p.add_argument("--baseline-torchrun-restart", action="store_true",
                   help="baseline: torchrun --max-restarts 1 instead of resubmitting the job")
    p.add_argument("--force", action="store_true", help="run strategies the controller does not list")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directories (logs, events)")
    a = p.parse_args(argv)
    names = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    if not 1 < a.fault_step <= a.steps or a.save_interval >= a.fault_step:
        p.error("need save-interval < fault-step <= steps (so the baseline has a checkpoint to resume)")
    have = implemented()
    results: Dict[str, dict] = {}
    root = Path(tempfile.mkdtemp(prefix="mindio-recovery-bench-"))
    try:
        for name in names:
            if name not in have and not a.force:
                results[name] = {"na": "n/a (not implemented)"}
                continue
            work = root / name
            work.mkdir()
            sc = scenario(name, a, work)
            print(f"[bench] {name}: {' '.join(sc.commands[0][1:4])} ... --inject {sc.inject}", flush=True)
            run = execute(sc, work, a.timeout)
            r = analyse(run, a.fault_step)
            r["timed_out"] = run.timed_out
            r["exit_hang"] = run.exit_hang
            results[name] = r
            print(f"[bench] {name}: {json.dumps({k: r.get(k) for k in ('ok', 'recovery_s', 'steps_lost', 'phases', 'exit_codes', 'error')})}",
                  flush=True)
            if not r["ok"]:
                tail = "\n".join(s for _, s in run.lines[-25:])
                print(f"[bench] {name}: last output lines:\n{tail}", flush=True)
    finally:
        if a.keep:
            print(f"[bench] work directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = report(results, a)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok") or r.get("na") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""mindio and the systems a user would pick instead, measured side by side in one run: one table.

    .venv/bin/pip install -c constraints.txt -e ".[megatron,peers]"  # + torchft, NVRx (pinned)
    .venv/bin/python bench/peers/run_all.py --size 1g          # everything (docs/benchmarks.md)
    .venv/bin/python bench/peers/run_all.py --size tiny        # the same drills on the tiny GPT
    .venv/bin/python bench/peers/run_all.py --skip recovery,ha --peer-runs torchft-kill-default

Parts, in this order, all on this machine, 4 training processes each:

1. bench/recovery_bench.py at ``--size``: the fault-free reference, the whole-job restart baseline,
   dump, retry, recover-in-place, recover (mindio on examples/megatron/pretrain_gpt.py).
2. bench/ha_overhead.py at ``--size``: plain Megatron vs replicas vs replicas + control plane.
3. The peers (bench/peers/peer_train.py, the GPT of the same size in plain torch):
   * kill drill: rank 1 SIGKILLed before step F -- torchft (its torchrun restarts the replica, which
     heals from a live peer) under its default and tuned settings;
   * raise drill: rank 1 raises before step F -- NVRx in-process restart and torchft, both settings;
   * steady state: plain DDP, torchft DDP, NVRx-wrapped DDP, no fault.

The table has one row per comparison: mindio's figure, the peer's, and mindio / peer (below 1:
mindio is faster / cheaper). Every drill is timed from the fault (the faulting process prints the
wall clock just before it) to the first committed step of the processes named in the row.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(HERE))

import _sizes  # noqa: E402
import ha_overhead  # noqa: E402
import recovery_bench  # noqa: E402
from mindio._ports import free_port  # noqa: E402

TRAIN = HERE / "peer_train.py"
WORLD = 4
FAULT_RANK = 1
# the lighthouse's flags per setting. default: its defaults (heartbeat timeout 5 s, join timeout 60 s,
# quorum tick 100 ms; min_replicas has no default: 1, as torchft's README). tuned: the README's command,
# "--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000". A lower --heartbeat_timeout_ms (1 s)
# was tried: under load the lighthouse then dropped live replicas and a restarted replica committed a
# step alone (a split brain; its final state differed), so the documented 5 s stays.
LIGHTHOUSE = {"default": ["--min_replicas", "1"],
              "tuned": ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]}
_LINE = re.compile(r"^peer: (\w+) (.*) t=([0-9.]+)$")
FAILED = "FAILED"  # a figure whose run failed (the details below the table say how)


# ------------------------------------------------------------------------------------ processes
class Job:
    """Processes started together; their output lines parsed as ``peer:`` records, kept raw too."""

    def __init__(self, work: Path):
        self.work, self.procs, self.raw = work, [], []
        self.records: List[dict] = []
        self.lock = threading.Lock()

    def start(self, cmd: List[str], env: dict, name: str) -> None:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
                                  "PYTHONPATH": str(REPO), **env},
                             start_new_session=True, bufsize=1)
        self.procs.append((name, p))

        def pump():
            for line in p.stdout:
                line = line.rstrip("\n")
                with self.lock:
                    self.raw.append(f"[{name}] {line}")
                    m = _LINE.match(line)
                    if m:
                        rec = dict(kv.split("=", 1) for kv in m.group(2).split())
                        rec.update(event=m.group(1), t=float(m.group(3)))
                        for k in ("rank", "step", "participants", "restart"):
                            if k in rec:
                                rec[k] = int(rec[k])
                        self.records.append(rec)
        threading.Thread(target=pump, daemon=True).start()

    def wait(self, timeout: float, poll=None) -> List[Optional[int]]:
        deadline = time.monotonic() + timeout
        self.timed_out = None
        try:
            while any(p.poll() is None for _, p in self.procs):
                if time.monotonic() > deadline:
                    self.timed_out = timeout  # the peer hung: killed here, at this run's bound
                    break
                if poll:
                    with self.lock:
                        poll(list(self.records))
                time.sleep(0.1)
        finally:
            for _, p in self.procs:
                if p.poll() is None:
                    recovery_bench._kill_tree(p)
        time.sleep(0.2)  # the pumps drain
        (self.work / "output.log").write_text("\n".join(self.raw) + "\n")
        return [p.returncode for _, p in self.procs]


def torchrun(nproc: int, port: int, args: List[str], restarts: int = 0) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(TRAIN), *args]


def control_store():
    import torch.distributed as dist

    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=600)), f"127.0.0.1:{port}"


def peer_run(ft: str, a, work: Path, settings: str = "default", inject: Optional[str] = None,
             steps: Optional[int] = None, gloo_timeout: Optional[float] = None) -> dict:
    """One peer job; a drill (``inject``) is stopped through the control store 2 steps after every rank
    committed a step after the fault."""
    work.mkdir(parents=True)
    store, addr = control_store()
    job, lighthouse = Job(work), None
    common = ["--ft", ft, "--size", a.size, "--settings", settings,
              "--steps", str(steps or (a.fault_step + 400 if inject else a.steady_steps))]
    if inject:
        common += ["--inject", inject]
    env = {"PEER_CONTROL": addr}
    try:
        if ft == "torchft":
            lh_port = free_port()
            lighthouse = subprocess.Popen(
                [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{lh_port}",
                 *LIGHTHOUSE[settings]], stdout=open(work / "lighthouse.log", "w"), stderr=subprocess.STDOUT,
                start_new_session=True)
            for r in range(WORLD):  # one torchrun per replica group; it restarts its replica once
                job.start(torchrun(1, free_port(), common, restarts=1),
                          {**env, "REPLICA_GROUP_ID": str(r), "NUM_REPLICA_GROUPS": str(WORLD),
                           "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lh_port}"}, f"replica{r}")
        else:
            extra = ["--gloo-timeout", str(gloo_timeout)] if gloo_timeout else []
            job.start(torchrun(WORLD, free_port(), common + extra), env, ft)
        stopper = _Stopper(store) if inject else None
        codes = job.wait(a.peer_timeout, poll=stopper)
    finally:
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
        del store
    return {"codes": codes, "records": job.records, "tail": job.raw[-30:], "timed_out": job.timed_out}


class _Stopper:
    """Sets ``stop`` (2 steps after the newest step seen) once every rank committed a step after the fault."""

    def __init__(self, store):
        self.store, self.done = store, False

    def __call__(self, records: List[dict]) -> None:
        if self.done:
            return
        fault = next((r for r in records if r["event"] == "fault"), None)
        if fault is None:
            return
        after = {r["rank"] for r in records if r["event"] == "step" and r["t"] > fault["t"]}
        if after >= set(range(WORLD)):
            newest = max(r["step"] for r in records if r["event"] == "step")
            self.store.set("stop", str(newest + 2))
            self.done = True


# ------------------------------------------------------------------------------------- analysis
def drill_figures(run: dict) -> dict:
    """From a drill's records: fault -> every survivor committed a step again; fault -> the faulty rank
    committed a step again together with every other rank; steps lost; whether the final digests agree.
    Only steps >= the fault step count: a peer's line of the step before can arrive after the fault's."""
    recs = run["records"]
    fault = next((r for r in recs if r["event"] == "fault"), None)
    out = {"ok": False, "codes": run["codes"]}
    if fault is None:
        out["error"] = "the fault never fired"
        return out
    t0, rank, step = fault["t"], fault["rank"], fault["step"]

    def first_after(r, everyone=False):
        return next((x for x in recs if x["event"] == "step" and x["rank"] == r and x["t"] > t0
                     and x["step"] >= step and (not everyone or x["participants"] == WORLD)), None)

    firsts = {r: first_after(r, everyone=r == rank) for r in range(WORLD)}
    survivors = [firsts[r] for r in range(WORLD) if r != rank]
    digests = {x["sha"] for x in recs if x["event"] == "digest"}
    out["digests_equal"] = len(digests) == 1 and sum(x["event"] == "digest" for x in recs) == WORLD
    redone = [x["step"] for x in recs if x["event"] == "step" and x["t"] > t0 and x["step"] < step - 1]
    out["steps_lost"] = step - min(redone) if redone else 0  # a rollback re-runs steps min(redone)..step-1
    if all(survivors):
        out["survivors_s"] = round(max(x["t"] for x in survivors) - t0, 3)
    if firsts[rank]:
        out["back_s"] = round(firsts[rank]["t"] - t0, 3)
        out["back_participants"] = firsts[rank]["participants"]
    out["ok"] = all(survivors) and firsts[rank] is not None
    if not out["ok"]:
        out["error"] = "not every rank committed a step after the fault"
    out["ended"] = how_it_ended(run, out["digests_equal"])
    return out


def how_it_ended(run: dict, digests_equal: bool) -> str:
    """"clean" (every process exited 0, final states equal), else what went wrong after the recovery that
    the drill's times measure: the table marks such a figure (a peer that recovered, then hung, still
    recovered in that time; the reader must see that it did not end well)."""
    if run.get("timed_out"):
        return f"hung: killed at this run's {run['timed_out']:g} s bound, final states not all written"
    if any(c != 0 for c in run["codes"]):
        return f"exit codes {run['codes']}"
    return "clean" if digests_equal else "final states differ"


def steady_ms(run: dict, warmup: int) -> Optional[List[float]]:
    """Rank 0's step times (ms) after the warm-up, all ranks participating; None if the run failed."""
    ms = [float(r["ms"]) for r in run["records"] if r["event"] == "step" and r["rank"] == 0
          and r["step"] > warmup and r.get("participants", WORLD) == WORLD]
    return ms if ms and all(c == 0 for c in run["codes"]) else None


# ---------------------------------------------------------------------------------------- table
def rows(res: dict) -> List[tuple]:
    """(drill, figure, mindio strategy, mindio value, peer and settings, peer value, unit) per comparison."""
    rec, ha, pr = res.get("recovery", {}), res.get("ha", {}), res.get("peers", {})

    def mio(name):
        r = rec.get(name, {})
        return r.get("recovery_s") if r.get("ok") else FAILED if r else None

    out = []
    def peer(r, key):
        return Marked(r[key], r["ended"]) if r and key in r and r.get("ended", "clean") != "clean" \
            else r.get(key, FAILED) if r else None

    for st in ("default", "tuned"):
        k = pr.get(f"torchft-kill-{st}", {})
        out.append(("kill rank 1", "survivors commit a step again", "recover-in-place",
                    mio("recover-in-place"), f"torchft {st}", peer(k, "survivors_s"), "s"))
        out.append(("kill rank 1", "killed rank back, with its state", "recover-in-place",
                    mio("recover-in-place"), f"torchft {st}", peer(k, "back_s"), "s"))
    # a generic exception raised outside the optimizer update is retried in place (issue 33); the dump
    # (a repeat, or one inside the update) is its own row
    raise_ = (("retry (raise outside update)", "retry-raise"), ("dump (any error)", "dump"))
    for st in ("default", "tuned"):
        n = pr.get(f"nvrx-raise-{st}", {})
        for strategy, name in raise_:
            out.append(("rank 1 raises", "every rank training again", strategy, mio(name),
                        f"NVRx in-process {st}", peer(n, "back_s"), "s"))
    for st in ("default", "tuned"):
        k = pr.get(f"torchft-raise-{st}", {})
        for strategy, name in raise_:
            out.append(("rank 1 raises", "survivors commit a step again", strategy, mio(name),
                        f"torchft {st}", peer(k, "survivors_s"), "s"))
            out.append(("rank 1 raises", "raising rank back, with its state", strategy, mio(name),
                        f"torchft {st}", peer(k, "back_s"), "s"))
    on = ha.get("configs", {}).get("on", {}).get("ratio", FAILED if ha else None)
    ddp = pr.get("steady-ddp", {}).get("median_ms")
    for ft, label in (("torchft", "torchft DDP + Manager"), ("nvrx", "NVRx Wrapper")):
        s = pr.get(f"steady-{ft}", {}).get("median_ms")
        ran = f"steady-{ft}" in pr or "steady-ddp" in pr
        out.append(("no fault", "step time, FT on / FT off", "replicas + control plane", on, label,
                    s / ddp if s and ddp else FAILED if ran else None, "x"))
    return out


class Marked(float):
    """A peer's figure from a run that did not end cleanly (``ended`` says how): shown with a mark and a
    footnote, never silently as if the run had gone well."""

    def __new__(cls, value, ended):
        obj = super().__new__(cls, value)
        obj.ended = ended
        return obj


def table(res: dict) -> str:
    notes: List[str] = []

    def fig(x, unit):
        text = ("not run" if x is None else "FAILED" if x is FAILED else f"{x:.2f} s" if unit == "s"
                else f"x{x:.3f}")
        if isinstance(x, Marked):
            if x.ended not in notes:
                notes.append(x.ended)
            text += "*" * (notes.index(x.ended) + 1)
        return text

    out = [f"{'drill':14} {'figure':34} {'mindio':37} {'peer (settings)':34} {'mindio/peer':>11}"]
    for d, f, ms, mv, ps, pv, unit in rows(res):
        known = all(isinstance(x, (int, float)) for x in (mv, pv)) and pv
        ratio = f"{mv / pv:.2f}" if known else "-"
        out.append(f"{d:14} {f:34} {fig(mv, unit) + ' ' + ms:37} {fig(pv, unit) + ' ' + ps:34} {ratio:>11}")
    out += [f"{'*' * (i + 1)} that run recovered in this time, then: {n}" for i, n in enumerate(notes)]
    return "\n".join(out)


def details(res: dict) -> str:
    pr = res.get("peers", {})
    rows = []
    for name, r in pr.items():
        keep = {k: v for k, v in r.items() if k not in ("records", "tail")}
        rows.append(f"  {name}: {json.dumps(keep)}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1g", choices=list(_sizes.SIZES))
    p.add_argument("--fault-step", type=int, default=8)
    p.add_argument("--steady-steps", type=int, default=None, help="steps of the steady-state runs "
                   "(default: 60, 15 at 1g)")
    p.add_argument("--ha-rounds", type=int, default=None, help="ha_overhead rounds (default 3, 2 at 1g)")
    p.add_argument("--steady-rounds", type=int, default=None,
                   help="rounds of the peers' steady-state runs, alternated (default 3, 2 at 1g)")
    p.add_argument("--peer-timeout", type=float, default=None, help="seconds per peer run")
    p.add_argument("--skip", default="", help="comma list of parts to skip: recovery,ha,peers")
    p.add_argument("--peer-runs", default="", help="only these peer runs (comma list of: steady, "
                   "torchft-kill-default, torchft-kill-tuned, torchft-raise-default, torchft-raise-tuned, "
                   "nvrx-raise-default, nvrx-raise-tuned); default: all")
    p.add_argument("--only", default=",".join(recovery_bench.STRATEGIES),
                   help="the recovery bench's strategies (comma list; default: all)")
    p.add_argument("--json", default=None, help="write every figure here")
    a = p.parse_args(argv)
    big = a.size == "1g"
    a.steady_steps = a.steady_steps or (15 if big else 60)
    a.ha_rounds = a.ha_rounds or (2 if big else 3)
    a.steady_rounds = a.steady_rounds or (2 if big else 3)
    a.peer_timeout = a.peer_timeout or (900 if big else 300)
    skip = {s for s in a.skip.split(",") if s}
    a.peer_runs = {s for s in a.peer_runs.split(",") if s}
    t_start = time.time()
    print(f"[peers] {_sizes.get(a.size).describe()}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs at the start", flush=True)
    res: Dict[str, dict] = {}
    if "recovery" not in skip:
        ra = recovery_bench.parser().parse_args(["--size", a.size, "--fault-step", str(a.fault_step),
                                                 "--steps", str(a.fault_step + 2)])
        res["recovery"] = recovery_bench.run_all([x for x in a.only.split(",") if x], ra)
        res["recovery_text"] = recovery_bench.report(res["recovery"], ra)
        print(res["recovery_text"], flush=True)
    if "ha" not in skip:
        iters, warm = (12, 2) if big else (60, 5)
        try:
            res["ha"] = ha_overhead.measure(a.size, WORLD, iters, warm, a.ha_rounds,
                                            echo=lambda s: print(f"[ha] {s}", flush=True))
            res["ha_text"] = ha_overhead.report(res["ha"])
            print(res["ha_text"], flush=True)
        except SystemExit as exc:  # a run failed twice (ha_overhead.run)
            res["ha"] = {"error": str(exc)}
            print(f"[ha] FAILED: {exc}", flush=True)
    if "peers" not in skip:
        res["peers"] = peers(a)
    print(f"\nmindio vs peers, size {a.size} ({_sizes.get(a.size).params / 1e6:.1f} M params), {WORLD} "
          f"processes, gloo/CPU, fault on rank {FAULT_RANK} before step {a.fault_step}; "
          f"{time.time() - t_start:.0f} s in all; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs at the end")
    print(table(res))
    print("details:\n" + details(res))
    targets = [x for key in ("recovery_text", "ha_text") for x in res.get(key, "").splitlines()
               if x.startswith("target ")]
    targets += [f"target {x}" for x in raise_targets(res)]
    if targets:
        print("targets (issues 18, 33; for an idle machine):\n" + "\n".join(f"  {x[7:]}" for x in targets))
    if a.json:
        Path(a.json).write_text(json.dumps({k: v for k, v in res.items()}, indent=1, default=str))
    failed = [d + ": " + f for d, f, _, mv, _, pv, _ in rows(res) if FAILED in (mv, pv)]
    if failed:
        print(f"{len(failed)} figure(s) FAILED: see the details and the [bench] / [peers] lines above")
    return 1 if failed else 0


def raise_targets(res: dict) -> List[str]:
    """Issue 33: every "rank 1 raises" row has mindio's retry ahead of the peer (PASS / FAIL per row)."""
    out = []
    for d, f, ms, mv, ps, pv, _ in rows(res):
        if d != "rank 1 raises" or not ms.startswith("retry"):
            continue
        decided = res.get("recovery", {}).get("retry-raise", {}).get("decision")
        if decided not in (None, "retry"):
            out.append(f"FAIL: rank 1 raises, {f} vs {ps}: the controller decided {decided}, not the retry")
        elif isinstance(mv, (int, float)) and isinstance(pv, (int, float)) and pv:
            out.append(f"{'PASS' if mv < pv else 'FAIL'}: rank 1 raises, {f}: mindio retry {mv:.2f} s < {ps} "
                       f"{pv:.2f} s")
        else:
            out.append(f"n/a: rank 1 raises, {f} vs {ps}: no figure ({mv}, {pv})")
    return out


def peers(a) -> dict:
    out: Dict[str, dict] = {}
    root = Path(tempfile.mkdtemp(prefix="mindio-peers-"))
    inj = lambda kind: f"{kind}:rank={FAULT_RANK},step={a.fault_step}"  # noqa: E731
    warm = 2 if a.size == "1g" else 5
    want = lambda name: not a.peer_runs or name in a.peer_runs  # noqa: E731
    try:
        steady: Dict[str, List[float]] = {ft: [] for ft in ("ddp", "torchft", "nvrx")}
        for rnd in range(a.steady_rounds if want("steady") else 0):  # alternated, so that drift of the machine hits all alike
            for ft in steady:
                print(f"[peers] steady {ft}, round {rnd + 1}", flush=True)
                run = peer_run(ft, a, root / f"steady-{ft}-{rnd}")
                ms = steady_ms(run, warm)
                if ms is None:
                    _echo(f"steady-{ft}", {"ok": False, "codes": run["codes"]}, run)
                    continue
                steady[ft] += ms
                print(f"[peers] steady {ft}, round {rnd + 1}: median {statistics.median(ms):.1f} ms", flush=True)
        for ft, ms in steady.items() if want("steady") else ():
            out[f"steady-{ft}"] = ({"ok": True, "median_ms": round(statistics.median(ms), 2), "n": len(ms)}
                                   if ms else {"ok": False, "error": "no run finished"})
        ddp_s = (out.get("steady-ddp", {}).get("median_ms") or 1000) / 1000
        for st in ("default", "tuned"):
            for kind in ("kill", "raise"):
                name = f"torchft-{kind}-{st}"
                if not want(name):
                    continue
                print(f"[peers] {name}", flush=True)
                run = peer_run("torchft", a, root / name, settings=st, inject=inj(kind))
                out[name] = drill_figures(run)
                _echo(name, out[name], run)
            name = f"nvrx-raise-{st}"
            if not want(name):
                continue
            # NVRx's gloo timeout: 10 s in its CPU examples (default); tuned: 3 plain DDP steps, within
            # [2 s, 10 s] (shorter risks firing in fault-free training when ranks drift apart)
            gto = 10.0 if st == "default" else min(10.0, max(2.0, round(3 * ddp_s, 1)))
            print(f"[peers] {name} (gloo timeout {gto} s)", flush=True)
            run = peer_run("nvrx", a, root / name, settings=st, inject=inj("raise"), gloo_timeout=gto)
            out[name] = {**drill_figures(run), "gloo_timeout_s": gto}
            _echo(name, out[name], run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _echo(name: str, fig: dict, run: dict) -> None:
    print(f"[peers] {name}: {json.dumps(fig)}", flush=True)
    if not fig.get("ok"):
        print(f"[peers] {name}: last output lines:\n" + "\n".join(run["tail"]), flush=True)


if __name__ == "__main__":
    sys.exit(main())

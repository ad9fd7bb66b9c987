"""mindio demo: a 4-rank Megatron GPT run (CPU, gloo) hit by faults, recovering bit for bit.

1. A fault-free reference run: ``mindio-run --nproc-per-node 4 pretrain_gpt.py`` for 12 steps (DP=4,
   every optimizer shard kept on 2 ranks); it prints ``state-digest: <sha256>`` over every parameter
   and every optimizer state.
2. **Retry** (``--enable-hbmfault-repair``): rank 1's optimizer shard is overwritten with NaN and it
   raises ``UCE ERROR`` at step 5. The processes stay up: the controller stops every rank at the last
   completed step, rebuilds the process groups, repairs rank 1's shard from its replica, rolls every
   rank back and re-enters ``train()``.
3. **Recover in place** (``HIGH_AVAILABILITY=recover-in-place,dump``): rank 3 is SIGKILLed at step 7.
   ``mindio-run``'s agent hosts the controller (rank -1), sees the death at once and starts only rank
   3 again, in a warm pre-started interpreter; the survivors keep running, rebuild their process
   groups with it, its optimizer shard and training state come from its replica, every rank rolls
   back to step 6 and goes on.
4. **Dump + relaunch** (``--enable-high-availability``): rank 2 raises an unknown error at step 9. The
   controller has one healthy holder of every shard write a last-words checkpoint at step 8, the job
   exits with code 75, ``mindio-run --max-restarts 1`` starts it again and it resumes from step 8.

Every faulty run must end with the reference digest: nothing lost, nothing corrupted. Each run writes
its own event log (``events-<run>.jsonl``) and the demo draws each faulty run's recovery with
``mindio timeline`` (``timeline-<run>.svg``, one lane per rank, every phase with its duration).
Run it with ``bash scripts/demo.sh`` (installs everything first) or ``.venv/bin/python examples/demo.py``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mindio._ports import free_port  # outside the ephemeral range (mindio/_ports.py)

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "examples" / "megatron" / "pretrain_gpt.py"
STEPS = 12
COMMON = ["--use-distributed-optimizer", "--train-iters", str(STEPS), "--seed", "1234"]


def mindio_run(args, env_extra, timeout=300, max_restarts=0):
    cmd = [sys.executable, "-W", "ignore", "-m", "mindio.launch.cli", "--nproc-per-node", "4",
           "--master-port", str(free_port()), "--max-restarts", str(max_restarts), str(PRETRAIN), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TTP_PORT": str(free_port()),
           "PYTHONPATH": str(REPO), **env_extra}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:  # stream it, so the user sees the run as it happens
            lines.append((time.monotonic() - t0, line.rstrip()))
            if _interesting(line):
                print(f"    {lines[-1][0]:6.1f}s  {line.rstrip()}", flush=True)
        proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"demo: the run did not finish within {timeout} s")
    return proc.returncode, lines


def _interesting(line: str) -> bool:
    keys = ("iteration", "state-digest", "inject", "dump", "saved checkpoint", "loaded checkpoint",
            "round", "mindio-run", "Error", "error", "exiting")
    return any(k in line for k in keys) and "Traceback" not in line


def digest(lines) -> str:
    found = [m.group(1) for _, l in lines if (m := re.search(r"state-digest: ([0-9a-f]{64})", l))]
    if not found:
        raise SystemExit("demo: the run printed no state digest; see its output above")
    return found[-1]


def steps_done(lines) -> list:
    """The iterations the run reported as completed, in order (rank 0 prints each one once)."""
    return [int(m.group(1)) for _, l in lines if (m := re.search(r"iteration\s+(\d+)/\d+ \|", l))]


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="mindio-demo-"))
    env = {"MINDIO_ACP_DIR": str(work / "acp"), "MINDIO_ACP_POOL_MB": "256", "MINDIO_ACP_IDLE_EXIT": "20",
           "TTP_LOG_PATH": str(work / "logs"), "MINDIO_EVENT_LOG": str(work / "events-reference.jsonl"),
           "MINDIO_DRILL_DIR": str(work / "drill")}  # each injected fault fires once per job
    events = lambda name: {"MINDIO_EVENT_LOG": str(work / f"events-{name}.jsonl")}  # noqa: E731 one log per run
    (work / "drill").mkdir()
    print(f"[1/4] fault-free reference run: {STEPS} steps, 4 ranks (DP=4, optimizer shards on 2 ranks each)")
    rc, ref = mindio_run(COMMON + ["--enable-high-availability", "--save", str(work / "ckpt-reference")], env)
    if rc != 0:
        raise SystemExit(f"demo: the reference run failed with exit code {rc}")
    want = digest(ref)

    print("\n[2/4] retry: UCE error on rank 1 at step 5 (its optimizer shard is destroyed first)")
    rc, retry = mindio_run(COMMON + ["--enable-hbmfault-repair", "--save", str(work / "ckpt-retry"),
                                     "--inject", "uce:rank=1,step=5"],
                           {**env, **events("retry")})
    if rc != 0:
        raise SystemExit(f"demo: the retry run failed with exit code {rc}")
    fault_t = next((t for t, l in retry if "inject" in l), None)
    resumed_t = next((t for t, l in retry if fault_t is not None and t > fault_t
                      and re.search(r"iteration\s+5/", l)), None)
    restarted = any(re.search(r"(restarting|relaunching) every worker", l) for _, l in retry)

    print("\n[3/4] recover in place: rank 3 is SIGKILLed at step 7; only that process is started again")
    rc, recover = mindio_run(COMMON + ["--enable-high-availability", "--save", str(work / "ckpt-recover"),
                                       "--inject", "kill:rank=3,step=7"],
                             {**env, "HIGH_AVAILABILITY": "recover-in-place,dump", **events("recover")})
    if rc != 0:
        raise SystemExit(f"demo: the recover-in-place run failed with exit code {rc}")
    kill_t = next((t for t, l in recover if "inject" in l), None)
    back_t = next((t for t, l in recover if kill_t is not None and t > kill_t
                   and re.search(r"iteration\s+7/", l)), None)

    ckpt = work / "ckpt"
    print("\n[4/4] dump + relaunch: unknown error on rank 2 at step 9; mindio-run may restart the job once")
    args = COMMON + ["--enable-high-availability", "--save", str(ckpt), "--load", str(ckpt),
                     "--inject", "raise:rank=2,step=9"]
    rc, dump = mindio_run(args, {**env, **events("dump")}, max_restarts=1)
    if rc != 0:
        raise SystemExit(f"demo: the dump + relaunch run failed with exit code {rc}")
    loaded = [int(m.group(1)) for _, l in dump if (m := re.search(r"loaded checkpoint iteration (\d+)", l))]

    print("\nresult")
    ok = True
    for name, lines in (("retry", retry), ("recover in place", recover), ("dump + relaunch", dump)):
        got = digest(lines)
        same = got == want
        ok &= same
        print(f"  {name:16} digest {got[:16]}... {'== reference' if same else '!= reference  MISMATCH'}")
    if fault_t is not None and resumed_t is not None:
        print(f"  retry: fault -> step 5 done again in {resumed_t - fault_t:.1f} s, "
              f"{'job restarted' if restarted else 'no process restarted'}, no step lost")
    log = work / "events-recover.jsonl"
    events = [json.loads(l) for l in log.read_text().splitlines() if l.strip()] if log.exists() else []
    replaced = [e for e in events if e.get("kind") == "recover_done"]
    lost = sorted(set(range(1, STEPS + 1)) - set(steps_done(recover)))
    took = f"SIGKILL -> step 7 done again in {back_t - kill_t:.1f} s" if kill_t and back_t else "no timing"
    if replaced and replaced[0].get("replaced") == [3]:
        print(f"  recover in place: {took}, only rank 3's process replaced, steps lost: {len(lost)} {lost or ''}")
    else:
        print("  recover in place: NOT recovered in place (no recover_done event for rank 3)")
    ok &= bool(replaced) and replaced[0].get("replaced") == [3] and not lost
    if loaded:
        print(f"  dump: fault at step 9, last-words checkpoint at step {loaded[0]}, "
              f"steps lost: {max(0, 8 - loaded[0])}")
    print(f"  reference digest {want}")
    print(f"  logs and event logs (JSON lines): {work}")
    print("\nrecovery timelines (mindio timeline EVENTS.jsonl -o FILE.svg|html):")
    for name in ("retry", "recover", "dump"):
        out = work / f"timeline-{name}.svg"
        subprocess.run([sys.executable, "-m", "mindio.cli", "timeline", str(work / f"events-{name}.jsonl"),
                        "-o", str(out), "--title", f"mindio demo: {name}"], check=False, timeout=120)
    if not ok:
        print("demo: a recovered run differs from the reference", file=sys.stderr)
        return 1
    print("  bit-for-bit identical: nothing was lost or corrupted by the faults")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Preemption (issue 19): a scheduler's SIGTERM becomes a last-words checkpoint at the current step.

The user's loop is tests/dropin/plain_loop.py (the reference ``tft_*`` API only, save and rename
handlers, resuming from ``ckpt/latest`` with ``--resume``); real mindio-run agents, real worker
processes, real gloo. Nothing of mindio's internals is called: the test sends signals and reads files.

* SIGTERM to ``mindio-run`` (Kubernetes signals the container's first process), with the controller in
  rank 0 or in mindio-run: every worker exits with 75 after a checkpoint of a step no earlier than the
  last one finished before the signal, mindio-run exits with 75 well inside a 30 s grace period, and
  running the job again resumes from it, bitwise equal to the fault-free run.
* SIGTERM to one worker under ``--max-restarts 1 --high-availability dump`` (the controller hosted by
  the agent): the same checkpoint, then the agent relaunches every worker, which resume from it; the
  job ends 0, bitwise equal too.
"""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from tests._exits import assert_no_signal_deaths, check_codes
from tests.dropin.test_plain_loop import STEPS, Run, assert_bitwise, assert_same_data, reference  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow
GRACE_S = 30.0  # Kubernetes' terminationGracePeriodSeconds and Slurm's KillWait default
SIGNAL_AFTER = 3  # steps every rank finished before the signal
SLOW = ["--step-sleep", "1.0"]  # >= 6 s of training left when the signal comes (a relaunched round: unpaced)


def _trained(out: Path) -> dict:
    """rank -> the last step it finished (its ``trained_rank<r>`` file)."""
    last = {}
    for rank in range(4):
        path = out / f"trained_rank{rank}"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # complete lines only
        last[rank] = int(lines[-1].split()[0]) if lines else 0
    return last


def _wait_for_steps(out: Path, step: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while min((last := _trained(out)).values()) < step:
        assert time.monotonic() < deadline, f"ranks did not all finish step {step} within {timeout} s: {last}"
        time.sleep(0.05)
    return last


def _assert_workers_exited(run: Run, code: int) -> None:
    """Every worker said it exits with ``code`` (its decorator's line), and none died by a signal."""
    for rank in range(4):
        assert re.search(rf"\[0/{rank}\][^\n]*exiting with code {code}:", run.text), (rank, run.tail())
    assert_no_signal_deaths(run.text)


def _rounds(run: Run) -> list:
    """{rank: exit code} of every round's workers that did not all exit 0, from mindio-run's "workers'
    exit codes" lines (a worker that died by a signal is missing: "rank 1: signal SIGKILL"); a round
    whose workers all exited 0 says "all workers finished" instead."""
    return [{int(r): int(c) for r, c in re.findall(r"rank (\d+): exit code (-?\d+)", line)}
            for line in run.text.splitlines() if "workers' exit codes:" in line]


def _checkpoint(out: Path) -> int:
    ckpt = out / "ckpt"
    step = int((ckpt / "latest").read_text())
    assert len(list((ckpt / f"step_{step}").glob("rank*.pt"))) == 2  # one rank per shard saved it
    assert (out / "renames").read_text().split() == [str(step)]  # renamed once: complete
    return step


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ha", [False, True], ids=["controller-in-rank-0", "controller-in-mindio-run"])
def test_sigterm_to_mindio_run_checkpoints_the_current_step_and_the_rerun_resumes_bitwise(tmp_path, reference, ha):
    """Without --high-availability the agent forwards the signal and the workers ask rank 0's controller;
    with it the agent asks the controller it hosts (the rerun is the same in both: run once)."""
    out = tmp_path / "job"
    seen: dict = {}

    def preempt(p):
        seen["before"] = _wait_for_steps(out, SIGNAL_AFTER)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)  # to the agent only, as Kubernetes does (its own session)
        p.wait(60)
        seen["exit_s"] = time.monotonic() - t0

    run = Run(out, ["--resume", *SLOW], "mindio-run", during=preempt,
              launcher_args=["--high-availability", "dump"] if ha else [])
    print(f"\nSIGTERM after step {max(seen['before'].values())} -> mindio-run exited {run.code} in "
          f"{seen['exit_s']:.2f} s")
    check_codes({"mindio-run": run.code})
    assert run.code == 75, run.tail()
    assert seen["exit_s"] < GRACE_S, run.tail()
    assert "mindio-run: job stopped: a last-words checkpoint was written (workers exited 75) after: preemption " \
           "(SIGTERM to node 0's mindio-run); run it again" in run.text, run.tail()
    _assert_workers_exited(run, 75)
    assert _rounds(run) == [{r: 75 for r in range(4)}], run.tail()
    step = _checkpoint(out)
    after = _trained(out)
    # the step the ranks were at: none lost of those finished before the signal, none beyond what trained
    assert max(seen["before"].values()) <= step <= max(after.values()) < STEPS, (seen["before"], step, after)
    requested = run.events("dump_requested")
    # asked by the agent itself (it hosts the controller), or by a worker the agent forwarded the signal to
    want = r"SIGTERM to node 0's mindio-run" if ha else r"rank \d: SIGTERM"
    assert requested and re.fullmatch(want, requested[0]["why"]), requested
    if ha:
        return

    rerun = Run(out, ["--resume"], "mindio-run")
    check_codes({"mindio-run": rerun.code})
    assert rerun.code == 0, rerun.tail()
    assert_no_signal_deaths(rerun.text)
    assert _rounds(rerun) == [] and "round 0: all workers finished" in rerun.text, rerun.tail()
    steps = [int(line.split()[0]) for line in (out / "trained_rank0").read_text().splitlines()]
    assert steps[len(steps) - (STEPS - step):] == list(range(step + 1, STEPS + 1)), steps  # resumed after it
    assert_bitwise(rerun.final(), reference)
    assert_same_data(rerun, reference)  # the rerun's DataLoader went on where the checkpoint left it


@pytest.mark.timeout(400)
def test_sigterm_to_a_worker_checkpoints_and_max_restarts_resumes_bitwise(tmp_path, reference):
    out = tmp_path / "job"
    seen: dict = {}

    def preempt_rank2(p):
        seen["before"] = _wait_for_steps(out, SIGNAL_AFTER)
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x]
        pid = next(e["pid"] for e in events if e["kind"] == "step_done" and e["rank"] == 2)
        seen["pid"] = pid
        import os

        os.kill(pid, signal.SIGTERM)

    run = Run(out, ["--resume", *SLOW], "mindio-run", during=preempt_rank2,
              launcher_args=["--max-restarts", "1", "--high-availability", "dump"])
    check_codes({"mindio-run": run.code})
    assert run.code == 0, run.tail()
    assert "mindio-run: round 0: a last-words checkpoint was written (workers exited 75)" in run.text, run.tail()
    assert "relaunching every worker to resume from it (restart 1 of 1)" in run.text, run.tail()
    _assert_workers_exited(run, 75)
    assert _rounds(run) == [{r: 75 for r in range(4)}] and "round 1: all workers finished" in run.text, run.tail()
    step = _checkpoint(out)
    assert max(seen["before"].values()) <= step < STEPS, (seen["before"], step)
    requested = run.events("dump_requested")
    assert requested and requested[0]["why"] == "rank 2: SIGTERM", requested
    steps = [int(line.split()[0]) for line in (out / "trained_rank2").read_text().splitlines()]
    assert steps[len(steps) - (STEPS - step):] == list(range(step + 1, STEPS + 1)), steps
    assert_bitwise(run.final(), reference)
    assert_same_data(run, reference)


@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_reaches_the_workers_which_checkpoint_and_exit_75(tmp_path):
    """torchrun forwards SIGTERM to its workers (SIGKILL 30 s later): their processors turn it into the
    same checkpoint. torchrun itself ends with its SignalException (exit 1), as without mindio."""
    out = tmp_path / "job"
    seen: dict = {}

    def preempt(p):
        seen["before"] = _wait_for_steps(out, SIGNAL_AFTER)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(60)
        seen["exit_s"] = time.monotonic() - t0

    run = Run(out, ["--resume", *SLOW], "torchrun", during=preempt)
    print(f"\nSIGTERM to torchrun -> exited {run.code} in {seen['exit_s']:.2f} s")
    check_codes({"torchrun": run.code})
    assert run.code == 1 and "SignalException" in run.text, run.tail()
    assert seen["exit_s"] < GRACE_S, run.tail()
    _assert_workers_exited(run, 75)
    step = _checkpoint(out)
    assert max(seen["before"].values()) <= step < STEPS, (seen["before"], step)

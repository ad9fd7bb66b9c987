"""docs/quickstart.md's DDP loop (examples/pytorch/quickstart_ddp.py) as a newcomer runs it (issue 30).

4 ranks of torch's own DistributedDataParallel on gloo, written only against the ``tft_*`` API and
``mindio.adapter.wrap_ddp``; faults from outside where a signal can make them (``kill -9`` of a rank's
process, its pid read from the event log), else by the loop's ``--inject`` drill (mindio.drill). Every
run ends as the quickstart promises: bitwise equal to the fault-free run (a UCE retried in place, a
killed or hung rank replaced under mindio-run) or in a last-words checkpoint (a raise; a kill under
torchrun). A fault-free run under torchrun prints no WARNING line at all.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mindio._ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pytorch" / "quickstart_ddp.py"
DOC = REPO / "docs" / "quickstart.md"
STEPS = 200  # a kill from outside lands while training runs (~1-5 s of steps after step 4)
LAUNCHERS = {"torchrun": "torch.distributed.run", "mindio-run": "mindio.launch.cli"}


class Job:
    """One 4-rank run of the quickstart's loop in ``cwd`` (its ckpt/ goes there): exit code, output."""

    def __init__(self, cwd: Path, launcher: str = "torchrun", launcher_args=(), args=(), env=None,
                 timeout: float = 120, during=None, script: Path = SCRIPT):
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd, self.events_path = cwd, cwd / "events.jsonl"
        full = {k: v for k, v in os.environ.items() if k not in ("HIGH_AVAILABILITY", "MINDIO_SECRET")}
        self.tmp = cwd / "tmp"  # the job's temporary directory: the one-node secret's private file goes there
        self.tmp.mkdir(mode=0o700, exist_ok=True)
        full.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_PORT=str(free_port()),
                    MINDIO_EVENT_LOG=str(self.events_path), TMPDIR=str(self.tmp), **(env or {}))
        cmd = [sys.executable, "-m", LAUNCHERS[launcher], "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), *launcher_args, str(script), "--steps", str(STEPS), *args]
        p = subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        lines: list = []
        reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
        reader.start()
        try:
            if during is not None:
                during(self, lines)
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            hung = p.poll() is None
            if hung:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher's session: it and every worker it started
                p.wait()
            reader.join(30)
        self.text, self.code = "".join(lines), p.returncode
        assert not hung, f"the job did not end within {timeout} s:\n{self.tail()}"

    def tail(self) -> str:
        return self.text[-6000:]

    def secrets_left(self) -> list:
        """The job secret's private files still in the job's temporary directory after it ended."""
        return sorted(p.name for p in self.tmp.glob("mindio-secret-*"))

    def events(self, kind: str) -> list:
        lines = self.events_path.read_text().splitlines() if self.events_path.exists() else []
        return [e for e in map(json.loads, filter(None, lines)) if e["kind"] == kind]

    def digests(self) -> dict:
        """{rank: digest} of the final state each rank printed (at step STEPS)."""
        found = re.findall(rf"rank (\d) step {STEPS} digest ([0-9a-f]{{64}})", self.text)
        return {int(r): d for r, d in found}


def wait_for(lines: list, pattern: str, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while not any(re.search(pattern, line) for line in list(lines)):
        assert time.monotonic() < end, f"no line matching {pattern!r} within {timeout} s:\n{''.join(lines)[-3000:]}"
        time.sleep(0.05)


def kill_rank(rank: int, at_step: int):
    """``during``: once rank 0 printed step ``at_step``, SIGKILL rank ``rank``'s process from outside (its
    pid from the event log, which every rank writes into)."""
    def during(job: Job, lines: list) -> None:
        wait_for(lines, rf"^step {at_step} loss")
        records = [json.loads(x) for x in job.events_path.read_text().splitlines() if x.strip()]
        pid = next(e["pid"] for e in records if e.get("rank") == rank)
        os.kill(pid, signal.SIGKILL)
    return during


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("fault-free"))


def test_quickstart_shows_the_example_verbatim():
    """The DDP loop in docs/quickstart.md is examples/pytorch/quickstart_ddp.py, character for character:
    the loop the suite runs is the loop a newcomer copies."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert SCRIPT.read_text() in blocks


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fault_free_run_under_torchrun_prints_no_warning(fault_free):
    """Must show: a fault-free run of the quickstart's loop under torchrun on one node prints no WARNING line
    (mindio's, torch's ``[W...]``, Python's) -- no job secret in the store, no gloo thread left at exit."""
    assert fault_free.code == 0, fault_free.tail()
    digests = fault_free.digests()
    assert sorted(digests) == [0, 1, 2, 3] and len(set(digests.values())) == 1, fault_free.tail()
    noisy = [line for line in fault_free.text.splitlines()
             if re.search(r"WARNING|Warning|^\[?W\d{4}", line)]
    assert not noisy, noisy
    assert fault_free.secrets_left() == []


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_uce_is_retried_in_place_and_bitwise(tmp_path, fault_free):
    """A UCE on rank 1 at step 6 under torchrun: retried in place; the DDP wrapper is re-created
    (wrap_ddp) on every rank, and the run ends bitwise equal to the fault-free one."""
    job = Job(tmp_path, args=["--inject", "uce:rank=1,step=6"])
    assert job.code == 0, job.tail()
    assert len(job.events("retry_done")) == 1, job.tail()
    assert job.digests() == fault_free.digests(), job.tail()


def secondary_line(job: Job) -> None:
    """The gloo errors the peers of rank 1 see are secondary: not one of them at WARNING but the one line
    that says they are expected, with the last step completed."""
    warnings = [line for line in job.text.splitlines() if " WARNING " in line]
    assert not [w for w in warnings if "GLHF" in w or "reporting RS_NORMAL" in w], warnings
    expected = [w for w in warnings if "saw secondary errors" in w]
    assert len(expected) == 1 and "the fault of [1]" in expected[0] and "expected" in expected[0], warnings
    assert "(after step 5)" in expected[0], expected  # the last step completed, said so


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_raise_outside_the_update_is_retried_in_place_and_bitwise(fault_free):
    """Rank 1 raises once at step 6, in its forward pass (outside the optimizer update): the step is rolled
    back and run again on every rank (issue 33), no process restarted, and the run ends bitwise equal to the
    fault-free one."""
    job = Job(fault_free.cwd.parent / "raise-retry", "mindio-run", args=["--inject", "raise:rank=1,step=6"])
    assert job.code == 0, job.tail()
    assert "retry done" in job.text and "exiting with code 75" not in job.text, job.tail()
    assert job.digests() == fault_free.digests() and len(job.digests()) == 4, job.tail()
    secondary_line(job)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_raise_opted_out_of_the_retry_ends_in_a_last_words_checkpoint(tmp_path):
    """The same raise with its class opted out of the retry by the fault table (MINDIO_FAULT_TABLE) under
    mindio-run: the dump of step 5 (``ckpt/latest``), every rank exits 75."""
    table = tmp_path / "table.json"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text('{"patterns": [{"pattern": "RuntimeError:", "level": "RestartBusiness"}]}')
    job = Job(tmp_path, "mindio-run", args=["--inject", "raise:rank=1,step=6"],
              env={"MINDIO_FAULT_TABLE": str(table)})
    assert job.code != 0 and (tmp_path / "ckpt" / "latest").read_text() == "5", job.tail()
    assert (tmp_path / "ckpt" / "step_5_r0.pt").exists() or (tmp_path / "ckpt" / "step_5_r2.pt").exists()
    assert job.text.count("exiting with code 75") == 4 and "workers exited 75" in job.text, job.tail()
    secondary_line(job)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_kill_under_torchrun_is_named_a_death_not_a_preemption(tmp_path):
    """``kill -9`` of rank 3 (from outside) under torchrun: torchrun SIGTERMs the survivors, which is not
    a preemption. The first line about it names the dead rank; the job ends in a last-words checkpoint.
    The controller's same-host pid probe is off (MINDIO_PID_PROBE=0), as for a rank on another node: what
    names the death is the survivors' finding that their launcher's SIGTERM follows a sibling's end."""
    job = Job(tmp_path, during=kill_rank(3, 4), env={"MINDIO_PID_PROBE": "0"})
    assert job.code != 0, job.tail()
    about = r" (WARNING|ERROR) mindio.*(declared dead|checkpoint requested|reporting RS_|incident decision)"
    first = next((line for line in job.text.splitlines() if re.search(about, line)), "")
    assert re.search(r"rank\(s\) \[3\] declared dead", first) and "SIGTERM" not in first, job.tail()
    assert not re.search(r"last-words checkpoint requested \(rank \d: SIGTERM\)", job.text), job.tail()
    dead = job.events("rank_dead")
    assert [(d["dead_rank"], "launcher stops" in d["cause"]) for d in dead] == [(3, True)], dead
    latest = tmp_path / "ckpt" / "latest"
    assert latest.exists() and int(latest.read_text()) >= 4, job.tail()
    # the controller's rank (0) ended by the fast exit after its EXIT order, which skips atexit: its private
    # file of the job secret is removed all the same (before: left in the temporary directory)
    assert job.secrets_left() == [], job.tail()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_killed_rank_is_replaced_under_mindio_run_bitwise(tmp_path, fault_free):
    """``kill -9`` of rank 2 (from outside) under mindio-run --high-availability recover-in-place,dump:
    only rank 2 is replaced; the survivors re-create their DDP wrapper while the replacement builds its
    own, and every rank ends bitwise equal to the fault-free run."""
    job = Job(tmp_path, "mindio-run", ["--high-availability", "recover-in-place,dump"], during=kill_rank(2, 4),
              env={"MINDIO_DRILL_DIR": str(tmp_path)}, timeout=170)
    assert job.code == 0, job.tail()
    done = job.events("recover_done")
    assert [d["replaced"] for d in done] == [[2]], job.tail()
    assert job.digests() == fault_free.digests(), job.tail()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hung_rank_is_replaced_under_mindio_run_bitwise(tmp_path, fault_free):
    """Rank 1 sleeps in step 6 (outside any collective) while its peers wait in DDP's all-reduce, issued
    from autograd: after MINDIO_HANG_TIMEOUT only rank 1 is replaced, and the run ends bitwise equal to the
    fault-free one (needs the processor to see peers blocked in DDP's backward as inside a collective,
    issue 30 item 1)."""
    job = Job(tmp_path, "mindio-run", ["--high-availability", "recover-in-place,dump"],
              args=["--inject", "hang:rank=1,step=6"],
              env={"MINDIO_DRILL_DIR": str(tmp_path), "MINDIO_HANG_TIMEOUT": "5"}, timeout=170)
    assert job.code == 0, job.tail()
    assert [d["replaced"] for d in job.events("recover_done")] == [[1]], job.tail()
    assert job.digests() == fault_free.digests(), job.tail()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_ddp_wrapper_held_at_exit_is_released_without_a_warning(tmp_path):
    """The quickstart's loop without its last ``model = None`` (the DDP wrapper, holding the default group,
    still referenced at exit): mindio's exit teardown makes the wrapper let go of the group, so no gloo
    thread is left running and nothing warns (issue 30 item 9)."""
    script = tmp_path / "keeps_ddp.py"
    source = SCRIPT.read_text()
    assert "\nmodel = None " in source
    script.write_text(source.replace("\nmodel = None ", "\npass  # "))
    job = Job(tmp_path / "run", script=script, args=["--steps", "3"])
    assert job.code == 0 and "rank 3 step 3 digest" in job.text, job.tail()
    assert not [line for line in job.text.splitlines() if "WARNING" in line], job.tail()

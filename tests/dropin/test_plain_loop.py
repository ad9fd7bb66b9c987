"""A user's own training loop recovers through the reference API alone (issue 12).

``plain_loop.py`` is written only against the ``tft_*`` API, as MindSpeed-LLM calls it: no stop, clean or
rebuild handler, no process-group handling, gloo with a 60 s timeout. Real processes under torchrun and
mindio-run (no launcher flag, no HIGH_AVAILABILITY unless a test says so), real gloo, no mocks. What mindio
must do by default: release the peers blocked in a collective with a failed rank (it destroys every
process group itself), dump at the last complete step, retry a UCE in place when the job registered the
repair and rollback handlers, replace a killed rank under mindio-run, and refuse at start what no
launcher here can do.
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
import torch

from mindio._ports import free_port
from tests._samples import assert_data_order

HERE = Path(__file__).resolve().parent
LOOP = HERE / "plain_loop.py"
REPO = HERE.parents[1]
STEPS, FAULT_STEP = 10, 6
LAUNCHERS = {"torchrun": "torch.distributed.run", "mindio-run": "mindio.launch.cli"}
pytestmark = pytest.mark.slow


class Run:
    """One 4-rank job of the plain loop: launcher exit code, output, the time it ended, its files."""

    def __init__(self, out: Path, args: list, launcher: str = "torchrun", launcher_args: list = (),
                 timeout: float = 150, during=None, nproc: int = 4):
        """``during(popen)``: called once the launcher started (e.g. to signal it mid-training)."""
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.nproc = out, nproc
        env = {k: v for k, v in os.environ.items() if k != "HIGH_AVAILABILITY"}  # only what a test asks for
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_PORT=str(free_port()), TTP_LOG_STDOUT="1",
                   MINDIO_EVENT_LOG=str(out / "events.jsonl"))
        cmd = [sys.executable, "-m", LAUNCHERS[launcher], "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), *launcher_args, str(LOOP), "--out", str(out),
               "--steps", str(STEPS), *args]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            if during is not None:  # the output is read meanwhile: a full pipe would stall the job
                chunks: list = []
                reader = threading.Thread(target=lambda: chunks.append(p.stdout.read()), daemon=True)
                reader.start()
                try:
                    during(p)
                    p.wait(timeout)
                finally:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                    reader.join(30)
                    self.text = "".join(chunks)
            else:
                self.text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher's session: it and every worker it started
            text = self.text if during is not None else p.communicate()[0]
            raise AssertionError(f"the job did not end within {timeout} s (a hang):\n{text[-6000:]}")
        self.ended = time.time()
        self.code, self.launcher = p.returncode, launcher

    def events(self, kind: str) -> list:
        path = self.out / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, filter(None, lines)) if e["kind"] == kind]

    def worker_codes(self) -> dict:
        """{rank: exit code} of the workers that failed, from the launcher's summary (signals negative)."""
        if self.launcher == "torchrun":
            found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", self.text)
        else:
            found = re.findall(r"rank (\d+): exit code (-?\d+)", self.text)  # the agent's "workers' exit codes"
        return {int(r): int(c) for r, c in found}

    def final(self) -> list:
        return [torch.load(self.out / f"final_rank{r}.pt") for r in range(self.nproc)]

    def tail(self) -> str:
        return self.text[-6000:]


@pytest.fixture(scope="module")
def reference(fault_free_run):
    """Final state of every rank after a fault-free run (one per session). Its launcher is not what it tests:
    mindio-run's fork server imports torch once for the 4 ranks (torchrun: in each); the launcher changes no
    number (the faulty runs under torchrun and under mindio-run are compared with it)."""
    def run(directory):
        r = Run(Path(directory), ["--repair"], "mindio-run")
        assert r.code == 0, r.tail()
        return Reference(r.final(), samples=r.out)

    return fault_free_run((str(LOOP), "mindio-run", STEPS, "--repair"), run)


class Reference(list):
    """The final state of every rank of the fault-free run; ``samples``: the directory of its sample-id logs."""

    def __init__(self, final: list, samples: Path):
        super().__init__(final)
        self.samples = samples


def assert_same_data(run: "Run", reference: Reference) -> None:
    """Every step of ``run`` trained on the samples the fault-free run's did, each sample once an epoch
    (the loop's DataLoader + DistributedSampler: plain_loop.STEPS_PER_EPOCH steps an epoch)."""
    assert_data_order(run.out, reference.samples, STEPS, steps_per_epoch=4)


def assert_bitwise(got: list, want: list) -> None:
    for rank, (a, b) in enumerate(zip(got, want)):
        assert a["step"] == b["step"] == STEPS, (rank, a["step"], b["step"])
        assert len(a["tensors"]) == len(b["tensors"])
        for i, (x, y) in enumerate(zip(a["tensors"], b["tensors"])):
            assert torch.equal(x, y), f"rank {rank}: tensor {i} differs from the fault-free run"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["torchrun", "mindio-run"])
def test_unknown_error_dumps_the_last_step_and_ends_every_process(tmp_path, launcher):
    """Rank 1 raises at step 6 while its peers wait for it in all_reduce: mindio tears its groups down,
    so they fail at once (no 60 s gloo timeout, no 'no dump possible'); the dump is of step 5, by ranks
    that together hold every shard (rank 1 not among them), renamed once; every process has ended 15 s
    after the fault. Each action of the controller is sent once."""
    run = Run(tmp_path / "run", ["--fault", f"unknown:1:{FAULT_STEP}"], launcher)
    fault_t = float((run.out / "fault_t").read_text())
    codes = run.worker_codes()
    # every rank exits 75 (dumped); torchrun itself SIGTERMs the ranks still exiting once the first ended
    assert run.code != 0 and sorted(codes) == [0, 1, 2, 3] and 75 in codes.values(), run.tail()
    allowed = {75, -signal.SIGTERM} if launcher == "torchrun" else {75}
    assert set(codes.values()) <= allowed, codes
    decision = run.events("decision")
    assert len(decision) == 1 and decision[0]["strategy"] == "dump" and decision[0]["lock_step"] == FAULT_STEP - 1
    savers = sorted(decision[0]["save_info"][0]["ranks"])
    assert 1 not in savers and {r % 2 for r in savers} == {0, 1}, savers  # shard = position mod 2
    ckpt = run.out / "ckpt"
    assert sorted(p.name for p in (ckpt / f"step_{FAULT_STEP - 1}").iterdir()) == [f"rank{r}.pt" for r in savers]
    assert all(torch.load(ckpt / f"step_{FAULT_STEP - 1}" / f"rank{r}.pt")["step"] == FAULT_STEP - 1 for r in savers)
    assert (ckpt / "latest").read_text() == str(FAULT_STEP - 1)
    assert (run.out / "renames").read_text() == f"{FAULT_STEP - 1}\n"  # renamed once
    actions = [e["action"] for e in run.events("action")]
    assert actions.count("stop") == 1 and not run.events("action_resent"), actions
    print(f"\n{launcher}: decision {decision[0]['latency_s']:.2f} s after the fault; every process ended "
          f"{run.ended - fault_t:.2f} s after it")
    assert run.ended - fault_t <= 15, run.tail()


@pytest.mark.timeout(200)
def test_uce_is_retried_from_the_replica_and_bitwise(tmp_path, reference):
    """The same loop with the repair and rollback handlers, and stop and clean handlers that leave the
    groups alone: a UCE on rank 1 at step 6 (its state overwritten first) is retried in place -- rank 1
    repaired from rank 3, the other copy of its shard, every rank rolled back to step 5 -- and every
    rank ends step 10 bitwise equal to the fault-free run."""
    run = Run(tmp_path / "run", ["--repair", "--stop-clean", "--fault", f"uce:1:{FAULT_STEP}"])
    assert run.code == 0, run.tail()
    done = run.events("retry_done")
    assert len(done) == 1 and done[0]["lock_step"] == FAULT_STEP - 1 and done[0]["repaired"] == [1], done
    assert re.search(r"retry: repairing .* from replicas \{'1/0': 3", run.text), run.tail()  # shard 1: ranks 1, 3
    for r in range(4):  # the user's handlers ran; mindio finished the teardown they left
        assert "stop" in (run.out / f"handlers_rank{r}").read_text()
    assert_bitwise(run.final(), reference)
    assert_same_data(run, reference)  # step 6 trained again on its own batch, every sample once an epoch
    fault_t = float((run.out / "fault_t").read_text())
    resumed = max(e["t"] for e in run.events("train_resumed"))
    print(f"\nUCE on rank 1: every rank training again {resumed - fault_t:.3f} s after the fault "
          f"(retry_done.total_s {done[0]['total_s']:.3f} s, from the report)")


@pytest.mark.timeout(300)
def test_killed_ranks_are_replaced_in_place_under_mindio_run(tmp_path, reference):
    """Under mindio-run --high-availability recover-in-place,dump, with only the repair and rollback
    handlers: rank 1 SIGKILLed at step 4, then rank 2 at step 8. Each time only the killed rank is
    replaced (the replacement runs the same script; its state comes from its replica through the repair
    handler); in the second recovery the first replacement rebuilds its groups like any survivor. Every
    rank ends bitwise equal to the fault-free run."""
    run = Run(tmp_path / "run", ["--repair", "--fault", "kill:1:4,kill:2:8"], "mindio-run",
              ["--high-availability", "recover-in-place,dump"], timeout=240)
    assert run.code == 0, run.tail()
    done = run.events("recover_done")
    assert [(d["strategy"], d["replaced"], d["lock_step"]) for d in done] == [
        ("recover-in-place", [1], 3), ("recover-in-place", [2], 7)], done
    assert_bitwise(run.final(), reference)
    assert_same_data(run, reference)  # the replacements found their steps' batches in the DataLoader


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher,fix", [("torchrun", "launch the job with `mindio-run --high-availability"),
                                          ("mindio-run", "add `--high-availability dump,recover-in-place`")])
def test_worker_reboot_without_a_launcher_that_replaces_fails_at_start(tmp_path, launcher, fix):
    """enable_arf asks for worker reboot; without a launcher hosting the controller no process can be
    replaced: the job fails at start with one line saying what to add, not with 76 at the first fault."""
    run = Run(tmp_path / "run", ["--enable-arf"], launcher, timeout=120)
    assert run.code != 0 and not (run.out / "trained_rank0").exists(), run.tail()
    lines = [line for line in run.text.splitlines() if "ConfigError: worker reboot" in line]
    assert lines and all(fix in line for line in lines), run.tail()


@pytest.mark.timeout(200)
def test_timeouts_of_a_group_the_loop_keeps_are_secondary(tmp_path):
    """The loop all-reduces on a group it keeps a reference to, so the failed rank's teardown cannot
    close it: its peers are released only by the group's timeout (5 s here). Those timeouts come after
    the incident began: secondary, never new faults -- the dump of step 5 still happens."""
    run = Run(tmp_path / "run", ["--keep-group", "--pg-timeout", "5", "--fault", f"unknown:1:{FAULT_STEP}"])
    assert set(run.worker_codes().values()) <= {75, -signal.SIGTERM} and 75 in run.worker_codes().values(), \
        run.tail()
    decision = run.events("decision")
    assert len(decision) == 1 and decision[0]["strategy"] == "dump" and decision[0]["faulty"] == [1], decision
    assert (run.out / "ckpt" / "latest").read_text() == str(FAULT_STEP - 1)
    assert len(run.events("secondary_error")) >= 1 and "Timed out" in run.text

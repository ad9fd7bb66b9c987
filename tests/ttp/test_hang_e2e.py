"""Issue #30.1 / #31: a rank of a user's loop hangs (``time.sleep`` in its main thread) under torchrun,
with no hang knob set. The job's 0.1 s steps set the hang bound (1 s, the floor); the controller
names the rank that never entered the collective its peers wait in -- in a DDP loop, where the peers
wait inside ``loss.backward()`` (no ``torch/distributed`` on their stacks), in a plain
``dist.all_reduce`` loop, and in an FSDP2 (``fully_shard``) loop, where the peers wait in the forward's
all-gather -- within 3 s of the hang, kills only it, and the survivors dump the last step. Real processes, real gloo; nothing of mindio's internals in the loop (_hang_loop.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mindio._ports import free_port
from mindio.ttp import EXIT_CODE_DUMPED

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
pytestmark = pytest.mark.slow
HANG_STEP = 35


def _env(out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINDIO_HANG") and k != "HIGH_AVAILABILITY"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_PORT=str(free_port()), TTP_LOG_STDOUT="1",
               MINDIO_EVENT_LOG=str(out / "events.jsonl"))
    return env


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,culprit", [("ddp", 1), ("all_reduce", 2), ("fsdp", 1)], ids=["ddp", "all_reduce", "fsdp"])
def test_a_hung_rank_is_named_within_3_s_and_only_it_is_killed(tmp_path, mode, culprit):
    out = tmp_path / "run"
    out.mkdir()
    env = _env(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(HERE / "_hang_loop.py"), "--out", str(out), "--steps", "40",
           "--hang", f"{culprit}:{HANG_STEP}", *([f"--{mode}"] if mode != "all_reduce" else [])]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        text, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"the job did not end within 120 s:\n{p.communicate()[0][-6000:]}")
    codes = {int(r): int(c) for r, c in
             re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)}
    # the culprit SIGKILLed on the controller's order; the survivors dumped (torchrun may SIGTERM one
    # still exiting once the first ended)
    assert codes.get(culprit) == -signal.SIGKILL and sorted(codes) == [0, 1, 2], text[-6000:]
    assert {c for r, c in codes.items() if r != culprit} <= {EXIT_CODE_DUMPED, -signal.SIGTERM}, codes
    assert EXIT_CODE_DUMPED in codes.values(), codes
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line]
    hung = [e for e in events if e["kind"] == "rank_hung"]
    assert [e["hung_rank"] for e in hung] == [culprit], text[-6000:]  # the peers waiting are not blamed
    assert hung[0]["group"] and sorted(hung[0]["waiting"]) == sorted({0, 1, 2} - {culprit})
    bound = [e for e in events if e["kind"] == "hang_bound"]
    assert len(bound) == 1 and bound[0]["bound_s"] == pytest.approx(max(1.0, 5 * bound[0]["p99_s"]), abs=1e-3), bound
    # 0.1 s steps: 5 x p99 is below the 1 s floor, and the hang is declared within 3 s (beats and the
    # check run each 1 s). On a starved machine the job's own p99 grows (a step of 0.42 s was seen with
    # seven suites on 2 cores), and so does the bound: within bound + 2 s then.
    delay = hung[0]["t"] - float((out / "hang_t").read_text())
    assert delay <= max(3.0, bound[0]["bound_s"] + 2.0), (delay, bound, text[-6000:])
    print(f"\nhang on rank {culprit} named {delay:.2f} s after it began (bound {bound[0]['bound_s']} s)")
    assert re.search(rf"rank {culprit} hung: .* never entered collective #\d+ of process group", text), text[-6000:]
    decision = [e for e in events if e["kind"] == "decision"]
    assert len(decision) == 1 and decision[0]["strategy"] == "dump" and decision[0]["faulty"] == [culprit]
    assert (out / "ckpt" / "latest").read_text() == str(HANG_STEP - 1)


@pytest.mark.timeout(150)
def test_a_rank_writing_a_checkpoint_alone_past_the_job_bound_is_not_hung(tmp_path):
    """Rank 0 alone writes a checkpoint for 6 s (its main thread busy: CPU, storage) at step 30, while its
    DDP peers wait in the step's all-reduce; the job-derived bound is ~1 s. The bound applies to a main
    thread that stopped working (a sleep, a block): this rank is slow, not hung, and the job ends normally."""
    out = tmp_path / "run"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(HERE / "_hang_loop.py"), "--out", str(out), "--steps", "34",
           "--work", "0:30:6", "--ddp"]
    p = subprocess.run(cmd, env=_env(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-6000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line]
    bound = [e for e in events if e["kind"] == "hang_bound"]
    assert len(bound) == 1 and bound[0]["bound_s"] < 6, bound  # the job's bound was in force, below the work
    assert not [e for e in events if e["kind"] in ("rank_hung", "decision")], p.stdout[-6000:]

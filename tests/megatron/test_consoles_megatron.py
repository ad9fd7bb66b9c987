"""The Megatron example refuses ``--enable-high-availability`` without ``--save`` at start, in one line that
says what to give (issue 19: bad combinations fail at start); with ``--no-dump`` it runs and its run agrees:
a fault ends the job with exit 76 and that meaning on the console, not a TypeError of a dump into no
directory (the controller plans no dump)."""
import re

import pytest

from _mgt_launch import PRETRAIN, SLOW_MEGATRON, torchrun

pytestmark = SLOW_MEGATRON
ARGS = ["--use-distributed-optimizer", "--enable-high-availability", "--train-iters", 4,
        "--inject", "raise:rank=1,step=3"]
REFUSAL = "--enable-high-availability needs --save DIR"


@pytest.mark.timeout(300)
def test_high_availability_without_save_is_refused_at_start():
    # one rank: with two, torchrun SIGTERMs the second while it may still be starting (its own policy)
    rc, out = torchrun(PRETRAIN, ARGS, nproc=1, timeout=200, check=False)
    assert rc != 0 and re.findall(r"exitcode\s+:\s*(-?\d+)", out) == ["1"], out[-4000:]
    assert out.count(REFUSAL) == 1 and "or --no-dump to run without one" in out, out[-4000:]  # what to give
    assert "pretrain_gpt.py\", line" not in out, out[-4000:]  # a message, not a worker traceback
    assert "iteration" not in out and "injecting" not in out, out[-4000:]  # refused before any step


@pytest.mark.timeout(300)
def test_no_dump_runs_and_a_fault_ends_the_job_without_a_checkpoint():
    rc, out = torchrun(PRETRAIN, ARGS + ["--no-dump"], nproc=2, timeout=200, check=False)
    assert rc != 0 and sorted(re.findall(r"exitcode\s+:\s*(-?\d+)", out)) == ["76", "76"], out[-4000:]
    assert REFUSAL not in out
    assert "exiting with code 76: stopped on a fault; no new checkpoint" in out
    assert "TypeError" not in out and "dump at step" not in out

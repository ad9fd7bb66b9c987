"""The Megatron example tells at start, in one line, what --enable-high-availability without --save
means, and its run agrees: a fault ends the job with exit 76 and that meaning on the console, not a
TypeError of a dump into no directory (the controller plans no dump)."""
import re

import pytest

from _mgt_launch import PRETRAIN, SLOW_MEGATRON, torchrun

pytestmark = SLOW_MEGATRON


@pytest.mark.timeout(300)
def test_high_availability_without_save_warns_at_start_and_never_dumps():
    args = ["--use-distributed-optimizer", "--enable-high-availability", "--train-iters", 4,
            "--inject", "raise:rank=1,step=3"]
    rc, out = torchrun(PRETRAIN, args, nproc=2, timeout=200, check=False)
    assert rc != 0 and sorted(re.findall(r"exitcode\s+:\s*(-?\d+)", out)) == ["76", "76"], out[-4000:]
    assert out.count("--enable-high-availability without --save") == 1, out[-4000:]
    assert out.index("--enable-high-availability without --save") < re.search(r"iteration\s+1/", out).start()
    assert "exiting with code 76: stopped on a fault; no new checkpoint" in out
    assert "TypeError" not in out and "dump at step" not in out

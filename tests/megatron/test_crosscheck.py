"""The replica cross-check end to end: the Megatron example, 4 ranks, DP=4 with two replicas per shard
(ranks 1 and 3 hold shard 1), ``MINDIO_CROSSCHECK_STEPS=4``. ``--inject flip:rank=1,step=6`` flips the
lowest mantissa bit of one fp32 value of rank 1's shard -- a master weight, or an Adam second moment --
while step 6 is computed: no error, no visible change of the loss. The holders' check finds it within 4
steps, names both holders and the byte range, and stops the job (ReplicaMismatch); before the flip no
check differs."""

import re

import pytest

from _mgt_launch import PRETRAIN, REFERENCE_LAUNCHER, losses, torchrun, SLOW_MEGATRON

pytestmark = SLOW_MEGATRON

EVERY = 4
FAILED = re.compile(r"job failed: rank (\d+) .*?exited with exit code (\d+): ReplicaMismatch.*?; also failed: "
                    r"rank (\d+); then ranks (\d+), (\d+) failed as a consequence")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("state", ["param", "exp_avg_sq"])
def test_a_flipped_low_bit_is_found_within_n_steps(state):
    rc, out = torchrun(PRETRAIN, ["--use-distributed-optimizer", "--replica-cnt", 2, "--train-iters", 12,
                                  "--inject", f"flip:rank=1,step=6,state={state},bit=0"],
                       timeout=150, launcher=REFERENCE_LAUNCHER, env={"MINDIO_CROSSCHECK_STEPS": str(EVERY)},
                       check=False)
    assert rc != 0, out[-3000:]
    assert re.search(rf"\[rank 1\] injecting flip at step 6: {state} of shard tensor \d+, element \d+, bit 0: ",
                     out), out[-3000:]
    found = re.findall(r"ERROR:mindio\.megatron\.optimizer:replica mismatch at step (\d+): optimizer shard 1 "
                       r"differs between its holders, ranks 1 and 3, in bytes (\d+)\.\.(\d+) \(CRC-32 rank 1: "
                       r"[0-9a-f]{8}, rank 3: [0-9a-f]{8}\); every byte is checked once every 4 steps", out)
    assert len(found) == 2, out[-3000:]  # each holder says it, about the same step and slice
    assert found[0] == found[1]
    assert 6 <= int(found[0][0]) < 6 + EVERY, found
    assert "replica mismatch" not in out.split("injecting flip")[0]  # nothing differed before the flip
    assert sorted(losses(out)) == list(range(1, int(found[0][0])))  # the step that found it did not finish
    m = FAILED.search(out)
    assert m, out[-3000:]
    assert {m.group(1), m.group(3)} == {"1", "3"} and m.group(2) == "1" and {m.group(4), m.group(5)} == {"0", "2"}

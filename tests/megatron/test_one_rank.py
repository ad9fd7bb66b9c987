"""mindio.megatron._one_rank: megatron's bucket reduce-scatter / all-gather skip a one-rank group (an
optimizer instance of one rank, d = R) only where they are the identity on the same memory; everything
else reaches torch.distributed. Two real gloo ranks (_one_rank_worker.py)."""

import json
import re

import pytest

from _mgt_launch import REFERENCE_LAUNCHER, REPO, SLOW_MEGATRON, torchrun

pytestmark = SLOW_MEGATRON


@pytest.mark.timeout(180)
def test_skips_only_the_one_rank_identity():
    # the launcher is not what this tests: mindio-run's fork server imports torch and megatron-core once for
    # both ranks (_mgt_launch.reference_run), where torchrun would import them in each
    out = torchrun(REPO / "tests" / "megatron" / "_one_rank_worker.py", [], nproc=2, timeout=150,
                   launcher=REFERENCE_LAUNCHER)
    for rank in (0, 1):
        checks = json.loads(re.search(rf"^RESULT{rank} (.*)$", out, re.M).group(1))
        assert checks and all(checks.values()), (rank, checks)

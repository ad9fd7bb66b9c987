"""The adapter interface outside Megatron: examples/pytorch/train_ddp.py (plain DDP + Adam, 2 ranks).

The in-process drill wipes rank 1's state at step 10 and runs the callbacks as mindio.ttp does
(stop, clean, new world, rebuild, repair from rank 0, rollback); the run must end bit-identical to
one without the drill, with a decreasing loss. With mindio.ttp available the same script also runs
with --enable-high-availability (controller, processors, registered callbacks).
"""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from _mgt_launch import REPO, digests, torchrun  # noqa: E402

SCRIPT = REPO / "examples" / "pytorch" / "train_ddp.py"
pytestmark = pytest.mark.slow


def _losses(out):
    return [float(x) for x in re.findall(r"iteration\s+\d+ \| loss ([0-9.eE+-]+)", out)]


@pytest.fixture(scope="module")
def plain():
    return torchrun(SCRIPT, ["--train-iters", 20], nproc=2, timeout=200)


@pytest.mark.timeout(260)
def test_trains(plain):
    curve = _losses(plain)
    assert len(curve) == 20 and sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.3


@pytest.mark.timeout(260)
def test_drill_repair_is_bitwise(plain):
    out = torchrun(SCRIPT, ["--train-iters", 20, "--drill-step", 10], nproc=2, timeout=200)
    assert "drill: rank 1 repaired from rank 0 at step 10" in out
    assert digests(out)[-1] == digests(plain)[-1]


def _ttp_available() -> bool:
    try:
        from mindio import ttp

        return hasattr(ttp, "tft_init_processor")
    except ImportError:
        return False


@pytest.mark.timeout(260)
@pytest.mark.skipif(not _ttp_available(), reason="mindio.ttp is not available")
def test_high_availability_on_same_digest(plain):
    out = torchrun(SCRIPT, ["--train-iters", 20, "--enable-high-availability"], nproc=2,
                   timeout=200)
    assert digests(out)[-1] == digests(plain)[-1]

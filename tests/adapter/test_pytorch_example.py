"""The adapter interface outside Megatron: examples/pytorch/train_ddp.py (plain DDP + Adam, 2 ranks).

The in-process drill wipes rank 1's state at step 10 and runs the callbacks as mindio.ttp does
(stop, clean, new world, rebuild, repair from rank 0, rollback); the run must end bit-identical to
one without the drill, with a decreasing loss. With mindio.ttp available the same script also runs
with --enable-high-availability (controller, processors, registered callbacks).
"""

import json
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


@pytest.fixture(scope="module")
def plain4():
    return torchrun(SCRIPT, ["--train-iters", 12], nproc=4, timeout=200, launcher="mindio.launch.cli")


@pytest.mark.timeout(400)
@pytest.mark.skipif(not _ttp_available(), reason="mindio.ttp is not available")
def test_ddp_recover_in_place_kills_the_rank_stuck_in_ddp_backward(plain4, tmp_path):
    """4 ranks, rank 1 SIGKILLed at step 7 while its peers are in DDP's backward all-reduce. Ranks 0
    and 3 fail at once and tear down, but their gloo group outlives the teardown (DDP's other bucket
    all-reduces are still in flight on it), so rank 2 stays blocked in the backward. Before, the stop
    waited its full 90 s and the recovery then failed at clean (recover-in-place -> dump -> exit 76).
    Now the controller gives such a rank MINDIO_STOP_STUCK_S (here 3 s), SIGKILLs it and replaces it
    with rank 1; the run ends bit-identical to the uninterrupted one."""
    events = tmp_path / "events.jsonl"
    out = torchrun(SCRIPT, ["--train-iters", 12, "--enable-high-availability", "--inject", "kill:rank=1,step=7",
                            "--save", tmp_path],
                   nproc=4, timeout=300, launcher="mindio.launch.cli",
                   env={"HIGH_AVAILABILITY": "recover-in-place,dump", "MINDIO_STOP_STUCK_S": "3",
                        "MINDIO_EVENT_LOG": str(events), "TTP_LOG_PATH": str(tmp_path / "logs")})
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    stuck = [e for e in evs if e["kind"] == "stop_stuck_killed"]
    done = [e for e in evs if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "recover-in-place", out[-6000:]
    assert len(stuck) == 1 and 1 not in stuck[0]["ranks"], (stuck, out[-6000:])
    assert sorted(done[0]["replaced"]) == sorted([1] + stuck[0]["ranks"]), done
    assert digests(out)[-1] == digests(plain4)[-1]

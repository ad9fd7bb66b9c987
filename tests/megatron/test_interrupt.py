"""An incident's stop interrupts a Megatron step in flight (mindio/megatron/adapter.py: check points before
each module's forward and after each param's gradient accumulation; the processor calls
``MegatronAdapter.interrupt`` at the stop). A step interrupted in its backward leaves gradients that
megatron's DDP hooks never took; after the rollback the following steps are bitwise those of a run that
was never interrupted (2 gloo ranks, _interrupt_worker.py); and the model a retry keeps holds no process
group once its rank tore down, so a peer blocked in a collective with it is released
(_park_release_worker.py)."""
import re

import pytest

from _mgt_launch import REFERENCE_LAUNCHER, REPO, torchrun, SLOW_MEGATRON

pytestmark = SLOW_MEGATRON

WORKER = REPO / "tests" / "megatron" / "_interrupt_worker.py"
# the launcher is not what these runs test: mindio-run's fork server imports torch and megatron-core once for
# both ranks (_mgt_launch.reference_run), where torchrun would import them in each
LAUNCH = REFERENCE_LAUNCHER


def result(where: str) -> tuple:
    out = torchrun(WORKER, [where], nproc=2, timeout=120, launcher=LAUNCH)
    digests = set(re.findall(r"params-digest (\w+)", out))
    norms = set(re.findall(r"grad-norms (\[.*\])", out))
    assert len(digests) == 1 and len(norms) == 1, out[-3000:]
    if where == "cleaned-twice":
        assert out.count("kept across two cleans") == 2, out[-3000:]
    elif where != "plain":
        assert out.count(f"interrupted in the {where}") == 2, out[-3000:]
    return digests.pop(), norms.pop()


@pytest.fixture(scope="module")
def plain():
    """Digest and grad norms of the run that is never interrupted (one per module)."""
    return result("plain")


@pytest.mark.timeout(400)
def test_a_step_interrupted_in_its_backward_or_forward_leaves_no_trace_after_the_rollback(plain):
    assert result("backward") == plain
    assert result("forward") == plain


@pytest.mark.timeout(300)
def test_a_model_kept_across_two_cleans_trains_on_bitwise(plain):
    """A rank held at its fence is torn down during the stop (retry.StopRound) and cleaned again when the
    clean action's FORCE STOP reaches its main thread: the second clean finds no model and must leave the
    kept one alone (it replaced it by an empty one: the retry's repair then failed on the sender, seen
    under load with TP2 x DP2); the rebuild takes it back and the next steps are bitwise."""
    assert result("cleaned-twice") == plain


RELEASE = REPO / "tests" / "megatron" / "_park_release_worker.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_kept_model_holds_no_group_after_an_interrupted_step(where, tmp_path):
    """TP=2: rank 1's step interrupted in its forward or backward, rank 0 blocked in its next TP
    all-reduce; rank 1's teardown keeps the model (groups unplugged) and still releases rank 0 at once.
    In the backward case the autograd engine keeps the queued nodes of the interrupted backward (and the
    TP group their functions saved) until the thread's next backward: the teardown flushes it
    (device.flush_autograd); without that, rank 0 stayed blocked."""
    out = torchrun(RELEASE, [where, tmp_path / "released"], nproc=2, timeout=120, launcher=LAUNCH)
    assert "rank 1 tore down, model kept" in out and "released after" in out, out[-3000:]
    assert "BLOCKED" not in out

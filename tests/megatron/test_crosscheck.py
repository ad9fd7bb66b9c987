"""The replica cross-check and its undo end to end: the Megatron example, 4 ranks, DP=4 with two replicas per
shard (ranks 1 and 3 hold shard 1), ``MINDIO_CROSSCHECK_STEPS=4``. ``--inject flip:rank=1,step=6`` flips the
lowest mantissa bit of one fp32 value of rank 1's shard -- a master weight, or an Adam second moment --
while step 6 is computed: no error, no visible change of the loss. The check (every 4 steps) finds it and
names both holders and the byte range; the job rolls back to the verified state of step 4, recomputes, and
ends bit for bit equal to a fault-free run. Before the flip no check differs."""

import json
import re
import threading

import pytest

from _mgt_launch import PRETRAIN, REFERENCE_LAUNCHER, Run, digests, losses, reference_run, torchrun, SLOW_MEGATRON
from tests._samples import assert_data_order

pytestmark = SLOW_MEGATRON

EVERY = 4
ARGS = ["--use-distributed-optimizer", "--replica-cnt", 2, "--train-iters", 12]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    samples = tmp_path_factory.mktemp("fault-free") / "samples"
    return Run(reference_run(PRETRAIN, ARGS + ["--log-samples", samples], timeout=150), samples)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("state", ["param", "exp_avg_sq"])
def test_a_flipped_low_bit_is_found_and_undone(fault_free, state, tmp_path):
    out = torchrun(PRETRAIN, ARGS + ["--inject", f"flip:rank=1,step=6,state={state},bit=0",
                                     "--log-samples", tmp_path / "s"], timeout=150,
                   launcher=REFERENCE_LAUNCHER, env={"MINDIO_CROSSCHECK_STEPS": str(EVERY)})
    assert re.search(rf"\[rank 1\] injecting flip at step 6: {state} of shard tensor \d+, element \d+, bit 0: ",
                     out), out[-3000:]
    found = re.findall(r"ERROR:mindio\.megatron\.optimizer:replica mismatch at step (\d+): optimizer shard 1 "
                       r"differs between its holders, ranks 1 and 3, in bytes (\d+)\.\.(\d+) \(XXH3-64 rank 1: "
                       r"([0-9a-f]{16}), rank 3: ([0-9a-f]{16})\); every byte is checked once every 4 steps", out)
    assert len(found) == 2 and found[0] == found[1], out[-3000:]  # each holder says it, same step and slice
    assert found[0][3] != found[0][4], found  # the holders' hashes of that slice
    at = int(found[0][0])
    assert 6 <= at < 6 + EVERY, found
    assert "replica mismatch" not in out.split("injecting flip")[0]  # nothing differed before the flip
    undo = re.findall(r"replica mismatch found at step (\d+) \(shard 1, holders \[1, 3\], bytes \d+\.\.\d+\): "
                      r"rolled back to the verified state of step 4; recomputing steps 5\.\.(\d+)", out)
    assert undo == [(str(at), str(at))], out[-3000:]
    assert losses(out) == losses(fault_free)
    assert digests(out)[-1] == digests(fault_free)[-1]
    assert_data_order(tmp_path / "s", fault_free.samples, 12)  # steps 5.. recomputed on the same samples


FAILED = re.compile(r"job failed: rank (\d+) \(node 0, vm\) exited with exit code 1: SubHealthyRank: rank \1 is "
                    r"sub-healthy: a holder in 2 replica mismatches within 1000 steps \(MINDIO_CROSSCHECK_WINDOW\), "
                    r"at steps 8, 12: replace it; also failed: rank (\d+); then ranks 0, 2 failed as a consequence")


@pytest.mark.timeout(200)
def test_a_holder_in_two_mismatches_is_sub_healthy():
    """Two flips on rank 1 (steps 6 and 10): the first is undone, the second makes both holders of the
    shard sub-healthy (with two replicas nothing tells which of them is bad): each says so and exits 1."""
    rc, out = torchrun(PRETRAIN, ["--use-distributed-optimizer", "--replica-cnt", 2, "--train-iters", 16,
                                  "--inject", "flip:rank=1,step=6; flip:rank=1,step=10"], timeout=150,
                       launcher=REFERENCE_LAUNCHER, env={"MINDIO_CROSSCHECK_STEPS": str(EVERY)}, check=False)
    assert rc != 0
    assert "rolled back to the verified state of step 4; recomputing steps 5..8" in out, out[-3000:]
    m = FAILED.search(out)
    assert m and {m.group(1), m.group(2)} == {"1", "3"}, out[-3000:]


@pytest.mark.timeout(300)
def test_sub_healthy_holders_are_switched_out_one_after_another_and_training_goes_on(fault_free, tmp_path):
    """The same under mindio-run --high-availability, every byte checked every 2 steps: flips on rank 1 at
    steps 3 and 5 are found at 4 and 6 and undone; after the second both holders of the shard are
    sub-healthy, rank 1 asks the controller to switch ranks 1 and 3 out, and it hot-switches them one after
    another (a backup takes each one's shard from the other holder) while training goes on: no step lost,
    the end state bit for bit that of the fault-free run, the same samples in every step. Rank 0 is held in
    steps 8 and 10 (from outside: the drill's hold) until the switch's backup registered, so that both
    switches happen before the 12 steps end."""
    events, drill = tmp_path / "events.jsonl", tmp_path / "drill"
    drill.mkdir()
    env = {"HIGH_AVAILABILITY": "recover-in-place,dump", "MINDIO_CROSSCHECK_STEPS": "2",
           "MINDIO_EVENT_LOG": str(events), "MINDIO_DRILL_DIR": str(drill), "TTP_LOG_PATH": str(tmp_path / "logs")}
    released, stop = [], threading.Event()

    def release():  # the backup of a switch registered: rank 0's hold of that switch ends (bounded by the run)
        while not stop.wait(0.05) and len(released) < 2:
            ready = [e for e in _events(events) if e["kind"] == "hot_switch_backups_ready"]
            for step in (8, 10)[len(released):len(ready)]:
                (drill / f"release-{step}").touch()
                released.append(step)

    watcher = threading.Thread(target=release, daemon=True)
    watcher.start()
    try:
        out = torchrun(PRETRAIN, ARGS + ["--enable-high-availability", "--no-dump", "--log-samples", tmp_path / "s",
                                         "--inject", "flip:rank=1,step=3; flip:rank=1,step=5; "
                                         "hold:rank=0,step=8,seconds=120; hold:rank=0,step=10,seconds=120"],
                       timeout=200, launcher="mindio.launch.cli", env=env)
    finally:
        stop.set()
        watcher.join()
    assert re.search(r"rank 1 is sub-healthy: a holder in 2 replica mismatches within 1000 steps "
                     r"\(MINDIO_CROSSCHECK_WINDOW\), at steps 4, 6: the controller is asked to switch ranks "
                     r"\[1, 3\] out, one after another", out), out[-6000:]
    evs = _events(events)
    assert [e["ranks"] for e in evs if e["kind"] == "sub_healthy"] == [[1, 3]], evs
    assert [e["ranks"] for e in evs if e["kind"] == "switched_out"] == [[1], [3]], out[-6000:]
    done = [e for e in evs if e["kind"] == "recover_done"]
    assert [(e["strategy"], e["replaced"]) for e in done] == [("hot switch", [1]), ("hot switch", [3])], done
    assert released == [8, 10], released  # each switch's backup registered while rank 0 was held
    assert sorted(losses(out)) == list(range(1, 13)) and losses(out) == losses(fault_free)
    assert digests(out)[-1] == digests(fault_free)[-1]
    assert_data_order(tmp_path / "s", fault_free.samples, 12)


def _events(path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

"""tests/_samples.py, the data-order check of the multi-process recovery tests: it accepts what a correct
recovery logs (a retried step, a scale-in whose removed ranks keep the lines of their last steps, a relaunch)
and names what a wrong one would (a sample twice, a sample skipped, a global batch with other samples)."""
import json

import pytest

from tests._samples import assert_data_order, read_sample_log

GBS, MBS = 8, 2


def _step(it: int, dp: int) -> dict:
    """The example's sampler: DP rank r takes ``mbs`` of every ``mbs * dp`` samples of the step's global batch."""
    first = (it - 1) * GBS
    return {r: [first + m * MBS * dp + r * MBS + k for m in range(GBS // (MBS * dp)) for k in range(MBS)]
            for r in range(dp)}


def _log(directory, lines) -> None:
    """``lines``: (t, rank, iteration, dp, dp_rank, samples), appended to the rank's file in order."""
    directory.mkdir(exist_ok=True)
    for t, rank, it, dp, dp_rank, samples in lines:
        with open(directory / f"samples-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"iteration": it, "rank": rank, "dp": dp, "dp_rank": dp_rank, "samples": samples,
                                "t": t}) + "\n")


def _run(directory, steps, dp_of=lambda it: 4, t0=0.0) -> None:
    _log(directory, [(t0 + it, r, it, dp_of(it), r, s) for it in steps for r, s in _step(it, dp_of(it)).items()])


def test_a_retried_step_and_a_scale_in_are_the_fault_free_order(tmp_path):
    _run(tmp_path / "ref", range(1, 11))
    got = tmp_path / "got"
    _run(got, range(1, 8))  # steps 1-7 at DP=4; then a rollback to 5 ...
    _run(got, range(6, 11), dp_of=lambda it: 2, t0=100)  # ... and steps 6-10 at DP=2 on ranks 0, 1
    assert sorted(read_sample_log(got)[6]) == [0, 1]  # the removed ranks' DP=4 lines of step 6 no longer stand
    assert_data_order(got, tmp_path / "ref", 10)


def test_a_sample_twice_or_skipped_or_another_batch_is_named(tmp_path):
    _run(tmp_path / "ref", range(1, 4))
    twice = tmp_path / "twice"
    _run(twice, range(1, 4))
    _log(twice, [(50, 1, 2, 4, 1, _step(2, 4)[0])])  # rank 1 retried step 2 on rank 0's samples
    with pytest.raises(AssertionError, match="iteration 2: samples .* in more than one DP rank"):
        assert_data_order(twice, tmp_path / "ref", 3)
    shifted = tmp_path / "shifted"
    _run(shifted, range(1, 3))
    _log(shifted, [(50, r, 3, 4, r, [s + GBS for s in ss]) for r, ss in _step(3, 4).items()])  # a batch skipped
    with pytest.raises(AssertionError, match="iteration 3: trained on"):
        assert_data_order(shifted, tmp_path / "ref", 3)
    missing = tmp_path / "missing"
    _run(missing, range(1, 4))
    _log(missing, [(50 + r, r, 3, 2, r, _step(3, 2)[r]) for r in (0,)])  # a DP=2 attempt of which rank 1 never logged
    with pytest.raises(AssertionError, match="iteration 3: DP size 2, logged DP ranks \\[0\\]"):
        read_sample_log(missing)


def _epochs(directory, order, t0=0.0, swap=None) -> None:
    """A DataLoader + DistributedSampler: 2 ranks, 2 samples each a step, 2 steps an epoch over samples 0..7
    in ``order[epoch]``; ``swap`` ({step: (i, sample)}): rank 0 of that step trains on ``sample`` at place i."""
    lines = []
    for it in range(1, 2 * len(order) + 1):
        perm = order[(it - 1) // 2]
        at = ((it - 1) % 2) * 4
        for r in range(2):
            samples = list(perm[at + 2 * r: at + 2 * r + 2])
            if swap and it in swap and r == 0:
                samples[swap[it][0]] = swap[it][1]
            lines.append((t0 + it, r, it, 2, r, samples))
    _log(directory, lines)


def test_per_epoch_each_sample_once_and_every_sample_in_a_complete_epoch(tmp_path):
    order = [[3, 1, 7, 0, 5, 2, 6, 4], [6, 0, 2, 5, 1, 7, 4, 3], [1, 2, 3, 4, 5, 6, 7, 0]]
    _epochs(tmp_path / "ref", order)
    _epochs(tmp_path / "ok", order)
    assert_data_order(tmp_path / "ok", tmp_path / "ref", 6, steps_per_epoch=2)  # samples again each epoch
    with pytest.raises(AssertionError, match="more than one step"):
        assert_data_order(tmp_path / "ok", tmp_path / "ref", 6)  # without epochs: every sample once per run
    _epochs(tmp_path / "twice", order, swap={4: (0, 6)})  # epoch 1 trains sample 6 twice (steps 3 and 4)
    with pytest.raises(AssertionError):
        assert_data_order(tmp_path / "twice", tmp_path / "ref", 6, steps_per_epoch=2)

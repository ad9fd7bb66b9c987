"""Exact data order: read the sample-id logs of the Megatron example (``--log-samples DIR``) and compare a run
with faults against its fault-free run.

Each rank appends one line per committed update: the iteration, its DP size and DP rank, the sample indices its
sampler yielded during the step. A step retried, rolled back or recomputed is logged again; what stands for an
iteration is its last attempt: the DP size of the latest line of that iteration, and per rank its latest line of
that iteration at that DP size (a rank removed by a scale-in keeps the lines of its last steps at the old size).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


def read_sample_log(directory) -> dict:
    """``{iteration: {dp_rank: samples}}``: what each DP rank trained on in the attempt of each iteration that
    stands. Fails if the ranks of one DP rank (its TP/PP/EP peers) disagree, or a DP rank is missing."""
    lines = [json.loads(x) for f in sorted(Path(directory).glob("samples-rank*.jsonl"))
             for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    assert lines, f"no sample log in {directory}"
    by_iter: dict = {}
    for rec in lines:
        by_iter.setdefault(rec["iteration"], []).append(rec)
    out = {}
    for it, recs in sorted(by_iter.items()):
        dp = max(recs, key=lambda r: r["t"])["dp"]
        latest: dict = {}
        for rec in recs:
            if rec["dp"] == dp and (rec["rank"] not in latest or rec["t"] >= latest[rec["rank"]]["t"]):
                latest[rec["rank"]] = rec
        per_dp: dict = {}
        for rec in latest.values():
            seen = per_dp.setdefault(rec["dp_rank"], rec["samples"])
            assert seen == rec["samples"], \
                f"iteration {it}: ranks of DP rank {rec['dp_rank']} trained on different samples: {seen} vs {rec['samples']}"
        assert sorted(per_dp) == list(range(dp)), f"iteration {it}: DP size {dp}, logged DP ranks {sorted(per_dp)}"
        out[it] = per_dp
    return out


def assert_data_order(directory, reference, iters: int, steps_per_epoch: int | None = None) -> None:
    """The run logged under ``directory`` trained every iteration 1..``iters`` on the samples the fault-free run
    logged under ``reference`` trained it on (the global batch, whatever the DP size), no sample twice within a
    step or across steps, none skipped (the samples of the run are one contiguous range of the sampler's
    indices: each sample of an epoch exactly once). ``steps_per_epoch``: a sampler that goes over its dataset
    again each epoch (a DataLoader's DistributedSampler): those checks hold per epoch of that many steps, and
    every complete epoch trained on every sample of the dataset once."""
    got, ref = read_sample_log(directory), read_sample_log(reference)
    assert sorted(got) == sorted(ref) == list(range(1, iters + 1)), (sorted(got), sorted(ref))
    if steps_per_epoch:
        for first in range(1, iters + 1, steps_per_epoch):
            epoch = range(first, min(first + steps_per_epoch, iters + 1))
            _assert_steps({it: got[it] for it in epoch}, ref, complete=len(epoch) == steps_per_epoch)
        return
    _assert_steps(got, ref, complete=True)


def _assert_steps(got: dict, ref: dict, complete: bool) -> None:
    """The steps ``got`` trained on the samples ``ref`` did, none twice; ``complete``: on 0..N-1 together."""
    everything: Counter = Counter()
    for it in sorted(got):
        step = Counter(s for samples in got[it].values() for s in samples)
        twice = sorted(s for s, n in step.items() if n > 1)
        assert not twice, f"iteration {it}: samples {twice} in more than one DP rank's batch"
        want = {s for samples in ref[it].values() for s in samples}
        assert set(step) == want, (f"iteration {it}: trained on {sorted(step)}, the fault-free run on "
                                   f"{sorted(want)} (missing {sorted(want - set(step))}, extra "
                                   f"{sorted(set(step) - want)})")
        everything.update(step)
    again = sorted(s for s, n in everything.items() if n > 1)
    assert not again, f"samples trained in more than one step: {again[:20]}"
    assert not complete or sorted(everything) == list(range(len(everything))), \
        "samples skipped: the run's samples are not 0..N-1"

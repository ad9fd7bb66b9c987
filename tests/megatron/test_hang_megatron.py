"""Issue #31: a hang in the Megatron example (4 ranks, DP=4, distributed optimizer, replicas R=2) under
torchrun, with no hang knob set. Megatron's collectives (its DP groups' reduce-scatter and all-gather, the
loss all-reduce) move torch's per-group counters like any other: after 20 timed steps the bound becomes the
job's own (1 s, the floor, for steps of ~0.05 s), and the controller names the rank that never entered the
collective its peers wait in, kills only it, and the survivors -- every shard has a live holder -- dump the
last step. ``--inject hang`` sleeps in the rank's main thread (a rank blocked outside any collective)."""
import json
import re
import signal

import pytest

from _mgt_launch import PRETRAIN, SLOW_MEGATRON, torchrun

pytestmark = SLOW_MEGATRON
HANG_STEP = 25


@pytest.mark.timeout(300)
def test_a_hung_megatron_rank_is_named_within_the_bound_and_only_it_is_killed(tmp_path):
    events = tmp_path / "events.jsonl"
    ckpt = tmp_path / "ckpt"
    rc, out = torchrun(PRETRAIN, ["--use-distributed-optimizer", "--enable-high-availability", "--train-iters", 32,
                                  "--save", ckpt, "--inject", f"hang:rank=2,step={HANG_STEP}"],
                       timeout=200, check=False, env={"MINDIO_EVENT_LOG": str(events), "TTP_LOG_STDOUT": "1"},
                       sent={2: "SIGKILL"})
    codes = {int(r): int(c) for r, c in
             re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out)}
    assert rc != 0 and codes.get(2) == -signal.SIGKILL and sorted(codes) == [0, 1, 2, 3], out[-6000:]
    assert {c for r, c in codes.items() if r != 2} <= {75, -signal.SIGTERM} and 75 in codes.values(), codes
    got = [json.loads(line) for line in events.read_text().splitlines() if line]
    hung = [e for e in got if e["kind"] == "rank_hung"]
    assert [e["hung_rank"] for e in hung] == [2] and hung[0]["group"] and 2 not in hung[0]["waiting"], hung
    bound = [e for e in got if e["kind"] == "hang_bound"]
    assert len(bound) == 1 and bound[0]["bound_s"] < 10, bound  # the job's own bound, not 300 s
    fired = [e for e in got if e["kind"] == "fault_injected"]
    delay = hung[0]["t"] - fired[0]["t"]
    assert delay <= bound[0]["bound_s"] + 3.0, (delay, bound, out[-6000:])
    assert re.search(r"rank 2 hung: .* never entered collective #\d+ of process group", out), out[-6000:]
    decision = [e for e in got if e["kind"] == "decision"]
    assert len(decision) == 1 and decision[0]["strategy"] == "dump" and decision[0]["faulty"] == [2], decision
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(HANG_STEP - 1)

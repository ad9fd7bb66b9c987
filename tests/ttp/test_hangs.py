"""Issue #30.1 / #31: whom a stall is blamed on (the rank that never entered the collective its peers
wait in, from torch's per-group sequence numbers) and how long a stall may last (the job's own step
times). Units here; tests/ttp/test_hang_e2e.py runs a user's DDP loop and a plain all_reduce loop."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from mindio._ports import free_port
from mindio.ttp.controller import hangs
from mindio.ttp.processor import collectives


def _view(rank, age, seqs, coll=False, step=5):
    return (rank, age, coll, step, seqs)


def test_the_rank_behind_in_a_group_is_the_culprit_not_the_ones_waiting_outside_torch_distributed():
    """DDP: the waiting ranks' stacks show backward(), not torch/distributed (in_collective False);
    their sequence numbers say they entered collective #9 that rank 1 never did."""
    views = [_view(0, 4.0, {"0": 9}), _view(1, 4.5, {"0": 8}), _view(2, 4.0, {"0": 9})]
    got = hangs.find_culprits(views, 3.0)
    assert [(h.rank, h.group, h.seq, h.waiting) for h in got] == [(1, "0", 9, [0, 2])]
    assert "never entered collective #9" in got[0].why()


def test_a_chain_blames_only_the_rank_inside_no_collective():
    """Rank 2 waits for rank 3 in group "b"; ranks 0 and 1 wait for rank 2 in group "a"."""
    views = [_view(0, 5, {"a": 4}), _view(1, 5, {"a": 4}), _view(2, 5, {"a": 3, "b": 7}), _view(3, 5, {"b": 6})]
    assert [h.rank for h in hangs.find_culprits(views, 3.0)] == [3]


def test_no_culprit_while_the_rank_behind_still_makes_progress_or_before_the_bound():
    views = [_view(0, 4.0, {"0": 9}), _view(1, 0.2, {"0": 8})]  # rank 1 slow, not hung
    assert hangs.find_culprits(views, 3.0) == []
    assert hangs.find_culprits([_view(0, 2.0, {"0": 9}), _view(1, 2.0, {"0": 8})], 3.0) == []
    assert hangs.find_culprits([_view(0, 9.0, {"0": 9}), _view(1, 9.0, {"0": 8})], 0) == []


def test_a_rank_not_armed_yet_is_no_evidence():
    """A standby (its own world, progress not armed) at a higher number does not make the job's ranks
    look behind."""
    views = [_view(0, 4.0, {"0": 9}, coll=True), _view(1, 4.0, {"0": 9}), _view(9, -1.0, {"0": 50})]
    assert [(h.rank, h.group) for h in hangs.find_culprits(views, 3.0)] == [(1, "")]


def test_without_sequence_evidence_the_stack_rule_holds_but_never_blames_a_rank_inside_by_number():
    same = [_view(0, 4.0, {"0": 9}, coll=True), _view(1, 4.0, {"0": 9}, coll=False)]
    assert [h.rank for h in hangs.find_culprits(same, 3.0)] == [1]
    assert hangs.find_culprits(same, 3.0)[0].group == ""
    none = [_view(0, 4.0, {}, coll=True), _view(1, 4.0, {}, coll=False)]  # relayed beats: no numbers
    assert [h.rank for h in hangs.find_culprits(none, 3.0)] == [1]
    garbage = [_view(0, 4.0, {"0": "x", 1: 2}, coll=True), _view(1, 4.0, [], coll=False)]
    assert [h.rank for h in hangs.find_culprits(garbage, 3.0)] == [1]


def test_under_the_job_derived_bound_ranks_all_stalled_outside_a_collective_are_no_hang():
    """Every rank writing a checkpoint for longer than a bound of seconds: nobody waits, nobody is hung."""
    saving = [_view(0, 4.0, {"0": 9}), _view(1, 4.0, {"0": 9})]
    assert hangs.find_culprits(saving, 3.0, need_waiter=True) == []
    assert [h.rank for h in hangs.find_culprits(saving, 3.0)] == [0, 1]  # a bound given: the rule as before
    waiting = [_view(0, 4.0, {"0": 9}, coll=True), _view(1, 4.0, {"0": 9})]
    assert [h.rank for h in hangs.find_culprits(waiting, 3.0, need_waiter=True)] == [1]


def test_the_bound_comes_from_the_job_once_every_rank_timed_its_steps(monkeypatch, caplog):
    monkeypatch.setenv("MINDIO_HANG_K", "5")
    monkeypatch.setenv("MINDIO_HANG_FLOOR", "1.0")
    b = hangs.HangBound(300.0, fixed=False)
    assert b.current([0.1, -1.0]) == 300.0  # a rank has not timed enough steps yet
    with caplog.at_level("INFO", logger="mindio.ttp.controller"):
        assert b.current([0.1, 0.12]) == 1.0  # the floor
        assert b.current([0.1, 0.4]) == pytest.approx(2.0)  # 5 x the slowest rank's p99
    said = [r for r in caplog.records if "hang bound from the job" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"]  # once; INFO: a fault-free run prints no WARNING
    assert b.current([-1.0, 0.4]) == pytest.approx(2.0)  # a replacement not timed yet: the last one holds
    assert hangs.HangBound(7.0, fixed=True).current([0.1, 0.1]) == 7.0
    assert hangs.HangBound(0.0, fixed=False).current([0.1]) == 0.0  # off stays off


def test_step_times_p99_needs_min_steps_and_skips_restarts():
    st = collectives.StepTimes(window=200)
    for _ in range(5):
        st.done()
    assert st.p99(10) == -1.0 and st.p99(4) >= 0
    st.restart()
    time.sleep(0.2)
    st.done()  # after a restart: no sample spanning the pause
    assert len(st.times) == 4 and max(st.times) < 0.1


def test_snapshot_reads_the_sequence_numbers_from_another_thread_while_a_collective_blocks():
    """Real gloo, two ranks in two threads of this process is not possible (one default group per
    process): one rank here, the counter moving per collective and readable from another thread."""
    assert collectives.snapshot() == {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        t = torch.ones(2)
        before = collectives.snapshot()
        dist.all_reduce(t)
        dist.all_reduce(t)
        seen = []
        th = threading.Thread(target=lambda: seen.append(collectives.snapshot()))
        th.start()
        th.join(5)
        assert len(before) == 1 and seen[0] == {k: v + 2 for k, v in before.items()}
        assert list(before)[0].startswith(f"{dist.group.WORLD.group_name}#")
        ref = weakref.ref(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert collectives.snapshot() == {}
    gc.collect()
    assert ref() is None  # the snapshot's cache keeps no destroyed group alive (its connections would stay open)


def test_under_the_job_derived_bound_a_working_main_thread_gets_the_bound_given():
    """Rank 0 alone writes a checkpoint (its main thread used CPU 0.5 s ago) while rank 1 waits in the
    next collective: not hung under the job's bound of 3 s, hung after the bound given (``patient``);
    a main thread idle as long as the bound (a sleep) is hung at once; an unknown idle age (-1): as before."""
    views = [_view(0, 4.0, {"0": 8}), _view(1, 4.0, {"0": 9}, coll=True)]
    assert hangs.find_culprits(views, 3.0, need_waiter=True, idle={0: 0.5, 1: 4.0}, patient=300) == []
    late = [_view(0, 301.0, {"0": 8}), _view(1, 301.0, {"0": 9}, coll=True)]
    assert [h.rank for h in hangs.find_culprits(late, 3.0, need_waiter=True, idle={0: 0.5}, patient=300)] == [0]
    assert [h.rank for h in hangs.find_culprits(views, 3.0, need_waiter=True, idle={0: 3.5}, patient=300)] == [0]
    assert [h.rank for h in hangs.find_culprits(views, 3.0, need_waiter=True, idle={0: -1.0}, patient=300)] == [0]
    assert [h.rank for h in hangs.find_culprits(views, 3.0, idle={0: 0.5}, patient=300)] == [0]  # a bound given


def test_the_main_thread_is_idle_while_it_sleeps_and_working_while_it_computes():
    """Read as the processor's link thread reads it: from another thread, while the main thread sleeps
    (blocked: idle), then while it computes (CPU used, runnable: working)."""
    import time
    from mindio.ttp.processor.collectives import MainActivity

    act = MainActivity()
    got: list = []

    def read_after(delays):
        for d in delays:
            time.sleep(d)
            got.append(act.idle_age())

    reader = threading.Thread(target=read_after, args=([0.3, 0.3],))
    reader.start()
    time.sleep(0.8)  # the main thread blocked for both reads
    reader.join(5)
    assert got[1] >= 0.25, got  # asleep: idle since before the first read
    reader = threading.Thread(target=read_after, args=([0.3],))
    reader.start()
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        pass
    reader.join(5)
    assert got[2] < 0.05, got  # it used CPU (and was runnable) since the last read


def test_a_culprit_whose_own_beat_is_stale_is_heard_again_before_it_is_named():
    """The Megatron hang test under the full suite's load: rank 2 hung; rank 3 waits for it in group "b" =
    {2, 3} (#11), but its last beat, sent just before it entered, says #10 there -- so by that beat rank 3
    is inside nothing and behind in the replica group "a" = {1, 3}, where rank 1 waits in #25. Rank 3 was
    killed. Its evidence must come from a beat sent at least half the bound after rank 1's stall began:
    the next one shows it inside "b", and rank 2 is named."""
    # (ages as of now: a beat's age plus the time since it was heard)
    stale = [_view(1, 1.2, {"a": 25}), _view(2, 1.4, {"b": 10}), _view(3, 1.95, {"a": 24, "b": 10})]
    heard = {1: 0.1, 2: 0.2, 3: 0.9}  # rank 3's beat left 0.9 s ago, 0.3 s after rank 1's stall began
    assert hangs.find_culprits(stale, 1.0, heard_ago=heard) == []
    fresh = [_view(1, 1.7, {"a": 25}), _view(2, 1.9, {"b": 10}), _view(3, 1.6, {"a": 24, "b": 11})]
    got = hangs.find_culprits(fresh, 1.0, heard_ago={1: 0.1, 2: 0.2, 3: 0.1})
    assert [(h.rank, h.group, h.waiting) for h in got] == [(2, "b", [3])]


def test_a_member_whose_beat_predates_the_stall_is_heard_again_before_the_culprit_is_named():
    """Ranks 0 and 1 entered collective #9; rank 2 never did. Rank 1's last beat was sent just before it
    entered (0.9 s ago, before rank 0's 1.2 s stall began 1.3 s ago): it still says #8. The decision waits
    for rank 1's next beat, which names the waiters right -- or finds rank 1 hung before the collective too,
    and names both in one decision."""
    stale = [_view(0, 1.3, {"0": 9}), _view(1, 1.45, {"0": 8}), _view(2, 1.7, {"0": 8})]  # (ages as of now)
    heard = {0: 0.1, 1: 1.4, 2: 0.2}
    assert hangs.find_culprits(stale, 1.0, heard_ago=heard) == []
    fresh = [_view(0, 2.0, {"0": 9}), _view(1, 1.8, {"0": 9}), _view(2, 2.4, {"0": 8})]
    got = hangs.find_culprits(fresh, 1.0, heard_ago={0: 0.1, 1: 0.3, 2: 0.2})
    assert [(h.rank, h.waiting) for h in got] == [(2, [0, 1])]
    both = [_view(0, 2.0, {"0": 9}), _view(1, 1.9, {"0": 8}), _view(2, 2.4, {"0": 8})]
    assert [h.rank for h in hangs.find_culprits(both, 1.0, heard_ago={0: 0.1, 1: 0.3, 2: 0.2})] == [1, 2]
    # without the ages of the beats (None), as before: every beat counts as fresh (rank 1 progressed 0.05 s ago)
    unaged = [_view(0, 1.2, {"0": 9}), _view(1, 0.05, {"0": 8}), _view(2, 1.5, {"0": 8})]
    assert [h.rank for h in hangs.find_culprits(unaged, 1.0)] == [2]


def test_a_rank_waiting_inside_a_collective_is_not_blamed_while_the_chain_ends_at_a_working_rank():
    """The Megatron hang test under the full suite's load (4 ranks, replica groups {0, 2} "r0" and {1, 3}
    "r1", instance groups {0, 1} "i0" and {2, 3} "i1"): rank 2 hung in its forward; rank 3 waits for it in
    the reduce-scatter of "i1" (#49), ranks 0 and 1 wait in the replica all-reduces (#25) for ranks 2 and
    3. Rank 2's last beat (0.8 s old) came when its main thread had last woken (idle 1.0 s < the 2.1 s
    bound): not stalled yet. Rank 3 -- behind in "r1", inside "i1" -- was blamed as "a cycle" and killed.
    Now nobody is blamed until rank 2 is stalled too; then rank 2 alone."""
    seqs = {0: {"i0": 49, "r0": 25}, 1: {"i0": 49, "r1": 25}, 2: {"i1": 48, "r0": 24}, 3: {"i1": 49, "r1": 24}}
    heard = {0: 0.02, 1: 0.02, 2: 0.8, 3: 0.03}
    ages = {0: 3.2, 1: 3.2, 2: 3.2, 3: 3.2}
    views = [_view(r, ages[r], seqs[r], coll=r != 2, step=24) for r in range(4)]
    idle = {0: 3.0, 1: 3.0, 2: 1.0, 3: 3.0}  # rank 2: its 1 s sleeps woke it (quantised by the 1 s reads)
    assert hangs.find_culprits(views, 2.1, need_waiter=True, idle=idle, patient=300, heard_ago=heard) == []
    idle[2] = 2.2
    got = hangs.find_culprits(views, 2.1, need_waiter=True, idle=idle, patient=300, heard_ago=heard)
    assert [(h.rank, h.group, h.waiting) for h in got] == [(2, "i1", [3])]


def test_a_cycle_of_ranks_each_inside_a_collective_blames_the_stalled_ones_behind():
    """No chain ends: rank 0 waits in "a" for rank 1, which waits in "b" for rank 0 (a cycle: each is
    behind in one group and inside the other). Both are blamed, as before."""
    views = [_view(0, 2.0, {"a": 5, "b": 4}, coll=True), _view(1, 2.0, {"a": 4, "b": 5}, coll=True)]
    assert [h.rank for h in hangs.find_culprits(views, 1.0)] == [0, 1]

"""Property tests of the pure decisions (mindio.ttp.controller.policy)."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from mindio.ttp.controller import policy
from mindio.ttp._enums import OsStatus, ReportState
from mindio.ttp.controller.policy import Incident, RankView


def test_reference_patterns_first_match():
    assert policy.classify("RuntimeError: UCE ERROR on device 3") is ReportState.RS_UCE
    assert policy.classify("HBM MULTI BIT ECC") is ReportState.RS_UCE
    assert policy.classify("HBM MULTI BIT ECC", uce_repairable=False) is ReportState.RS_UCE_CORRUPTED
    assert policy.classify("FORCE STOP") is ReportState.RS_NORMAL
    assert policy.classify("ARF FINISH") is ReportState.RS_PREREPAIR_FINISH
    assert policy.classify("STEP FINISH") is ReportState.RS_STEP_FINISH
    for m in ("HCCL OP RETRY FAILED", "SUSPECT REMOTE ERROR", "UB LINK ERROR", "HCCS LINK ERROR"):
        assert policy.classify(m) is ReportState.RS_HCCL_FAILED
    assert policy.classify("UCE ERROR then FORCE STOP") is ReportState.RS_UCE  # first match wins
    assert policy.classify("[../third_party/gloo/...] Connection closed by peer [127.0.0.1]:1234") \
        is ReportState.RS_NORMAL
    assert policy.classify("division by zero") is ReportState.RS_UNKNOWN


def test_a_generic_exception_outside_the_update_window_is_retryable():
    """Issue 33: anything no pattern names, raised with the optimizer update window known closed and no
    incident under way, is RS_RETRY; inside the window (or unknown) RS_UNKNOWN, as before; a pattern
    still wins; and retry needs no replica for it (no state was lost)."""
    assert policy.classify("ValueError: bad batch", outside_update=True) is ReportState.RS_RETRY
    assert policy.classify("ValueError: bad batch", outside_update=False) is ReportState.RS_UNKNOWN
    assert policy.classify("ValueError: bad batch", outside_update=True, during_incident=True) \
        is ReportState.RS_UNKNOWN
    assert policy.classify("RuntimeError: UCE ERROR", outside_update=True) is ReportState.RS_UCE
    # a corrupt model state found by the replica cross-check is never retried (it would train on from it)
    for corrupt in ("ReplicaMismatch: rank 1 and rank 3 differ in bytes [0, 4096)", "SubHealthyRank: rank 3"):
        assert policy.classify(corrupt, outside_update=True) is ReportState.RS_UNKNOWN
    assert policy.classify("x", [("x", ReportState.RS_UNKNOWN)], outside_update=True) is ReportState.RS_UNKNOWN
    inc = Incident(states={1: ReportState.RS_RETRY}, repair_possible=False, dump_possible=True)
    assert policy.feasible_strategies({"retry", "dump"}, inc) == ["retry", "dump", "exit"]
    inc = Incident(states={1: ReportState.RS_UNKNOWN}, repair_possible=True, dump_possible=True)
    assert policy.feasible_strategies({"retry", "dump"}, inc) == ["dump", "exit"]
    inc = Incident(states={1: ReportState.RS_RETRY}, dead=frozenset({2}), repair_possible=True, dump_possible=True)
    assert "retry" not in policy.feasible_strategies({"retry", "dump"}, inc)


def test_user_patterns_come_first():
    pats = [("UCE ERROR", ReportState.RS_HCCL_FAILED), ("my disk died", ReportState.RS_UCE)]
    assert policy.classify("UCE ERROR", pats) is ReportState.RS_HCCL_FAILED
    assert policy.classify("oh no my disk died", pats) is ReportState.RS_UCE


@given(st.text())
def test_classify_total(msg):
    assert isinstance(policy.classify(msg), ReportState)


@given(st.integers(0, 100), st.integers(0, 100), st.integers(0, 100))
def test_uce_window(t, a, b):
    start, end = min(a, b), max(a, b)
    assert policy.can_do_uce_repair(t, start, end) == (not start <= t <= end)
    assert policy.can_do_uce_repair(t, None, None)


@st.composite
def _cluster(draw):
    """A DP world of d = R * k ranks with replica info, random health / steps / status."""
    r = draw(st.sampled_from([1, 2, 4]))
    k = draw(st.integers(1, 4))
    d = r * k
    lock = draw(st.integers(1, 5))
    views = []
    entry = {"rank_list": list(range(d)), "replica_cnt": r, "replica_shift": 0}
    for rank in range(d):
        views.append(RankView(rank=rank, alive=draw(st.booleans()), faulty=draw(st.booleans()),
                              step=draw(st.sampled_from([lock - 1, lock, lock])),
                              data_status=draw(st.sampled_from(list(OsStatus))), replica=(entry,)))
    return views, lock, d, r


@given(_cluster())
@settings(max_examples=300)
def test_dump_plan_one_usable_rank_per_shard(cluster):
    views, lock, d, r = cluster
    plan = policy.select_dump_ranks(views, lock)
    by_rank = {v.rank: v for v in views}
    chosen = set(plan.ranks)
    for rank in chosen:  # only usable ranks save
        assert policy.usable(by_rank[rank], lock)
    shards = {}
    for v in views:
        shards.setdefault(v.rank % (d // r), []).append(v)
    for idx, members in shards.items():
        has_usable = any(policy.usable(v, lock) for v in members)
        saved = [v.rank for v in members if v.rank in chosen]
        if has_usable:
            assert len(saved) == 1  # exactly one saver per shard
        else:
            assert saved == []
            assert any(key[2] == idx for key in plan.missing)
    assert plan.possible == all(any(policy.usable(v, lock) for v in m) for m in shards.values())
    assert plan.save_info == [{"type": 0, "ranks": sorted(chosen)}]


@given(_cluster(), st.sets(st.integers(0, 15)))
@settings(max_examples=300)
def test_dump_plan_without_the_ranks_that_could_not_write(cluster, unable):
    """A re-plan after some writers failed (dump.save): the same as the plan of a cluster where those ranks
    are not usable -- the next usable holder of each shard, never a rank of ``unable``."""
    views, lock, _d, _r = cluster
    plan = policy.select_dump_ranks(views, lock, unable)
    assert not set(plan.ranks) & unable
    fenced = [RankView(v.rank, v.alive, v.faulty or v.rank in unable, v.step, v.data_status, v.replica)
              for v in views]
    assert plan == policy.select_dump_ranks(fenced, lock)


def test_describe_shard():
    assert policy.describe_shard((0, (0, 1, 2, 3), 1)) == "shard 1 of optimizer 0 (DP group [0, 1, 2, 3])"
    assert policy.describe_shard((1, tuple(range(10)), 0)) == \
        "shard 0 of optimizer 1 (DP group [0, 1, 2, 3, 4, 5, 6, 7, ...])"


@given(_cluster())
@settings(max_examples=200)
def test_repair_sources_are_usable_replicas(cluster):
    views, lock, d, r = cluster
    targets = [v.rank for v in views if not policy.usable(v, lock)]
    try:
        plan = policy.select_repair_sources(views, lock, targets)
    except ValueError:
        return
    for (dst, _t), src in plan.items():
        assert src != dst and policy.usable(views[src], lock)
        assert src % (d // r) == dst % (d // r)


@given(_cluster())
@settings(max_examples=300)
def test_lock_step_is_the_highest_step_with_every_shard(cluster):
    views, _, _, _ = cluster
    lock = policy.choose_lock_step(views)
    healthy = {v.step for v in views if v.alive and not v.faulty}
    complete = [s for s in healthy if policy.select_dump_ranks(views, s).possible]
    if complete:
        assert lock == max(complete)
        # every stale rank has a usable replica to be repaired from at the lock step
        policy.select_repair_sources(views, lock, policy.stale_ranks(views, lock))
    else:
        assert lock == max(healthy or {v.step for v in views if v.alive} or {0})
    for r in policy.stale_ranks(views, lock):
        v = views[r]
        assert v.alive and not v.faulty and not policy.usable(v, lock)


def test_a_stop_on_both_sides_of_the_fence_locks_the_step_before_it():
    # 4 ranks, 2 replicas (shard j on ranks j and j + 2): rank 1 failed inside its update of step 8;
    # the stop held ranks 0 and 3 at their fence (state of step 7) while rank 2 had updated to step 8
    entry = {"rank_list": [0, 1, 2, 3], "replica_cnt": 2}
    U, UP = int(OsStatus.UPDATED), int(OsStatus.UPDATING)
    views = [RankView(0, True, False, 7, U, (entry,)), RankView(1, True, True, 7, UP, (entry,)),
             RankView(2, True, False, 8, U, (entry,)), RankView(3, True, False, 7, U, (entry,))]
    assert not policy.select_dump_ranks(views, 8).possible  # shard 1 at step 8 was only on rank 1
    assert policy.choose_lock_step(views) == 7
    assert policy.stale_ranks(views, 7) == [2]
    assert policy.select_repair_sources(views, 7, [1, 2]) == {(1, 0): 3, (2, 0): 0}
    # all healthy ranks at one step: that step, nobody stale (the common case)
    same = [RankView(r, True, r == 1, 8, U, (entry,)) for r in range(4)]
    assert policy.choose_lock_step(same) == 8 and policy.stale_ranks(same, 8) == []
    # the higher step is preferred when it is complete: the rank behind is the stale one
    behind = [RankView(0, True, False, 7, U, (entry,))] + [RankView(r, True, False, 8, U, (entry,)) for r in (1, 2, 3)]
    assert policy.choose_lock_step(behind) == 8 and policy.stale_ranks(behind, 8) == [0]


def test_ranks_held_before_an_update_another_rank_made_finish_it():
    entry = {"rank_list": [0, 1, 2, 3], "replica_cnt": 2}
    U, UP = int(OsStatus.UPDATED), int(OsStatus.UPDATING)
    # plain DP loop: rank 1 failed at the start of step 6; rank 3, the other copy of its shard, was held
    # before its update of step 5, which ranks 0 and 2 had made
    views = [RankView(0, True, False, 5, U, (entry,)), RankView(1, True, True, 5, U, (entry,)),
             RankView(2, True, False, 5, U, (entry,)), RankView(3, True, False, 4, U, (entry,))]
    assert policy.ranks_to_advance(views, fenced=[3]) == (5, [3])
    assert policy.ranks_to_advance(views, fenced=[]) == (5, [])  # running or parked: nothing to advance
    # rank 1 failed inside its update of step 8 (started it: its gradients were complete), rank 2 made it,
    # ranks 0 and 3 were held before it: both finish it
    both = [RankView(0, True, False, 7, U, (entry,)), RankView(1, True, True, 7, UP, (entry,)),
            RankView(2, True, False, 8, U, (entry,)), RankView(3, True, False, 7, U, (entry,))]
    assert policy.ranks_to_advance(both, fenced=[0, 3]) == (8, [0, 3])
    # a faulty rank that started the update is enough; a dead one is not known well enough to count
    started = [RankView(0, True, False, 7, U, (entry,)), RankView(1, True, True, 7, UP, (entry,))]
    assert policy.ranks_to_advance(started, fenced=[0]) == (8, [0])
    dead = [RankView(0, True, False, 7, U, (entry,)), RankView(1, False, True, 7, UP, (entry,))]
    assert policy.ranks_to_advance(dead, fenced=[0]) == (7, [])
    # caught mid-update, or two updates behind: not advanced
    mid = views[:3] + [RankView(3, True, False, 4, UP, (entry,))]
    assert policy.ranks_to_advance(mid, fenced=[3]) == (5, [])
    two = views[:3] + [RankView(3, True, False, 3, U, (entry,))]
    assert policy.ranks_to_advance(two, fenced=[3]) == (5, [])


@given(_cluster(), st.sets(st.integers(0, 15)))
@settings(max_examples=200)
def test_advanced_ranks_are_one_update_behind_a_rank_that_started_it(cluster, fenced):
    views, _, _, _ = cluster
    step, ranks = policy.ranks_to_advance(views, fenced)
    by_rank = {v.rank: v for v in views}
    for r in ranks:  # healthy, fenced, one clean update behind
        v = by_rank[r]
        assert r in fenced and v.alive and not v.faulty and v.step == step - 1 and v.data_status == OsStatus.UPDATED
    if ranks:  # some live rank made or started the update of ``step``
        assert any(v.alive and (v.step >= step or (v.step == step - 1 and v.data_status != OsStatus.UPDATED))
                   for v in views)


def test_ranks_ask_for_strategies_with_their_flags():
    assert policy.strategies_of([]) == set()
    assert policy.strategies_of([{}, {}]) == set()  # processors that sent no flags ask for nothing
    flags = {"uce": True, "arf": False, "zit": False}
    assert policy.strategies_of([flags] * 4) == {"retry"}
    assert policy.strategies_of([flags, dict(flags, uce=False)]) == set()  # one refuses: no retry
    assert policy.strategies_of([flags, dict(flags, arf=True)]) == {"retry", "recover-in-place", "recover"}
    assert policy.strategies_of([dict(flags, uce=False, zit=True)]) == {"elastic-training"}


def test_in_place_strategies_need_the_repair_and_rollback_handlers():
    inc = Incident(states={1: ReportState.RS_UCE}, repair_possible=True, dump_possible=True,
                   in_place_possible=False)
    assert policy.feasible_strategies({"retry", "recover-in-place", "dump"}, inc) == ["dump", "exit"]
    dead = Incident(dead=frozenset({1}), repair_possible=True, dump_possible=True, in_place_possible=False)
    assert policy.feasible_strategies({"recover-in-place", "elastic-training", "dump"}, dead) == \
        ["downgrade", "dump", "exit"]


def test_timeouts_are_secondary_only_once_an_incident_began():
    gloo = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation"
    assert policy.classify(gloo) is ReportState.RS_UNKNOWN  # alone: something hung
    assert policy.classify(gloo, during_incident=True) is ReportState.RS_NORMAL
    gone = "ValueError: Default process group has not been initialized, please make sure to call init_process_group."
    assert policy.classify(gone, during_incident=True) is ReportState.RS_NORMAL
    assert policy.classify("UCE ERROR after a Timeout", during_incident=True) is ReportState.RS_UCE  # a fault
    assert policy.secondary_in_incident(gloo) and not policy.secondary_in_incident("division by zero")


def test_no_replica_info_means_own_shard():
    views = [RankView(0, step=3), RankView(1, alive=False, faulty=True, step=3)]
    plan = policy.select_dump_ranks(views, 3)
    assert not plan.possible and plan.missing == ((0, (1,), 0),)


def test_bad_layout_rejected():
    import pytest
    with pytest.raises(ValueError, match="divisible"):
        policy.shard_key(0, 0, {"rank_list": [0, 1, 2], "replica_cnt": 2})


_ENABLED = st.sets(st.sampled_from(["retry", "recover-in-place", "recover", "elastic-training", "dump"]))
_STATE = st.sampled_from([ReportState.RS_UCE, ReportState.RS_HCCL_FAILED, ReportState.RS_UNKNOWN,
                          ReportState.RS_UCE_CORRUPTED, ReportState.RS_RETRY])


@given(_ENABLED, st.dictionaries(st.integers(0, 7), _STATE, max_size=3), st.frozensets(st.integers(0, 7)),
       st.booleans(), st.booleans(), st.booleans())
def test_strategies_follow_fallback_order(enabled, states, dead, repair, dump, spare):
    inc = Incident(states=states, dead=dead, repair_possible=repair, dump_possible=dump, spare_available=spare)
    out = policy.feasible_strategies(enabled, inc)
    assert out[-1] == "exit"
    order = [policy.STRATEGY_ORDER.index(s) for s in out]
    assert order == sorted(order)
    names = {"downgrade": "elastic-training"}
    for s in out[:-1]:
        assert names.get(s, s) in enabled
    if "dump" in out:
        assert dump
    if "retry" in out:
        assert not dead and set(states.values()) <= {ReportState.RS_UCE, ReportState.RS_HCCL_FAILED,
                                                     ReportState.RS_RETRY}
        assert repair or set(states.values()) <= policy.INTACT  # a UCE needs a replica to repair from
    if "recover" in out:
        assert spare and repair


def test_dump_only_job():
    inc = Incident(states={3: ReportState.RS_UCE}, repair_possible=True, dump_possible=True)
    assert policy.feasible_strategies({"dump"}, inc) == ["dump", "exit"]
    assert policy.feasible_strategies({"retry", "dump"}, inc) == ["retry", "dump", "exit"]
    assert policy.feasible_strategies(set(), inc) == ["exit"]


def test_hung_rank_found():
    # rank 2 sleeps outside any collective; the others wait for it inside an all-reduce
    views = [(0, 9.0, True, 5), (1, 9.0, True, 5), (2, 9.0, False, 5), (3, 9.0, True, 5)]
    assert policy.find_hung_ranks(views, 5.0) == [2]
    assert policy.find_hung_ranks(views, 10.0) == []
    assert policy.find_hung_ranks(views, 0) == []
    behind = [(0, 9.0, True, 5), (1, 9.0, True, 4)]
    assert policy.find_hung_ranks(behind, 5.0) == [1]
    assert policy.find_hung_ranks([(0, -1.0, False, 0)], 5.0) == []


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(-1, 100), st.booleans(), st.integers(0, 9)),
                unique_by=lambda t: t[0]), st.floats(0.1, 50))
def test_hung_ranks_are_stalled(views, timeout):
    stalled = {r for r, age, _, _ in views if age >= timeout}
    assert set(policy.find_hung_ranks(views, timeout)) <= stalled


# -- issue 34: the vectorised ShardMap answers what the per-view loops answered ---------------------
def _old_select_dump_ranks(views, lock_step, unable=()):
    """select_dump_ranks as it was before the ShardMap (one shards_of per view per call)."""
    views, unable = list(views), set(unable)
    members, memo = {}, {}
    for v in views:
        for key in policy.shards_of(v, memo):
            members.setdefault(key, [])
            if policy.usable(v, lock_step) and v.rank not in unable:
                members[key].append(v.rank)
    chosen, missing = {}, []
    for key in sorted(members):
        if members[key]:
            chosen.setdefault(key[0], set()).add(min(members[key]))
        else:
            missing.append(key)
    types = sorted({k[0] for k in members})
    every = tuple(sorted(set().union(*chosen.values()))) if chosen else ()
    return policy.DumpPlan([{"type": t, "ranks": sorted(chosen.get(t, ()))} for t in types], every, tuple(missing))


def _old_repair_sources(views, lock_step, targets):
    views = {v.rank: v for v in views}
    holders, memo = {}, {}
    for v in views.values():
        if policy.usable(v, lock_step):
            for key in policy.shards_of(v, memo):
                holders.setdefault(key, []).append(v.rank)
    plan = {}
    for dst in sorted(set(targets)):
        for t, key in enumerate(policy.shards_of(views[dst], memo)):
            srcs = sorted(r for r in holders.get(key, ()) if r != dst)
            if not srcs:
                raise ValueError(f"no usable replica of shard {key} for rank {dst} at step {lock_step}")
            plan[(dst, t)] = srcs[0]
    return plan


@st.composite
def _world(draw):
    """Several DP groups, one or two optimizer types (dense, expert) with their own groups, some ranks
    without replica info, random health / steps / status."""
    groups, d = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4]))
    r = draw(st.sampled_from([1, 2]))
    experts = draw(st.booleans())
    lock = draw(st.integers(1, 4))
    views = []
    for rank in range(groups * d):
        g = rank - rank % d
        entries = ({"rank_list": list(range(g, g + d)), "replica_cnt": r},)
        if experts:  # an expert group across the DP groups: every d-th rank
            eg = [x for x in range(groups * d) if x % d == rank % d]
            entries += ({"rank_list": eg, "replica_cnt": 1 if len(eg) == 1 else draw(st.sampled_from([1, len(eg)]))},)
        if draw(st.integers(0, 9)) == 0:
            entries = ()
        views.append(RankView(rank, draw(st.booleans()), draw(st.integers(0, 3)) == 0,
                              draw(st.sampled_from([lock - 1, lock, lock])),
                              draw(st.sampled_from([OsStatus.UPDATED] * 3 + list(OsStatus))), entries))
    return views, lock, draw(st.lists(st.integers(0, groups * d - 1), max_size=3))


@given(_world())
@settings(max_examples=300)
def test_the_shard_map_decides_as_the_per_view_loops_did(world):
    views, lock, some = world
    shards = policy.ShardMap(views)
    for step in (lock - 1, lock):
        for unable in ((), some):
            assert policy.select_dump_ranks(shards, step, unable) == _old_select_dump_ranks(views, step, unable)
    steps = {v.step for v in views if v.alive and not v.faulty} or {v.step for v in views if v.alive} or {0}
    old_lock = next((s for s in sorted(steps, reverse=True) if _old_select_dump_ranks(views, s).possible), max(steps))
    assert policy.choose_lock_step(shards) == policy.choose_lock_step(views) == old_lock
    try:
        want = _old_repair_sources(views, lock, some)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            policy.select_repair_sources(shards, lock, some)
    else:
        assert policy.select_repair_sources(shards, lock, some) == want


def _fresh_rows(views):
    return policy.ShardMap._rows(list(views))


def _same_rows(shards, views):
    keys, row_view, row_shard, types, key_type = _fresh_rows(views)
    assert shards.keys == keys and shards.types == types
    assert shards.row_view.tolist() == row_view.tolist() and shards.row_shard.tolist() == row_shard.tolist()
    assert shards.key_type.tolist() == key_type.tolist()
    assert shards.row_rank.tolist() == [views[i].rank for i in row_view.tolist()]


@given(_world(), _world(), st.lists(st.tuples(st.sampled_from(["layout", "health", "drop", "other"]),
                                              st.integers(0, 11)), max_size=6))
@settings(max_examples=200)
def test_the_shard_map_reuses_its_rows_only_while_every_rank_and_layout_is_the_same(world, other, edits):
    """Issue 34: consecutive decisions over the same ranks and layouts reuse the shard rows (ShardMap._last); a
    rank whose layout was replaced (even by an equal one), a rank gone, or another world builds them anew -- the
    map always equals one built from scratch, and so does every answer made from it."""
    views = list(world[0])
    for kind, i in [("same", 0)] + edits:
        i %= len(views)
        v = views[i]
        if kind == "layout":  # its INFO again: an equal layout in a new tuple, or none (a shard of its own)
            views[i] = v._replace(replica=tuple(dict(e) for e in v.replica) if i % 2 else ())
        elif kind == "health":
            views[i] = v._replace(alive=not v.alive, step=v.step + 1)
        elif kind == "drop" and len(views) > 1:
            del views[i]
        elif kind == "other":
            views = list(other[0])
        shards = policy.ShardMap(views)
        _same_rows(shards, views)
        assert policy.ShardMap(views).row_shard is shards.row_shard  # the next decision reuses them
        lock = policy.choose_lock_step(shards)
        assert lock == policy.choose_lock_step(list(views))
        assert policy.select_dump_ranks(shards, lock) == _old_select_dump_ranks(views, lock)


def test_in_the_controllers_own_process_what_a_decision_builds_is_frozen_out_of_the_collectors_walks():
    """policy.no_gc: with FREEZE_AFTER_NO_GC (set by Controller._freeze_heap in a process of its own, reset by
    close) the objects built inside are frozen (gc.freeze) before the collector is enabled again, so its next
    passes do not walk 100,000 new views; they are still freed by reference counting."""
    import gc
    import weakref

    from mindio.ttp.controller import policy

    class Obj:
        pass

    was, before = policy.FREEZE_AFTER_NO_GC, gc.get_freeze_count()
    try:
        policy.FREEZE_AFTER_NO_GC = True
        with policy.no_gc():
            made = [Obj() for _ in range(1000)]
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() >= before + 1000
        ref = weakref.ref(made[0])
        del made
        assert ref() is None  # freed as before
    finally:
        policy.FREEZE_AFTER_NO_GC = was
        gc.unfreeze()

"""Which ranks a downgrade removes (whole optimizer instances, in every DP group) and who repairs whom
after the upgrade: mindio.ttp.elastic.plan_downgrade / _repair_pairs, table-driven."""
import pytest

from mindio.ttp.elastic import _repair_pairs, plan_downgrade


def layout(groups, cnt):
    return {r: [{"rank_list": list(g), "replica_cnt": cnt, "replica_shift": 0}] for g in groups for r in g}


@pytest.mark.parametrize("groups,cnt,faulty,survivors,removed,new_groups", [
    # DP=4, 2 instances [0,1] [2,3]: losing rank 3 leaves [0,1], which holds every shard
    ([[0, 1, 2, 3]], 2, [3], [0, 1], [2, 3], [[0, 1]]),
    ([[0, 1, 2, 3]], 2, [0], [2, 3], [0, 1], [[2, 3]]),
    # TP=2 x DP=4: DP groups [0,2,4,6] and [1,3,5,7]; rank 5 is in instance 1 -> the DP slice 4..7 goes
    ([[0, 2, 4, 6], [1, 3, 5, 7]], 2, [5], [0, 1, 2, 3], [4, 5, 6, 7], [[0, 2], [1, 3]]),
    # DP=8, 4 instances of 2: two faults in two instances remove both
    ([list(range(8))], 4, [1, 6], [2, 3, 4, 5], [0, 1, 6, 7], [[2, 3, 4, 5]]),
    # two faults in the same instance remove it once
    ([list(range(8))], 4, [2, 3], [0, 1, 4, 5, 6, 7], [2, 3], [[0, 1, 4, 5, 6, 7]]),
])
def test_plan_downgrade(groups, cnt, faulty, survivors, removed, new_groups):
    members = sorted(r for g in groups for r in g)
    assert plan_downgrade(layout(groups, cnt), members, faulty) == (survivors, removed, new_groups)


@pytest.mark.parametrize("groups,cnt,faulty,message", [
    ([[0, 1, 2, 3]], 2, [1, 2], "every optimizer instance"),    # both copies of the state lost
    ([[0, 1, 2, 3]], 1, [2], "every optimizer instance"),       # no replicas at all
    ([[0, 1, 2, 3]], 2, [9], "in no reported DP group"),
])
def test_plan_downgrade_impossible(groups, cnt, faulty, message):
    with pytest.raises(ValueError, match=message):
        plan_downgrade(layout(groups, cnt), [0, 1, 2, 3], faulty)


def test_plan_downgrade_needs_the_layout():
    with pytest.raises(ValueError, match="rank 2 reported no optimizer replica layout"):
        plan_downgrade({0: layout([[0, 1]], 1)[0], 1: layout([[0, 1]], 1)[1]}, [0, 1, 2], [1])


def test_upgrade_repair_pairs_use_a_surviving_replica_of_the_same_shard():
    lay = layout([[0, 1, 2, 3]], 2)
    assert _repair_pairs(lay, [0, 1], [2, 3]) == [{"type": 0, "src": 0, "dst": 2}, {"type": 0, "src": 1, "dst": 3}]
    assert _repair_pairs(lay, [2, 3], [0, 1]) == [{"type": 0, "src": 2, "dst": 0}, {"type": 0, "src": 3, "dst": 1}]
    assert _repair_pairs(lay, [0], [3]) is None          # shard 1 has no survivor
    assert _repair_pairs({}, [0, 1], [2]) is None        # layout unknown

"""Worker for test_regroup.py: one gloo rank (its own process: a default group in pytest's process would
outlive the test), groups held the ways megatron's objects hold them, unplugged, destroyed, plugged.

    _regroup_worker.py plug|closure|layout|replay
"""
import collections
import dataclasses
import os
import sys
import weakref

import torch
import torch.distributed as dist

from mindio.megatron import regroup
from mindio.ttp.processor import device

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Collection:  # megatron's ProcessGroupCollection is a dataclass of groups
    tp: object = None
    dp: object = None


class Slotted:
    __slots__ = ("group", "n")

    def __init__(self, group):
        self.group, self.n = group, 3


class Module(torch.nn.Module):
    def __init__(self, tp, dp):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.tp_group = tp
        self.pgs = Collection(tp, dp)
        self.pair = Pair(tp, 1)
        self.groups = [dp, {"x": (tp, dp)}]
        self.slotted = Slotted(dp)


def world() -> list:
    tp = dist.new_group([0], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    dp = dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
    return [tp, dp]


def closure(group):
    return lambda: group


def teardown() -> None:
    device.destroy_groups()


def replay_case() -> None:
    """A build's collectives are recorded; the object ones run again on the new groups, a tensor one is
    named as the reason not to keep the model."""
    tp, dp = world()
    calls = []
    with regroup.recording(calls):
        out = [None]
        dist.all_gather_object(out, ("keys", 1))  # what megatron's get_megatron_optimizer does
        dist.barrier(group=dp)
    assert dist.all_gather_object.__name__ == "all_gather_object" and not hasattr(dist.all_gather_object,
                                                                                "mindio_recorded")
    assert [(n, k) for n, _a, k in calls] == [("all_gather_object", None),
                                              ("barrier", ("DATA_PARALLEL_GROUP", (0,)))], calls
    store = dist.distributed_c10d._get_default_store()
    del tp, dp
    teardown()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.PrefixStore("gen1/", store))
    groups = lambda: device.all_groups() + [dist.group.WORLD]  # noqa: E731
    assert "DATA_PARALLEL_GROUP" in regroup.replayable(calls, groups())  # not created yet
    world()
    assert regroup.replayable(calls, groups()) == ""
    assert regroup.replay(calls, groups()) == 2
    with regroup.recording(calls):
        dist.all_reduce(torch.ones(1))
    assert "all_reduce" in regroup.replayable(calls, groups())
    print("replay: ok", flush=True)
    teardown()


def main(case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    if case == "replay":
        return replay_case()
    tp, dp = world()
    model = Module(tp, dp)
    if case == "closure":
        model.hook = closure(tp)  # a closure cell: the walk cannot replace it
    unplugged = regroup.unplug([model], device.all_groups() + [dist.group.WORLD])
    assert unplugged.places == 8, unplugged.places
    assert isinstance(model.tp_group, regroup.Socket) and model.pgs.tp is model.tp_group
    assert type(model.pair) is Pair and model.pair.a is model.tp_group and model.pair.b == 1
    assert isinstance(model.slotted.group, regroup.Socket) and model.slotted.n == 3
    assert model.groups[1]["x"] == (model.tp_group, model.pgs.dp)
    try:
        model.tp_group.size()
        raise AssertionError("a socket answered")
    except RuntimeError as exc:
        assert "TENSOR_MODEL_PARALLEL_GROUP" in str(exc) and "unplugged" in str(exc), exc
    held = regroup.held_elsewhere(unplugged.groups, [tp, dp])
    if case == "closure":
        assert held == ["TENSOR_MODEL_PARALLEL_GROUP by cell"], held
        print("closure held: found", flush=True)
        return
    assert held == [], held
    refs = [weakref.ref(tp), weakref.ref(dp)]
    store = dist.distributed_c10d._get_default_store()  # the job's store outlives its groups (inplace.World)
    del tp, dp
    teardown()  # every group destroyed: nothing in the model keeps one alive
    assert [r() for r in refs] == [None, None], "an unplugged group is still alive"
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.PrefixStore("gen1/", store))
    if case == "layout":  # the new world has no tensor-parallel group of these ranks
        dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
        gone = regroup.missing(unplugged, device.all_groups() + [dist.group.WORLD])
        assert [s.desc for s in gone] == ["TENSOR_MODEL_PARALLEL_GROUP"], gone
        print("layout: missing named", flush=True)
        return
    new_tp, new_dp = world()
    assert regroup.missing(unplugged, device.all_groups() + [dist.group.WORLD]) == []
    assert regroup.plug(unplugged, device.all_groups() + [dist.group.WORLD]) == 8
    assert model.tp_group is new_tp and model.pgs.dp is new_dp and model.pair.a is new_tp
    assert model.slotted.group is new_dp and model.groups[1]["x"] == (new_tp, new_dp)
    t = torch.ones(1)
    dist.all_reduce(t, group=model.pgs.dp)  # the plugged group works
    print("plugged: ok", flush=True)
    teardown()


if __name__ == "__main__":
    main(sys.argv[1])

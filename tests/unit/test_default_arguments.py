"""mindio.ttp.processor.device.forget_default_arguments: a library function that holds a process group as a
default argument would keep the group (and its connections) alive after destroy_process_group."""
import sys
import types
import weakref

import torch.distributed as dist

from mindio.ttp.processor import device


class _Group:  # stands in for a ProcessGroup: only identity matters
    pass


def test_groups_held_as_default_arguments_are_replaced_by_none(monkeypatch):
    g, other = _Group(), _Group()
    mod = types.ModuleType("fake_dist_nn")
    mod.G, mod.O = g, other  # the names the defaults are evaluated from, removed after the defs
    exec("def f(x, op='sum', group=G):\n    return group\n"
         "def h(x, group=O):\n    return group\n"
         "def k(x):\n    return x\n", mod.__dict__)
    del mod.G, mod.O
    monkeypatch.setitem(sys.modules, "fake_dist_nn", mod)
    monkeypatch.setattr(device, "_BAKED_DEFAULT_MODULES", ("fake_dist_nn",))
    ref = weakref.ref(g)
    assert mod.f(1) is g
    assert device.forget_default_arguments([g]) == 1
    assert mod.f.__defaults__ == ("sum", None) and mod.f(1) is None  # None: the default group at call time
    assert mod.h(1) is other and mod.k(2) == 2  # other groups and functions untouched
    del g
    assert ref() is None  # nothing holds the group any more


def test_the_torch_module_that_bakes_the_world_group_is_covered():
    import torch.distributed.nn.functional as fn  # noqa: F401

    assert "torch.distributed.nn.functional" in device._BAKED_DEFAULT_MODULES
    assert fn.all_reduce.__defaults__[-1] is None or isinstance(fn.all_reduce.__defaults__[-1], dist.ProcessGroup)

"""Keep a built model across a retry: its process groups are unplugged at ``clean`` and the next
generation's plugged in at ``rebuild_groups``, instead of dropping the model and building it again.

A retry (mindio.ttp.controller.retry) keeps every process and the parallel layout: the same ranks
hold the same model chunks, buckets and optimizer shards before and after. What must change are the
process groups: a gloo group whose collective failed (or a NCCL communicator that was aborted) cannot
be used again, and a peer blocked in a collective with this rank is released only once the group is
destroyed and nothing references it any more (mindio/ttp/processor/device.py). Building the model,
its DDP buffers and the distributed optimizer again cost 4.8-5.5 s at 1 GiB of state per rank on the
benchmark machine, and left params that only an all-gather of the whole param buffer could restore
(3.7 s more; issue 18, docs/benchmarks.md).

So :func:`unplug` walks what the training objects reference (modules, DDP bucket groups, optimizers,
the scheduler; dicts, lists, tuples, dataclasses and plain objects; never tensors) and replaces each
``torch.distributed.ProcessGroup`` it finds by a :class:`Socket` naming the group (its global ranks
and its description, e.g. megatron's ``DATA_PARALLEL_GROUP``): afterwards the objects hold no group,
so mindio's teardown releases every one of them as before. :func:`plug` walks the same objects after
the new generation's groups exist and puts in, for each socket, the new group with the same ranks and
description. A group the walk cannot see (held by a closure or by C++ only) would stay alive and is
caught by :func:`unplug`'s check of what still refers to the groups it found, and the model is then
dropped and built again, as before. Using a socket before it is plugged raises, naming the group.

Only for a rebuild of the same ranks and parallel layout (retry, recover-in-place, recover, hot
switch); an elastic change builds again. Some ranks of such a rebuild may build from scratch -- a
replacement process, or a rank that could not keep its model -- and a build runs collectives (megatron-
core 0.16: one ``all_gather_object`` of the param-group keys over the world, in
``get_megatron_optimizer``). So every build records the collectives it calls through
``torch.distributed`` (:func:`recording`), and a rank that keeps its model runs them again with the
same arguments on the new groups (:func:`replay`): the builders meet them. A build that ran a collective
that cannot be run again without its tensors (:data:`REPLAYABLE`) is not kept: the rank builds again.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import gc
import logging
import types
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["Socket", "unplug", "plug", "missing", "held_elsewhere", "group_key", "Unplugged", "recording",
           "replayable", "replay"]

_log = logging.getLogger(__name__)

# values the walk never enters: no process group can be inside them
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), enum.Enum, torch.Tensor, torch.dtype,
           torch.device, torch.Size, range, slice, type, types.ModuleType, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType)
try:  # numpy arrays: large and group-free
    import numpy as _np
    _LEAVES = _LEAVES + (_np.ndarray, _np.generic)
except ImportError:  # pragma: no cover
    pass


class Socket:
    """Where a process group was: its global ranks and description. Plugged by :func:`plug`."""

    __slots__ = ("ranks", "desc")

    def __init__(self, ranks: Tuple[int, ...], desc: str):
        self.ranks, self.desc = ranks, desc

    def __repr__(self) -> str:
        return f"Socket({self.desc or 'group'} of ranks {list(self.ranks)[:8]})"

    def __getattr__(self, name: str):
        raise RuntimeError(f"process group {self.desc or ''} of ranks {list(self.ranks)[:8]} was unplugged by "
                           f"mindio's clean (the model is kept for a retry) and is not plugged in again yet: "
                           f"no collective may run between clean and rebuild")


def group_key(group) -> Optional[Tuple[str, Tuple[int, ...]]]:
    """(description, global ranks in group-rank order) of a registered group; None when it is not
    registered (destroyed already)."""
    ranks = dist.distributed_c10d._world.pg_group_ranks.get(group)
    if ranks is None:
        return None
    return getattr(group, "group_desc", "") or "", tuple(g for g, _ in sorted(ranks.items(), key=lambda kv: kv[1]))


def _walk(roots: Iterable[Any], swap: Callable[[Any], Any]) -> int:
    """Replace, in place, every value ``v`` reachable from ``roots`` for which ``swap(v)`` is not
    ``v``; returns the number of places changed. Tuples are rebuilt in their parent."""
    seen: set = set()
    changed = [0]

    def visit(obj):  # -> the value to put where obj was
        new = swap(obj)
        if new is not obj:
            changed[0] += 1
            return new
        if isinstance(obj, _LEAVES) or isinstance(obj, Socket) or id(obj) in seen:
            return obj
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                nv = visit(v)
                if nv is not v:
                    obj[k] = nv
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                nv = visit(v)
                if nv is not v:
                    obj[i] = nv
        elif isinstance(obj, tuple):
            items = [visit(v) for v in obj]
            if any(a is not b for a, b in zip(items, obj)):
                return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        elif isinstance(obj, (set, frozenset)):
            for v in obj:
                if visit(v) is not v:
                    raise TypeError(f"a process group inside a {type(obj).__name__}: cannot be replaced")
        else:
            try:
                attrs = object.__getattribute__(obj, "__dict__")
            except Exception:  # no __dict__ (C++ objects, slots only)
                attrs = None
            if isinstance(attrs, dict):
                for k, v in list(attrs.items()):
                    nv = visit(v)
                    if nv is not v:
                        attrs[k] = nv
            for cls in type(obj).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for k in (slots,) if isinstance(slots, str) else slots:
                    if k in ("__dict__", "__weakref__"):
                        continue
                    try:
                        v = object.__getattribute__(obj, k)
                    except AttributeError:
                        continue
                    nv = visit(v)
                    if nv is not v:
                        object.__setattr__(obj, k, nv)
        return obj

    for root in roots:
        if visit(root) is not root:
            raise TypeError("a root of the walk is itself a process group")
    return changed[0]


@dataclasses.dataclass
class Unplugged:
    """What :func:`unplug` took out: the objects (walked again by :func:`plug`), the sockets, and
    weak references to the groups unplugged (:func:`held_elsewhere`)."""

    roots: List[Any]
    sockets: Dict[Tuple[str, Tuple[int, ...]], Socket]
    places: int
    found: List[Any] = dataclasses.field(default_factory=list)  # weakref.ref to each group unplugged

    @property
    def groups(self) -> List[Any]:
        return [g for g in (r() for r in self.found) if g is not None]


def unplug(roots: List[Any], groups: List[Any]) -> Unplugged:
    """Replace every registered process group reachable from ``roots`` by its :class:`Socket`.

    ``groups``: the registered groups (mindio.ttp.processor.device.all_groups() plus the default
    one). Raises ``RuntimeError`` when a group is found that is not registered (its ranks are unknown),
    or when, afterwards, something the walk cannot see still refers to one of them (the caller then
    drops the objects, as without this module)."""
    keys = {}
    for g in groups:
        key = group_key(g)
        if key is not None:
            keys[id(g)] = key
    sockets: Dict[Tuple[str, Tuple[int, ...]], Socket] = {}
    unknown: List[str] = []
    found: Dict[int, Any] = {}

    def swap(v):
        if isinstance(v, dist.ProcessGroup):
            key = keys.get(id(v))
            if key is None:
                unknown.append(repr(getattr(v, "group_desc", v)))
                return v
            found.setdefault(id(v), weakref.ref(v))
            sock = sockets.get(key)
            if sock is None:
                sock = sockets[key] = Socket(key[1], key[0])
            return sock
        return v

    places = _walk(roots, swap)
    if unknown:
        raise RuntimeError(f"process groups {unknown[:4]} held by the model are not registered: cannot "
                           f"name them for the rebuild")
    return Unplugged(list(roots), sockets, places, list(found.values()))


def held_elsewhere(groups: List[Any], allowed: Iterable[Any] = ()) -> List[str]:
    """Which of ``groups`` something still refers to, as far as the garbage collector can tell (objects,
    containers, closure cells, partials; not C++), other than torch's registry of groups, a list or
    tuple of nothing but groups (mindio's teardown holds one until it releases them), frames,
    ``groups`` itself and ``allowed``: "<description> by <type of the holder>" for each."""
    c10d = dist.distributed_c10d
    skip = {id(groups)} | {id(a) for a in allowed} | {id(vars(c10d._world))}
    for reg in list(vars(c10d._world).values()) + list(vars(c10d).values()):  # torch's registry of groups
        if isinstance(reg, (dict, list)):
            skip.add(id(reg))
            if isinstance(reg, dict):
                skip.update(id(v) for v in reg.values() if isinstance(v, (list, tuple)))
    held = []
    for g in groups:
        for r in gc.get_referrers(g):
            if id(r) in skip or isinstance(r, types.FrameType):
                continue
            if isinstance(r, (list, tuple)) and all(isinstance(x, dist.ProcessGroup) for x in r):
                continue
            held.append(f"{getattr(g, 'group_desc', '') or 'group'} by {type(r).__name__}")
            break
    return held


def _by_key(groups: List[Any]) -> dict:
    new = {}
    for g in groups:
        key = group_key(g)
        if key is not None:
            new.setdefault(key, g)
    return new


def missing(unplugged: Unplugged, groups: List[Any]) -> List[Socket]:
    """The sockets of ``unplugged`` no group of ``groups`` (the registered ones now) fits."""
    new = _by_key(groups)
    return [s for k, s in unplugged.sockets.items() if k not in new]


def plug(unplugged: Unplugged, groups: List[Any]) -> int:
    """Put the new generation's groups where :func:`unplug` left sockets; returns the places filled.
    ``groups``: the registered groups now. Raises ``RuntimeError`` when a socket has no new group of
    the same ranks and description (a different layout: the objects cannot be kept)."""
    new = _by_key(groups)
    gone = [s for k, s in unplugged.sockets.items() if k not in new]
    if gone:
        raise RuntimeError(f"no new process group for {gone[:4]}: the layout changed")
    by_id = {id(s): new[k] for k, s in unplugged.sockets.items()}
    return _walk(unplugged.roots, lambda v: by_id.get(id(v), v) if isinstance(v, Socket) else v)


# ----------------------------------------------------------------------- the collectives of a build
#: collectives a rank keeping its model can run again from what :func:`recording` kept
REPLAYABLE = ("all_gather_object", "broadcast_object_list", "barrier")
_WATCHED = REPLAYABLE + ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
                         "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
                         "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
                         "gather_object", "scatter_object_list", "monitored_barrier")


def _recorder(name: str, fn, calls: list):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        try:
            bound = dict(signature.bind(*args, **kwargs).arguments)
        except TypeError:
            bound = {}
        group = bound.pop("group", None)
        key = None if group is None else group_key(group)
        if group is not None and key is None:
            kept = ("unregistered group",)
        elif name == "all_gather_object":
            kept = {"obj": copy.deepcopy(bound.get("obj"))}
        elif name == "broadcast_object_list":
            kept = {"object_list": copy.deepcopy(list(bound.get("object_list", ()))),
                    **{k: bound[k] for k in ("src", "group_src") if bound.get(k) is not None}}
        elif name == "barrier":
            kept = {}
        else:
            kept = None  # a tensor collective: not replayable
        calls.append((name, kept, key))
        return fn(*args, **kwargs)

    recorded.mindio_recorded = True
    return recorded


@contextlib.contextmanager
def recording(calls: list):
    """Record, into ``calls``, each collective called through ``torch.distributed`` inside the block:
    ``(name, what to call it with again or None, group key or None for the default group)``."""
    saved = {}
    for name in _WATCHED:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "mindio_recorded", False):
            continue  # absent in this torch, or already recorded by an enclosing block
        saved[name] = fn
        setattr(dist, name, _recorder(name, fn, calls))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def replayable(calls: Optional[list], groups: List[Any]) -> str:
    """"" when :func:`replay` can run ``calls`` on ``groups`` (the registered groups now); else why not."""
    if calls is None:
        return "its build's collectives were not recorded"
    new = _by_key(groups)
    for name, kept, key in calls:
        if name not in REPLAYABLE or not isinstance(kept, dict):
            return f"its build ran {name}, which cannot be run again without the build"
        if key is not None and key not in new:
            return f"no new process group {key[0] or ''} of ranks {list(key[1])[:8]} for its build's {name}"
    return ""


def replay(calls: list, groups: List[Any]) -> int:
    """Run the recorded collectives of a build again on the new groups (:func:`replayable` said yes);
    what they return is dropped. Returns how many ran."""
    new = _by_key(groups)
    for name, kept, key in calls:
        group = None if key is None else new[key]
        if name == "all_gather_object":
            out = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, kept["obj"], group=group)
        elif name == "broadcast_object_list":
            dist.broadcast_object_list(copy.deepcopy(kept["object_list"]), group=group,
                                       **{k: v for k, v in kept.items() if k != "object_list"})
        else:
            dist.barrier(group=group)
    return len(calls)

"""Replica layout (pure): shard index, replica sets, memory formula, argument resolution."""

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _mgt_launch import have_megatron

pytestmark = pytest.mark.skipif(not have_megatron(), reason="megatron-core is not installed")


@settings(deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 50))
def test_every_shard_has_replica_cnt_holders(shards, r, offset):
    from mindio.megatron.replica import ReplicaLayout

    dp = tuple(range(offset, offset + shards * r))
    lay = ReplicaLayout(dp, r)
    holders = {}
    for rank in dp:
        holders.setdefault(lay.shard_of(rank), []).append(rank)
        assert rank in lay.replicas_of(rank)
        assert len(lay.replicas_of(rank)) == r
    assert sorted(holders) == list(range(shards))
    assert all(len(v) == r for v in holders.values())
    # contiguous parts: the first d/R ranks hold every shard once
    assert sorted(lay.shard_of(x) for x in dp[:shards]) == list(range(shards))


def test_layout_rejects_bad_input():
    from mindio.megatron.replica import ReplicaLayout

    with pytest.raises(ValueError, match="not divisible"):
        ReplicaLayout((0, 1, 2), 2)
    with pytest.raises(ValueError, match=">= 1"):
        ReplicaLayout((0, 1), 0)


def test_memory_overhead_formula():
    from mindio.megatron.replica import memory_overhead_bytes

    assert memory_overhead_bytes(1_000_000, 2, 4) == 12 * 1_000_000 * 1 / 4
    assert memory_overhead_bytes(1_000_000, 1, 4) == 0


def test_high_availability_flags(monkeypatch):
    from mindio.megatron import add_high_availability_args, replica_count, resolve_high_availability, wants_dump

    p = add_high_availability_args(argparse.ArgumentParser())
    p.add_argument("--use-distributed-optimizer", action="store_true")
    monkeypatch.setenv("HIGH_AVAILABILITY", "retry")
    args = resolve_high_availability(p.parse_args(["--use-distributed-optimizer"]))
    assert args.enable_hbmfault_repair and args.enable_high_availability
    assert replica_count(args) == 2
    args = resolve_high_availability(p.parse_args(["--use-distributed-optimizer",
                                                   "--distributed-optimizer-no-replica"]))
    assert replica_count(args) == 1
    monkeypatch.delenv("HIGH_AVAILABILITY")
    with pytest.raises(SystemExit, match="needs --use-distributed-optimizer"):
        resolve_high_availability(p.parse_args(["--enable-high-availability"]))
    # a parser with --save (Megatron's): high availability plans a dump there, so none is refused...
    p.add_argument("--save", default=None)
    ha = ["--use-distributed-optimizer", "--enable-high-availability"]
    with pytest.raises(SystemExit, match=r"needs --save DIR.*--no-dump"):
        resolve_high_availability(p.parse_args(ha))
    for flags in (["--enable-hbmfault-repair"], ["--enable-worker-reboot"], ["--enable-elastic-training"]):
        with pytest.raises(SystemExit, match="needs --save DIR"):  # each sub-feature implies the dump too
            resolve_high_availability(p.parse_args(["--use-distributed-optimizer", *flags]))
    # ...unless the job asks for no dump: --no-dump, or HIGH_AVAILABILITY without "dump"
    assert not wants_dump(resolve_high_availability(p.parse_args(ha + ["--no-dump"])))
    assert wants_dump(resolve_high_availability(p.parse_args(ha + ["--save", "ckpt"])))
    monkeypatch.setenv("HIGH_AVAILABILITY", "retry")
    assert not wants_dump(resolve_high_availability(p.parse_args(["--use-distributed-optimizer"])))

"""The replica cross-check's pieces, one process: the N slices cover every byte of any shard once (hypothesis),
each slice's hash is the XXH3-64 of its bytes across tensors (one slice: what repairs check), any one
flipped bit changes exactly one slice's, and the ``flip`` drill's spec. The holders' comparison runs in
tests/megatron/test_crosscheck.py."""

import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from mindio import drill
from mindio.adapter.crosscheck import shard_bytes, slice_bounds, slice_hashes
from mindio.errors import ConfigError


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 10_000), min_size=1, max_size=8), every=st.integers(1, 64),
       start=st.integers(0, 10**9))
def test_any_n_consecutive_steps_cover_every_byte_of_every_shard(sizes, every, start):
    """Several shards (their sizes drawn independently), one schedule: from any step on, the slices of
    ``every`` consecutive steps cover bytes 0..size of each shard, without overlap."""
    for total in sizes:
        seen = bytearray(total)
        for step in range(start, start + every):
            lo, hi = slice_bounds(total, every, step)
            assert 0 <= lo <= hi <= total
            for i in range(lo, hi):
                assert not seen[i], f"byte {i} hashed twice in {every} steps"
                seen[i] = 1
        assert all(seen), f"bytes of a {total}-byte shard not hashed within {every} steps"


def test_slice_bounds_refuses_no_slices():
    with pytest.raises(ValueError, match="every must be >= 1"):
        slice_bounds(10, 0, 3)


_DTYPES = [torch.float32, torch.float16, torch.int64, torch.uint8]


@st.composite
def _shard(draw):
    tensors = [torch.randint(0, 256, (draw(st.integers(0, 300)),), dtype=torch.uint8).view(torch.uint8)
               for _ in range(draw(st.integers(1, 5)))]
    out = []
    for t in tensors:  # reinterpret as another dtype where the size allows (a shard mixes fp32 and step)
        dt = draw(st.sampled_from(_DTYPES))
        size = torch.empty((), dtype=dt).element_size()
        out.append(t[:len(t) - len(t) % size].view(dt))
    return out


@settings(max_examples=200, deadline=None)
@given(tensors=_shard(), every=st.integers(1, 40))
def test_slice_hashes_are_each_slices_xxh3_in_one_pass(tensors, every):
    """What a boundary check hashes (one pass over the shard, any sizes, slices cut inside or across
    tensors, empty slices) is each slice's XXH3-64 (as a signed int64), as if hashed one by one."""
    blob = b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors)
    want = [xxhash.xxh3_64_intdigest(blob[slice(*slice_bounds(len(blob), every, i))]) for i in range(every)]
    assert [h & (1 << 64) - 1 for h in slice_hashes(tensors, every)] == want


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 2000), every=st.integers(1, 16), data=st.data())
def test_one_flipped_bit_anywhere_is_seen_within_every_steps(n, every, data):
    """Two holders, one of them with one bit flipped (any element, any bit): exactly one of the ``every``
    slices' hashes differs (a check every ``every`` steps sees it)."""
    a = [torch.randn(n), torch.randn(3), torch.tensor([7.0])]
    b = [t.clone() for t in a]
    k = data.draw(st.integers(0, len(b) - 1))
    j = data.draw(st.integers(0, b[k].numel() - 1))
    bit = data.draw(st.integers(0, 31))
    b[k].view(torch.int32)[j] ^= (1 << bit) if bit < 31 else -(1 << 31)
    differ = [i for i, (x, y) in enumerate(zip(slice_hashes(a, every), slice_hashes(b, every))) if x != y]
    assert len(differ) == 1 and 0 <= differ[0] < every


def test_flip_spec():
    (f,) = drill.parse("flip:rank=1,step=6")
    assert (f.kind, f.rank, f.step, f.state, f.bit) == ("flip", 1, 6, "param", 0)
    (f,) = drill.parse("flip:rank=3,step=2,state=exp_avg_sq,bit=4")
    assert (f.state, f.bit) == ("exp_avg_sq", 4)


@pytest.mark.parametrize("spec, needle", [
    ("flip:rank=1,step=3,state=grad", "state= is only for flip, one of param, exp_avg, exp_avg_sq"),
    ("flip:rank=1,step=3,bit=23", "a mantissa bit of fp32 (0..22)"),
    ("kill:rank=1,step=3,bit=2", "bit= is only for flip"),
    ("raise:rank=1,step=3,state=param", "state= is only for flip"),
])
def test_bad_flip_specs_say_what_is_wrong(spec, needle):
    with pytest.raises(ConfigError) as err:
        drill.parse(spec)
    assert needle in str(err.value)


def test_flip_calls_the_framework_and_raises_nothing(capsys):
    calls = []
    d = drill.Drill("flip:rank=0,step=2,state=exp_avg,bit=3", environ={})
    d.maybe_fire(1, 0, flip=lambda state, bit: calls.append((state, bit)) or "x of tensor 0")
    d.maybe_fire(2, 0, flip=lambda state, bit: calls.append((state, bit)) or "x of tensor 0")
    d.maybe_fire(2, 0, flip=lambda state, bit: calls.append((state, bit)) or "again")
    assert calls == [("exp_avg", 3)]  # once per job
    assert "[rank 0] injecting flip at step 2: x of tensor 0" in capsys.readouterr().out


def test_flip_without_a_flip_function_is_a_clear_error():
    with pytest.raises(ConfigError, match="passes no flip function"):
        drill.Drill("flip:rank=0,step=1", environ={}).maybe_fire(1, 0)

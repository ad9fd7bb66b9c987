"""restore_build.recycled_buffers: inside, megatron's way of allocating a DDP buffer
(``torch.zeros(n, dtype=, device=)``) takes a kept buffer of exactly that size and dtype, zeroed in
place; every other allocation is a new one, and torch.zeros is itself again afterwards."""

import torch

from mindio.megatron.restore_build import recycled_buffers, spare_buffers


def test_a_spare_of_the_size_asked_is_zeroed_and_handed_out_once():
    spare = torch.full((1000,), 7.0)
    other = torch.full((10,), 7, dtype=torch.int64)
    spares = [spare, other]
    with recycled_buffers(spares):
        assert spares == []  # taken over: what is not handed out is dropped at the end
        a = torch.zeros(1000, dtype=torch.float32, device=torch.device("cpu"), requires_grad=False)
        b = torch.zeros(1000, dtype=torch.float32, device="cpu")  # the spare is gone: new memory
        c = torch.zeros(10)  # default dtype float32: the int64 spare does not fit
        d = torch.zeros(2, 5, dtype=torch.int64)  # not a flat size: new memory
    assert a.data_ptr() == spare.data_ptr() and torch.count_nonzero(a) == 0 and not a.requires_grad
    assert b.data_ptr() != spare.data_ptr() and torch.count_nonzero(b) == 0
    assert c.data_ptr() != other.data_ptr() and d.data_ptr() != other.data_ptr()
    assert torch.equal(other, torch.full((10,), 7, dtype=torch.int64))  # never handed out: untouched
    assert torch.zeros(1000).data_ptr() != spare.data_ptr()  # torch.zeros restored


def test_requires_grad_and_an_exception_inside():
    spare = torch.ones(8)
    try:
        with recycled_buffers([spare]):
            t = torch.zeros(8, requires_grad=True)
            raise RuntimeError("build failed")
    except RuntimeError:
        pass
    assert t.data_ptr() == spare.data_ptr() and t.requires_grad and torch.count_nonzero(t) == 0
    assert torch.zeros(8).data_ptr() != spare.data_ptr()


class _Buffer:  # the two attributes spare_buffers reads of megatron's _ParamAndGradBuffer
    def __init__(self, param_data, grad_data):
        self.param_data, self.grad_data = param_data, grad_data


class _Chunk:  # the two lists spare_buffers reads of megatron's DistributedDataParallel
    def __init__(self, buffers, expert=()):
        self.buffers, self.expert_parallel_buffers = list(buffers), list(expert)


def test_spare_buffers_are_grad_buffers_nothing_kept_uses():
    g0, g1, g2, shared = torch.zeros(16), torch.zeros(8), torch.zeros(4), torch.zeros(32)
    model = [_Chunk([_Buffer(torch.zeros(16), g0), _Buffer(shared[:16], shared)], expert=[_Buffer(None, g1)]),
             _Chunk([_Buffer(torch.zeros(4), g2)])]
    kept = {"shards": [g2[1:3]]}  # clean() keeps a view of g2: not a spare
    spares = spare_buffers(model, kept)
    assert [t.data_ptr() for t in spares] == [g0.data_ptr(), g1.data_ptr()]
    assert spare_buffers(None) == []

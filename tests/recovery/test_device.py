"""mindio.ttp.processor.device: backend selection, and the CPU/gloo teardown releasing a blocked peer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from mindio._ports import free_port as _free_port  # outside the ephemeral range (mindio/_ports.py)
from mindio.ttp.processor import device
from tests._exits import check_codes

WORKER = Path(__file__).with_name("_device_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_gloo_teardown_releases_blocked_peer_within_a_second(tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(tmp_path)], env=env)
             for r in (0, 1)]
    try:
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    check_codes(codes)  # names the rank and the signal of a signal death
    assert codes == [0, 0]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r1["error"] == "injected fault on rank 1"
    assert r1["backend"] == r1["backend_used"] == "gloo"
    assert r1["initialized_after"] is False
    assert r0["error"], "rank 0 was never released"
    # rank 0 stayed blocked until the teardown (rank 1 waited 0.5 s first) ...
    assert r0["t_error"] >= r1["t_teardown"] - 0.05, (r0, r1)
    # ... and was released by it, long before rank 1 exits (5 s later) or the 120 s timeout.
    # ~10 ms measured; the margin is for a loaded shared machine.
    assert r0["t_error"] - r1["t_teardown"] < 2.0, (r0, r1)


def test_backend_selection_without_a_process_group(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setattr(device, "_npu_importable", lambda: False)
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: False)
    assert isinstance(device.backend_for(), device.GlooBackend)
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: True)
    assert isinstance(device.backend_for(), device.NcclBackend)


def test_backend_selection_from_the_group(monkeypatch):
    monkeypatch.setattr(device.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(device, "_npu_importable", lambda: False)
    for name, cls in (("gloo", device.GlooBackend), ("nccl", device.NcclBackend),
                      ("cpu:gloo,cuda:nccl", device.NcclBackend), ("mpi", device.GlooBackend)):
        monkeypatch.setattr(device.dist, "get_backend", lambda group=None, _n=name: _n)
        assert isinstance(device.backend_for(), cls), name
    monkeypatch.setattr(device.dist, "get_backend", lambda group=None: "hccl")
    with pytest.raises(RuntimeError, match="torch_npu is not importable"):
        device.backend_for()


def test_hccl_backend_calls_torch_npu(monkeypatch):
    """The HCCL path is written against torch_npu's documented API; here a recording stand-in
    checks the call order and the stop_device failure check (no Ascend device on this machine)."""
    import types

    calls = []
    npu = types.SimpleNamespace(
        npu=types.SimpleNamespace(stop_device=lambda d: calls.append(("stop", d)) or 1,
                                  restart_device=lambda d: calls.append(("restart", d))),
        distributed=types.SimpleNamespace(
            reinit_process_group=lambda group=None, rebuild_link=True: calls.append(("reinit", rebuild_link))))
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    monkeypatch.setattr(device.torch, "npu", types.SimpleNamespace(current_device=lambda: 3), raising=False)
    b = device.HcclBackend()
    with pytest.raises(RuntimeError, match="stop_device\\(3\\) returned 1"):
        b.stop()
    b.clean()
    b.reinit()
    assert calls == [("stop", 3), ("restart", 3), ("reinit", True)]


def test_processor_teardown_frees_the_device_after_destroying_the_groups(monkeypatch):
    """A rank's teardown after a fault runs the backend's stop first and its device-side counterpart
    last (nccl: synchronize + empty_cache; hccl: restart_device after stop_device), on the backend
    picked while the groups still existed: the later ``clean`` action finds no group and does not."""
    from mindio.ttp.processor.processor import Processor

    calls = []

    class Recorder(device.DeviceBackend):
        name = "recorder"

        def stop(self):
            calls.append("stop")

        def free_device_memory(self):
            calls.append("free")

    picked = iter([Recorder()])
    monkeypatch.setattr(device, "backend_for", lambda group=None: next(picked))
    monkeypatch.setattr(device, "destroy_groups", lambda: calls.append("destroy") or 0)
    Processor(0, 1).teardown(is_uce=False)
    assert calls == ["stop", "destroy", "free"]


class _FakeGroup:
    """A process group whose abort waits on ``gate`` (a barrier of every group, or an event)."""

    def __init__(self, gate):
        self.gate, self.aborted = gate, False

    def abort(self):
        self.gate.wait(5) if isinstance(self.gate, threading.Barrier) else self.gate.wait()
        self.aborted = True


def test_nccl_stop_aborts_every_group_at_once(monkeypatch):
    """ncclCommAbort takes about 1 s per communicator (measured on an H200: 21 groups one after another
    12-19.5 s, on parallel threads 1.01 s): every group's abort is under way before any returns -- one at
    a time, the barrier below would break after 5 s and no group would count as aborted."""
    gate = threading.Barrier(6)
    groups = [_FakeGroup(gate) for _ in range(6)]
    monkeypatch.setattr(device, "all_groups", lambda: groups)
    monkeypatch.setattr(device.dist, "is_initialized", lambda: False)
    device.NcclBackend().stop()
    assert all(g.aborted for g in groups)


def test_nccl_stop_gives_up_waiting_at_its_bound_and_says_so(monkeypatch, caplog):
    """An abort that never returns holds the teardown for MINDIO_NCCL_ABORT_TIMEOUT at most, and the log
    names the knob."""
    never = threading.Event()
    monkeypatch.setattr(device, "all_groups", lambda: [_FakeGroup(never), _FakeGroup(never)])
    monkeypatch.setattr(device.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("MINDIO_NCCL_ABORT_TIMEOUT", "1")
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="mindio.ttp.device"):
        device.NcclBackend().stop()
    assert time.monotonic() - t0 < 5
    assert "2 of 2 communicator aborts still running after 1 s (MINDIO_NCCL_ABORT_TIMEOUT)" in caplog.text
    never.set()


def test_kill_hung_rejects_nothing_but_kills(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    device.kill_hung(p.pid)
    assert p.wait(timeout=10) == -9

"""mindio.ttp.processor.device: backend selection, and the CPU/gloo teardown releasing a blocked peer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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


def test_kill_hung_rejects_nothing_but_kills(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    device.kill_hung(p.pid)
    assert p.wait(timeout=10) == -9

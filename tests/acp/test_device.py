"""Accelerator state through mindio.save/load (mindio/acp/_device.py): straight into the registered
pool, loads to the device, the staging fallback, and CPU-only processes that never touch CUDA.

The CUDA tests run wherever a GPU is present and skip elsewhere; the CPU ones run everywhere.
Timings are bench/acp_gpu_bench.py's job, not these tests'.
"""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from mindio.acp import _device, api
from mindio.acp import format as fmt

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device in this process (torch.cuda.is_available() "
                                                     "is False): the device path is tested where a GPU is present")


def _child(mode: str, ckpt: str, **env) -> tuple:
    proc = subprocess.run([sys.executable, "-m", "tests.acp._device_child", mode, ckpt], cwd=ROOT,
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _desc(device: str, index: int = 0) -> list:
    return [index, 0, [4], [1], "float32", False, False, device]


def test_placement_follows_map_location():
    """Which storages load to an accelerator (copied once, shared by their views) and which stay CPU views."""
    cuda0 = torch.device("cuda:0")
    tensors = [_desc("cuda:0", 0), _desc("cuda:0", 0), _desc("cpu", 1)]
    assert fmt._placement(tensors, 2, None) == [cuda0, None]
    assert fmt._placement(tensors, 2, "cpu") == [None, None]
    assert fmt._placement(tensors, 2, "cuda:1") == [torch.device("cuda:1")] * 2
    assert fmt._placement(tensors, 2, {"cuda:0": "cpu"}) == [None, None]
    assert fmt._placement(tensors, 2, {"cpu": "cuda:0"}) == [cuda0, cuda0]
    assert fmt._placement(tensors, 2, lambda t, loc: t) == [None, None]        # per tensor, as before
    assert fmt._placement([["x"], _desc("nonsense:7", 1), _desc("cuda:0", 5)], 2, None) == [None, None]


def test_cpu_only_process_never_touches_cuda(acp_env):
    """A CPU-only trainer saves and loads without creating a CUDA context or registering anything."""
    found, err = _child("cpu", acp_env["ck"])
    assert found == {"cuda_initialized": False, "paths": {}}, err[-2000:]
    assert "page-locked" not in err


@needs_cuda
@pytest.mark.slow
def test_cuda_state_straight_into_the_registered_pool(acp_env):
    """CUDA in use before initialize(): the pool is registered up front; saves and loads are bitwise,
    views keep sharing storage, mixed CPU/GPU objects work, no pinned host memory is allocated per save."""
    found, err = _child("cuda", acp_env["ck"], MINDIO_ACP_POOL_MB="1024")   # two versions of ~150 MiB
    assert found["paths_after_initialize"] == {"cuda": "pinned"}, err[-3000:]
    assert found["paths"] == {"cuda": "pinned"}
    assert found["counts"] == {}                               # every save went to the pool (rc 1)
    assert err.count("registered as page-locked memory") == 1
    for key, delta in found.get("host_alloc", {}).items():
        assert delta == 0, (key, delta)


@needs_cuda
@pytest.mark.slow
def test_cuda_state_through_staging_when_registration_is_off(acp_env):
    """MINDIO_ACP_PIN_POOL=0: saves still succeed, through reusable pinned staging, logged once."""
    found, err = _child("cuda", acp_env["ck"], MINDIO_ACP_PIN_POOL="0", MINDIO_ACP_POOL_MB="1024")
    assert found["paths_after_initialize"] == {"cuda": "staged"}, err[-3000:]
    assert found["paths"] == {"cuda": "staged"} and found["counts"] == {}
    assert err.count("not registered as page-locked memory for cuda (MINDIO_ACP_PIN_POOL=0)") == 1
    assert "registered as page-locked memory in" not in err


@needs_cuda
def test_failed_registration_falls_back_and_leaves_cuda_usable(acp_env):
    """A registration the driver refuses (here: the range is already registered by this process's
    client) selects the staging path, and leaves no stale CUDA error behind for the next kernel."""
    x = torch.randn((150 << 20) // 4, device="cuda")          # CUDA in use before initialize()
    assert api.initialize() == 0
    client = api._client
    assert client.device.paths == {"cuda": "pinned"}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mindio.acp._device").addHandler(handler)
    try:
        second = _device.DevicePool(client.pool, client.hello["pool_bytes"], client._copy_many)
        assert second.path("cuda") == "staged"
    finally:
        logging.getLogger("mindio.acp._device").removeHandler(handler)
    assert any("cudaError" in r.getMessage() for r in records), [r.getMessage() for r in records]
    y = (x * 2).sum()                                         # a kernel launch right after the failure
    torch.cuda.synchronize()
    assert torch.isfinite(y)
    src = x.view(torch.uint8)
    buf = bytearray(src.numel() + 4096)
    wait = second.to_host(memoryview(buf), [(4096, src)])
    assert wait is None                                       # staged copies are complete on return
    back = torch.frombuffer(buf, dtype=torch.uint8)[4096:]
    assert torch.equal(back, src.cpu())

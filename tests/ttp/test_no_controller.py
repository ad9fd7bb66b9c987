"""A processor whose controller never comes fails within its own bound, naming the address it tried
(issue 13: it used to wait for the process group's timeout, 30 min by default, on a store key)."""
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import mindio.ttp as ttp
from mindio._ports import free_port
from mindio.errors import NoController
from mindio.ttp._runtime import state as _rt


@pytest.fixture
def no_controller(monkeypatch):
    """A free port nobody listens on; the processor state of this process is reset afterwards."""
    monkeypatch.delenv("MINDIO_SECRET", raising=False)
    port = free_port()
    yield port
    _rt.processor = None


@pytest.mark.timeout(60)
def test_without_secret_the_store_wait_is_bounded(no_controller, monkeypatch):
    """torchrun style: the secret comes from the job's store, published by the controller's rank --
    which never starts one. The process group's timeout (600 s here) is not what bounds the wait."""
    monkeypatch.setenv("MINDIO_CONTROLLER_WAIT", "2")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=600))
    try:
        ttp.tft_init_processor(0, 1, enable_local_copy=False, enable_tls=False)
        t0 = time.monotonic()
        with pytest.raises(NoController) as err:
            ttp.tft_start_processor("127.0.0.1", no_controller)
        took = time.monotonic() - t0
    finally:
        dist.destroy_process_group()
    text = str(err.value)
    assert f"tcp://127.0.0.1:{no_controller}" in text and "MINDIO_CONTROLLER_WAIT" in text, text
    assert "mindio/ttp/secret" in text, text
    assert 2 <= took < 30, took  # its own bound (2 s), not the group's 600 s


@pytest.mark.timeout(60)
def test_with_secret_the_registration_is_bounded(no_controller, monkeypatch):
    """mindio-run style (MINDIO_SECRET given): nobody answers the registration at the address."""
    monkeypatch.setenv("MINDIO_SECRET", "ab" * 32)
    monkeypatch.setenv("TTP_RETRY_TIMES", "2")
    monkeypatch.setenv("MINDIO_HEARTBEAT_INTERVAL", "0.5")
    ttp.tft_init_processor(0, 1, enable_local_copy=False, enable_tls=False)
    t0 = time.monotonic()
    with pytest.raises(NoController) as err:
        ttp.tft_start_processor("127.0.0.1", no_controller)
    took = time.monotonic() - t0
    text = str(err.value)
    assert f"tcp://127.0.0.1:{no_controller}" in text and "TTP_RETRY_TIMES" in text, text
    assert 2 <= took < 30, took  # 2 attempts x max(1 s, 2 intervals)

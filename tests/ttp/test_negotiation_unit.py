"""Cluster-brain negotiation in one process over real loopback sockets (the toy-job version with a
separate decider process is test_negotiation_e2e.py)."""
import time

import pytest

import mindio.ttp as ttp
from mindio.errors import ConfigError
from mindio.ttp._runtime import state as _rt

from ._harness import start_plane, stop_plane, until as _until

KEY = b"n" * 32


@pytest.fixture
def ctl(monkeypatch):
    # action_limit 1.0: the pytest "main thread" never parks: stop waits half of this
    c, procs, _ = start_plane(2, KEY, misses=10, action_limit=1.0)
    monkeypatch.setattr(_rt, "controller", c)
    yield c
    stop_plane(c, procs)


@pytest.mark.timeout(60)
def test_on_global_rank_time_bounds_the_wait_for_the_decider(ctl):
    seen = []
    ttp.tft_register_mindx_callback("report_strategies", lambda ranks, options: seen.append((time.monotonic(),
                                                                                             ranks, options)))
    assert ttp.tft_notify_controller_on_global_rank({1: 1}, time=1) == 0  # MINDIO_WAIT_MINDX_TIME is 30
    assert _until(lambda: ctl.final.is_set(), 20)
    t_asked, ranks, options = seen[0]
    assert ranks == {1: 1} and options == ["exit"]  # rank 1's state exists nowhere else: no dump possible
    assert ctl.last_decision["strategy"] == "exit" and ctl.last_decision["decided_at"]
    assert ctl.final.is_set() and time.monotonic() - t_asked < 10


def test_on_global_rank_validates_its_arguments():
    for bad in (0, 3601, "1", True):
        with pytest.raises(ConfigError, match="time"):
            ttp.tft_notify_controller_on_global_rank({1: 1}, time=bad)
    with pytest.raises(ConfigError, match="errorType"):
        ttp.tft_notify_controller_on_global_rank({1: 5})

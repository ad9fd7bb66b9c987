"""Processor side of the retry actions (inplace.py) without sockets: the fence / FORCE STOP hand-off."""
import threading
import time

import pytest

from mindio.ttp._enums import Action
from mindio.ttp.processor import Processor


@pytest.mark.timeout(30)
def test_clean_force_stops_a_fenced_rank_and_retry_releases_it():
    proc = Processor(0, 1)
    proc._hold = True  # the stop action holds the fence
    seen = {}

    def main():  # what the decorator does around train()
        try:
            proc.start_updating_os(-1)
            seen["error"] = None
        except RuntimeError as exc:
            seen["error"] = str(exc)
        seen["next"] = proc.wait_next_action()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    end = time.monotonic() + 5
    while proc._main != "fenced" and time.monotonic() < end:
        time.sleep(0.01)
    assert proc._main == "fenced"
    assert proc._do_clean(timeout=5) == {"main": "parked", "destroyed": 0}
    assert seen["error"].startswith("FORCE STOP")
    proc._do_retry()
    t.join(5)
    assert seen["next"] == (Action.RETRY, 0)
    assert not proc._hold and proc._main == "running"


@pytest.mark.timeout(30)
def test_clean_times_out_on_a_busy_rank():
    proc = Processor(0, 1)  # main thread "running" (e.g. stuck in a long computation)
    with pytest.raises(TimeoutError, match="still running"):
        proc._do_clean(timeout=0.2)


def test_retry_refuses_a_rank_that_is_not_parked():
    with pytest.raises(RuntimeError, match="not parked"):
        Processor(0, 1)._do_retry()

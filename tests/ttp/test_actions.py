"""mindio/ttp/controller/actions.py: an action's caller is woken as soon as every live target answered,
also when a target died before the last live one answered (watch.declare_dead -> ActionEngine.lost: the
dead one no longer counts as outstanding). Before, the caller slept out its look-again wait (0.5 s): every recover-in-place
incident's stop took 0.55 s for replies that were all in after 0.1 s."""
import threading
import time

import pytest

from mindio.ttp.controller.actions import ActionEngine


class NotifiedOnly(threading.Condition):
    """A condition whose waits end only when notified (or after 30 s): a caller that is never woken hangs.
    ``waits`` counts the waits begun."""

    waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(30)


@pytest.mark.timeout(60)
def test_the_caller_wakes_when_its_last_missing_target_dies():
    cond, alive, sent = NotifiedOnly(), {0: True, 1: True}, []
    engine = ActionEngine(cond, lambda ranks, body, sn: sent.append((sorted(ranks), sn)), alive.__getitem__,
                          interval=60.0)
    out = {}
    caller = threading.Thread(target=lambda: out.update(engine.call("stop", {"timeout": 60}, [0, 1], 60)),
                              daemon=True)
    caller.start()
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    from mindio.ttp.wire import protocol as P

    with cond:
        before = cond.waits
        alive[1] = False  # rank 1 dies first: what declare_dead does, under the same condition
        engine.lost([1])
        cond.notify_all()  # the caller looks again: rank 0 has not answered yet, it waits on
    while cond.waits == before and time.monotonic() < deadline:  # until it waits again
        time.sleep(0.01)
    engine.on_reply(0, sent[0][1], P.Reply(ok=True))  # the last live target answers: that must wake it
    caller.join(10)
    assert not caller.is_alive(), "the caller still waits for a dead rank"
    assert list(out) == [0]

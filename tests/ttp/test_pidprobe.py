"""Same-host death detection (pidprobe.py): a SIGKILLed rank process on the controller's host is declared
dead through its pidfd, long before 3 missed heartbeats; a rank that says BYE and exits is no fault."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mindio.ttp.controller.controller import Controller
from mindio.ttp.controller.pidprobe import PidProbe, host_token
from mindio.ttp.controller.states import State

from ._harness import ROOT, free_port, until

KEY = b"p" * 32
_START = """
    import os, sys, time
    from mindio.ttp.processor.processor import Processor
    rank, port, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    p = Processor(rank, 2)
    p.start(f"tcp://127.0.0.1:{port}", bytes.fromhex(sys.argv[4]))
    while not os.path.exists(go):
        time.sleep(0.02)
"""
CHILD = textwrap.dedent(_START + """
    if rank == 1:
        p.destroy("training finished")
        sys.exit(0)
    time.sleep(600)
""")

pytestmark = pytest.mark.skipif(not PidProbe().enabled, reason="no pidfd_open or no host token here")



def _events(path):
    """The controller's event log so far; the log is created by its first event, so none yet is []."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def _job(tmp_path, monkeypatch, child: str, **ctl_args):
    """A controller in this process and two ranks running ``child``; yields (controller, processes,
    go file, event log); every process is reaped and the controller destroyed at the end."""
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("MINDIO_EVENT_LOG", str(events))
    port, go = free_port(), str(tmp_path / "go")
    ctl = Controller(rank=-1, world_size=2, enabled={"dump"}, key=KEY, misses=3, **ctl_args)
    ctl.start("127.0.0.1", port)
    env = dict(os.environ, PYTHONPATH=ROOT)
    kids = [subprocess.Popen([sys.executable, "-c", child, str(r), str(port), go, KEY.hex()], env=env)
            for r in range(2)]
    try:
        yield ctl, kids, go, events
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
            k.wait()
        ctl.destroy()


def test_host_token_names_host_and_pid_namespace():
    token = host_token()
    boot, ns = token.split("/")
    assert boot == open("/proc/sys/kernel/random/boot_id").read().strip()
    assert int(ns) == os.stat("/proc/self/ns/pid").st_ino


@pytest.mark.timeout(120)
def test_sigkill_seen_through_pidfd_and_bye_is_not_a_fault(tmp_path, monkeypatch):
    # 1 s heartbeats, 3 misses: the heartbeat path alone would need > 3 s
    with _job(tmp_path, monkeypatch, CHILD, interval=1.0, hang_timeout=0) as (ctl, kids, go, events):
        assert until(lambda: ctl.sm.state is State.NORMAL, 90), "ranks did not register"  # imports, loaded host
        assert ctl.liveness.probe.watched == 2  # both processes share this host and pid namespace
        open(go, "w").close()
        assert kids[1].wait(30) == 0  # rank 1: BYE, then a normal exit
        time.sleep(0.5)
        assert not ctl.ranks[1].faulty and ctl.incidents.current is None and ctl.sm.state is State.NORMAL
        os.kill(kids[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert until(lambda: not ctl.ranks[0].alive, 10.0)
        dt = time.monotonic() - t0
        assert dt < 3.0, f"declared dead after {dt:.2f} s: the pidfd path did not fire"
        # the I/O thread marks the rank dead, then writes its event and opens the incident: wait for both
        # (under xdist load the test read the file in between: [] != [(0, 'pid', ...)])
        assert until(lambda: any(e["kind"] == "rank_dead" for e in _events(events))
                      and ctl.incidents.current is not None, 10.0)
        dead = [e for e in _events(events) if e["kind"] == "rank_dead"]
        assert [(e["dead_rank"], e["cause"], e["pid"]) for e in dead] == [(0, "pid", kids[0].pid)]
        assert ctl.ranks[0].faulty and ctl.incidents.current is not None  # the incident is opened as for any death


def test_other_host_or_namespace_is_not_watched():
    import zmq
    probe, poller = PidProbe(), zmq.Poller()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not probe.watch(0, child.pid, "other-boot-id/1", poller)   # another host: heartbeats only
        assert not probe.watch(1, os.getpid(), host_token(), poller)     # itself: never
        # ...but a rank of this very process (a controller hosted by rank 0) is runnable while this runs:
        # its silence is a starved link thread, never a death (elastic test under load 50: rank 0 was
        # declared dead by heartbeat by the controller in its own process, 2026-11-26)
        assert probe.runnable(1) == os.getpid() and probe.runnable(0) == 0 and probe.watched == 0
        assert probe.watch(2, child.pid, host_token(), poller) and probe.watched == 1
        assert probe.watch(2, child.pid, host_token(), poller) and probe.watched == 1  # re-register: replaced
        child.kill()
        child.wait()
        events = dict(poller.poll(2000))
        probe.on_events(events, 0.0, poller)
        assert probe.watched == 0 and probe.due(0.0) == [] and probe.due(PidProbe.GRACE) == [(2, child.pid)]
        probe.unwatch(1, poller)
        assert probe.runnable(1) == 0
    finally:
        if child.poll() is None:
            child.kill()
        probe.close(poller)


SILENT = textwrap.dedent(_START + """
    p.link.stop()  # no BYE: from now on this live process is silent, as one starved of CPU
    p.link.join(5)
    time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_a_silent_live_process_is_starved_not_dead_until_the_hang_timeout(tmp_path, monkeypatch):
    """Seen at load 20-30 on 2 cores: a rank's link thread did not run for 2-3.6 s and 3 missed heartbeats
    declared the live rank dead, which ended the job. A silent rank whose process on this host is alive
    and not stopped is starved: it gets MINDIO_HANG_TIMEOUT, then is SIGKILLed and declared dead; a
    stopped one (SIGSTOP) is dead at once."""
    with _job(tmp_path, monkeypatch, SILENT, interval=0.2, hang_timeout=4.0) as (ctl, kids, go, events):
        assert until(lambda: ctl.sm.state is State.NORMAL, 90), "ranks did not register"
        open(go, "w").close()
        t0 = time.monotonic()
        # the event log is created by the first event: until the ranks starve there may be no file
        assert until(lambda: [e["kind"] for e in _events(events)].count("rank_starved") >= 2, 10.0), \
            "silence of a live process was not seen as starvation"
        assert ctl.ranks[0].alive and ctl.ranks[1].alive  # silent for > misses * interval: not dead
        os.kill(kids[1].pid, signal.SIGSTOP)  # stopped: it will not run again by itself
        assert until(lambda: not ctl.ranks[1].alive, 3.0)
        assert ctl.ranks[0].alive and time.monotonic() - t0 < 4.0
        assert until(lambda: not ctl.ranks[0].alive, 10.0)  # the hang timeout: SIGKILLed, dead
        assert kids[0].wait(10) == -signal.SIGKILL

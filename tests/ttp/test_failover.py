"""Controller death with a backup alive: the ranks fail over, training goes on, and the backup drives
the dump of a later fault."""
import os
import subprocess
import sys
import time

import pytest

from mindio.ttp import EXIT_CODE_DUMPED
from mindio.ttp.controller.controller import Controller
from mindio.ttp.wire.transport import job_secret
from tests._faultplan import FaultPlan

from ._harness import ROOT, Job, free_port, until

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_backup_takes_over_and_dumps(tmp_path, monkeypatch):
    secret = "failover-test-secret"
    monkeypatch.setenv("MINDIO_SECRET", secret)
    port, backup_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, TTP_LOG_STDOUT="1", MINDIO_SECRET=secret, MINDIO_BACKUP_CONTROLLERS="1")
    ctl_log = open(tmp_path / "primary.log", "w+")
    primary = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_controller_proc.py"),
                                "4", str(port)], env=env, stdout=ctl_log, stderr=subprocess.STDOUT, text=True)
    backup = None
    job = None
    try:
        end = time.monotonic() + 60
        while "controller up" not in (tmp_path / "primary.log").read_text() and time.monotonic() < end:
            time.sleep(0.1)
        backup = Controller(rank=1, world_size=4, enabled={"dump"}, key=job_secret(create=False), backup=True)
        backup.start("127.0.0.1", backup_port, primary=f"tcp://127.0.0.1:{port}")
        out = str(tmp_path / "run")
        job = Job(out, ctl_port=port, env={"MINDIO_SECRET": secret},
                  args=["--external-controller", "--steps", "170", "--step-sleep", "0.1"],
                  plan=FaultPlan.of(("raise-uce", 2, 150), enable_uce=False))  # a dump, not a retry
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # every rank registered and knows where the backup is
            logs = [open(os.path.join(out, f"rank{r}.log")).read() for r in range(4)]
            if all(f"fail-over order ['tcp://127.0.0.1:{backup_port}']" in text for text in logs):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the ranks never learned the backup's address:\n" + job.tail())
        primary.kill()
        primary.wait()
        t_kill = time.monotonic()
        codes = job.wait(180)
        assert codes == [EXIT_CODE_DUMPED] * 4, job.tail()
        # FINAL follows the exit action's replies; the ranks may be gone a few ms before it is set
        assert backup.active and backup.final.wait(15)
        assert backup.last_decision["strategy"] == "dump" and backup.last_decision["lock_step"] == 150
        assert backup.last_decision["faulty"] == [2]
        with open(os.path.join(out, "ckpt", "latest")) as f:
            assert int(f.read()) == 150
        states = [(a.value, r.value, b.value) for a, r, b in backup.sm.history]
        assert states[0] == ("INIT", "ALL_REGISTERED", "NORMAL")  # took over: training went on under it
        assert states[-1] == ("EXIT", "OK", "FINAL")
        assert time.monotonic() - t_kill > 5  # training ran on for a while after the primary died
    finally:
        if job is not None:
            job.kill()
        primary.kill()
        primary.wait()
        ctl_log.close()
        if backup is not None:
            backup.destroy()


@pytest.mark.timeout(60)
def test_report_to_a_passive_backup_is_acted_on_after_takeover(monkeypatch):
    """The ranks notice the dead primary before the backup does (3 vs 20 missed beats); a rank that fails
    over and reports its error in that moment reports only once: the backup must act on it when it takes
    over, not drop it (the job would wait forever for a decision)."""
    from mindio.ttp._enums import ReportState
    from mindio.ttp.processor.processor import Processor
    from mindio.ttp.controller.states import State

    monkeypatch.setenv("MINDIO_HEARTBEAT_MISSES", "3")
    key, port, bport = b"f" * 32, free_port(), free_port()
    primary = Controller(rank=-1, world_size=2, enabled={"dump"}, key=key, interval=0.2, misses=3, hang_timeout=0,
                         backups_allowed=1)
    primary.start("127.0.0.1", port)
    backup = Controller(rank=1, world_size=2, enabled={"dump"}, key=key, interval=0.2, misses=20, hang_timeout=0,
                        backup=True)
    backup.action_limit = 2.0
    baddr = f"tcp://127.0.0.1:{bport}"
    backup.start("127.0.0.1", bport, primary=f"tcp://127.0.0.1:{port}")
    procs = [Processor(r, 2) for r in range(2)]
    try:
        assert until(lambda: primary.backups == [baddr])
        for p in procs:
            p.start(f"tcp://127.0.0.1:{port}", key)
        assert until(lambda: primary.sm.state is State.NORMAL and all(baddr in p.link.addrs for p in procs))
        primary.destroy()  # its socket closes: silence
        assert until(lambda: all(p.link.address == baddr and p.link.registered.is_set() for p in procs), 10)
        assert not backup.active  # the backup itself needs 20 silent beats (4 s) to give up on the primary
        procs[1].report(ReportState.RS_UCE, "UCE ERROR")
        assert until(lambda: backup.active, 20)
        assert until(lambda: bool(backup.last_decision), 20), "the report made before the takeover was lost"
        assert backup.last_decision["faulty"] == [1]
    finally:
        for p in procs:
            p.destroy()
        backup.destroy()
        primary.destroy()


@pytest.mark.timeout(60)
def test_ranks_go_back_to_a_stalled_primary_from_a_passive_backup(tmp_path, monkeypatch):
    """The primary (its own process) is SIGSTOPped for longer than the links' bound: both ranks fail over
    to the backup, which is passive (takeover_quorum above the world: as mindio-run's before node 1's
    agent arms it). Once the primary runs again each link goes back to it; the primary declares nobody
    dead, the backup never takes over and forgets the ranks. Before: the ranks stayed with the passive
    backup and the primary declared them dead misses x interval after it resumed."""
    import json
    import signal

    from mindio.ttp.processor.processor import Processor

    # 0.5 s beats (bound 1.75 s): at 0.2 s, stress at load 48 starved this process 1.7 s, past the links'
    # bound, and the links failed over once more after they were home (then went home again)
    secret, interval, misses = "stall-test-secret", 0.5, 3
    for k, v in {"MINDIO_SECRET": secret, "MINDIO_HEARTBEAT_INTERVAL": str(interval),
                 "MINDIO_HEARTBEAT_MISSES": str(misses)}.items():
        monkeypatch.setenv(k, v)
    port, bport = free_port(), free_port()
    events = tmp_path / "primary.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT, TTP_LOG_STDOUT="1", MINDIO_BACKUP_CONTROLLERS="1",
               MINDIO_EVENT_LOG=str(events))
    log = open(tmp_path / "primary.log", "w+")
    primary = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_controller_proc.py"),
                                "2", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    home, baddr = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{bport}"
    backup, procs = None, []
    try:
        assert until(lambda: "controller up" in (tmp_path / "primary.log").read_text(), 30)
        backup = Controller(rank=1, world_size=2, enabled={"dump"}, key=job_secret(create=False), backup=True,
                            interval=interval, misses=misses, hang_timeout=0)
        backup.takeover_quorum = 3  # never (mindio/launch/backup.py until node 0 is found lost)
        backup.start("127.0.0.1", bport, primary=home)
        procs = [Processor(r, 2) for r in range(2)]
        for p in procs:
            p.start(home, job_secret(create=False))
        assert until(lambda: all(baddr in p.link.addrs for p in procs), 10), "the backup was never advertised"
        primary.send_signal(signal.SIGSTOP)
        bound = misses * interval + interval / 2
        assert until(lambda: all(p.link.address == baddr and p.link.registered.is_set() for p in procs), 10 * bound)
        assert backup.registered == 2 and not backup.active
        time.sleep(bound)  # the stall itself goes on a while with the ranks on the backup
        t_cont = time.monotonic()  # before the signal: the primary runs only after it
        primary.send_signal(signal.SIGCONT)
        assert until(lambda: all(p.link.address == home and p.link.registered.is_set() for p in procs), 10), \
            [(p.link.address, p.link.registered.is_set()) for p in procs]
        back = time.monotonic() - t_cont
        # the primary's own bound passes: nobody declared dead; the backup forgot the ranks, never took over
        assert until(lambda: backup.registered == 0, 10 * misses * interval)
        time.sleep(misses * interval + 2 * interval)  # the primary's whole death bound after its resume
        evs = [json.loads(line) for line in events.read_text().splitlines()]
        assert not [e for e in evs if e["kind"] == "rank_dead"], (tmp_path / "primary.log").read_text()[-4000:]
        assert [e for e in evs if e["kind"] == "controller_stalled"], "the primary did not see its stall"
        assert not backup.active
        assert until(lambda: all(p.link.address == home and p.link.registered.is_set() for p in procs), 10)
        print(f"\nprimary stopped ~{2 * bound:.1f} s: both ranks back with it {back:.3f} s after it ran again")
    finally:
        for p in procs:
            p.destroy()
        if backup is not None:
            backup.destroy()
        if primary.poll() is None:
            primary.send_signal(signal.SIGCONT)
            primary.kill()
        primary.wait()
        log.close()

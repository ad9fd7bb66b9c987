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

from ._harness import ROOT, Job, free_port

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

    def until(pred, timeout=20.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return True
            time.sleep(0.01)
        return False

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

"""``mindio status`` and the Prometheus metrics against a running 4-rank job (the toy job: real
processes, gloo, a controller in rank 0 started with MINDIO_STATUS_PORT): the status lists every rank
while it trains, a request not signed with the job secret is refused, and after an injected UCE the
metrics count one retry incident and its phases, and the status shows its phase times."""
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests._faultplan import FaultPlan

from ._harness import ROOT, Job, free_port

pytestmark = pytest.mark.slow


def _until(what, check, timeout=90.0):
    """check() until it returns something truthy (a bounded wait); fail naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _cli(args, env):
    return subprocess.run([sys.executable, "-m", "mindio.cli", "status", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": ROOT, **env})


def _metrics(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return ""


@pytest.mark.timeout(300)
def test_status_and_metrics_of_a_running_four_rank_job(tmp_path):
    secret, port = secrets.token_hex(16), free_port()
    env = {"MINDIO_SECRET": secret, "MINDIO_STATUS_ADDR": f"127.0.0.1:{port}"}
    job = Job(str(tmp_path / "run"), args=["--steps", "60", "--step-sleep", "0.25"],
              plan=FaultPlan.of(("raise-uce", 1, 20)),
              env={"HIGH_AVAILABILITY": "dump,retry", "MINDIO_STATUS_PORT": str(port), "MINDIO_SECRET": secret})
    try:
        def training():
            out = _cli(["--json"], env)
            if out.returncode != 0:
                return None
            info = json.loads(out.stdout)
            alive = [r for r in info["ranks"] if r["alive"] and r["registered"]]
            return info if len(alive) == 4 and info["state"] == "NORMAL" else None

        info = _until("4 ranks registered and training", training)
        assert info["world_size"] == 4 and info["strategies"] == ["dump", "retry"]
        assert [r["rank"] for r in info["ranks"]] == [0, 1, 2, 3]
        assert all(r["last_beat_s"] is not None and r["last_beat_s"] < 30 and r["pid"] > 0 for r in info["ranks"])

        text = _cli([], env)
        assert text.returncode == 0 and "controller tcp://127.0.0.1:" in text.stdout and "NORMAL" in text.stdout
        assert len(re.findall(r"^\s+\d\s+yes\s+no\s+\d+", text.stdout, re.M)) == 4, text.stdout

        refused = _cli(["--json"], {**env, "MINDIO_SECRET": secrets.token_hex(16)})
        assert refused.returncode == 1 and "refused" in refused.stderr
        with pytest.raises(urllib.error.HTTPError) as unsigned:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5)
        assert unsigned.value.code == 403

        metrics = _until("the retry in the metrics",
                         lambda: (m := _metrics(port)) and 'mindio_recoveries_total{strategy="retry"} 1' in m and m)
        assert 'mindio_incidents_total{strategy="retry"} 1' in metrics
        assert 'mindio_faults_total{kind="RS_UCE"} 1' in metrics
        assert re.search(r'mindio_recovery_phase_seconds_sum\{strategy="retry",phase="repair"\} [0-9.]+', metrics)
        assert 'mindio_recovery_seconds_count{strategy="retry"} 1' in metrics
        assert "mindio_ranks_alive 4" in metrics and "# TYPE mindio_faults_total counter" in metrics
        # no MINDIO_HANG_TIMEOUT: 300 s until every rank timed 20 steps (since the retry too), then the job's
        bound = float(re.search(r"^mindio_hang_bound_seconds ([0-9.]+)$", metrics, re.M).group(1))
        assert bound == 300.0 or 1.0 <= bound < 300, metrics

        info = json.loads(_cli(["--json"], env).stdout)
        assert info["hang_bound_from_job"] and all(r["step_p99_s"] is None or r["step_p99_s"] > 0 for r in info["ranks"])
        last = info["incidents"][-1]
        assert last["strategy"] == "retry" and last["faulty"] == [1] and last["result"] == "training again"
        assert {"clean", "rebuild", "repair", "rollback"} <= set(last["phases"])
    finally:
        codes = job.wait(150)
    assert codes == [0, 0, 0, 0], job.tail()

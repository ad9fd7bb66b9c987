"""Graceful pause / continue on the Megatron example (4 ranks, DP=4, replicas R=2) under torchrun.

The controller runs in an external decider process (tests/ttp/_decider_proc.py, MINDIO_CONTROLLER_EXTERNAL=1):
once every rank passed step 3 it calls ``tft_notify_controller_stop_train({}, stop_type="pause")``; every
rank parks at the same iteration inside ``tft_pause_train`` (the example's pause point), the adapter's
stream sync runs, the decider holds the pause 1 s and answers ``change_strategy("continue")``. The job
finishes with the digest of the uninterrupted run: no step lost, nothing changed.
"""
import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from _mgt_launch import PRETRAIN, REPO, digests, free_port, reference_run, torchrun, SLOW_MEGATRON

pytestmark = SLOW_MEGATRON

ITERS = 30
BASE = ["--use-distributed-optimizer", "--enable-high-availability", "--no-dump", "--train-iters", ITERS,
        "--seed", 1234]
DECIDER = REPO / "tests" / "ttp" / "_decider_proc.py"


@pytest.mark.timeout(600)
def test_pause_continue_megatron_is_bitwise(tmp_path):
    reference = digests(reference_run(PRETRAIN, BASE, timeout=240))[-1]
    port = free_port()
    env = {"MINDIO_SECRET": secrets.token_hex(16), "MINDIO_CONTROLLER_EXTERNAL": "1", "TTP_PORT": str(port),
           "MINDIO_HEARTBEAT_INTERVAL": "0.5", "MINDIO_HEARTBEAT_MISSES": "6",
           "MINDIO_EVENT_LOG": str(tmp_path / "events.jsonl"), "TTP_LOG_PATH": str(tmp_path / "logs")}
    log = open(tmp_path / "decider.log", "w")
    decider = subprocess.Popen([sys.executable, str(DECIDER), "4", str(port), str(tmp_path), "pause:1.0"],
                               env={**os.environ, "PYTHONPATH": str(REPO), "TTP_LOG_STDOUT": "1", **env},
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 60
        while "decider up" not in (tmp_path / "decider.log").read_text():
            assert decider.poll() is None and time.monotonic() < end, (tmp_path / "decider.log").read_text()
            time.sleep(0.05)
        out = torchrun(PRETRAIN, BASE, timeout=300, env=env)
        decider.wait(timeout=60)
    finally:
        if decider.poll() is None:
            decider.kill()
            decider.wait()
        log.close()
    calls = [json.loads(line) for line in (tmp_path / "decider.jsonl").read_text().splitlines() if line.strip()]
    kinds = [c["kind"] for c in calls]
    assert kinds[:4] == ["notify_pause", "report_stop_complete", "change_strategy", "report_result"], calls
    assert calls[1]["code"] == 0 and (calls[3]["code"], calls[3]["strategy"]) == (0, "continue")
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines() if line.strip()]
    paused = [e for e in evs if e["kind"] == "paused_at"]
    assert sorted(e["rank"] for e in paused) == [0, 1, 2, 3] and len({e["step"] for e in paused}) == 1, paused
    assert 3 <= paused[0]["step"] < ITERS
    print(f"\nmegatron pause: every rank paused at iteration {paused[0]['step']}; "
          f"{[e for e in evs if e['kind'] == 'paused'][0]['latency_s']:.3f} s after the request")
    assert digests(out)[-1] == reference

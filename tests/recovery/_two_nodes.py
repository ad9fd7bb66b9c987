"""Two mindio-run agents of the toy job (_recover_toy.py) on one host, 2 ranks each, standing for two
nodes (tests/recovery/test_network_faults.py, test_controller_node_loss.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from mindio._ports import free_port

from test_recover_inplace import REPO, TOY

__all__ = ["two_nodes"]


def _agent(cmd: list, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def two_nodes(out, toy_args: list, strategies: str, env: dict, wait_for: str, timeout: float = 150):
    """Start node 0's then node 1's agent, wait up to ``timeout`` s for ``wait_for`` ("node0" or "node1")
    to end (else kill both and fail: a hang), then SIGKILL whatever is left of the other (a frozen or
    killed node: the test's own doing). Returns ({name: exit code}, {name: output}, events)."""
    out.mkdir()
    events = out / "events.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_LOG_STDOUT="1",
               MINDIO_EVENT_LOG=str(events), **env)
    common = [sys.executable, "-W", "ignore", "-m", "mindio.launch.cli", "--nnodes", "2", "--nproc-per-node", "2",
              "--master-port", str(free_port()), "--high-availability", strategies]
    tail = [str(TOY), "--out", str(out), *toy_args]
    procs = {"node0": _agent(common + ["--node-rank", "0"] + tail, env)}
    time.sleep(0.3)
    procs["node1"] = _agent(common + ["--node-rank", "1"] + tail, env)
    main = procs[wait_for]
    texts = {}
    try:
        texts[wait_for], _ = main.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(main.pid, signal.SIGKILL)
        text, _ = main.communicate()
        raise AssertionError(f"{wait_for} did not end within {timeout:g} s (a hang):\n{text[-6000:]}")
    finally:
        for name, p in procs.items():
            if p.poll() is None or p is not main:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if name not in texts:
                texts[name], _ = p.communicate()
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()] if events.exists() else []
    return {n: p.returncode for n, p in procs.items()}, texts, evs

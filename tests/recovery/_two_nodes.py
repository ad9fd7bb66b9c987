"""Two mindio-run agents of the toy job (_recover_toy.py) on one host, 2 ranks each, standing for two
nodes (tests/recovery/test_network_faults.py, test_controller_node_loss.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from mindio._ports import free_port

from test_recover_inplace import REPO, TOY

__all__ = ["two_nodes"]


def _agent(cmd: list, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def two_nodes(out, toy_args: list, strategies: str, env: dict, wait_for: str, timeout: float = 150, during=None,
              flags=()):
    """Start node 0's then node 1's agent, wait up to ``timeout`` s for ``wait_for`` ("node0" or "node1")
    to end (else kill both and fail: a hang), then SIGKILL whatever is left of the other (a frozen or
    killed node: the test's own doing). ``wait_for="both"``: both must end by themselves within
    ``timeout``. ``flags``: more mindio-run flags (e.g. the etcd store). ``during(procs, events_path, outs)`` runs in a thread meanwhile (a fault the test makes;
    ``outs``: {name: the lines of output read so far}).
    Returns ({name: exit code}, {name: output}, events)."""
    out.mkdir()
    events = out / "events.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_LOG_STDOUT="1",
               MINDIO_EVENT_LOG=str(events), **env)
    common = [sys.executable, "-W", "ignore", "-m", "mindio.launch.cli", "--nnodes", "2", "--nproc-per-node", "2",
              "--master-port", str(free_port()), "--high-availability", strategies, *flags]
    tail = [str(TOY), "--out", str(out), *toy_args]
    procs = {"node0": _agent(common + ["--node-rank", "0"] + tail, env)}
    time.sleep(0.3)
    procs["node1"] = _agent(common + ["--node-rank", "1"] + tail, env)
    outs = {name: [] for name in procs}  # both pipes drained meanwhile: a full pipe would stall an agent
    readers = [threading.Thread(target=lambda p=p, o=outs[name]: o.extend(p.stdout), daemon=True)
               for name, p in procs.items()]
    for t in readers:
        t.start()
    if during is not None:
        threading.Thread(target=during, args=(procs, events, outs), daemon=True).start()
    waited = list(procs) if wait_for == "both" else [wait_for]
    end, hung = time.monotonic() + timeout, ""
    try:
        for name in waited:
            try:
                procs[name].wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = name
                break
    finally:
        for name, p in procs.items():
            if p.poll() is None or name not in waited or hung:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        for t in readers:
            t.join(timeout=30)  # the pipes close with the process groups just ended
    texts = {name: "".join(o) for name, o in outs.items()}
    if hung:
        raise AssertionError(f"{hung} did not end within {timeout:g} s (a hang):\n{texts[hung][-6000:]}")
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()] if events.exists() else []
    return {n: p.returncode for n, p in procs.items()}, texts, evs

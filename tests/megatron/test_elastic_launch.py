"""Elastic training through ``mindio-run``: a lost node -> scale-in; a ``--standby`` agent -> scale-out.

Two mindio-run agents of 2 ranks each (node 0: ranks 0, 1; node 1: ranks 2, 3) run the Megatron example
at DP=4 with 2 optimizer instances ([0,1] and [2,3], each a full sharded copy of the optimizer state),
``--high-availability elastic-training,dump``: node 0's agent hosts the controller. ``kill-node:node=1,
step=7`` SIGKILLs node 1's agent (its workers die with it). With no spare the controller downgrades:
instance [2,3] is removed and ranks 0, 1 train on at DP=2 (same global batch). Node 0's agent finds node 1
vacant (lost, every rank removed) and offers it on the takeover key of recover (mindio/launch/elastic.py).
Only then does the test start a ``mindio-run --standby`` agent: it claims node 1 and starts ranks 2, 3 as
elastic standbys; they register, the controller pauses ranks 0, 1 at a step, rebuilds the 4-rank world,
repairs the new ranks from their replicas, rolls back and training goes on at DP=4 to the end.

Checks: every iteration trained once; ``--check-replicas`` finds every replica pair of every optimizer
shard bitwise identical after every step at DP=4; the checkpoint the controller writes right after the
scale-out (MINDIO_DUMP_AFTER_UPGRADE=1), relaunched at DP=4 (under mindio-run:
_mgt_launch.assert_relaunch_reproduces), reproduces every later loss and the final state digest bit for bit.
(The pacing of _elastic_paced.py only slows the steps at DP=2.)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _mgt_launch import (REPO, PRETRAIN, _kill_tree, free_port,
                         torchrun, assert_relaunch_reproduces, assert_steps_logged_once, SLOW_MEGATRON)

from tests._exits import assert_no_signal_deaths, check_codes, injected, sent_by_faults

pytestmark = SLOW_MEGATRON

ITERS = 40
ARGS = ["--use-distributed-optimizer", "--enable-elastic-training", "--train-iters", ITERS, "--seed", 1234]
PACED = Path(__file__).resolve().parent / "_elastic_paced.py"


def _events(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(tmp: Path, args: list, timeout: float = 600, standby: bool = True) -> tuple[dict, list]:
    """Agents for nodes 0 and 1 now, a standby agent once the downgrade is done (``standby``);
    {name: (code, text)}."""
    events = tmp / "events.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MINDIO_EVENT_LOG=str(events),
               MINDIO_DRILL_DIR=str(tmp), TTP_LOG_PATH=str(tmp / "logs"), MINDIO_ACP_IDLE_EXIT="20",
               MINDIO_DUMP_AFTER_UPGRADE="1", ELASTIC_TEST_PACE="4", HIGH_AVAILABILITY="elastic-training,dump")
    if not standby:  # the pace leaves a standby time to come up: with none coming, it would only wait
        env["ELASTIC_TEST_PACE"] = "0"
    common = [sys.executable, "-W", "ignore", "-m", "mindio.launch.cli", "--nnodes", "2", "--nproc-per-node", "2",
              "--master-port", str(free_port()), "--high-availability", "elastic-training,dump"]
    tail = [str(PACED), *map(str, args)]
    procs, files = {}, {}

    def start(name, flags):
        files[name] = tmp / f"{name}.out"
        procs[name] = subprocess.Popen(common + flags + tail, env=env, stdout=open(files[name], "w"),
                                       stderr=subprocess.STDOUT, start_new_session=True)

    start("node0", ["--node-rank", "0"])
    time.sleep(0.3)
    start("node1", ["--node-rank", "1"])
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            evs = _events(events)
            kinds = {e["kind"] for e in evs}
            if standby and "standby" not in procs and {"node_offered", "downgrade_done"} <= kinds:
                start("standby", ["--standby", "--warm-spares", "2"])  # the node "came back" after the scale-in
            if procs["node0"].poll() is not None and all(p.poll() is not None for p in procs.values()):
                break
            if procs["node0"].poll() is not None and "standby" not in procs:
                break  # the job ended before any standby was wanted: the assertions say why
            time.sleep(0.2)
        else:
            raise AssertionError(f"agents did not end within {timeout} s (a hang):\n"
                                 + "\n".join(f"--- {n}\n{f.read_text()[-3000:]}" for n, f in files.items()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                _kill_tree(p)
    res = {n: (procs[n].returncode, files[n].read_text()) for n in procs}
    spec = injected(args)  # kill-node SIGKILLs node 1's agent (its workers die with it)
    check_codes({n: c for n, (c, _t) in res.items()}, {"node1": "SIGKILL"} if "kill-node:" in spec else {},
                what="agent", context=str({n: t[-2000:] for n, (_c, t) in res.items()}))
    for _code, text in res.values():
        assert_no_signal_deaths(text, sent_by_faults(spec, per_node=2))
    return res, _events(events)


@pytest.mark.timeout(1200)
def test_standby_agent_scales_a_downgraded_job_back_out(tmp_path):
    ckpt = tmp_path / "ckpt"
    res, evs = _run(tmp_path, ARGS + ["--check-replicas", "--inject", "kill-node:node=1,step=7", "--save", ckpt])
    code0, out = res["node0"]
    assert code0 == 0, out[-6000:]
    assert res["node1"][0] != 0  # its agent was SIGKILLed
    assert "standby" in res and res["standby"][0] == 0, res.get("standby", (None, "(never started)"))[1][-4000:]
    assert not [e for e in evs if e["kind"] in ("round_failed", "upgrade_failed")], out[-4000:]

    down = [e for e in evs if e["kind"] == "downgrade_done"]
    assert len(down) == 1 and down[0]["lock_step"] == 6 and down[0]["removed"] == [2, 3], down
    assert down[0]["members"] == [0, 1] and down[0]["world"] == 2
    takeover = [e for e in evs if e["kind"] == "standby_takeover"]
    assert [(e["node"], e["round"], e["how"]) for e in takeover] == [(1, 0, "elastic")], takeover  # running round
    assert [e["ranks"] for e in evs if e["kind"] == "standbys_started"] == [[2, 3]]
    up = [e for e in evs if e["kind"] == "upgrade_done"]
    assert len(up) == 1 and up[0]["added"] == [2, 3] and up[0]["world"] == 4, up
    assert up[0]["table"] == up[0]["members"] == [0, 1, 2, 3]
    u = up[0]["lock_step"]
    assert 6 <= u < ITERS, u
    assert [e["step"] for e in evs if e["kind"] == "upgrade_dump"] == [u]

    # every step trained once (rank 0 prints; the lock step's line may be cut by the node loss:
    # assert_steps_logged_once); replicas identical after every step at DP=4
    assert_steps_logged_once(out, ITERS, node_lost_at=6)
    checked = {int(m) for m in re.findall(r"replicas-identical: iteration (\d+)", out)}
    assert checked - {6} == set(range(1, 6)) | set(range(u + 1, ITERS + 1)), sorted(checked)
    assert checked <= set(range(1, 7)) | set(range(u + 1, ITERS + 1)), sorted(checked)
    t = {k: min(e["t"] for e in evs if e["kind"] == k) for k in ("fault_injected", "downgrade_done",
                                                                  "standby_takeover", "upgrade_done")}
    print(f"\nelastic via mindio-run: kill node 1 -> DP=2 {t['downgrade_done'] - t['fault_injected']:.2f} s; "
          f"standby agent claimed node 1 {t['standby_takeover'] - t['downgrade_done']:.2f} s after the downgrade; "
          f"takeover -> DP=4 {t['upgrade_done'] - t['standby_takeover']:.2f} s (upgrade {up[0]['total_s']:.3f} s "
          f"at step {u})")

    # the checkpoint of the scale-out step, relaunched at DP=4, reproduces the continuing run bit for bit
    assert_relaunch_reproduces(ckpt, u, ARGS + ["--no-dump"], out, tmp_path, ITERS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["lost-node", "same-node"])
def test_a_job_that_stays_downgraded_ends_normally(tmp_path, where):
    """No standby ever comes. lost-node: node 1's agent is killed; its ranks are removed and the vacant
    node counts as finished. same-node: one agent runs all 4 ranks, rank 3 is SIGKILLed; rank 2 (its
    instance partner) exits 77. Either way the removed ranks' exits are no deaths for the agents and
    the job ends with exit 0 after every step at DP=2, instead of waiting for the lost node or failing
    the round."""
    args = ["--use-distributed-optimizer", "--enable-elastic-training", "--no-dump", "--train-iters", 10,
            "--seed", 1234]
    if where == "lost-node":
        res, evs = _run(tmp_path, args + ["--inject", "kill-node:node=1,step=7"], timeout=420, standby=False)
        code0, out = res["node0"]
        assert [e["node"] for e in evs if e["kind"] == "node_offered"] == [1], out[-4000:]
    else:
        events = tmp_path / "events.jsonl"
        code0, out = torchrun(PRETRAIN, args + ["--inject", "kill:rank=3,step=7"], timeout=420, check=False,
                              launcher="mindio.launch.cli",
                              env={"HIGH_AVAILABILITY": "elastic-training,dump", "MINDIO_EVENT_LOG": str(events),
                                   "MINDIO_DRILL_DIR": str(tmp_path), "TTP_LOG_PATH": str(tmp_path / "logs")})
        evs = _events(events)
        assert not [e for e in evs if e["kind"] == "node_offered"]  # its agent lives: nothing to offer
    assert code0 == 0, out[-6000:]
    assert not [e for e in evs if e["kind"] == "round_failed"], out[-4000:]
    down = [e for e in evs if e["kind"] == "downgrade_done"]
    assert len(down) == 1 and down[0]["removed"] == [2, 3] and down[0]["world"] == 2, down
    assert not [e for e in evs if e["kind"] == "upgrade_done"]
    assert_steps_logged_once(out, 10, node_lost_at=down[0]["lock_step"] if where == "lost-node" else None)

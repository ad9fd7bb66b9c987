"""Hot switch on the Megatron example (examples/megatron/pretrain_gpt.py) under mindio-run.

4 ranks on CPU/gloo, distributed optimizer with replicas (DP=4, R=2). Node 0's agent hosts the
controller; the cluster brain in the agent's process (_hotswitch_brain.py) asks for a hot switch of rank
1 once every rank passed iteration 3 and answers ``migration``. A backup process starts and registers
while training goes on (imports, data, CPU patches: the example's ``prepare``, before its
init_process_group), then every rank pauses at one iteration, rank 1's old process exits (78), the
backup joins generation 1 and builds its model and optimizer with Megatron's normal init order,
receives its optimizer shard from its DP replica, and the job goes on: digest of the run without the
switch, no iteration lost.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "megatron"))
from _mgt_launch import PRETRAIN, REPO, digests, losses, torchrun, SLOW_MEGATRON  # noqa: E402
from test_hotswitch import assert_backup_registered_before_the_pause, pause_s  # noqa: E402

from mindio.ttp.controller.hotswitch import EXIT_CODE_SWITCHED  # noqa: E402
from tests._samples import assert_data_order  # noqa: E402

pytestmark = SLOW_MEGATRON

ITERS = 20
BASE = ["--use-distributed-optimizer", "--enable-high-availability", "--no-dump", "--train-iters", ITERS,
        "--seed", 1234]


@pytest.mark.timeout(800)
def test_megatron_hot_switch_is_bitwise(tmp_path):
    env = {"HIGH_AVAILABILITY": "recover-in-place,dump", "TTP_LOG_PATH": str(tmp_path / "logs"),
           "PYTHONPATH": f"{REPO}:{HERE}", "HS_AT": "3",
           "MINDIO_HEARTBEAT_INTERVAL": "0.5", "MINDIO_HEARTBEAT_MISSES": "6"}  # steps seen soon; no false deaths
    ref = torchrun(PRETRAIN, BASE + ["--log-samples", tmp_path / "ref"], timeout=330, launcher="mindio.launch.cli", env=env)
    events = tmp_path / "events.jsonl"
    # rank 0 holds iteration 5 until the brain saw the backup registered (the job still trains meanwhile)
    out = torchrun(PRETRAIN, BASE + ["--inject", "hold:rank=0,step=5,seconds=120", "--log-samples", tmp_path / "s"],
                   timeout=330,
                   launcher="_hotswitch_brain", env={**env, "MINDIO_EVENT_LOG": str(events), "HS_SCENARIO": "switch",
                                                     "HS_OUT": str(tmp_path), "MINDIO_DRILL_DIR": str(tmp_path)})
    evs = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    brain = [json.loads(x) for x in (tmp_path / "brain.jsonl").read_text().splitlines() if x.strip()]
    prep = next(b for b in brain if b["kind"] == "prepare_action")
    assert prep["rc"] == 0, brain
    done = [e for e in evs if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "hot switch" and done[0]["replaced"] == [1], out[-6000:]
    gone = [e for e in evs if e["kind"] == "switched_out_exit"]
    assert len(gone) == 1 and gone[0]["old_pid"] == prep["pids"]["1"] and gone[0]["code"] == EXIT_CODE_SWITCHED
    new_pid = assert_backup_registered_before_the_pause(evs, 1)
    assert next(e for e in evs if e["kind"] == "train_resumed" and e["rank"] == 1)["pid"] == new_pid
    assert not [e for e in evs if e["kind"] == "round_failed"]
    assert sorted(losses(out)) == list(range(1, ITERS + 1))  # no iteration lost or repeated in the log
    resumed = max(e["t"] for e in evs if e["kind"] == "train_resumed")
    print(f"\nmegatron dp4: hot switch request (lock step {done[0]['lock_step']}) -> every rank training again "
          f"{resumed - prep['t']:.3f} s, of which paused {pause_s(evs):.3f} s; "
          f"{ {k: v for k, v in done[0].items() if k.endswith('_s')} }")
    assert digests(out)[-1] == digests(ref)[-1]
    assert_data_order(tmp_path / "s", tmp_path / "ref", ITERS)  # the backup logs into rank 1's file

"""mindio.drill: spec parsing, once-per-job firing, and every fault kind on real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mindio import drill
from mindio.errors import ConfigError
from mindio.ttp._enums import ReportState
from mindio.ttp.controller.policy import classify

REPO = Path(__file__).resolve().parents[2]


def test_parse_several_faults():
    faults = drill.parse("kill:rank=3,step=7; uce:rank=1,step=9,hang:rank=0,step=2,seconds=0.5,"
                         "kill-node:node=1,step=4")
    assert [(f.kind, f.rank, f.node, f.step) for f in faults] == [
        ("kill", 3, None, 7), ("uce", 1, None, 9), ("hang", 0, None, 2), ("kill-node", None, 1, 4)]
    assert faults[2].seconds == 0.5
    assert [f.index for f in faults] == [0, 1, 2, 3]


@pytest.mark.parametrize("spec,needle", [
    ("", "empty"),
    ("explode:rank=1,step=2", "unknown kind 'explode'"),
    ("rank=1,kill:step=2", "before any KIND"),
    ("kill:rank=1", "needs step=S"),
    ("kill:rank=1,step=0", "needs step=S"),
    ("kill:step=3", "needs rank=R"),
    ("kill:rank=x,step=3", "non-number"),
    ("kill:rank=1,step=3,colour=red", "bad field"),
    ("kill:rank=1,rank=2,step=3", "given twice"),
    ("raise:node=1,step=3", "only for kill-node"),
    ("kill-node:step=3", "exactly one of node=N or rank=R"),
    ("kill:rank=1,step=3,seconds=2", "only for hang"),
    ("hang:rank=-1,step=3", ">= 0"),
])
def test_bad_specs_say_what_is_wrong(spec, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("=", "=")):
        drill.parse(spec)


@pytest.mark.parametrize("kind,state", [("raise", ReportState.RS_UNKNOWN),
                                        ("uce", ReportState.RS_UCE),
                                        ("net", ReportState.RS_HCCL_FAILED)])
def test_error_kinds_raise_what_the_controller_classifies(kind, state):
    d = drill.Drill(f"{kind}:rank=1,step=3", environ={})
    d.maybe_fire(step=3, rank=0)  # another rank: nothing
    d.maybe_fire(step=2, rank=1)  # another step: nothing
    with pytest.raises(RuntimeError) as info:
        d.maybe_fire(step=3, rank=1)
    assert classify(str(info.value)) == state
    d.maybe_fire(step=3, rank=1)  # train() re-entered (retry): does not fire again


def test_not_in_a_relaunched_job():
    d = drill.Drill("raise:rank=0,step=1", environ={"TORCHELASTIC_RESTART_COUNT": "1"})
    d.maybe_fire(step=1, rank=0)


def test_marker_dir_makes_it_once_per_job_across_processes(tmp_path):
    env = {"MINDIO_DRILL_DIR": str(tmp_path)}
    with pytest.raises(RuntimeError):
        drill.Drill("raise:rank=2,step=5", environ=env).maybe_fire(step=5, rank=2)
    assert (tmp_path / "fired-0-raise").exists()
    drill.Drill("raise:rank=2,step=5", environ=env).maybe_fire(step=5, rank=2)  # a replacement process


def test_marker_dir_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        drill.Drill("raise:rank=0,step=1", environ={"MINDIO_DRILL_DIR": str(tmp_path / "nope")})


def test_hang_sleeps_then_returns():
    d = drill.Drill("hang:rank=0,step=1,seconds=0.3", environ={})
    t0 = time.monotonic()
    d.maybe_fire(step=1, rank=0)
    assert 0.25 < time.monotonic() - t0 < 10


def test_hold_ends_when_the_release_file_appears(tmp_path):
    """hold: the step waits until <MINDIO_DRILL_DIR>/release exists (here written by a thread), not its
    seconds (120)."""
    import threading

    d = drill.Drill("hold:rank=0,step=1,seconds=120", environ={"MINDIO_DRILL_DIR": str(tmp_path)})
    threading.Timer(0.2, lambda: (tmp_path / "release").write_text("")).start()
    t0 = time.monotonic()
    d.maybe_fire(step=1, rank=0)
    assert (tmp_path / "release").exists() and time.monotonic() - t0 < 60


def _run(code: str, env=None, timeout=60):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


@pytest.mark.timeout(60)
def test_kill_sigkills_the_rank(tmp_path):
    r = _run("""
        from mindio import drill
        for step in range(1, 5):
            drill.inject("kill:rank=0,step=3", step, 0)
            print("done", step, flush=True)
    """, env={"MINDIO_DRILL_DIR": str(tmp_path)})
    assert r.returncode == -signal.SIGKILL
    assert r.stdout.splitlines() == ["done 1", "done 2", "[rank 0] injecting kill at step 3"]


@pytest.mark.timeout(60)
def test_kill_node_sigkills_the_agent_and_the_rank(tmp_path):
    """A stand-in agent starts a worker with MINDIO_AGENT_PID set (as mindio-run does); the worker,
    local rank 0 of node 1, fires kill-node: the agent dies by SIGKILL, and the worker too."""
    agent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = {{**os.environ, "MINDIO_AGENT_PID": str(os.getpid()), "MINDIO_NODE_RANK": "1",
               "LOCAL_RANK": "0", "RANK": "2"}}
        w = subprocess.Popen([sys.executable, "-c",
            "from mindio import drill; drill.inject('kill-node:node=1,step=2', 1, 2);"
            "open(r'{tmp_path}/worker-pid', 'w').write(str(__import__('os').getpid()));"
            "drill.inject('kill-node:node=1,step=2', 2, 2); print('survived')"], env=env)
        w.wait()
        time.sleep(30)  # never reached: the worker kills this process
    """)
    r = subprocess.run([sys.executable, "-c", agent], timeout=60, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == -signal.SIGKILL
    pid = int((tmp_path / "worker-pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker {pid} still alive after killing its node")


def test_uce_corrupts_state_first_then_raises():
    state = {"shard": [1.0, 2.0]}
    d = drill.Drill("uce:rank=0,step=2", environ={})
    d.maybe_fire(step=1, rank=0, corrupt=lambda: state.update(shard=None))
    assert state["shard"] == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="UCE ERROR"):
        d.maybe_fire(step=2, rank=0, corrupt=lambda: state.update(shard=None))
    assert state["shard"] is None
    with pytest.raises(RuntimeError, match="injected fault"):  # corrupt is only for uce
        drill.Drill("raise:rank=0,step=2", environ={}).maybe_fire(2, 0, corrupt=lambda: 1 / 0)

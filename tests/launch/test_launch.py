"""mindio-run with real agents, real worker processes and real gloo collectives on loopback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mindio._ports import free_port as _free_port  # outside the ephemeral range (mindio/_ports.py)
from mindio.errors import ConfigError
from mindio.launch import LaunchConfig
from mindio.launch._bootstrap import top_level_imports
from mindio.launch.cli import parse_args
from tests._exits import assert_no_signal_deaths, check_codes

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out = os.environ["OUT_DIR"]
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "TORCHELASTIC_RESTART_COUNT", "MINDIO_WORKER_WARMUP_S", "OMP_NUM_THREADS"]
    with open(os.path.join(out, f"r{restart}-rank{rank}.json"), "w") as f:
        json.dump({"sum": t.item(), "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}, f)
    if os.environ.get("FAIL_RANK") == str(rank) and restart == 0:
        if os.environ.get("LINGER_S"):  # close the sockets first, exit later: the peer dies before us
            dist.destroy_process_group()
            time.sleep(float(os.environ["LINGER_S"]))
        sys.exit(7)
    for _ in range(int(os.environ.get("STEPS", "0"))):
        dist.all_reduce(t)
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
""")


class _Agent(subprocess.Popen):
    """An agent whose output, once read, is checked: neither it nor a worker it reports died by a signal
    the test did not send (``sent``: {rank: signal}; the agent itself: "agent") (tests/_exits.py)."""

    sent: dict = {}

    def communicate(self, *args, **kwargs):
        out, err = super().communicate(*args, **kwargs)
        check_codes({"agent": self.returncode}, self.sent, what="process", context=(out or "")[-4000:])
        assert_no_signal_deaths(out or "", self.sent)
        return out, err


@pytest.fixture
def job(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    procs = []

    def start(*flags, env=None, **kw):
        e = dict(os.environ, OUT_DIR=str(out), TTP_LOG_STDOUT="1", **(env or {}))
        p = _Agent([sys.executable, "-m", "mindio.launch.cli", *flags, str(script), "--x", "1"],
                   env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
        procs.append(p)
        return p

    def results():
        return {f.name: json.loads(f.read_text()) for f in sorted(out.iterdir())}

    yield start, results
    for p in procs:  # end only what this test started
        if p.poll() is None:
            p.kill()
        subprocess.Popen.communicate(p)  # unchecked: killed here, or checked when the test read it


@pytest.mark.timeout(90)
def test_two_workers_get_torchrun_environment(job):
    start, results = job
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()))
    out, _ = p.communicate(timeout=80)
    assert p.returncode == 0, out
    res = results()
    assert sorted(res) == ["r0-rank0.json", "r0-rank1.json"]
    for rank in (0, 1):
        r = res[f"r0-rank{rank}.json"]
        assert r["sum"] == 1.0  # 0 + 1: a real all_reduce across both workers
        assert r["argv"] == ["--x", "1"]
        env = r["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
        assert env["OMP_NUM_THREADS"] == "1"
        assert float(env["MINDIO_WORKER_WARMUP_S"]) > 0  # torch was imported before the assignment


@pytest.mark.timeout(120)
def test_failed_worker_restarts_whole_job_with_fresh_store(job):
    start, results = job
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()), "--max-restarts", "1",
              env={"FAIL_RANK": "1"})
    out, _ = p.communicate(timeout=110)
    assert p.returncode == 0, out
    assert "rank 1 exited with exit code 7" in out
    assert {"r1-rank0.json", "r1-rank1.json"} <= set(results())


@pytest.mark.timeout(90)
def test_the_failing_rank_is_named_when_a_peer_dies_before_it_is_reaped(job):
    # rank 1 closes its connections, then lingers before exiting 7: rank 0's barrier fails and rank 0
    # dies first (gloo's exception), so the agent's first look sees only rank 0 dead (CI saw this race
    # with a plain sys.exit: the report named rank 0's abort and not the rank that failed)
    start, _ = job
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()), env={"FAIL_RANK": "1", "LINGER_S": "0.4"})
    out, _ = p.communicate(timeout=80)
    assert p.returncode == 1, out
    line = next(ln for ln in out.splitlines() if "job failed" in ln)
    assert "rank 1 exited with exit code 7" in line, out
    assert "rank 0 exited with" in line, out


@pytest.mark.timeout(90)
def test_failure_without_restarts_fails_the_job(job):
    start, _ = job
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()), env={"FAIL_RANK": "0"})
    out, _ = p.communicate(timeout=80)
    assert p.returncode == 1
    assert "job failed: node 0: rank 0 exited with exit code 7" in out


@pytest.mark.timeout(150)
def test_standby_agent_replaces_a_lost_node(job):
    start, results = job
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", port, "--max-restarts", "1"]
    env = {"STEPS": "40"}
    a0 = start(*common, "--node-rank", "0", env=env)
    a1 = start(*common, "--node-rank", "1", env=env)
    spare = start(*common, "--standby", env=env)
    deadline = time.monotonic() + 60
    while "r0-rank1.json" not in results():  # node 1's worker is training
        assert time.monotonic() < deadline, "round 0 never started"
        time.sleep(0.2)
    a1.send_signal(signal.SIGKILL)  # the node dies: its agent, and with it its workers
    a1.sent = {"agent": "SIGKILL"}
    out0, _ = a0.communicate(timeout=120)
    outs, _ = spare.communicate(timeout=30)
    assert a0.returncode == 0, out0
    assert spare.returncode == 0, outs
    assert "standby takes over node 1" in outs
    res = results()
    assert res["r1-rank1.json"]["env"]["GROUP_RANK"] == "1"
    assert res["r1-rank0.json"]["sum"] == 1.0


def test_bad_flags_are_explained(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    with pytest.raises(SystemExit):
        parse_args(["--nnodes", "2", "--node-rank", "2", str(script)])
    assert "--node-rank 2 is outside [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--nnodes", "1:4", str(script)])
    assert "elastic ranges are not supported" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not exist"):
        LaunchConfig(entrypoint=str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match="monitor-interval"):
        LaunchConfig(entrypoint=str(script), monitor_interval=2.0)
    cfg = parse_args(["--rdzv-endpoint", "127.0.0.1:1234", "--nproc_per_node", "3", str(script), "--lr", "1"])
    assert (cfg.master_addr, cfg.master_port, cfg.nproc_per_node, cfg.args) == ("127.0.0.1", 1234, 3, ("--lr", "1"))


def test_top_level_imports_are_found_without_running_the_script(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, json\nfrom collections import abc\nfrom . import x\n"
                      "def f():\n    import secret\nraise SystemExit('must not run')\n")
    assert top_level_imports(str(script)) == ["os", "json", "collections"]

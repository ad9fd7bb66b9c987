"""mindio-run with real agents, real worker processes and real gloo collectives on loopback.

Every test starts real ``mindio-run`` agents (and, to compare, real ``torchrun``) on a tiny script and
asserts the exit code of every launcher it starts; the launcher asserts its workers' (it exits non-zero
when one dies)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mindio._ports import free_port as _free_port  # outside the ephemeral range (mindio/_ports.py)
from tests._exits import assert_no_signal_deaths, check_codes

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

# A module the script imports: it reads the rank environment at import time, as many do (device choice).
HELPER = "import os\nLOCAL_RANK_AT_IMPORT = os.environ.get('LOCAL_RANK')\n"

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import helper
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out = os.environ["OUT_DIR"]
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_NAME", "MASTER_ADDR",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE", "MINDIO_WORKER_WARMUP_S", "OMP_NUM_THREADS"]
    name = os.path.join(out, f"r{restart}-rank{rank}.json")
    with open(name + ".tmp", "w") as f:  # whole or absent: the test polls the directory while ranks write
        json.dump({"sum": t.item(), "argv": sys.argv[1:], "import_local_rank": helper.LOCAL_RANK_AT_IMPORT,
                   "env": {k: os.environ.get(k) for k in keys}}, f)
    os.rename(name + ".tmp", name)
    print(f"hello from rank {rank}", flush=True)
    print(f"warning from rank {rank}", file=sys.stderr, flush=True)
    if os.environ.get("FAIL_RANK") == str(rank) and restart == 0:
        if os.environ.get("LINGER_S"):  # close the sockets first, exit later: the peer dies before us
            dist.destroy_process_group()
            time.sleep(float(os.environ["LINGER_S"]))
        if os.environ.get("FAIL_HOW") == "raise":
            raise ValueError(f"bad batch on rank {rank}")
        sys.exit(7)
    # STEPS: round 0 only, to keep it training while the test acts on it; a restarted round waits for nothing
    for _ in range(int(os.environ.get("STEPS", "0")) if restart == 0 else 0):
        dist.all_reduce(t)
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
""")


class _Launcher(subprocess.Popen):
    """A launcher whose output, once read, is checked: neither it nor a worker it reports died by a
    signal the test did not send (``sent``: {rank: signal name}; the launcher itself: "launcher")
    (tests/_exits.py)."""

    sent: dict = {}

    def communicate(self, *args, **kwargs):
        out, err = super().communicate(*args, **kwargs)
        check_codes({"launcher": self.returncode}, self.sent, what="process", context=(out or "")[-4000:])
        assert_no_signal_deaths(out or "", self.sent)
        return out, err


@pytest.fixture
def job(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "helper.py").write_text(HELPER)
    out = tmp_path / "out"
    out.mkdir()
    procs = []

    def start(*flags, env=None, launcher="mindio.launch.cli", target=None, **kw):
        e = dict(os.environ, OUT_DIR=str(out), TTP_LOG_STDOUT="1", **(env or {}))
        p = _Launcher([sys.executable, "-m", launcher, *flags, str(target or script), "--x", "1"],
                      env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
        procs.append(p)
        return p

    def results():
        return {f.name: json.loads(f.read_text()) for f in sorted(out.iterdir()) if f.suffix == ".json"}

    start.dir = tmp_path
    yield start, results
    for p in procs:  # end only what this test started
        if p.poll() is None:
            p.kill()
        subprocess.Popen.communicate(p)  # unchecked: killed here, or checked when the test read it


def _tree(root: Path) -> dict:
    """{path below the job's run directory, with the run directory's random suffix cut: file content}"""
    runs = list(root.iterdir())
    assert len(runs) == 1, runs
    prefix = runs[0].name.split("_", 1)[0]  # <rdzv-id>_<mkdtemp suffix> (the id here: "none")
    return {f"{prefix}_*/{f.relative_to(runs[0])}": f.read_text() for f in sorted(runs[0].rglob("*")) if f.is_file()}


@pytest.mark.timeout(150)
def test_workers_get_torchrun_environment_and_logs(job):
    """Two workers: torchrun's environment, set before the script's own modules are imported (a module
    reading LOCAL_RANK at import sees each rank's value, not the warm interpreter's nothing), and
    ``--tee 3 --log-dir D --local-ranks-filter 0`` writes the same per-rank files as torchrun, with only
    local rank 0 on the console."""
    start, results = job
    logs = {name: job[0].dir / f"logs-{name}" for name in ("mindio", "torchrun")}
    flags = ["--nproc-per-node", "2", "--role", "trainer", "--tee", "3", "--local-ranks-filter", "0"]
    # what the script writes is compared, not what importing torch says in this environment (with the
    # `peers` extra installed, torch.cuda warns that pynvml is deprecated: in each torchrun worker's
    # stderr, but once in mindio-run's warm interpreter before any worker exists)
    quiet = {"PYTHONWARNINGS": "ignore"}
    p = start(*flags, "--log-dir", str(logs["mindio"]), "--master-port", str(_free_port()), env=quiet)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    res = results()
    assert sorted(res) == ["r0-rank0.json", "r0-rank1.json"]
    for rank in (0, 1):
        r = res[f"r0-rank{rank}.json"]
        assert r["import_local_rank"] == str(rank)  # the script's module saw its rank at import time
        assert r["sum"] == 1.0  # 0 + 1: a real all_reduce across both workers
        assert r["argv"] == ["--x", "1"]
        env = r["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank) and env["ROLE_NAME"] == "trainer"
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")
        assert float(env["MINDIO_WORKER_WARMUP_S"]) > 0  # torch was imported before the assignment
    assert "[trainer0]:hello from rank 0" in out and "[trainer0]:warning from rank 0" in out
    assert "rank 1" not in out  # filtered from the console, still in its files
    for f in res.values():
        os.remove(job[0].dir / "out" / f"r0-rank{f['env']['RANK']}.json")
    t = start(*flags, "--log-dir", str(logs["torchrun"]), "--master-port", str(_free_port()),
              launcher="torch.distributed.run", env=quiet)
    tout, _ = t.communicate(timeout=120)
    assert t.returncode == 0, tout
    ours, theirs = _tree(logs["mindio"]), _tree(logs["torchrun"])
    assert ours == theirs, (ours, theirs)
    assert ours["none_*/attempt_0/1/stdout.log"] == "hello from rank 1\n"


@pytest.mark.timeout(150)
def test_failed_worker_restarts_whole_job_and_its_exception_is_named(job):
    """Round 0: rank 1 raises. The summary names its exception and rank, its traceback starts at the
    script's frame (no launcher frames), and every worker restarts in round 1 (a fresh store), which ends
    the job with 0."""
    start, results = job
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()), "--max-restarts", "1",
              env={"FAIL_RANK": "1", "FAIL_HOW": "raise"})
    out, _ = p.communicate(timeout=140)
    assert p.returncode == 0, out
    line = next(ln for ln in out.splitlines() if "round 0 failed" in ln)
    assert "rank 1 (node 0, " in line and "exited with exit code 1: ValueError: bad batch on rank 1" in line, out
    assert line.endswith("restarting every worker (restart 1 of 1)"), line
    trace = out[out.index("Traceback"):]
    frames = [ln for ln in trace.splitlines() if ln.startswith('  File "')]
    assert frames[0].startswith(f'  File "{job[0].dir / "worker.py"}"'), trace  # the script's frame comes first
    assert "_bootstrap" not in out and "runpy" not in out, out
    assert {"r1-rank0.json", "r1-rank1.json"} <= set(results())


@pytest.mark.timeout(90)
def test_the_failing_rank_is_named_when_a_peer_dies_before_it_is_reaped(job):
    # rank 1 closes its connections, then lingers before exiting 7: rank 0's barrier fails and rank 0
    # dies first (gloo's exception), so the agent's first look sees only rank 0 dead (CI saw this race
    # with a plain sys.exit: the report named rank 0's abort and not the rank that failed). Rank 0's
    # error is a consequence (connection closed by its peer): rank 1 is the root cause. It lingers 1.5 s,
    # longer than the agent's 1 s exit grace (a loaded machine's teardown, seen under xdist): while only
    # a consequence is known, the agent awaits the others (up to --shutdown-timeout, agent._settle).
    start, _ = job
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()), env={"FAIL_RANK": "1", "LINGER_S": "1.5"})
    out, _ = p.communicate(timeout=80)
    assert p.returncode == 1, out
    line = next(ln for ln in out.splitlines() if "job failed" in ln)
    assert line.startswith("mindio-run: job failed: rank 1 (node 0, "), out
    assert "exited with exit code 7; then rank 0 failed as a consequence" in line, out


@pytest.mark.timeout(150)
def test_root_cause_on_another_node_with_c10d_node_ranks(job):
    """Two agents meet through ``--rdzv-backend c10d`` without ``--node-rank`` (the agent hosting the
    endpoint is node 0, the other node 1, as torchrun assigns them); rank 1, on node 1, raises. Node 0's
    agent names node 1's exception and rank in its summary and prints its traceback."""
    start, results = job
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    agents = [start(*flags, env={"FAIL_RANK": "1", "FAIL_HOW": "raise"}) for _ in range(2)]
    outs = [a.communicate(timeout=140)[0] for a in agents]
    assert [a.returncode for a in agents] == [1, 1], outs
    ranks = {r["env"]["RANK"]: r["env"]["GROUP_RANK"] for r in results().values()}
    assert ranks == {"0": "0", "1": "1"}, ranks
    for out in outs:  # both agents name the root cause, node 1's
        line = next(ln for ln in out.splitlines() if "job failed" in ln)
        assert "rank 1 (node 1, " in line and "ValueError: bad batch on rank 1" in line, out
    node0 = [o for o in outs if "root cause, from node 1" in o]  # node 0 also prints node 1's traceback
    assert len(node0) == 1 and 'raise ValueError(f"bad batch on rank {rank}")' in node0[0], outs


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
    a1.sent = {"launcher": "SIGKILL"}
    out0, _ = a0.communicate(timeout=120)
    outs, _ = spare.communicate(timeout=30)
    a1.communicate(timeout=10)
    assert a1.returncode == -signal.SIGKILL
    assert a0.returncode == 0, out0
    assert spare.returncode == 0, outs
    assert "standby takes over node 1" in outs
    res = results()
    assert res["r1-rank1.json"]["env"]["GROUP_RANK"] == "1"
    assert res["r1-rank0.json"]["sum"] == 1.0


def _lose_node_1(start, results, common, env, node0=()):
    """Start nodes 1 and 0 (``node0``: flags of node 0's agent only), wait until node 1's worker trains,
    SIGKILL node 1's agent (the node dies). Node 1 starts first: node 0's first join then waits for an
    agent that is already up, so a short ``join_timeout`` of node 0 bounds the wait for the lost node,
    not the two agents' start-up on a loaded machine. A launcher that exits before round 0 trains fails
    the test at once with its output; otherwise the test's timeout bounds the start."""
    a1 = start(*common, "--node-rank", "1", env=env)
    a0 = start(*common, "--node-rank", "0", *node0, env=env)
    while "r0-rank1.json" not in results():
        for name, a in (("node 0", a0), ("node 1", a1)):
            assert a.poll() is None, f"{name}'s launcher exited before round 0 trained: " + a.communicate()[0]
        time.sleep(0.2)
    a1.send_signal(signal.SIGKILL)
    a1.sent = {"launcher": "SIGKILL"}
    return a0, a1


def _read_until(proc, text: str, timeout: float) -> list[str]:
    """Lines of ``proc``'s output up to the first holding ``text`` (a reader thread: bounded)."""
    import queue
    import threading
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in iter(proc.stdout.readline, "")] + [q.put(None)],
                     daemon=True).start()
    lines, deadline = [], time.monotonic() + timeout
    while not lines or text not in lines[-1]:
        line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, f"exited before printing {text!r}: " + "".join(lines)[-4000:]
        lines.append(line)
    proc.rest = q
    return lines


@pytest.mark.timeout(150)
def test_a_spare_started_after_the_loss_takes_the_node(job):
    """No standby yet when node 1 dies: node 0 waits (bounded by join_timeout, and says so) for the
    spare agent its message asks for; the spare started then takes node 1 and the job ends with 0."""
    start, results = job
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", port, "--max-restarts", "1"]
    a0, a1 = _lose_node_1(start, results, common, {"STEPS": "40"})
    head = _read_until(a0, "--rdzv-conf join_timeout=S) for a spare agent", timeout=90)
    spare = start(*common, "--standby", env={"STEPS": "40"})
    outs, _ = spare.communicate(timeout=90)
    a0.wait(30)
    rest = []
    while (line := a0.rest.get(timeout=10)) is not None:
        rest.append(line)
    out0 = "".join(head + rest)
    check_codes({"launcher": a0.returncode}, {}, what="process", context=out0[-4000:])
    assert_no_signal_deaths(out0, {})
    a1.communicate(timeout=10)
    assert spare.returncode == 0, outs
    assert "standby takes over node 1" in outs
    assert results()["r1-rank1.json"]["env"]["GROUP_RANK"] == "1"


@pytest.mark.timeout(150)
def test_a_lost_node_with_no_spare_ends_the_job_at_the_join_timeout(job):
    """No standby ever comes: node 0 gives up after ``--rdzv-conf join_timeout`` and says which node it
    waited for, how many spares joined and which knob sets the bound."""
    start, results = job
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", port, "--max-restarts", "1"]
    a0, a1 = _lose_node_1(start, results, common, {"STEPS": "40"}, node0=("--rdzv-conf", "join_timeout=8"))
    t0 = time.monotonic()
    out0, _ = a0.communicate(timeout=90)
    a1.communicate(timeout=10)
    assert a0.returncode == 1, out0
    assert "node(s) [1] lost and 0 standby node(s) joined within 8 s (--rdzv-conf join_timeout=S)" in out0
    # the lost node's agent is not awaited at the end either (it waited out leave_timeout, 10 s, before)
    assert "for the other agents to leave" not in out0, out0
    assert time.monotonic() - t0 < 60, out0


def _await_line(p, text: str, timeout: float) -> list:
    """The launcher's output lines up to the first that contains ``text`` (bounded). A reader thread, not
    select() on the pipe: a buffered readline takes in more than the line it returns, and select() would
    then wait for output that already arrived."""
    import queue
    import threading

    lines, got = [], queue.Queue()
    threading.Thread(target=lambda: got.put(p.stdout.readline()), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = got.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        lines.append(line)
        if not line or text in line:
            break
        threading.Thread(target=lambda: got.put(p.stdout.readline()), daemon=True).start()
    assert lines and text in lines[-1], f"no {text!r} within {timeout} s: {''.join(lines)}"
    return lines


def _stop(p, head: list) -> tuple:
    """SIGTERM to launcher ``p``: (its whole output, seconds it took to exit)."""
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    return "".join(head) + out, time.monotonic() - t0


@pytest.mark.timeout(120)
def test_sigterm_ends_the_rendezvous_wait_at_once(job):
    """#30 item 4: mindio-run ends at once on SIGTERM while it waits in the rendezvous -- node 1 for a
    node 0 that does not answer, node 0 for the other agents -- with one line saying what it waited for;
    the wait for node 0 prints one line, not c10d's line per retry. (Also #30 items 7, 8: abbreviated
    flags and a quoted --rdzv-conf, as an argument list passes them, without a shell.)"""
    start, _ = job
    port = _free_port()
    flags = ["--nnodes", "2", "--nproc-per", "1", "--master-port", str(port), "--rdzv-conf='join_timeout=90'"]
    a1 = start(*flags, "--node-rank", "1")  # node 0 is not up: its port refuses
    out1, took1 = _stop(a1, _await_line(a1, "does not answer yet (attempt 1: Connection refused)", 60))
    assert a1.returncode == 1 and took1 < 5, (took1, out1)
    assert out1.strip().splitlines()[-1] == ("mindio-run: job failed: SIGTERM: stopped while waiting for node 0's "
                                             f"agents' store at 127.0.0.1:{port}"), out1
    assert out1.count("does not answer yet") == 1 and "TCPStore" not in out1 and "Traceback" not in out1, out1
    a0 = start(*flags, "--node-rank", "0")  # node 1 never comes
    deadline = time.monotonic() + 60
    while True:  # the store is up: node 0 is in the rendezvous (its signal handlers are set before)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and a0.poll() is None, "node 0's store never came up"
            time.sleep(0.2)
    out0, took0 = _stop(a0, [])
    assert a0.returncode == 1 and took0 < 5, (took0, out0)
    assert out0.strip().splitlines()[-1] == ("mindio-run: job failed: SIGTERM: stopped while waiting for the other "
                                             "agents to join round 0 (1 of 2 joined)"), out0
    assert "Traceback" not in out0 and "waiting 10 s for the other agents to leave" not in out0, out0


@pytest.mark.timeout(120)
def test_sigterm_ends_the_wait_for_etcd_at_once(job):
    """#30 item 4 with ``--rdzv-backend etcd``: an agent waiting for an etcd server that does not answer
    (its port refuses) says so in one line and ends at once on SIGTERM, naming what it waited for."""
    pytest.importorskip("etcd", reason="python-etcd (pip install -c constraints.txt -e '.[etcd]')")
    start, _ = job
    endpoint = f"127.0.0.1:{_free_port()}"
    a = start("--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
              "--rdzv-conf", "join_timeout=90")
    out, took = _stop(a, _await_line(a, f"etcd at {endpoint} does not answer yet", 60))
    assert a.returncode == 1 and took < 5, (took, out)
    assert out.strip().splitlines()[-1] == f"mindio-run: job failed: SIGTERM: stopped while waiting for etcd at {endpoint}", out
    assert out.count("does not answer yet") == 1 and "Traceback" not in out, out


@pytest.mark.timeout(150)
def test_an_elastic_node_range_starts_with_min_and_takes_an_agent_that_comes_later(job):
    """#30 item 6: ``--nnodes 1:2`` (c10d), as torchrun runs it: the first agent starts the job alone once
    MIN joined and ``last_call_timeout`` passed; a second agent that comes later restarts every worker
    with it (world size 2), which does not use up a restart (``--max-restarts 0``)."""
    start, results = job
    flags = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
             "--rdzv-conf", "last_call_timeout=1", "--nproc-per-node", "1", "--max-restarts", "0"]
    a = start(*flags, env={"STEPS": "60"})
    deadline = time.monotonic() + 90
    while "r0-rank0.json" not in results():  # round 0 runs, with one node
        assert time.monotonic() < deadline and a.poll() is None, "round 0 never ran"
        time.sleep(0.2)
    b = start(*flags, env={"STEPS": "60"})  # the same script: as many collectives as node 0's
    out_a, _ = a.communicate(timeout=120)
    out_b, _ = b.communicate(timeout=30)
    assert (a.returncode, b.returncode) == (0, 0), out_a + out_b
    got = results()
    assert got["r0-rank0.json"]["env"]["WORLD_SIZE"] == "1"
    assert {r["env"]["WORLD_SIZE"] for k, r in got.items() if k.startswith("r1-")} == {"2"}, got.keys()
    assert got["r1-rank0.json"]["sum"] == got["r1-rank1.json"]["sum"] == 1.0
    assert "round 0: agent(s) came to join (--nnodes MIN:MAX)" in out_a, out_a


REFUSED = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    from mindio.ttp import tft_init_controller, tft_init_processor, tft_start_controller, tft_start_processor
    if os.environ.get("WHY"):
        sys.exit(os.environ["WHY"])  # as a framework's argument check does (megatron's missing --save)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    port = int(os.environ["TTP_PORT"])
    if rank == 0 and not os.environ.get("NO_CONTROLLER"):
        tft_init_controller(rank, world, enable_local_copy=False)
        tft_start_controller("127.0.0.1", port, enable_tls=False)
    tft_init_processor(rank, world, enable_local_copy=False, enable_tls=False)
    tft_start_processor("127.0.0.1", port)
""")


@pytest.mark.timeout(300)
def test_refused_settings_are_one_line_under_torchrun_and_mindio_run(job, tmp_path):
    """#30 item 12: a controller port in use (under torchrun: every rank's refused setting is one line,
    not a traceback; torchrun's root cause is that line), a controller that never answers (one line, not
    a line per heartbeat window), a script's ``sys.exit(reason)`` (mindio-run's summary carries the reason)."""
    script = tmp_path / "refused.py"
    script.write_text(REFUSED)
    start, _ = job
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t = start("--nproc-per-node", "2", "--standalone", launcher="torch.distributed.run", target=script,
                  env={"TTP_PORT": str(port)})
        t.sent = {1: "SIGTERM"}  # torchrun stops rank 1 once rank 0 failed
        out, _ = t.communicate(timeout=120)
    assert t.returncode == 1, out
    line = (f"mindio: rank 0: ConfigError: controller port {port} on 127.0.0.1 is already in use (another job's "
            f"controller, or one still running?): give tft_start_controller a free port (TTP_PORT in the examples)")
    assert f"[rank0]: {line}" in out.splitlines(), out
    assert not [ln for ln in out.splitlines() if ln.startswith("[rank") and "Traceback" in ln], out  # a rank's
    root = out[out.index("Root Cause"):]
    assert "traceback : ConfigError: controller port" in root, root
    # no controller answers: one line when the rank gives up, not one per silent heartbeat window (a
    # plain process, as a rank under torchrun runs: the excepthook mindio.ttp installs prints it)
    env = dict(os.environ, NO_CONTROLLER="1", TTP_PORT=str(_free_port()), TTP_RETRY_TIMES="2", TTP_LOG_STDOUT="1",
               MINDIO_SECRET="s" * 32, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    alone = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 1, alone.stderr
    said = [ln for ln in alone.stderr.splitlines() if "NoController" in ln]  # torch's excepthook adds "[rank0]: "
    assert len(said) == 1 and said[0].startswith("[rank0]: mindio: NoController: rank 0: no controller answered at "
                                                 "tcp://127.0.0.1:"), alone.stderr
    assert alone.stderr.count("silent for") <= 1 and "Traceback" not in alone.stderr, alone.stderr  # 1 INFO line
    why = "--enable-high-availability needs --save DIR: the last-words checkpoint is written there"
    m = start("--nproc-per-node", "1", target=script, env={"WHY": why})
    out, _ = m.communicate(timeout=120)
    assert m.returncode == 1, out
    assert f"exited with exit code 1: SystemExit: {why} (restarts used: 0 of 0)" in out.splitlines()[-1], out


LATE = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    import mindio.ttp as ttp
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    ttp.tft_init_processor(rank, world, False, enable_tls=False)
    ttp.tft_start_processor(os.environ["TTP_ADDR"], int(os.environ["TTP_PORT"]))
    dist.barrier()                 # "training"
    ttp.tft_destroy_processor()    # training finished: the rank leaves the controller
    dist.destroy_process_group()
    if rank == 1:
        with open(os.path.join(os.environ["OUT_DIR"], "aborted_at"), "w") as f:
            f.write(repr(time.time()))
        os.abort()                 # then dies abnormally at exit (issue 13: SIGABRT at interpreter exit)
""")


@pytest.mark.timeout(120)
def test_abnormal_exit_after_training_finished_ends_the_job_at_once(job, tmp_path):
    """With the controller in the launcher, rank 1 aborts after its training finished (its processor
    left the controller): nothing to recover, and the job must not wait for a decision that never comes
    (before: it waited forever). It ends within 10 s of the abort, non-zero, naming rank 1."""
    start, _ = job
    script = tmp_path / "late.py"
    script.write_text(LATE)
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()), "--high-availability", "dump",
              target=script)
    p.sent = {1: "SIGABRT"}  # the script's os.abort()
    out, _ = p.communicate(timeout=110)
    ended = time.time()
    assert p.returncode == 1, out
    line = next(ln for ln in out.splitlines() if "job failed" in ln)
    assert "rank 1 (node 0, " in line and "exited with signal SIGABRT after its training finished" in line, out
    aborted = float((tmp_path / "out" / "aborted_at").read_text())
    print(f"\nabort -> mindio-run exited in {ended - aborted:.2f} s")
    assert ended - aborted < 10, ended - aborted
    assert "after its training finished (it had left the controller)" in out, out


PLAIN_EXIT = textwrap.dedent("""
    import os
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    if os.environ["HOW"] == "raise":  # as a collective that met a lost peer's "Connection reset by peer"
        raise RuntimeError("gloo: Connection reset by peer")
    # "return": the script ends holding its group, as many do
""")

# Runs in every process of the job (PYTHONPATH), registered at interpreter start: the last atexit handler
# of a worker, so it sees what the interpreter's shutdown would meet.
LAST_EXIT_HANDLER = textwrap.dedent("""
    import atexit, os, sys

    def _report():
        dist = sys.modules.get("torch.distributed")
        if dist is not None and "RANK" in os.environ:
            print(f"rank {os.environ['RANK']}: a process group at interpreter shutdown: {dist.is_initialized()}",
                  flush=True)

    atexit.register(_report)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "return"])
def test_a_plain_worker_releases_its_groups_before_the_interpreter_shuts_down(job, tmp_path, how):
    """A worker whose script knows nothing of mindio leaves its gloo group to the interpreter's shutdown,
    which can abort the process (SIGABRT, "terminate called without an active exception": seen once in a
    full suite, a plain worker that raised on a lost peer; mindio/ttp/shutdown.py). mindio-run's worker
    bootstrap releases the groups at exit, after the script's own handlers, whether the script raised or
    returned: the interpreter's shutdown meets no group."""
    start, _ = job
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_EXIT)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LAST_EXIT_HANDLER)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    # the node's own fork server (not the suite's host, started before this test's PYTHONPATH): it imports
    # the sitecustomize at its start, and its children inherit the handler
    env = {"HOW": how, "PYTHONPATH": path, "MINDIO_FORK_SERVER_HOST": ""}
    # one rank when it raises: a second one would be stopped by the agent (SIGTERM) if its own exit took
    # longer than the agent's grace after the first failure
    nproc = 1 if how == "raise" else 2
    p = start("--nproc-per-node", str(nproc), "--master-port", str(_free_port()), target=script, env=env)
    out, _ = p.communicate(timeout=110)
    assert p.returncode == (1 if how == "raise" else 0), out
    for rank in range(nproc):
        assert f"rank {rank}: a process group at interpreter shutdown: False" in out, out


ARF = textwrap.dedent("""
    import os
    import torch.distributed as dist
    import mindio.ttp as ttp
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    if rank == 0:
        ttp.tft_init_controller(rank, world, False, enable_arf=True)
    ttp.tft_init_processor(rank, world, False, enable_tls=False, enable_arf=True)
    raise SystemExit("unreachable: worker reboot without a launcher that replaces processes must fail at start")
""")


@pytest.mark.timeout(120)
def test_worker_reboot_under_torchrun_fails_at_start(job, tmp_path):
    """A job that asks for worker reboot (enable_arf, the scripts' --enable-worker-reboot) under torchrun:
    nothing could replace a dead rank, so it fails at start, one line naming what to use (before: it
    trained, and its first dead rank ended the job with 76). Under mindio-run without
    --high-availability: test_launch_megatron.py, on the Megatron example."""
    start, _ = job
    script = tmp_path / "arf.py"
    script.write_text(ARF)
    p = start("--nproc-per-node", "2", "--master-port", str(_free_port()), target=script,
              launcher="torch.distributed.run")
    # both ranks fail at start; torchrun ends the workers still running when the first one failed with
    # SIGTERM (torch.distributed.elastic's policy), so whichever rank exits second may die by it
    p.sent = {0: "SIGTERM", 1: "SIGTERM"}
    out, _ = p.communicate(timeout=110)
    assert p.returncode == 1, out
    assert "ConfigError: worker reboot (tft_init_controller(enable_arf=True), --enable-worker-reboot) replaces " \
           "failed processes, which torchrun cannot do: launch the job with `mindio-run --high-availability " \
           "dump,recover-in-place`" in out, out


@pytest.mark.timeout(60)
def test_master_port_in_use_is_one_line(job, tmp_path):
    start, _ = job
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = start("--nproc-per-node", "1", "--master-port", str(port))
        out, _ = p.communicate(timeout=50)
    assert p.returncode == 1, out
    assert out.strip().splitlines()[-1] == (
        f"mindio-run: error: --master-port {port} is in use on this host (another job, or a "
        f"torchrun?): pick a free port (on a single node, leave --master-port out and mindio-run picks one)"), out
    assert "Traceback" not in out


@pytest.mark.timeout(90)
def test_missing_optional_dependency_names_the_pip_command(job, tmp_path):
    """The Megatron example on an installation without the ``megatron`` extra (hidden here by an import
    hook): the summary names the pip command instead of a bare ModuleNotFoundError."""
    hook = tmp_path / "hide"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        class _Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "megatron" or name.startswith("megatron."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, _Hide())
    """))
    start, _ = job
    p = start("--nproc-per-node", "1", env={"PYTHONPATH": f"{hook}:{REPO}"},
              target=REPO / "examples" / "megatron" / "pretrain_gpt.py")
    out, _ = p.communicate(timeout=80)
    assert p.returncode == 1, out
    line = next(ln for ln in out.splitlines() if "job failed" in ln)
    assert "ModuleNotFoundError: No module named 'megatron'" in line, out
    assert "pip install 'mindio[megatron]'" in line, out


@pytest.mark.timeout(60)
def test_no_python_runs_the_program_itself(job, tmp_path):
    prog = tmp_path / "prog.sh"
    prog.write_text('#!/bin/sh\necho "rank $RANK of $WORLD_SIZE args $*"\n')
    prog.chmod(0o755)
    start, _ = job
    p = start("--nproc-per-node", "2", "--no-python", "--tee", "1", target=prog)
    out, _ = p.communicate(timeout=50)
    assert p.returncode == 0, out
    assert "[default0]:rank 0 of 2 args --x 1" in out and "[default1]:rank 1 of 2 args --x 1" in out, out

"""mindio-run's fork server (mindio/launch/_zygote.py, forkserver.py): a forked worker is the worker an
exec'd warm spare would be -- same environment, argv, open files, stdin, signal handlers, exit codes and
signal deaths, dies with its agent -- and where a fork is unsafe the agent execs its workers instead.

Real agents, real workers; every launcher's exit code asserted (tests/_exits.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mindio._ports import free_port
from mindio.launch import forkserver
from tests._exits import assert_no_signal_deaths, check_codes

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

# Reports what a worker sees, then exits with EXIT_CODE (a rank's code: EXIT_CODE + rank) or kills
# itself with KILL_RANK's signal.
WORKER = textwrap.dedent("""
    import gc, json, os, signal, sys, threading
    import numpy, torch
    fds = {}
    for fd in sorted(os.listdir("/proc/self/fd")):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}").split(":[")[0]  # pipe:[inode] -> pipe
        except OSError:  # the directory listing's own fd, closed by now
            pass
    rank = int(os.environ["RANK"])
    path = os.path.join(os.environ["OUT_DIR"], f"{os.environ['MINDIO_FORK_SERVER']}-{rank}.json")
    with open(path + ".tmp", "w") as f:  # renamed when complete: a test polls for it
        json.dump({"fds": fds, "argv": sys.argv[1:], "threads": threading.active_count(),
                   "tasks": len(os.listdir("/proc/self/task")), "ppid": os.getppid(),
                   "agent": int(os.environ["MINDIO_AGENT_PID"]), "np": float(numpy.random.random()),
                   "torch": torch.initial_seed(), "sigint": repr(signal.getsignal(signal.SIGINT)),
                   "sigterm": repr(signal.getsignal(signal.SIGTERM)), "frozen": gc.get_freeze_count(),
                   "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS",
                                                          "MINDIO_WORKER_WARMUP_S")},
                   "error_file": os.environ["TORCHELASTIC_ERROR_FILE"].split("/")[-3:], "pid": os.getpid()}, f)
    os.replace(path + ".tmp", path)
    if os.environ.get("KILL_RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGABRT)
    if os.environ.get("SLEEP_S"):
        import time
        time.sleep(float(os.environ["SLEEP_S"]))
    sys.exit(int(os.environ.get("EXIT_CODE", "0")) + rank if os.environ.get("EXIT_CODE") else 0)
""")


def _run(tmp_path, mode: str, *flags, timeout: float = 90, sent=None, source: str = WORKER, **env):
    script = tmp_path / "worker.py"
    script.write_text(source)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    e = dict(os.environ, OUT_DIR=str(out), MINDIO_FORK_SERVER=mode, PYTHONPATH=str(REPO))
    e.update(env)
    p = subprocess.run([sys.executable, "-m", "mindio.launch.cli", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), *flags, str(script), "--x", "1"],
                       env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    check_codes({"launcher": p.returncode}, what="launcher", context=p.stdout[-4000:])
    assert_no_signal_deaths(p.stdout, sent or {})
    seen = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob(f"{mode}-*.json")}
    return p.returncode, p.stdout, seen


@pytest.mark.skipif(forkserver.unusable(dict(os.environ, MINDIO_FORK_SERVER="auto", OMP_NUM_THREADS="1")) != "",
                    reason="no fork server here (an accelerator build of torch)")
@pytest.mark.timeout(240)
def test_a_forked_worker_sees_what_an_execd_one_sees(tmp_path):
    _, _, forked = _run(tmp_path, "auto", "--max-restarts", "1")
    _, _, execd = _run(tmp_path, "off", "--max-restarts", "1")
    assert sorted(forked) == sorted(execd) == [0, 1]
    for rank in (0, 1):
        f, x = forked[rank], execd[rank]
        assert f["ppid"] != f["agent"] and x["ppid"] == x["agent"]  # forked by the server / exec'd by the agent
        assert f["fds"] == x["fds"], (f["fds"], x["fds"])  # no fd of the server leaks into a worker
        for key in ("argv", "threads", "tasks", "sigint", "sigterm", "error_file"):
            assert f[key] == x[key], (key, f[key], x[key])
        assert {k: v for k, v in f["env"].items() if k != "MINDIO_WORKER_WARMUP_S"} == \
            {k: v for k, v in x["env"].items() if k != "MINDIO_WORKER_WARMUP_S"}
        assert f["tasks"] == 1 and f["fds"]["0"] == "/dev/null"
        # the server froze its start-up objects before forking (MINDIO_GC_FREEZE, on by default)
        assert f["frozen"] > 10000 and x["frozen"] == 0, (f["frozen"], x["frozen"])
    assert forked[0]["ppid"] == forked[1]["ppid"]  # one server per agent
    for seen in (forked, execd):  # numpy's and torch's global generators seeded per process from the OS
        assert seen[0]["np"] != seen[1]["np"] and seen[0]["torch"] != seen[1]["torch"]


# Says whether torch._dynamo was imported before the script's first line of its own ran: mindio.ttp, which the
# fork server preloads, checks at its import whether the script wants it (mindio/ttp/shutdown.py).
DYNAMO_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import mindio.ttp
    {wants}
    path = os.path.join(os.environ["OUT_DIR"], f"{{os.environ['MINDIO_FORK_SERVER']}}-{{os.environ['RANK']}}.json")
    with open(path, "w") as f:
        json.dump({{"dynamo": "torch._dynamo" in sys.modules, "ppid": os.getppid(),
                   "agent": int(os.environ["MINDIO_AGENT_PID"])}}, f)
""")


@pytest.mark.skipif(forkserver.unusable(dict(os.environ, MINDIO_FORK_SERVER="auto", OMP_NUM_THREADS="1")) != "",
                    reason="no fork server here (an accelerator build of torch)")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("server,wants", [("hosted", False), ("hosted", True), ("own", False)],
                         ids=["hosted-toy", "hosted-optim", "own-toy"])
def test_a_fork_server_imports_torch_dynamo_only_for_a_script_that_wants_it(tmp_path, server, wants):
    """mindio/_dynamo.py: torch._dynamo (~1.3 CPU-s) is imported before ``init_process_group`` only for a
    script that names what imports it (here ``torch.optim``). The fork server's own module
    (mindio.launch._zygote; _zygote_host when the fork-server host of tests/conftest.py forked it) names
    megatron: mindio.ttp's check, run while the server preloads it, read that module as the script and
    imported torch._dynamo into every fork server."""
    env = {"MINDIO_FORK_SERVER_HOST": ""} if server == "own" else {}
    if server == "hosted" and not os.environ.get("MINDIO_FORK_SERVER_HOST"):
        pytest.skip("no fork-server host in this test process (MINDIO_TEST_FORK_SERVER_HOST=0)")
    source = DYNAMO_WORKER.format(wants="from torch import optim" if wants else "")
    rc, out, seen = _run(tmp_path, "auto", source=source, **env)
    assert rc == 0 and sorted(seen) == [0, 1], out[-3000:]
    assert all(s["ppid"] != s["agent"] for s in seen.values()), seen  # forked by the fork server
    assert [s["dynamo"] for s in seen.values()] == [wants, wants], seen


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_exit_codes_and_signal_deaths_reach_the_agent(tmp_path, mode):
    rc, out, seen = _run(tmp_path, mode, EXIT_CODE="3")
    assert rc == 1 and sorted(seen) == [0, 1], out[-3000:]
    assert "exited with exit code 3" in out or "exited with exit code 4" in out, out[-3000:]
    rc, out, _ = _run(tmp_path, mode, KILL_RANK="1", SLEEP_S="2", sent={1: "SIGABRT"})
    assert rc == 1 and "rank 1 (node 0" in out and "exited with signal SIGABRT" in out, out[-3000:]


@pytest.mark.timeout(120)
def test_workers_die_with_their_agent(tmp_path):
    """SIGKILL of the agent (a lost node): its fork server and every forked worker die with it."""
    kill_agent_and_see_its_workers_die(tmp_path)


def kill_agent_and_see_its_workers_die(tmp_path, **env) -> list:
    """Start an agent of 2 sleeping workers (``env`` added), SIGKILL it once both run, assert that the workers
    and their parents (the fork server) are gone within 10 s; returns what the workers reported."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    e = dict(os.environ, OUT_DIR=str(out), MINDIO_FORK_SERVER="auto", PYTHONPATH=str(REPO), SLEEP_S="120", **env)
    p = subprocess.Popen([sys.executable, "-m", "mindio.launch.cli", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), str(script)], env=e,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(out.glob("*.json"))) < 2 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None, f"the agent ended first: {p.returncode}"
        seen = [json.loads(f.read_text()) for f in out.glob("*.json")]
        assert len(seen) == 2, "the workers did not start within 90 s"
        p.kill()
        assert p.wait(10) == -signal.SIGKILL
        pids = [s["pid"] for s in seen] + [s["ppid"] for s in seen]
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), [pid for pid in pids if _alive(pid)]
        return seen
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(300)
def test_a_server_with_threads_after_its_imports_execs_its_workers(tmp_path):
    """A preloaded module that starts a thread makes a fork unsafe: the agent says so and execs. The
    workers' imports start only once the server has done its own and found the fork unsafe: two import
    phases in a row, hence a bound of its own (90 s was hit twice in 3 runs at load 50-60)."""
    (tmp_path / "threaded_mod.py").write_text("import threading, time\n"
                                              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    rc, out, seen = _run(tmp_path, "auto", "--max-restarts", "1", timeout=240, MINDIO_PRELOAD="threaded_mod",
                         PYTHONPATH=f"{REPO}:{tmp_path}")
    assert rc == 0 and sorted(seen) == [0, 1], out[-3000:]
    if forkserver.unusable(dict(os.environ, MINDIO_FORK_SERVER="auto", OMP_NUM_THREADS="1")) == "":
        assert "the fork server cannot fork workers (2 threads run after the imports" in out, out[-3000:]
    assert all(s["ppid"] == s["agent"] for s in seen.values())


@pytest.mark.parametrize("build", ["cuda", "hip", "xpu"])
def test_off_and_accelerator_builds_are_not_forked(monkeypatch, build):
    """A fork after CUDA/HIP/XPU started is unsafe: such a torch build execs every worker."""
    import torch

    assert forkserver.unusable({"MINDIO_FORK_SERVER": "off"}) == "MINDIO_FORK_SERVER=off"
    assert "OMP_NUM_THREADS='4', not 1" in forkserver.unusable({"OMP_NUM_THREADS": "4"})  # BLAS threads at import
    monkeypatch.setattr(torch.version, build, "12.4", raising=False)
    assert f"torch is built for {build.upper()} 12.4" in forkserver.unusable({"OMP_NUM_THREADS": "1"})

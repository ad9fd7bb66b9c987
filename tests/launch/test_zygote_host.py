"""The fork-server host (mindio/launch/_zygote_host.py, MINDIO_FORK_SERVER_HOST): a fork server it forks for
an agent gives the workers exactly what the agent's own fork server gives them; the agent's death still
takes them; whatever could make it differ (the import-time environment, the sys.path, another user's
socket) is refused and the agent starts its own. Real hosts, agents and workers."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from mindio.launch import _zygote_host as host_mod
from mindio.launch import forkserver
from tests.launch.test_forkserver import REPO, _run, kill_agent_and_see_its_workers_die

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    forkserver.unusable(dict(os.environ, MINDIO_FORK_SERVER="auto", OMP_NUM_THREADS="1")) != "",
    reason="no fork server here (an accelerator build of torch)")]


@pytest.fixture
def host(tmp_path_factory):
    """A fresh host in a private directory: (socket path, its log)."""
    d = tmp_path_factory.mktemp("host")
    os.chmod(d, 0o700)
    path, log = d / "h.sock", d / "host.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MINDIO_FORK_SERVER_HOST", None)
    with open(log, "wb") as f:
        p = host_mod.spawn(str(path), f, env=env, cwd=REPO)
    assert p is not None, log.read_text()
    try:
        yield str(path), log
    finally:
        p.kill()
        assert p.wait(10) == -signal.SIGKILL  # it was still serving: nothing made it exit


def _forked_by(log) -> set:
    return {int(m.group(1)) for m in re.finditer(r"fork server (\d+) for agent", log.read_text())}


@pytest.mark.timeout(300)
def test_a_hosted_fork_server_gives_the_workers_what_their_agents_own_gives(tmp_path, host):
    """The first job on a fresh host also proves that the branch it forks holds none of the agent's fds
    (_run reads the agent's output to its end: a branch holding the pipe would hang it)."""
    path, log = host
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, out, hosted = _run(tmp_path / "a", "auto", MINDIO_FORK_SERVER_HOST=path)
    _, _, own = _run(tmp_path / "b", "auto", MINDIO_FORK_SERVER_HOST="")
    assert sorted(hosted) == sorted(own) == [0, 1], out[-3000:]
    assert {hosted[0]["ppid"]} == {hosted[1]["ppid"]} and hosted[0]["ppid"] in _forked_by(log)
    assert own[0]["ppid"] not in _forked_by(log)
    for rank in (0, 1):
        h, o = hosted[rank], own[rank]
        assert h["fds"] == o["fds"], (h["fds"], o["fds"])  # the agent's stdout/stderr, no fd of the host
        for key in ("argv", "threads", "tasks", "sigint", "sigterm", "error_file"):
            assert h[key] == o[key], (key, h[key], o[key])
        assert {k: v for k, v in h["env"].items() if k != "MINDIO_WORKER_WARMUP_S"} == \
            {k: v for k, v in o["env"].items() if k != "MINDIO_WORKER_WARMUP_S"}
        assert h["frozen"] > 10000 and h["fds"]["0"] == "/dev/null"
    # fresh generators in every worker, also across two jobs of one host
    _, _, again = _run(tmp_path / "a", "auto", MINDIO_FORK_SERVER_HOST=path)
    draws = [s["np"] for s in (*hosted.values(), *again.values())]
    assert len(set(draws)) == 4 and len({s["torch"] for s in (*hosted.values(), *again.values())}) == 4
    assert again[0]["ppid"] in _forked_by(log) and again[0]["ppid"] != hosted[0]["ppid"]
    # MINDIO_GC_FREEZE=0: nothing frozen in the workers of either (the host's branch froze its imports' objects
    # once, for its fork servers' collections; a server whose agent turned the freeze off unfreezes them)
    (tmp_path / "c").mkdir()
    (tmp_path / "d").mkdir()
    _, out, hosted = _run(tmp_path / "c", "auto", MINDIO_FORK_SERVER_HOST=path, MINDIO_GC_FREEZE="0")
    _, _, own = _run(tmp_path / "d", "auto", MINDIO_FORK_SERVER_HOST="", MINDIO_GC_FREEZE="0")
    assert hosted[0]["ppid"] in _forked_by(log) and own[0]["ppid"] not in _forked_by(log), out[-3000:]
    assert [s["frozen"] for s in (*hosted.values(), *own.values())] == [0, 0, 0, 0], (hosted, own)


@pytest.mark.timeout(120)
def test_the_workers_of_a_hosted_fork_server_die_with_their_agent(tmp_path, host):
    path, log = host
    seen = kill_agent_and_see_its_workers_die(tmp_path, MINDIO_FORK_SERVER_HOST=path)
    assert seen[0]["ppid"] in _forked_by(log)  # hosted: not the agent's child


@pytest.mark.timeout(200)
def test_an_agent_whose_imports_could_differ_is_refused_and_starts_its_own(tmp_path, host):
    path, log = host
    rc, out, seen = _run(tmp_path, "auto", MINDIO_FORK_SERVER_HOST=path, TORCH_SHOW_CPP_STACKTRACES="1")
    assert rc == 0 and sorted(seen) == [0, 1], out[-3000:]
    assert seen[0]["ppid"] not in _forked_by(log) and seen[0]["ppid"] != seen[0]["agent"]  # its own fork server
    assert "refused agent" in log.read_text() and "TORCH_SHOW_CPP_STACKTRACES" in log.read_text()


def test_a_sys_path_that_finds_an_imported_module_elsewhere_is_refused(tmp_path):
    (tmp_path / "numpy.py").write_text("raise ImportError('a shadow')\n")
    (tmp_path / "empty").mkdir()

    # (cwd, PYTHONPATH) of an agent -> what _moved answers, all asked of one interpreter started as the host is
    # (a host answers every agent's request so, one after the other; _moved imports nothing)
    cases = [((REPO, str(tmp_path)), "numpy"),
             ((REPO, f"{tmp_path / 'empty'}:{REPO}"), ""),
             ((REPO, None), ""),  # mindio found through its (editable) install instead: the same files
             ((tmp_path, str(REPO)), "numpy")]  # the agent's own directory comes first on its sys.path (python -m)
    code = ("import json, sys, numpy, torch; from mindio.launch._zygote_host import _moved; "
            "print(repr([_moved(c, {} if p is None else {'PYTHONPATH': p}) for c, p in json.loads(sys.argv[1])]))")
    asked = json.dumps([[str(cwd), path] for (cwd, path), _ in cases])
    p = subprocess.run([sys.executable, "-c", code, asked], cwd=REPO, text=True, capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    assert eval(p.stdout) == [want for _, want in cases]


def test_a_socket_nobody_else_could_have_placed_is_the_only_one_used(tmp_path):
    import socket

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(shared / "h.sock"))
    assert "not private" in host_mod.private_socket(str(shared / "h.sock"))
    os.chmod(shared, 0o700)
    assert host_mod.private_socket(str(shared / "h.sock")) == ""
    (shared / "f").write_text("")
    assert "not a socket" in host_mod.private_socket(str(shared / "f"))
    a, b = socket.socketpair()
    assert forkserver._hosted(["x.py"], {"MINDIO_FORK_SERVER_HOST": str(shared / "f")}, b) is None
    s.close()
    # the host itself does not start in a directory others may write
    os.chmod(shared, 0o777)
    p = subprocess.run([sys.executable, "-m", "mindio.launch._zygote_host", str(shared / "g.sock")],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 1 and "not a private directory" in p.stderr

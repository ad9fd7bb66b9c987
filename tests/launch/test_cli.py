"""mindio-run's command line is torchrun's (no processes): every torchrun flag and PET_* variable is
accepted with its meaning, the flags mindio-run cannot honour fail with one line, the help is plain
text; plus the interface check of multi-host jobs (mindio/launch/netif.py) and the bootstrap's choice of
what a warm interpreter may import before it knows its rank."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mindio.errors import ConfigError
from mindio.launch import LaunchConfig, netif
from mindio.launch._bootstrap import _preload, first_call_imports, preloadable, submodule_imports, top_level_imports
from mindio.launch.cli import build_parser, parse_args
from tests._exits import signal_deaths


@pytest.fixture
def script(tmp_path):
    s = tmp_path / "t.py"
    s.write_text("pass\n")
    return str(s)


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]  # argparse: usage line(s), then one line "mindio-run: error: ..."


def test_every_torchrun_flag_is_accepted_with_its_help():
    from torch.distributed.run import get_args_parser

    ours = build_parser()
    mine = {s for a in ours._actions for s in a.option_strings}
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert theirs <= mine, sorted(theirs - mine)
    for a in ours._actions:
        if a.dest != "help":
            assert a.help, f"{a.option_strings or a.dest} has no help"
    text = subprocess.run([sys.executable, "-m", "mindio.launch.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "`" not in text.stdout and "--high-availability" in text.stdout and "--tee" in text.stdout
    v = subprocess.run([sys.executable, "-m", "mindio.launch.cli", "--version"], capture_output=True, text=True,
                       timeout=120)
    import mindio

    assert v.returncode == 0 and v.stdout.strip() == f"mindio-run (mindio {mindio.__version__})"


def test_torchrun_flags_keep_their_meaning(script, monkeypatch):
    cfg = parse_args(["--rdzv-endpoint", "127.0.0.1:1234", "--nproc_per_node", "3", "--role", "trainer",
                      "--tee", "3", "--log-dir", "/tmp/x", "--local-ranks-filter", "0,2", "--shutdown-timeout", "7",
                      "--signals-to-handle", "SIGTERM,SIGUSR1", "--run-path", script, "--lr", "1"])
    assert (cfg.master_addr, cfg.master_port, cfg.nproc_per_node, cfg.args) == ("127.0.0.1", 1234, 3, ("--lr", "1"))
    assert (cfg.role, cfg.tee, cfg.log_dir, cfg.local_ranks_filter) == ("trainer", "3", "/tmp/x", frozenset({0, 2}))
    assert cfg.term_grace == 7 and cfg.signals == ("SIGTERM", "SIGUSR1")
    import os

    assert parse_args(["--nproc-per-node", "cpu", script]).nproc_per_node == os.cpu_count()
    # torchrun: a single node without --master-port gets a free port; with one, the static rendezvous
    assert parse_args([script]).master_port != 29500
    assert parse_args(["--nnodes", "2", script]).master_port == 29500
    assert parse_args(["--nnodes", "2:2", "--node-rank", "1", script]).node_rank == 1
    # c10d: the endpoint is node 0's store; node ranks come from the rendezvous unless given
    c = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29555", "--nnodes", "2", script])
    assert c.dynamic_rank and (c.master_addr, c.master_port) == ("127.0.0.1", 29555)
    assert not parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--nnodes", "2", "--node-rank",
                           "1", script]).dynamic_rank
    # etcd: the endpoint is the etcd server (port 2379 by default); node 0's address stays --master-addr
    e = parse_args(["--rdzv-backend", "etcd", "--rdzv-endpoint", "10.0.0.9", "--nnodes", "2", "--node-rank", "1",
                    "--master-addr", "10.0.0.1", script])
    assert (e.etcd_endpoint, e.master_addr, e.node_rank, e.dynamic_rank) == ("10.0.0.9:2379", "10.0.0.1", 1, False)
    assert parse_args(["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:1", "--nnodes", "2", "--standby",
                       script]).etcd_endpoint == "h:1"
    assert parse_args([script]).etcd_endpoint == ""
    # the members of an etcd cluster, each with 2379 by default
    assert parse_args(["--rdzv-backend", "etcd", "--rdzv-endpoint", "a:1, b,c:3", "--nnodes", "2", "--standby",
                       script]).etcd_endpoint == "a:1,b:2379,c:3"
    # PET_* variables are torchrun's defaults for its flags, mindio's flags included
    monkeypatch.setenv("PET_NPROC_PER_NODE", "5")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_HIGH_AVAILABILITY", "dump,retry")
    cfg = parse_args([script])
    assert (cfg.nproc_per_node, cfg.max_restarts, cfg.high_availability) == (5, 2, ("dump", "retry"))


def test_preemption_flags_reach_the_agent_and_its_workers(script, capsys, monkeypatch):
    cfg = parse_args([script])
    assert (cfg.preempt_signals, cfg.preempt_timeout) == (("SIGTERM",), 20.0)
    cfg = parse_args(["--preempt-signal", "term,USR1", "--preempt-timeout", "12", script])
    assert (cfg.preempt_signals, cfg.preempt_timeout) == (("SIGTERM", "SIGUSR1"), 12.0)
    # the workers' handlers (mindio.ttp.processor.preempt) read the same settings from their environment
    assert cfg.extra_env == {"MINDIO_PREEMPT_SIGNAL": "SIGTERM,SIGUSR1", "MINDIO_PREEMPT_TIMEOUT": "12.0"}
    assert parse_args(["--preempt-signal", "none", script]).extra_env["MINDIO_PREEMPT_SIGNAL"] == "none"
    monkeypatch.setenv("MINDIO_PREEMPT_TIMEOUT", "9")
    assert parse_args([script]).preempt_timeout == 9.0
    assert "--preempt-signal 'SIGKILL' is not valid" in _error(capsys, ["--preempt-signal", "SIGKILL", script])
    assert "--preempt-timeout must be > 0" in _error(capsys, ["--preempt-timeout", "0", script])


def test_abbreviated_flags_and_quoted_rdzv_conf_as_torchrun_takes_them(script, capsys):
    """#30 items 7 and 8: torchrun's parser accepts unambiguous prefixes of long options (``--redirect=3``)
    and its --rdzv-conf values quoted (a job file or an argument list keeps the quotes a shell removes)."""
    cfg = parse_args(["--redirect=3", "--nproc-per", "2", "--max-restart", "1", script, "--redirect", "x"])
    assert (cfg.redirects, cfg.nproc_per_node, cfg.max_restarts) == ("3", 2, 1)
    assert cfg.args == ("--redirect", "x")  # the script's own arguments are never expanded
    for conf in ("'join_timeout=5,read_timeout=5'", "join_timeout='5',read_timeout=\"5\"", "join_timeout=5, timeout=9"):
        assert parse_args(["--rdzv-conf", conf, script]).rdzv_timeout == 5.0, conf
    assert parse_args([f"--rdzv-conf=\"timeout=7\"", script]).rdzv_timeout == 7.0
    assert _error(capsys, ["--stand", script]).endswith("ambiguous option: --stand could match --standalone, --standby")
    assert _error(capsys, ["--rdzv-conf", "join_timeout=soon", script]) == \
        "mindio-run: error: --rdzv-conf join_timeout=soon: expected a number of seconds > 0"
    assert "expected KEY=VALUE" in _error(capsys, ["--rdzv-conf", "join_timeout", script])


def test_flags_mindio_run_cannot_honour_fail_with_one_line(script, capsys):
    assert "--rdzv-backend zookeeper: not supported" in _error(capsys, ["--rdzv-backend", "zookeeper", script])
    # etcd (the agents' store on an etcd server: tests/recovery/test_etcd_store.py runs it)
    assert "needs --rdzv-endpoint HOST:PORT (the etcd server; several members of an etcd cluster: " \
           "HOST:PORT,HOST:PORT,...)" in _error(capsys, ["--rdzv-backend", "etcd", script])
    assert "give each agent its --node-rank" in _error(capsys, ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:1",
                                                                "--nnodes", "2", script])
    assert "a MIN:MAX range needs --rdzv-backend c10d" in _error(capsys, ["--nnodes", "1:4", script])
    assert "not supported with --high-availability" in _error(capsys, [
        "--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--high-availability", "dump", script])
    r = parse_args(["--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf",
                    "last_call_timeout=3", script])
    assert (r.min_nodes, r.nnodes, r.last_call, r.dynamic_rank) == (2, 4, 3.0, True)
    assert "--numa-binding node: not supported" in _error(capsys, ["--numa-binding", "node", script])
    assert "--event-log-handler console" in _error(capsys, ["--event-log-handler", "console", script])
    assert "--node-rank 2 is outside [0, 1]" in _error(capsys, ["--nnodes", "2", "--node-rank", "2", script])
    assert "--tee 7" in _error(capsys, ["--tee", "7", script])
    assert "Unsupported nproc_per_node" in _error(capsys, ["--nproc-per-node", "many", script])
    assert "--module and --no-python" in _error(capsys, ["-m", "--no-python", "x"])
    assert "does not exist" in _error(capsys, ["/nonexistent/train.py"])
    with pytest.raises(ConfigError, match="monitor-interval"):
        LaunchConfig(entrypoint=script, monitor_interval=2.0)


def test_gloo_interface_is_checked_or_chosen_at_start():
    have = netif.interfaces()
    assert have.get("lo") == "127.0.0.1"
    assert netif.choose({}, "127.0.0.1", None, multi_node=True) == {}  # all nodes on loopback: nothing to do
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0"):
        netif.choose({"GLOO_SOCKET_IFNAME": "nosuch0"}, "127.0.0.1", None, multi_node=True)
    assert netif.choose({}, "127.0.0.1", "127.0.0.1", multi_node=False) == {"GLOO_SOCKET_IFNAME": "lo"}
    with pytest.raises(ConfigError, match="is not an address of this host"):
        netif.choose({}, "127.0.0.1", "192.0.2.254" if "192.0.2.254" not in have.values() else "198.51.100.9",
                     multi_node=True)
    others = {n: a for n, a in have.items() if n != "lo"}
    if others:  # the interface that routes to a master address on another interface (a UDP connect: no traffic)
        name, addr = sorted(others.items())[0]
        assert netif.choose({}, addr, None, multi_node=True) == {"GLOO_SOCKET_IFNAME": name}
        assert netif.choose({}, addr, None, multi_node=False) == {}  # one node: gloo's own choice works


def test_an_interface_that_evicts_arp_on_carrier_loss_is_named_with_its_sysctl(tmp_path):
    """#16: link flaps cost 1-2 s of traffic where the kernel drops ARP entries on carrier loss; the
    agent of a multi-host job says so at start, with the sysctl that stops it (a /proc tree of the test's)."""
    for name, value in {"eth0": "1\n", "eth1": "0\n", "ib0": "1\n"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "arp_evict_nocarrier").write_text(value)
    advice = netif.flap_advice("eth0,eth1,ib0", proc=str(tmp_path))
    assert "interface(s) eth0, ib0 drop their ARP entries" in advice
    assert "sysctl -w net.ipv4.conf.eth0.arp_evict_nocarrier=0 net.ipv4.conf.ib0.arp_evict_nocarrier=0" in advice
    assert netif.flap_advice("eth1", proc=str(tmp_path)) is None
    assert netif.flap_advice("eth9", proc=str(tmp_path)) is None  # no such setting (an older kernel)


def test_warm_interpreters_import_only_what_cannot_read_the_rank(tmp_path):
    s = tmp_path / "s.py"
    s.write_text("import os, json, helper\nimport torch.distributed as dist\nfrom megatron.core import mpu\n"
                 "from mindio import ttp\nfrom . import x\nimport megatron.training\n"
                 "def f():\n    import secret\nraise SystemExit('must not run')\n")
    names = top_level_imports(str(s))
    assert names == ["os", "json", "helper", "torch.distributed", "megatron.core", "mindio", "megatron.training"]
    assert preloadable(names) == ["torch.distributed", "megatron.core", "mindio"]
    assert preloadable(names, extra=("helper",)) == ["helper", "torch.distributed", "megatron.core", "mindio"]


def test_warm_interpreters_import_the_submodules_a_from_import_names(tmp_path):
    """``from mindio import megatron as mio`` (docs/megatron.md) imports megatron-core: a warm interpreter
    preloads ``mindio.megatron``, not only ``mindio``; a name that is no module (a function) is skipped."""
    s = tmp_path / "s.py"
    s.write_text("from mindio import ttp as t\nfrom mindio.ttp import tft_init_processor\nfrom . import x\n"
                 "from os import *\ndef f():\n    from mindio import secret\n")
    assert submodule_imports(str(s)) == ["mindio.ttp", "mindio.ttp.tft_init_processor"]
    done = _preload(str(s), is_module=False)  # torch and mindio.ttp: already imported by this process
    assert "mindio.ttp" in done and "mindio.ttp.tft_init_processor" not in done, done


def test_warm_interpreters_import_what_the_script_pays_for_anyway(tmp_path):
    """A top-level ``try:`` import (an optional dependency, as examples/megatron/pretrain_gpt.py imports
    mindio.ttp) counts as top-level; a call of torch.use_deterministic_algorithms anywhere preloads the
    torch module it imports at its first call; its handlers and a script that never calls it do not."""
    s = tmp_path / "s.py"
    s.write_text("try:\n    from mindio import ttp\nexcept ImportError:\n    import secret\n"
                 "def f():\n    torch.use_deterministic_algorithms(True)\n")
    assert top_level_imports(str(s)) == ["mindio"] and submodule_imports(str(s)) == ["mindio.ttp"]
    assert first_call_imports(str(s)) == ["torch._inductor.config"]
    assert "torch._inductor.config" in _preload(str(s), is_module=False)
    s.write_text("import torch\ntorch.manual_seed(0)\n")
    assert first_call_imports(str(s)) == []


def test_a_spare_is_kept_only_where_a_worker_can_start_again(script):
    """A warm spare costs a core its imports while the first workers start; it is kept only where the
    agent can start a worker again: a controller that replaces ranks, a whole-job restart, a standby."""
    from mindio.launch.agent import Agent

    def spares(*argv):
        return Agent(parse_args([*argv, script])).cfg.warm_spares

    assert spares() == 0 and spares("--warm-spares", "3") == 0
    assert spares("--max-restarts", "1") == 1 and spares("--max-restarts", "1", "--warm-spares", "2") == 2
    assert spares("--high-availability", "dump") == 1
    assert spares("--nnodes", "2", "--standby", "--warm-spares", "1") == 1


def test_root_cause_and_round_outcome_wording(tmp_path):
    """failures.read parses torchrun's error-file format; the root cause is the earliest failure that is not
    a peer's consequence; a round that ended with a dump is said to, and relaunched, or exits 75."""
    import json

    from mindio.launch import failures

    err = tmp_path / "error.json"  # what torch's @record (ErrorHandler.record_exception) writes
    err.write_text(json.dumps({"message": {"message": "ValueError: bad batch", "extraInfo": {
        "py_callstack": "Traceback ...\nValueError: bad batch\n", "timestamp": "100"}}}))
    root = failures.read(3, 1, str(err), node=1)
    assert (root.error, root.time, root.node) == ("ValueError: bad batch", 100.0, 1)
    peer = failures.Failure(rank=0, code=1, error="RuntimeError: [gloo] Connection closed by peer", time=99.0)
    killed = failures.Failure(rank=2, code=-9, time=98.0)  # SIGKILLed without an error: the agents' doing
    # stopped by the controller because of another rank's fault: mindio's decorator records it as a consequence
    forced = failures.Failure(rank=4, code=75, error="RuntimeError: FORCE STOP: ...", consequence=True, time=1.0)
    assert failures.first([peer, killed, forced, root]) is root
    assert failures.first([failures.read(5, 7, None)]).line().startswith("rank 5 (node 0, ")
    # it raised, and its agent's SIGTERM (the round ended by another node's failure) came while it exited:
    # its failure is its own, and the line says so -- not "exited with signal SIGTERM", a signal death
    exiting = failures.Failure(rank=1, code=-15, node=1, error="ValueError: bad batch", time=97.0, stopped=True)
    assert failures.first([peer, killed, exiting]) is exiting and not exiting.secondary
    assert exiting.line() == ("rank 1 (node 1) failed: ValueError: bad batch (its agent's signal SIGTERM came "
                              "while it exited)")
    assert signal_deaths(exiting.line()) == [] and signal_deaths(killed.line()) == [(2, "SIGKILL")]

    text, code = failures.outcome([peer, root], "node 1: ...", rnd=0, max_restarts=0, node=0)
    assert code == 1 and text.splitlines()[0] == (
        f"mindio-run: job failed: rank 3 (node 1, {root.host}) exited with exit code 1: ValueError: bad batch; "
        f"then rank 0 failed as a consequence (restarts used: 0 of 0)")
    assert "root cause, from node 1" in text and "ValueError: bad batch" in text.splitlines()[-1]
    text, code = failures.outcome([peer, root], "node 1: ...", rnd=0, max_restarts=2, node=1)
    assert code is None and text.endswith("restarting every worker (restart 1 of 2)") and "\n" not in text

    dumped = [failures.Failure(rank=r, code=75, error="RuntimeError: FORCE STOP", consequence=True) for r in (0, 2)] \
        + [failures.Failure(rank=3, code=75), failures.Failure(rank=1, code=75, error="ValueError: injected")]
    text, code = failures.outcome(dumped, "node 0: the controller ended the job (exit code 75)", rnd=0,
                                  max_restarts=1)
    assert code is None and text.startswith("mindio-run: round 0: a last-words checkpoint was written (workers "
                                            "exited 75) after: rank 1 (node 0")
    assert "ValueError: injected (the controller ended the job (exit code 75)); relaunching every worker to resume " \
        "from it (restart 1 of 1)" in text, text  # ranks that only exited 75 after the dump are no failures
    text, code = failures.outcome(dumped, "x", rnd=1, max_restarts=1)
    assert code == 75 and text.startswith("mindio-run: job stopped: a last-words checkpoint was written")
    # a rank met the exception the last launch dumped after, at the same step (79): no restart, restarts left or not
    again = [failures.Failure(rank=1, code=79, error="ValueError: bug -- rank 1 raised it again at step 6"),
             failures.Failure(rank=0, code=79, error="RuntimeError: [gloo] Connection closed by peer", consequence=True)]
    text, code = failures.outcome(again, "node 0: the controller ended the job (exit code 79)", rnd=1, max_restarts=3)
    assert code == 1 and text.startswith("mindio-run: job failed: rank 1 (node 0) exited with exit code 79: "), text
    assert "raised it again at step 6" in text and text.endswith(
        "(restarts used: 1 of 3; not restarted: workers exited 79, a deterministic fault)"), text


def test_torchrun_names_the_cause_not_a_peers_connection_closed(tmp_path):
    """#30 item 2: torchrun's root cause is the failure with the smallest whole-second error-file
    timestamp, ties to the lowest rank. Rank 2 raised, rank 1 then saw its peer's connection close in the
    same second and recorded it (mindio's decorator marks it a consequence): torchrun's own code, reading
    the files mindio wrote, names rank 2 -- and so does mindio-run's summary."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mindio.launch import failures

    t = int(time.time()) + 0.25
    files = {r: str(tmp_path / f"{r}.json") for r in (1, 2)}
    failures.record("ValueError: bad batch on rank 2", "Traceback ...\nValueError: bad batch on rank 2\n",
                    path=files[2], when=t)
    # known to mindio as a consequence, and one only its text tells (no decorator around the loop)
    failures.record("RuntimeError: Connection closed by peer", "...", path=files[1], when=t + 0.5, consequence=True)
    pf = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file=files[r]) for r in (1, 2)}
    assert ChildFailedError("train.py", pf).get_first_failure()[0] == 2
    failures.record("RuntimeError: [gloo] Connection closed by peer", "...", path=files[1], when=t + 0.5, replace=True)
    pf[1] = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=files[1])
    assert ChildFailedError("train.py", pf).get_first_failure()[0] == 2
    assert failures.first([failures.read(r, 1, files[r]) for r in (1, 2)]).rank == 2
    assert failures.read(1, 1, files[1]).time == t + 0.5  # mindio's own time stays exact

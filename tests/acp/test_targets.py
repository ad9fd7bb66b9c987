"""Targets a save cannot write: refused at save() as torch.save would refuse them, never a storage
failure; a target that breaks after save() fails that file only; durable renames (directory fsync)."""
import os
import signal
import stat
import time

import pytest
import torch

from mindio import acp
from mindio.acp import _config, _storage, api

pytestmark = pytest.mark.timeout(120)
OBJ = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}

# file names torch.save writes (240, 255 bytes) and refuses (256 bytes: ENAMETOOLONG); with mindio's
# temp suffix (".<name>.mindio-tmp.<host>.<seq>") the first two used to be unwritable as well
NAMES = {"name240": "a" * 237 + ".pt", "name255": "b" * 252 + ".pt", "name256": "c" * 253 + ".pt",
         "directory": "iter_0001", "missing-dir": os.path.join("no-such-dir", "x.pt")}


def _torch_outcome(path: str) -> str:
    try:
        torch.save(OBJ, path)
    except (OSError, RuntimeError) as exc:    # torch's own writer reports a failed open as RuntimeError
        return type(exc).__name__
    return "written"


@pytest.mark.parametrize("daemon", [True, False], ids=["daemon", "no-daemon"])
def test_targets_behave_like_torch_save(acp_env, monkeypatch, caplog, daemon):
    """Every name: mindio.save writes what torch.save writes and refuses (-1, logged with the reason)
    what torch.save refuses; with the daemon, no refusal reaches it or counts as a storage failure,
    even with MINDIO_ACP_UNSERVICEABLE_AFTER=1."""
    monkeypatch.setenv("MINDIO_ACP_UNSERVICEABLE_AFTER", "1")
    monkeypatch.setenv("MINDIO_ACP_PERSIST_RETRIES", "1")
    if not daemon:
        monkeypatch.setenv("MINDIO_ACP_DISABLE", "1")
    ref, ours = (os.path.join(acp_env["ck"], d) for d in ("torch", "mindio"))
    os.mkdir(ref)
    os.mkdir(ours)
    written = []
    for case, name in NAMES.items():
        if case == "directory":
            os.mkdir(os.path.join(ref, name))
            os.mkdir(os.path.join(ours, name))
        expected = _torch_outcome(os.path.join(ref, name))
        path = os.path.join(ours, name)
        caplog.clear()
        rc = acp.save(OBJ, path)
        if expected == "written":
            assert rc == (1 if daemon else 2), case
            written.append(path)
        else:
            assert rc == -1, (case, expected)
            assert any(path in r.message and "cannot save" in r.message for r in caplog.records), case
    assert len(written) == 2                               # the 240- and 255-byte names
    assert acp.flush() == 0
    for path in written:
        assert torch.equal(acp.load(path, open_way="fopen")["w"], OBJ["w"])
    assert sorted(os.listdir(ours)) == sorted(os.listdir(ref))     # the same files, no temp file, no marker
    if daemon:
        stat_ = acp.server_stat()
        assert stat_["state"] == "ok" and stat_["persist_failures"] == 0 and stat_["target_errors"] == 0
        assert acp.save(OBJ, os.path.join(ours, "after.pt")) == 1  # still serviceable


def test_target_broken_after_save_is_not_a_storage_failure(acp_env, monkeypatch):
    """A directory appears where a saved file is to go (the user's error, after save returned): that
    file fails, flush names it, its data stays loadable from memory, the daemon stays serviceable,
    no temp file is left; then the idle daemon exits with that failure pending, frees its pool and
    reports the file lost to the next initialize()."""
    for knob, value in (("MINDIO_ACP_UNSERVICEABLE_AFTER", "1"), ("MINDIO_ACP_PERSIST_RETRIES", "1"),
                        ("MINDIO_ACP_PERSIST_DELAY", "1"), ("MINDIO_ACP_IDLE_EXIT", "2")):
        monkeypatch.setenv(knob, value)
    assert acp.initialize() == 0
    target = os.path.join(acp_env["ck"], "x.pt")
    assert acp.save(OBJ, target) == 1
    daemon = api._client.hello["pid"]
    os.kill(daemon, signal.SIGSTOP)  # inside its 1 s persist delay: the directory comes first, however late
    try:
        os.mkdir(target)
    finally:
        os.kill(daemon, signal.SIGCONT)
    assert acp.flush(timeout=60) == 1
    stat_ = acp.server_stat()
    assert stat_["state"] == "ok" and stat_["target_errors"] == 1 and stat_["persist_failures"] == 0
    other = os.path.join(acp_env["ck"], "y.pt")
    handle = acp.async_save(OBJ, other)
    assert handle.rc == 1 and handle.wait(60)              # storage still works and is still used
    assert torch.equal(acp.load(target)["w"], OBJ["w"])     # the failed file is served from memory
    assert not [n for n in os.listdir(acp_env["ck"]) if ".mindio-tmp." in n]

    pool, pid = _config.pool_dir(acp_env["run"]), api._client.hello["pid"]
    assert os.path.isdir(pool)
    api.reset()                                             # the trainer goes away: the daemon is idle
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") and not os.path.exists(pool)
    assert acp.initialize() == 0                            # a new daemon: the given-up file is reported
    lost = {rec["path"]: rec["reason"] for rec in acp.lost_checkpoints()}
    assert "idle daemon exited" in lost[target] and "IsADirectoryError" in lost[target]
    assert acp.flush() == 0                                 # and not retried


def _fsynced_dirs(monkeypatch) -> list:
    seen = []
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            seen.append((st.st_dev, st.st_ino))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _ident(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_journal_rewrite_fsyncs_its_directory(tmp_path, monkeypatch):
    journal = _storage.Journal(str(tmp_path / "journal.jsonl"))
    journal.append({"c": 1, "path": "/x", "file": "/f", "off": 0, "size": 1, "kind": "acp"})
    seen = _fsynced_dirs(monkeypatch)
    journal.rewrite([])
    assert _ident(tmp_path) in seen
    assert _storage.Journal.load(str(tmp_path / "journal.jsonl")) == ([], [])
    assert sorted(os.listdir(tmp_path)) == ["journal.jsonl"]


class _NotBytes:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_megatron_checkpoint_bytes_fsync_and_clean_up(tmp_path, monkeypatch):
    """mindio.megatron's torch_dist byte writer without the ACP store: the directory is fsynced after
    the rename, and a failing write leaves no temp file behind."""
    from mindio.megatron import torch_dist

    monkeypatch.setenv("MINDIO_ACP_DISABLE", "1")
    api.reset()
    monkeypatch.setattr(torch_dist, "_acp", lambda: None)    # no ACP store: atomic write to storage
    seen = _fsynced_dirs(monkeypatch)
    torch_dist._store(tmp_path / "common.pt", b"0123456789")
    assert _ident(tmp_path) in seen and (tmp_path / "common.pt").read_bytes() == b"0123456789"
    with pytest.raises(TypeError):
        torch_dist._store(tmp_path / "other.pt", _NotBytes())      # not bytes: fails inside the write
    assert sorted(os.listdir(tmp_path)) == ["common.pt"]

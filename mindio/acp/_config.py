"""server_info validation and the daemon's file locations.

Every key of the reference's server_info table is accepted, as a string (the reference's form) or a
plain Python value, and checked against its documented range; unknown keys are rejected. Two defaults
differ from the reference on purpose: the pool defaults to a quarter of physical memory (at most
128 GB) instead of a fixed 128 GB, and blocks default to 16 MB so that small files waste little.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from .. import _knobs
from ..errors import ConfigError

__all__ = ["ServerConfig", "parse_server_info", "runtime_dir", "pool_dir", "KEYS"]

_GB = 1 << 30
_MB = 1 << 20


def _physical_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _default_capacity_gb() -> int:
    return max(1, min(128, _physical_bytes() // 4 // _GB))


# key: (kind, low, high, default or callable)
KEYS = {
    "memfs.data_block_pool_capacity_in_gb": ("int", 1, 1024, _default_capacity_gb),
    "memfs.data_block_size_in_mb": ("int", 1, 1024, 16),
    "memfs.write.parallel.enabled": ("bool", None, None, True),
    "memfs.write.parallel.thread_num": ("int", 2, 96, 16),
    "memfs.write.parallel.slice_in_mb": ("int", 1, 1024, 16),
    "background.backup.thread_num": ("int", 1, 256, 32),
}


@dataclass(frozen=True)
class ServerConfig:
    pool_bytes: int
    block_bytes: int
    parallel: bool
    write_threads: int
    slice_bytes: int
    backup_threads: int

    def copy_threads(self) -> int:
        """Threads a client uses to copy into the pool: the setting, capped at this machine's cores."""
        return max(1, min(self.write_threads, os.cpu_count() or 1)) if self.parallel else 1

    def persist_threads(self) -> int:
        """Daemon persistence workers: the setting, capped at 8 (each writes one file at a time)."""
        return max(1, min(self.backup_threads, 8))

    def to_wire(self) -> dict:
        return dict(self.__dict__)


def _value(key: str, raw):
    kind, low, high, _ = KEYS[key]
    if kind == "bool":
        text = str(raw).strip().lower()
        if text not in ("true", "false", "1", "0"):
            raise ConfigError(f"server_info[{key!r}]={raw!r}: expected 'true' or 'false'")
        return text in ("true", "1")
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"server_info[{key!r}]={raw!r}: expected an integer in [{low}, {high}]") from None
    if not low <= value <= high:
        raise ConfigError(f"server_info[{key!r}]={value} is out of range [{low}, {high}]")
    return value


def parse_server_info(server_info=None, environ=None) -> ServerConfig:
    """Validate ``server_info`` (dict or None) and return the effective configuration."""
    if server_info is None:
        server_info = {}
    if not isinstance(server_info, dict):
        raise ConfigError(f"server_info must be a dict of str to str, not {type(server_info).__name__}")
    unknown = sorted(set(server_info) - set(KEYS))
    if unknown:
        raise ConfigError(f"server_info has unknown key(s) {unknown}; known keys: {sorted(KEYS)}")
    values = {}
    for key, (_, _, _, default) in KEYS.items():
        values[key] = _value(key, server_info[key]) if key in server_info else (
            default() if callable(default) else default)
    pool = values["memfs.data_block_pool_capacity_in_gb"] * _GB
    if pool > _physical_bytes():
        raise ConfigError(
            f"server_info['memfs.data_block_pool_capacity_in_gb']={pool // _GB} exceeds this machine's "
            f"{_physical_bytes() / _GB:.1f} GB of memory; the reference advises at most 25% of it")
    override_mb = _knobs.get("MINDIO_ACP_POOL_MB", environ)
    if override_mb:
        pool = override_mb * _MB
    block = values["memfs.data_block_size_in_mb"] * _MB
    if block > pool:
        raise ConfigError(f"block size {block // _MB} MB is larger than the pool ({pool // _MB} MB)")
    return ServerConfig(pool_bytes=pool // block * block, block_bytes=block,
                        parallel=values["memfs.write.parallel.enabled"],
                        write_threads=values["memfs.write.parallel.thread_num"],
                        slice_bytes=values["memfs.write.parallel.slice_in_mb"] * _MB,
                        backup_threads=values["background.backup.thread_num"])


def runtime_dir(environ=None) -> str:
    """Directory of the socket, lock, journal and logs: MINDIO_ACP_DIR, else $XDG_RUNTIME_DIR/mindio-acp
    (the per-user directory of a login session), else /tmp/mindio-acp-<uid>. It is created 0700 and
    verified before use (mindio._secure.private_dir)."""
    path = _knobs.get("MINDIO_ACP_DIR", environ)
    if not path:
        xdg = _knobs.get("XDG_RUNTIME_DIR", environ)
        path = os.path.join(xdg, "mindio-acp") if xdg else f"/tmp/mindio-acp-{os.geteuid()}"
    return os.path.abspath(path)


def pool_dir(run_dir: str) -> str:
    """Where pool files live: /dev/shm when present (memory), else the runtime directory. Created 0700
    and verified like the runtime directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        tag = hashlib.sha1(run_dir.encode()).hexdigest()[:12]
        return f"/dev/shm/mindio-acp-{os.geteuid()}-{tag}"
    return os.path.join(run_dir, "pool")

"""The client side of a job's status server (mindio/ttp/controller/status.py): the request signature and the
query ``mindio status`` sends. Light on purpose: no torch, so the command answers at once."""
from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.request

__all__ = ["AUTH_HEADER", "MAX_SKEW_S", "sign", "verify", "query"]

AUTH_HEADER = "X-Mindio-Auth"
MAX_SKEW_S = 60.0


def sign(key: bytes, path: str, now: float | None = None) -> str:
    """The ``X-Mindio-Auth`` value for ``path``: ``<unix time>:<hex HMAC-SHA256(key, "<time>:<path>")>``,
    ``key`` being the job key that signs control frames (sha256 of MINDIO_SECRET)."""
    stamp = str(int(now if now is not None else time.time()))
    return stamp + ":" + hmac.new(key, f"{stamp}:{path}".encode(), hashlib.sha256).hexdigest()


def verify(key: bytes, path: str, value: str | None) -> bool:
    """Is ``value`` a signature of ``path`` by ``key`` made less than MAX_SKEW_S seconds from now?"""
    stamp, _, mac = (value or "").partition(":")
    if not stamp.isdigit() or abs(time.time() - int(stamp)) > MAX_SKEW_S:
        return False
    want = hmac.new(key, f"{stamp}:{path}".encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, mac)


def query(address: str, key: bytes, path: str = "/status", timeout: float = 10.0):
    """GET ``path`` from a job's status server at ``host:port``; the parsed JSON for /status, text else."""
    req = urllib.request.Request(f"http://{address}{path}", headers={AUTH_HEADER: sign(key, path)})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read().decode()
    return json.loads(body) if path == "/status" else body

"""What a running job is doing, for ``mindio status`` and for Prometheus (opt-in: ``MINDIO_STATUS_PORT``).

The controller starts :func:`serve` when ``MINDIO_STATUS_PORT`` is set: a small HTTP server on the
controller's address with two read-only endpoints.

* ``GET /metrics`` -- Prometheus text exposition (format 0.0.4), no authentication (numbers only: no
  secret, path or message). Names, all prefixed ``mindio_``:

  ==================================================  =========  ==========================================
  name                                                type       meaning
  ==================================================  =========  ==========================================
  ``world_size``, ``ranks_registered``, ``ranks_alive``  gauge   the job's ranks
  ``controller_state{state}``                         gauge      1 for the controller's current state
  ``step_max``, ``step_min``                          gauge      completed steps over the live ranks
  ``heartbeat_lag_max_seconds``                       gauge      the oldest live rank's time since a frame
  ``hang_bound_seconds``                              gauge      the hang bound in force (controller/hangs.py)
  ``rank_wait_fraction{rank}``                        gauge      last slow-rank window's wait share (slow.py)
  ``group_collective_wait_seconds{group,of}``          gauge      a group's least member wait per step (slow.py)
  ``faults_total{kind}``                              counter    RS_UCE, RS_UNKNOWN, ... (reports), DEAD, HUNG
  ``incidents_total{strategy}``                       counter    decisions, by the strategy chosen
  ``recoveries_total{strategy}``                      counter    recoveries that got every rank training again
  ``recovery_seconds_sum{strategy}`` / ``_count``     summary    fault report -> every rank training again
  ``recovery_phase_seconds_sum{strategy,phase}``      summary    decide, clean, rebuild, repair, rollback, ...
  ``steps_lost_total``                                counter    completed steps rolled back (dump, restart)
  ``acp_entries{state}``, ``acp_pool_free_bytes``,    gauge      the checkpoint store of the controller's
  ``acp_unserviceable``                                          process, when it uses one
  ==================================================  =========  ==========================================

* ``GET /status`` -- JSON: the controller's state, its strategies, every rank (alive, faulty, step,
  optimizer-state status, seconds since its last frame, host, pid, p99 step time) and the last incidents
  with their phase times, the hang bound in force (``hang_bound_s``, ``hang_bound_from_job``), the slow-rank scores (``slow``). Authenticated: header ``X-Mindio-Auth: <unix time>:<hex HMAC-SHA256(job key, "<time>:<path>")>``
  (the job key is the one that signs control frames, from ``MINDIO_SECRET``); a time more than 60 s
  off is refused. :func:`mindio._status_auth.query` does this for ``mindio status``.

The controller-side hook is one object: :class:`Observer` reads the controller's rank table on request
and counts incidents from mindio's event stream (``_logging.add_listener``), whether or not
``MINDIO_EVENT_LOG`` is set.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ... import _logging
from ..._status_auth import AUTH_HEADER, verify

__all__ = ["Observer", "serve"]

_log = logging.getLogger("mindio.ttp.status")
DONE_KINDS = ("retry_done", "recover_done", "downgrade_done", "upgrade_done")


def _label(value) -> str:
    """A Prometheus label value, escaped (a group key comes from a rank's beat: authentic, not sane)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Observer:
    """Counts a controller's incidents from mindio's events and reads its rank table on request."""

    def __init__(self, controller):
        self.ctl = controller
        self._lock = threading.Lock()
        self.faults: collections.Counter = collections.Counter()
        self.incidents: collections.Counter = collections.Counter()
        self.recoveries: collections.Counter = collections.Counter()
        self.recovery_s: dict = collections.defaultdict(float)
        self.phase_s: dict = collections.defaultdict(float)
        self.phase_n: collections.Counter = collections.Counter()
        self.steps_lost = 0
        self.last: collections.deque = collections.deque(maxlen=8)  # the last incidents, newest last
        _logging.add_listener(self.on_event)

    def close(self) -> None:
        _logging.remove_listener(self.on_event)

    def on_event(self, record: dict) -> None:
        kind = record["kind"]
        with self._lock:
            if kind == "report_received" and record.get("state") not in ("RS_NORMAL", None):
                self.faults[record["state"]] += 1
            elif kind in ("rank_dead", "rank_hung"):
                self.faults["DEAD" if kind == "rank_dead" else "HUNG"] += 1
            elif kind == "decision":
                strategy = record.get("strategy", "?")
                self.incidents[strategy] += 1
                t = self.ctl.ranks  # the columns (ranks.py): no loop over 100k records inside the decision
                steps = t.col["step"][t.mask(registered=True)]
                lost = max(0, (int(steps.max()) if len(steps) else 0) - int(record.get("lock_step") or 0))
                self.last.append({"t": record["t"], "strategy": strategy, "lock_step": record.get("lock_step"),
                                  "faulty": record.get("faulty"), "decide_s": round(record.get("latency_s", 0), 6),
                                  "steps_lost": lost, "result": "in progress", "phases": {}})
            elif kind in DONE_KINDS:
                strategy = record.get("strategy") or kind[:-len("_done")]
                self.recoveries[strategy] += 1
                self.recovery_s[strategy] += record.get("total_s", 0.0)
                phases = {k[:-2]: v for k, v in record.items() if k.endswith("_s") and k != "total_s"}
                for phase, seconds in phases.items():
                    self.phase_s[(strategy, phase)] += seconds
                    self.phase_n[(strategy, phase)] += 1
                if self.last:
                    self.last[-1].update(result="training again", total_s=record.get("total_s"), phases=phases)
            elif kind == "transition" and record.get("dst") in ("EXIT", "FINAL") and self.last:
                if self.last[-1]["result"] == "in progress":
                    self.last[-1]["result"] = "job ending"
            elif kind == "action" and record.get("action") in ("save", "rename") and self.last:
                self.last[-1]["phases"][record["action"]] = record.get("duration_s")
                if record["action"] == "save" and self.last[-1]["strategy"] == "dump":
                    self.steps_lost += self.last[-1]["steps_lost"]

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        ctl, now = self.ctl, time.monotonic()
        ranks = []
        for r in sorted(list(ctl.ranks.values()), key=lambda r: r.rank):
            ranks.append({"rank": r.rank, "alive": r.alive, "registered": r.registered, "faulty": r.faulty,
                          "step": r.step, "data_status": ["UPDATED", "UPDATING", "COPYING"][r.data_status]
                          if 0 <= r.data_status <= 2 else r.data_status,
                          "last_beat_s": round(now - r.last_seen, 3) if r.last_seen else None,
                          "host": r.host, "pid": r.pid, "step_p99_s": r.step_p99 if r.step_p99 >= 0 else None})
        with self._lock:
            incidents = [dict(i) for i in self.last]
        return {"state": ctl.sm.state.value, "world_size": ctl.world_size, "address": ctl.address,
                "strategies": sorted(ctl.enabled), "ranks": ranks, "incidents": incidents,
                "hang_bound_s": ctl.liveness.hang.value, "hang_bound_from_job": not ctl.liveness.hang.fixed,
                "slow": ctl.liveness.slow.status()}

    def metrics(self) -> str:
        ctl, now = self.ctl, time.monotonic()
        t = ctl.ranks  # the rank table's columns (ranks.py)
        live = t.mask(alive=True, registered=True)
        steps, seen = t.col["step"][live], t.col["last_seen"][live]
        out: list[str] = []

        def metric(name, kind, help_text, samples):
            """samples: (labels, value), or (suffix, labels, value) for a summary's _sum / _count."""
            out.append(f"# HELP mindio_{name} {help_text}")
            out.append(f"# TYPE mindio_{name} {kind}")
            for sample in samples:
                suffix, labels, value = sample if len(sample) == 3 else ("", *sample)
                text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                out.append(f"mindio_{name}{suffix}{{{text}}} {value}" if text else f"mindio_{name}{suffix} {value}")

        metric("world_size", "gauge", "Ranks of the job.", [({}, ctl.world_size)])
        metric("ranks_registered", "gauge", "Ranks registered with the controller.",
               [({}, t.count(registered=True))])
        metric("ranks_alive", "gauge", "Registered ranks the controller hears from.", [({}, int(live.sum()))])
        metric("controller_state", "gauge", "1 for the controller's current state.",
               [({"state": ctl.sm.state.value}, 1)])
        metric("step_max", "gauge", "Highest completed step of a live rank.",
               [({}, int(steps.max()) if len(steps) else 0)])
        metric("step_min", "gauge", "Lowest completed step of a live rank.",
               [({}, int(steps.min()) if len(steps) else 0)])
        lags = (now - seen[seen > 0]).tolist()
        metric("heartbeat_lag_max_seconds", "gauge", "Seconds since the oldest live rank's last frame.",
               [({}, round(max(lags, default=0.0), 3))])
        metric("hang_bound_seconds", "gauge", "Seconds of no progress after which a rank the job waits for is hung "
               "(MINDIO_HANG_TIMEOUT, or derived from the job's step times; 0: off).",
               [({}, round(ctl.liveness.hang.value, 3))])
        waits = [({"rank": str(r)}, s["wait"]) for r, s in sorted(ctl.liveness.slow.scores.items())]
        metric("rank_wait_fraction", "gauge", "Share of a rank's last scoring window's wall time its main thread "
               "waited (its wait clock: on-time ticks with no CPU used); the straggler waits least (controller/slow.py).", waits)
        groups = ctl.liveness.slow.status()["groups"]  # the 16 waiting most above their floor
        metric("group_collective_wait_seconds", "gauge", "Per step of the last scoring window: the least wait of a "
               "process group's members in its collectives (its floor: its usual wait, the median of its recent "
               "windows); all of them high: its communication is slow (controller/slow.py).",
               [({"group": g, "of": kind}, v[key]) for g, v in groups.items()
                for kind, key in (("window", "wait_s"), ("floor", "floor_wait_s"))])
        with self._lock:
            metric("faults_total", "counter", "Faults seen, by kind (report state, DEAD, HUNG).",
                   [({"kind": k}, v) for k, v in sorted(self.faults.items())])
            metric("incidents_total", "counter", "Incidents decided, by strategy.",
                   [({"strategy": k}, v) for k, v in sorted(self.incidents.items())])
            metric("recoveries_total", "counter", "Recoveries after which every rank trained again.",
                   [({"strategy": k}, v) for k, v in sorted(self.recoveries.items())])
            metric("recovery_seconds", "summary", "Fault report to every rank training again.",
                   [("_sum", {"strategy": k}, round(v, 6)) for k, v in sorted(self.recovery_s.items())]
                   + [("_count", {"strategy": k}, self.recoveries[k]) for k in sorted(self.recovery_s)])
            metric("recovery_phase_seconds", "summary", "Time of each recovery phase.",
                   [("_sum", {"strategy": s, "phase": p}, round(v, 6)) for (s, p), v in sorted(self.phase_s.items())]
                   + [("_count", {"strategy": s, "phase": p}, n) for (s, p), n in sorted(self.phase_n.items())])
            metric("steps_lost_total", "counter", "Completed steps rolled back by dumps.", [({}, self.steps_lost)])
        store = _store_stat()
        if store is not None:
            metric("acp_entries", "gauge", "Checkpoint store entries, by state.",
                   [({"state": k}, v) for k, v in sorted(store.get("entries", {}).items())])
            metric("acp_pool_free_bytes", "gauge", "Free bytes of the store's memory pool.", [({}, store.get("free", 0))])
            metric("acp_unserviceable", "gauge", "1 when the store gave up persisting.",
                   [({}, int(store.get("state") != "ok"))])
        return "\n".join(out) + "\n"


def _store_stat() -> dict | None:
    """The checkpoint store's counters if this process is already connected to one (never starts one)."""
    from ...acp import api

    client = getattr(api, "_client", None)
    if client is None or not client.alive():
        return None
    try:
        return api.server_stat()
    except Exception:  # the daemon went away: no store metrics this time
        return None


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/metrics":
            self._reply(200, self.server.observer.metrics(), "text/plain; version=0.0.4")
        elif self.path == "/status":
            if not verify(self.server.key, self.path, self.headers.get(AUTH_HEADER)):
                self._reply(403, "refused: sign the request with the job secret (mindio status does)\n",
                            "text/plain")
                return
            self._reply(200, json.dumps(self.server.observer.status()), "application/json")
        else:
            self._reply(404, "mindio: GET /metrics or /status\n", "text/plain")

    def _reply(self, code: int, body: str, ctype: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args) -> None:  # requests are not worth a log line each
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, observer: Observer, key: bytes):
        super().__init__(addr, _Handler)
        self.observer, self.key = observer, key


def serve(controller, host: str, port: int) -> _Server:
    """Start the status / metrics server of ``controller`` on ``host:port`` (a daemon thread)."""
    server = _Server((host, port), Observer(controller), controller.key)
    server.timeout = 1.0
    threading.Thread(target=server.serve_forever, name="mindio-status", daemon=True).start()
    _log.info("status and metrics on http://%s:%d (/status, /metrics)", host, server.server_address[1])
    return server

"""The controller: watches every rank and drives recovery through the state table (states.py).

Two threads. The *I/O thread* owns the ROUTER socket: it registers processors, answers heartbeats,
records reports, marks a rank dead after ``misses * interval`` s of silence, finds hung ranks (and
orders them SIGKILLed), and hands action replies to the *driver thread*, which runs one incident at a
time with one action in flight (actions.ActionEngine: sequence number, resend every 2 heartbeat
intervals to ranks that have not answered, deadline TTP_NORMAL_ACTION_TIME_LIMIT; processors replay
cached replies for a repeated sn).

An incident (the dump flow of this issue; retry/recover/elastic belong to later issues):

1. a REPORT, a dead rank, a hung rank, or the cluster brain opens it: NORMAL -FAULT-> ABNORMAL;
2. ``stop`` to every live rank: each holds its fence and answers once its main thread is quiet
   (parked in the decorator or blocked before its next optimizer update); a rank that dies meanwhile
   is dropped from the wait by the liveness sweep -- so every rank is accounted for;
3. lock step = max step over healthy ranks; policy picks the feasible strategies (and the cluster
   brain, if registered, chooses among them within MINDIO_WAIT_MINDX_TIME);
4. dump: ``save(step, save_info)`` on one usable rank per optimizer shard, then ``rename(step)`` on one
   of them -- only after every save succeeded, so the checkpoint becomes "latest" only when complete;
5. ``exit(code)`` to every live rank: EXIT_CODE_DUMPED after a complete dump, EXIT_CODE_FAULT otherwise.

Backups: a backup controller binds its own socket, announces itself to the primary (which advertises
it to processors in every ack) and stays passive until the primary is silent *and* more than half of
the ranks registered with it; then it drives the job.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import zmq

from .. import _knobs, _logging
from . import policy
from . import protocol as P
from ._enums import EXIT_CODE_DUMPED, EXIT_CODE_FAULT, ReportState, ResultCode
from .states import Result, State, StateMachine
from .actions import ActionEngine
from .transport import Channel, Link, Waker

__all__ = ["Controller"]

_log = logging.getLogger(__name__)
_OPEN_STATES = (State.INIT, State.NORMAL, State.PAUSE, State.DOWNGRADE)


@dataclass
class _Rank:
    rank: int
    ident: bytes
    pid: int = 0
    host: str = ""
    last_seen: float = 0.0
    step: int = 0
    data_status: int = 0
    in_collective: bool = False
    progress_age: float = -1.0
    replica: list = field(default_factory=list)
    dp_group: list = field(default_factory=list)
    alive: bool = True
    faulty: bool = False
    registered: bool = True


class Controller:
    def __init__(self, rank: int, world_size: int, enabled, key: bytes, backup: bool = False,
                 curve: dict | None = None, interval: float | None = None, misses: int | None = None,
                 hang_timeout: float | None = None):
        self.rank, self.world_size, self.key, self.curve = rank, world_size, key, curve or {}
        self.enabled = set(enabled)
        self.interval = interval or _knobs.get("MINDIO_HEARTBEAT_INTERVAL")
        self.misses = misses or _knobs.get("MINDIO_HEARTBEAT_MISSES")
        self.hang_timeout = _knobs.get("MINDIO_HANG_TIMEOUT") if hang_timeout is None else hang_timeout
        self.action_limit = _knobs.get("TTP_NORMAL_ACTION_TIME_LIMIT")
        self.sm = StateMachine()
        self.backup, self.active = backup, not backup
        self.backups: list[str] = []
        self.ranks: dict[int, _Rank] = {}
        self.drops = P.DropCounter()
        self.mindx: dict = {}
        self.address = ""
        self.final = threading.Event()
        self.exit_code: int | None = None
        self.last_decision: dict = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()
        self._stop = threading.Event()
        self._incident: dict | None = None
        self._incident_evt = threading.Event()
        self._strategy_evt = threading.Event()
        self._chosen: str | None = None
        self._primary_link: Link | None = None
        self._threads: list[threading.Thread] = []
        self._ack_cache: dict[int, bytes] = {}
        self._registered = 0
        self._drained_at = time.monotonic()
        self._lagging = False
        self.actions = ActionEngine(self._cond, self._send_many, lambda r: self.ranks[r].alive, self.interval)
        self._call = self.actions.call
        # live ranks, least recently heard first: a heartbeat moves its rank to the end, so the sweep
        # looks only at the front (O(expired) per sweep instead of O(world))
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._ack_version: tuple = ()

    # ------------------------------------------------------------------ lifecycle
    def start(self, bind_ip: str, port: int, primary: str | None = None) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * P.MAX_FRAME)  # zmq drops the connection of a flooding peer
        sock.setsockopt(zmq.BACKLOG, 4096)  # thousands of ranks connect at once; a short accept queue drops SYNs
        for opt, val in self.curve.items():
            sock.setsockopt(opt, val)
        sock.bind(f"tcp://{bind_ip}:{port}")
        self.address = f"tcp://{bind_ip}:{port}"
        self._chan = Channel(sock, self.key, self.drops)
        if self.backup:
            if not primary:
                raise ValueError("a backup controller needs the primary's address")
            hello = lambda: P.Register(world_size=self.world_size, pid=0, host="", role="backup", addr=self.address)
            beat = lambda: P.Heartbeat(step=0, data_status=0)
            self._primary_link = Link(-1000 - max(self.rank, 0), self.key, [primary], hello, beat,
                                      lambda env: None, curve=None, interval=self.interval, misses=self.misses,
                                      follow_backups=False)
            self._primary_link.start()
        for target, name in ((self._io_loop, "io"), (self._driver_loop, "driver")):
            t = threading.Thread(target=target, name=f"mindio-ctl-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        _log.info("controller %s listening on %s (world %d, strategies %s)",
                  "backup" if self.backup else "primary", self.address, self.world_size, sorted(self.enabled))

    def destroy(self) -> None:
        self._stop.set()
        self._incident_evt.set()
        self._waker.wake()
        if self._primary_link is not None:
            self._primary_link.stop()
        for t in self._threads:
            t.join(timeout=2)

    # ------------------------------------------------------------------ I/O thread
    def _send(self, rank: int, body, mtype=P.MsgType.ACTION, sn: int = 0) -> None:
        """(any thread) Queue a message for ``rank``; the envelope's rank names the rank it concerns
        (the recipient here), so a relaying agent can deliver it."""
        r = self.ranks.get(rank)
        ident = r.ident if r is not None else str(rank).encode()
        self._out.put((ident, P.Envelope(mtype, body, rank=rank, sn=sn)))
        self._waker.wake()

    def _send_many(self, ranks, body, sn: int) -> None:
        """(any thread) Queue the same ACTION for many ranks with a single wake-up of the I/O thread."""
        get = self.ranks.get
        for rank in ranks:
            r = get(rank)
            self._out.put((r.ident if r is not None else str(rank).encode(), P.Envelope(P.MsgType.ACTION, body,
                                                                                        rank=rank, sn=sn)))
        self._waker.wake()

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._chan.sock, zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
        period = min(0.1, self.interval / 4)
        next_sweep = next_hang = time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(max(0.0, next_sweep - time.monotonic()) * 1000))
            if self._waker.rfd in events:
                self._waker.drain()
            while True:
                try:
                    ident, env = self._out.get_nowait()
                except queue.Empty:
                    break
                self._chan.send(env, ident)
            if self._chan.sock in events:
                for _ in range(100000):
                    try:
                        got = self._chan.recv()
                    except zmq.Again:
                        self._drained_at = time.monotonic()
                        break
                    if got is not None:
                        self._on_frame(*got)
            else:
                self._drained_at = time.monotonic()
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + period
                self._sweep(now, check_hang=now >= next_hang)
                if now >= next_hang:
                    next_hang = now + self.interval
        self._chan.sock.close(0)

    def _on_frame(self, ident: bytes, env: P.Envelope) -> None:
        body, now = env.body, time.monotonic()
        if env.type is P.MsgType.HEARTBEAT:
            r = self.ranks.get(env.rank)
            if r is not None and r.registered:
                r.last_seen, r.step, r.data_status = now, body.step, body.data_status
                if r.alive:
                    self._seen[env.rank] = None
                    self._seen.move_to_end(env.rank)
                r.in_collective, r.progress_age = body.in_collective, body.progress_age
            state = "UNKNOWN" if (r is None or not r.registered) and env.rank >= 0 else self.sm.state.value
            self._chan.send_raw(self._ack(env.rank, state), ident)
        elif env.type is P.MsgType.REGISTER:
            self._on_register(ident, env.rank, body, now)
        elif env.type is P.MsgType.REPORT and env.rank in self.ranks:
            state = ReportState(body.state) if body.state in ReportState._value2member_map_ else ReportState.RS_UNKNOWN
            _logging.event("report_received", from_rank=env.rank, state=state.name, step=body.step)
            with self._lock:
                r = self.ranks[env.rank]
                r.last_seen, r.step = now, body.step
                if r.alive:
                    self._seen[env.rank] = None
                    self._seen.move_to_end(env.rank)
                if policy.is_primary(state):
                    r.faulty = True
            self._open_incident(env.rank, state)
        elif env.type is P.MsgType.INFO and env.rank in self.ranks:
            self.ranks[env.rank].replica, self.ranks[env.rank].dp_group = body.replica, body.dp_group
        elif env.type is P.MsgType.BYE and env.rank in self.ranks:
            _log.info("rank %d left (%s)", env.rank, body.reason)
            with self._cond:
                self.ranks[env.rank].alive = False
                self.ranks[env.rank].registered = False
                self._registered -= 1
                self._cond.notify_all()
        elif env.type is P.MsgType.REPLY:
            r = self.ranks.get(env.rank)
            if r is not None and r.alive and env.rank in self._seen:  # any frame proves life, not only a beat
                r.last_seen = now
                self._seen.move_to_end(env.rank)
            self.actions.on_reply(env.rank, env.sn, body)

    def _ack(self, rank: int, state: str) -> bytes:
        """The signed HEARTBEAT_ACK for ``rank``, cached: the hot path of a large job is one beat and one
        ack per rank per interval, and the ack only changes with the state or the backup list."""
        version = (state, tuple(self.backups))
        if self._ack_version != version:
            self._ack_cache.clear()
            self._ack_version = version
        frame = self._ack_cache.get(rank)
        if frame is None:
            frame = self._ack_cache[rank] = P.encode(
                P.Envelope(P.MsgType.HEARTBEAT_ACK, P.HeartbeatAck(state, list(self.backups)), rank=rank), self.key)
        return frame

    def _on_register(self, ident: bytes, rank: int, body: P.Register, now: float) -> None:
        if body.role == "backup":
            if body.addr and body.addr != self.address and body.addr not in self.backups and len(self.backups) < 2:
                self.backups.append(body.addr)
                _log.info("backup controller %s announced", body.addr)
        elif not 0 <= rank < self.world_size or body.world_size != self.world_size:
            _log.error("refused registration of rank %d with world size %d (job: %d)", rank, body.world_size,
                       self.world_size)
            return
        else:
            with self._lock:
                old = self.ranks.get(rank)
                r = _Rank(rank, ident, body.pid, body.host, now, body.step, body.data_status,
                          replica=body.replica, dp_group=body.dp_group)
                r.faulty = old is not None and old.faulty
                self.ranks[rank] = r
                self._seen[rank] = None
                self._seen.move_to_end(rank)
                if old is None or not old.registered:
                    self._registered += 1  # a counter, not a scan: 100k registrations stay O(n)
        self._chan.send(P.Envelope(P.MsgType.REGISTER_ACK, P.RegisterAck(gen=0, interval=self.interval,
                                                                         backups=list(self.backups)),
                                   rank=rank), ident)
        if self.active and self._registered == self.world_size and self.sm.state is State.INIT:
            self.sm.fire(Result.ALL_REGISTERED, ranks=self._registered)

    def _sweep(self, now: float, check_hang: bool) -> None:
        if not self.active:
            link = self._primary_link
            n = self._registered
            if link is not None and link.failovers and not link.registered.is_set() and 2 * n > self.world_size:
                self._take_over(now, n)
            return
        limit = self.misses * self.interval
        if now - self._drained_at > self.interval:
            # our own inbound queue is behind: the missing heartbeats may be sitting in it. Never blame
            # ranks for the controller's backlog; declare deaths once we have caught up.
            if not self._lagging:
                _log.warning("controller is %.1f s behind its inbound queue; liveness checks paused",
                             now - self._drained_at)
            self._lagging = True
            return
        self._lagging = False
        dead = []
        while self._seen:
            r = self.ranks[next(iter(self._seen))]
            if r.alive and now - r.last_seen <= limit:
                break
            self._seen.popitem(last=False)
            if r.alive:
                dead.append(r)
        if dead:  # one log line for a mass death (a lost node or switch), one event per rank
            _log.error("%d rank(s) missed %d heartbeats (%.2f s): declared dead: %s%s", len(dead), self.misses,
                       now - dead[0].last_seen, [r.rank for r in dead[:16]], " ..." if len(dead) > 16 else "")
            with self._cond:
                for r in dead:
                    r.alive, r.faulty = False, True
                self._cond.notify_all()
            for r in dead:
                _logging.event("rank_dead", dead_rank=r.rank, silent_s=round(now - r.last_seen, 3))
                self._open_incident(r.rank, None)
        if check_hang and self.hang_timeout > 0 and self.sm.state is State.NORMAL:
            views = [(r.rank, r.progress_age, r.in_collective, r.step) for r in self.ranks.values() if r.alive]
            for rank in policy.find_hung_ranks(views, self.hang_timeout):
                _log.error("rank %d hung (no progress for %.0f s outside a collective): ordering SIGKILL",
                           rank, self.hang_timeout)
                _logging.event("rank_hung", hung_rank=rank)
                self._send(rank, P.Action("kill", {"reason": "hung"}))
                with self._cond:
                    self.ranks[rank].alive = False
                    self.ranks[rank].faulty = True
                self._open_incident(rank, None)

    def _take_over(self, now: float, n: int) -> None:
        _log.warning("primary controller lost; backup %s takes over with %d/%d ranks", self.address, n, self.world_size)
        _logging.event("backup_takeover", address=self.address, ranks=n)
        with self._lock:
            for rank in range(self.world_size):  # ranks that never come are declared dead by the sweep
                if rank not in self.ranks:
                    self.ranks[rank] = _Rank(rank, str(rank).encode(), last_seen=now, registered=False)
                    self._seen[rank] = None
            self.active = True
        self.sm.fire(Result.ALL_REGISTERED, ranks=n, takeover=True)

    # ------------------------------------------------------------------ incidents
    def _open_incident(self, rank: int | None, state: ReportState | None, cause: str = "fault") -> None:
        if not self.active:
            return
        with self._lock:
            inc = self._incident
            if inc is None:
                if self.sm.state not in _OPEN_STATES:
                    return
                inc = self._incident = {"t0": time.monotonic(), "primary": {}, "cause": cause, "first": rank}
                self._incident_evt.set()
            if rank is not None and (state is None or policy.is_primary(state)):
                inc["primary"][rank] = state if state is not None else ReportState.RS_UNKNOWN

    def _error_rank_dict(self) -> dict:
        with self._lock:  # the I/O thread adds ranks to the incident while the driver reads it
            primary = dict((self._incident or {"primary": {}})["primary"])
        return {r: 0 if s in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED) else 1 for r, s in primary.items()}

    def _mindx_call(self, action: str, *args) -> None:
        func = self.mindx.get(action)
        if func is not None:
            try:
                func(*args)
            except Exception:
                _log.exception("cluster-brain callback %s failed", action)

    def _driver_loop(self) -> None:
        while not self._stop.is_set():
            self._incident_evt.wait()
            if self._stop.is_set():
                return
            try:
                self._run_incident()
            except Exception:
                _log.exception("incident handling failed; stopping the job without a dump")
                self._exit(EXIT_CODE_FAULT)
            return  # after an incident of this strategies the job ends (FINAL)

    def _run_incident(self) -> None:
        inc = self._incident
        graceful = inc["cause"] == "dump_request"
        self.sm.fire(Result.DUMP if graceful else Result.FAULT, first_rank=inc["first"], cause=inc["cause"])
        self._mindx_call("report_fault_ranks", self._error_rank_dict())
        with self._lock:
            live = [r.rank for r in self.ranks.values() if r.alive]
        # a rank answers "stop" when quiet, or after half the limit anyway: the held fence keeps its step
        # from moving, and a rank caught mid-update reports UPDATING and is simply not usable
        params = {"timeout": self.action_limit / 2, "stop_clean": bool(_knobs.get("TTP_STOP_CLEAN_BEFORE_DUMP"))}
        replies = self._call("stop", params, live, self.action_limit)
        with self._lock:
            for rank, rep in replies.items():
                if rep.ok:
                    self.ranks[rank].step = rep.detail.get("step", self.ranks[rank].step)
                    self.ranks[rank].data_status = rep.detail.get("data_status", 0)
            views = [policy.RankView(r.rank, r.alive and r.rank in replies, r.faulty, r.step, r.data_status,
                                     tuple(r.replica)) for r in self.ranks.values()]
        missing = sorted(set(range(self.world_size)) - set(self.ranks))
        views += [policy.RankView(r, alive=False, faulty=True) for r in missing]
        self._mindx_call("report_stop_complete", int(ResultCode.OK), "training stopped", self._error_rank_dict())
        healthy = [v.step for v in views if v.alive and not v.faulty] or [v.step for v in views if v.alive] or [0]
        lock = max(healthy)
        plan = policy.select_dump_ranks(views, lock)
        faulty = [v.rank for v in views if v.faulty]
        try:
            policy.select_repair_sources(views, lock, faulty)
            repairable = bool(faulty)
        except ValueError:
            repairable = False
        with self._lock:
            primary = dict(inc["primary"])
        incident = policy.Incident(states=primary, dead=frozenset(v.rank for v in views if not v.alive),
                                   repair_possible=repairable, dump_possible=plan.possible)
        feasible = policy.feasible_strategies(self.enabled | ({"dump"} if graceful else set()), incident)
        usable_now = [s for s in feasible if s in ("dump", "exit")]  # retry/recover/downgrade: later issues
        strategy = self._negotiate(usable_now)
        latency = time.monotonic() - inc["t0"]
        self.last_decision = {"strategy": strategy, "lock_step": lock, "save_info": plan.save_info,
                              "decided_at": time.time(),
                              "faulty": faulty, "missing_shards": [list(map(str, m)) for m in plan.missing],
                              "feasible": feasible, "latency_s": latency}
        _log.warning("incident decision after %.3f s: %s (lock step %d, faulty %s, feasible %s)",
                     latency, strategy, lock, faulty[:16], feasible)
        _logging.event("decision", **self.last_decision)
        if strategy == "dump":
            if not graceful:
                self.sm.fire(Result.DUMP, lock_step=lock)
            ok = self._dump(lock, plan)
            self.sm.fire(Result.OK if ok else Result.FAIL)
            self._mindx_call("report_result", int(ResultCode.OK if ok else ResultCode.EXIT_ONLY),
                             "dump done" if ok else "dump failed", self._error_rank_dict(), "dump")
            self._exit(EXIT_CODE_DUMPED if ok else EXIT_CODE_FAULT)
        else:
            self.sm.fire(Result.FAIL if self.sm.state is State.DUMP else Result.EXIT,
                         reason="no dump possible" if plan.missing else "exit chosen")
            self._exit(EXIT_CODE_FAULT)

    def _negotiate(self, strategies: list[str]) -> str:
        if "report_strategies" not in self.mindx:
            return strategies[0]
        self._chosen = None
        self._strategy_evt.clear()
        self._mindx_call("report_strategies", self._error_rank_dict(), list(strategies))
        if self._strategy_evt.wait(_knobs.get("MINDIO_WAIT_MINDX_TIME")) and self._chosen in strategies:
            return self._chosen
        _log.warning("cluster brain chose %r (allowed %s) or did not answer; using %s", self._chosen,
                     strategies, strategies[0])
        return strategies[0]

    def _dump(self, lock: int, plan: policy.DumpPlan) -> bool:
        _log.warning("dump at step %d by %d ranks %s%s", lock, len(plan.ranks), list(plan.ranks[:16]),
                     " ..." if len(plan.ranks) > 16 else "")
        saved = self._call("save", {"step": lock, "save_info": plan.save_info}, plan.ranks, self.action_limit)
        bad = [r for r in plan.ranks if r not in saved or not saved[r].ok]
        if bad:
            _log.error("dump failed on %d ranks %s: %s", len(bad), bad[:16],
                       {r: saved[r].detail for r in bad[:16] if r in saved})
            return False
        renamed = self._call("rename", {"step": lock}, [plan.ranks[0]], self.action_limit)
        return plan.ranks[0] in renamed and renamed[plan.ranks[0]].ok

    def _exit(self, code: int) -> None:
        if self.sm.state is not State.EXIT:
            self.sm.fire(Result.EXIT if self.sm.can(Result.EXIT) else Result.SHUTDOWN, code=code)
        self.exit_code = code
        with self._lock:
            live = [r.rank for r in self.ranks.values() if r.alive]
        self._call("exit", {"code": code}, live, 10.0)
        if self.sm.state is State.EXIT:
            self.sm.fire(Result.OK)
        self.final.set()

    # ------------------------------------------------------------------ cluster brain
    def notify_dump(self) -> int:
        if self.sm.state is not State.NORMAL:
            return 1
        self._open_incident(None, None, cause="dump_request")
        return 0

    def notify_stop_train(self, fault_ranks: dict) -> int:
        for rank, kind in fault_ranks.items():
            if int(rank) in self.ranks:
                self.ranks[int(rank)].faulty = True
            self._open_incident(int(rank), ReportState.RS_UCE if int(kind) == 0 else ReportState.RS_UNKNOWN,
                                cause="cluster_brain")
        return 0

    def change_strategy(self, strategy: str) -> int:
        self._chosen = strategy
        self._strategy_evt.set()
        return 0

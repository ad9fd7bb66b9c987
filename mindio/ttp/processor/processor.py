"""The per-rank agent inside every training process.

Threads: the training *main thread* (calls the tft_* status functions and, in the decorator, parks);
the *link* thread (transport.Link: heartbeats, controller messages); one short-lived *action* thread
per controller action, so callbacks never run on the main thread and a 30-minute save never blocks
heartbeats.

Status: ``tft_start_updating_os`` -> UPDATING, ``tft_start_copy_os`` -> COPYING, ``tft_end_updating_os(s)``
-> (s, UPDATED). Heartbeats carry (step, status, is the main thread inside torch.distributed, seconds
since the last step progress, the sequence number of the last collective each process group entered
(collectives.py), the p99 of the recent step times); the controller uses them to find hung ranks and
the one that never entered the collective its peers wait in (controller/hangs.py).

Actions (ACTION name -> what this rank does; every reply is cached by sn, a repeated sn replays it):

* ``stop``   hold the fence (no new optimizer update starts), wait until the main thread is quiet
             (parked in the decorator or blocked at the fence), or ``timeout``, or ``look`` s inside a
             collective; reply {step, data_status, main, in_collective, missing handlers}; with
             ``stop_clean`` (TTP_STOP_CLEAN_BEFORE_DUMP) a fenced rank runs stop+clean too.
* ``teardown``, ``wait_quiet``, ``advance``: the rest of the stop round (stopround.StopRound): a
             fenced rank tears its groups down; wait for a running one; a rank held before an update
             every other holder of its shards made finishes it.
* ``save``   run the save-ckpt callback ``func(step, save_info, args, ctx)``.
* ``rename`` run the rename callback ``func(step, args, ctx)``; for a provisional dump only one that
             can complete it elsewhere (:meth:`Processor._do_rename`).
* ``exit``   hand EXIT(code) to the main thread (a fenced main thread gets ``RuntimeError("FORCE STOP")``).
* ``kill``   SIGKILL this process: the controller found it hung; a hang becomes a process death.
* ``clean``, ``rebuild``, ``repair``, ``rollback``, ``retry``: the retry strategy (inplace.py).
* ``pause_query``, ``pause_at``, ``pause_resume``: graceful pause at one step (controller side: pause.py).
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from ... import _knobs, _logging
from ...errors import ConfigError, NoController, describe
from ..wire import protocol as P
from ..controller.pidprobe import host_token
from .._enums import ActionName, EXIT_CODE_FAULT, Action, MainState, OsStatus, ReportState
from .._runtime import state as _rt
from .. import shutdown
from . import collectives, device, elastic_rank, inplace, preempt, reboot
from .rank_state import RankState
from .reboot import adopt as _adopt_reboot
from .waitclock import WaitClock
from ..wire.transport import Link

__all__ = ["Processor", "CALLBACK_NAMES", "IN_PLACE_CALLBACKS"]

_log = logging.getLogger("mindio.ttp.processor")
CALLBACK_NAMES = ("save_ckpt", "rename", "exit", "stop", "clean", "rebuild_group", "repair", "rollback",
                  "stream_sync", "zit_downgrade_rebuild", "zit_upgrade_rebuild", "zit_upgrade_repair",
                  "zit_upgrade_rollback", "decrypt")
IN_PLACE_CALLBACKS = ("repair", "rollback")  # what retry and recover call on a rank besides mindio's defaults


def _in_collective(frame) -> bool:
    while frame is not None:
        if "torch/distributed" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Processor:
    """One rank's agent (module docstring). It holds its parts: the link to the controller
    (transport.Link), the job's first world for rebuilds (inplace.World), and the explicit table of the
    actions it runs (``ACTIONS``: this module's handlers, inplace.py's, reboot.py's, elastic_rank.py's)."""

    def __init__(self, rank: int, world_size: int, enable_uce: bool = True, enable_arf: bool = False,
                 enable_zit: bool = False, curve: dict | None = None):
        if not 0 <= rank < world_size <= 100000:
            raise ConfigError(f"processor rank {rank} / world_size {world_size}: need 0 <= rank < world_size <= 100000")
        self.rank, self.world_size = rank, world_size
        self.features = {"uce": enable_uce, "arf": enable_arf, "zit": enable_zit}
        self.curve = curve
        self.callbacks: dict[str, tuple[Callable, Any]] = {}
        self.step_args = None
        self.replica: list = []
        self.dp_group: list = []
        self.step, self.data_status, self.backup_step = 0, OsStatus.UPDATED, -1
        self.update_window: list = [None, None]
        self.repair_step = 0
        self.repair_type = "unknown"
        # a dump the controller orders as provisional (a backup that cannot rule out a partition,
        # mindio/launch/backup.py): the subdirectory, of the job's checkpoint directory, it goes to; "" else
        self.dump_provisional = ""
        self._cond = threading.Condition()
        self._hold = False
        self._allow: int | None = None  # while held: an update up to this step may still start (advance)
        self._limit: int | None = None
        self._next: tuple[Action, int] | None = None
        self._main = MainState.RUNNING
        self._main_ident = threading.main_thread().ident
        self._progress_t: float | None = None
        self.activity = collectives.MainActivity()  # is a stalled main thread working? (controller/hangs.py)
        # the step anatomy for slow ranks (controller/slow.py): a wait clock only while slow ranks are scored
        self._slow_window = _knobs.get("MINDIO_SLOW_WINDOW")
        waits = WaitClock(_knobs.get("MINDIO_SLOW_HZ")).start() if self._slow_window > 0 else None
        self.step_times = collectives.StepTimes(waits=waits)  # and for the hang bound (controller/hangs.py)
        self._hang_min_steps = _knobs.get("MINDIO_HANG_MIN_STEPS")
        self._replies: collections.OrderedDict = collections.OrderedDict()
        self._busy: set[int] = set()
        self.link: Link | None = None
        self.last_report: P.Report | None = None
        self.first_step_pending = True  # set again when training resumes after a recovery (decorator)
        self.standby = False  # an elastic standby process until the upgrade repaired it (standby.py)
        self.gen = 0  # generation of this rank's default group (a rebuild or a replacement's start sets it)
        self.rebuild_same_layout = False  # the last rebuild kept the ranks and the layout (inplace.rebuild)
        self.world = inplace.World()  # the job's store, backend, timeout: what a rebuild needs
        self._force = False  # clean asked a fenced main thread to leave with FORCE STOP
        self.members: list | None = None  # the job ranks of the current torch world (None: all; elastic_rank.py)
        self.state = RankState(self)  # what the handlers of inplace, reboot, elastic_rank see (rank_state.py)
        self._exit_watched = False  # the exit order's watch started (_watch_exit)
        self._left = False  # destroy() ran

    # ---------------------------------------------------------------- lifecycle
    def start(self, addr: str, key: bytes) -> None:
        self.link = Link(self.rank, key, [addr], self._hello, self._beat, self._on_message, curve=self.curve,
                         on_registered=self._on_registered)
        self.world.remember()
        _adopt_reboot(self)  # a replacement process (reboot.py) registers in its new generation
        self.link.start()
        budget = _knobs.get("TTP_RETRY_TIMES") * max(1.0, 2 * self.link.interval)
        if not self.link.registered.wait(budget):
            self.link.stop()
            raise NoController(f"rank {self.rank}: no controller answered at {addr} within {budget:.0f} s "
                               "(TTP_RETRY_TIMES x 2 heartbeat intervals, MINDIO_HEARTBEAT_INTERVAL): is "
                               "tft_start_controller running there, with the same MINDIO_SECRET?")
        _log.info("processor registered with controller at %s", self.link.address)

    def destroy(self, reason: str = "") -> None:
        """Leave: BYE tells the controller this rank stopped on purpose (not a fault), unless exiting
        after an incident (``reason`` empty), where the controller already knows."""
        with self._cond:
            self._left = True  # nothing of this processor acts any more (_watch_exit)
            self._cond.notify_all()
        if self.step_times.waits is not None:
            self.step_times.waits.close(1.0)  # the wait clock's thread (controller/slow.py): one tick at most
        if self.link is not None:
            if reason:
                self.link.send(P.Envelope(P.MsgType.BYE, P.Bye(reason)))
            self.link.stop()  # flushes what is queued (BYE, the last replies) before closing
            self.link.join(timeout=2)
            self.link = None

    def _hello(self) -> P.Register:
        return P.Register(world_size=self.world_size, pid=os.getpid(), host=socket.gethostname(),
                          step=self.step, data_status=int(self.data_status), replica=list(self.replica),
                          dp_group=list(self.dp_group), pidns=host_token(), features=dict(self.features))

    def _on_registered(self) -> None:
        """(link thread) After a (re)registration -- e.g. failover to a backup controller -- a rank that
        is parked re-sends its report, which the lost controller may never have acted on."""
        if self._main == MainState.PARKED and self.last_report is not None and self.link is not None:
            self.link.send(P.Envelope(P.MsgType.REPORT, self.last_report))

    def _main_in_collective(self) -> bool:
        """Is the training main thread inside torch.distributed right now?"""
        return _in_collective(sys._current_frames().get(self._main_ident))

    def _beat(self) -> P.Heartbeat:
        preempt.check(self.link)  # a preemption signal's request: logged here, bounded (preempt.py)
        return self._heartbeat()

    def _heartbeat(self) -> P.Heartbeat:
        age = -1.0 if self._progress_t is None else time.monotonic() - self._progress_t
        return P.Heartbeat(step=self.step, data_status=int(self.data_status),
                           in_collective=self._main_in_collective(), progress_age=age,
                           coll_seq=collectives.snapshot(), idle_age=self.activity.idle_age(), step_p99=self.step_times.p99(self._hang_min_steps),
                           step_sums=self.step_times.anatomy())

    def send_info(self) -> None:
        if self.link is not None:
            self.link.send(P.Envelope(P.MsgType.INFO, P.Info(replica=list(self.replica), dp_group=list(self.dp_group))))

    # ---------------------------------------------------------------- main-thread status calls
    def _fence(self, next_step: int) -> bool:
        """Block while the controller holds the fence or ``next_step`` is beyond the limit step; did it block?"""
        blocked = False
        with self._cond:
            while self._next is None and not self._force and (
                    (self._hold and (self._allow is None or next_step > self._allow))
                    or (self._limit is not None and next_step > self._limit)):
                self._main, blocked = MainState.FENCED, True
                self._cond.notify_all()
                self._cond.wait(0.5)
            self._main = MainState.RUNNING
            self._check_force_stop()
            if self._next is not None:
                raise RuntimeError("FORCE STOP: the controller stopped training on this rank")
        return blocked

    def _check_force_stop(self) -> None:
        """(main thread, under ``_cond``) Raise FORCE STOP when the clean action asked for it."""
        if self._force:
            self._force = False
            raise RuntimeError("FORCE STOP: the controller stopped training on this rank (clean: a retry, or the end of the job)")

    def start_updating_os(self, backup_step: int = -1) -> None:
        self._fence(self.step + 1)
        self.backup_step = backup_step
        self.data_status = OsStatus.UPDATING

    def start_copy_os(self) -> None:
        self.data_status = OsStatus.COPYING

    def end_updating_os(self, step: int) -> None:
        self.step, self.data_status = step, OsStatus.UPDATED
        self._progress_t = time.monotonic()
        _logging.set_context(step=step)
        if self.first_step_pending:  # a step spanning a recovery is no measure of the job's steps
            self.step_times.restart()
        self.step_times.done()
        if self._slow_window > 0 and self.step_times.sums[0] % self._slow_window == 0 and self.link is not None:
            # a slow-rank window closes at this step: its sums go now, not at the next beat (controller/slow.py)
            self.link.send(P.Envelope(P.MsgType.HEARTBEAT, self._heartbeat()))
        if self.first_step_pending:  # the first step of this process, or after a recovery (mindio timeline)
            self.first_step_pending = False
            _logging.event("step_done", step=step)

    def pause_train(self, cur_step: int) -> None:
        self._progress_t = time.monotonic()
        if self._fence(cur_step + 1):
            self.step_times.restart()  # the time paused is no step time

    def reset_limit_step(self) -> None:
        with self._cond:
            self._limit = None
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        """Has the controller stopped this rank (an incident is under way)?"""
        return self._hold or self._force

    # ---------------------------------------------------------------- decorator side
    def report(self, state: ReportState, message: str) -> None:
        self.last_report = P.Report(state=int(state), message=message[:4000], step=self.step)
        # RS_NORMAL: a secondary error (a peer's fault reaching this rank), expected: the controller names the
        # first one of an incident at WARNING (incident.py)
        _log.log(logging.INFO if state == ReportState.RS_NORMAL else logging.WARNING, "reporting %s: %s",
                 ReportState(state).name, message[:300])
        _logging.event("fault_seen", state=ReportState(state).name, message=message[:300], step=self.step)
        if self.link is not None:  # handed to zmq before the teardown takes the GIL (its gc pass)
            self.link.send(P.Envelope(P.MsgType.REPORT, self.last_report), wait=0.1)

    @property
    def connected(self) -> bool:
        """A live link, registered with a controller: what a request to the controller needs."""
        link = self.link
        return link is not None and link.is_alive() and link.registered.is_set()

    def ask_switch_out(self, ranks: list, why: str) -> bool:
        """Ask the controller to hot-switch ``ranks`` out, one after another (ranks found sub-healthy: a holder
        in two replica mismatches, mindio.megatron.verified; the controller recovers them as faulty when it
        cannot switch). Training goes on meanwhile. False without a registered link (no controller)."""
        if not self.connected:
            return False
        reason = ",".join(str(int(r)) for r in ranks) + " " + why[:300]
        self.link.send(P.Envelope(P.MsgType.REQUEST, P.Request("switch", reason=reason)), wait=0.1)
        return True

    def teardown(self, is_uce: bool) -> None:
        """Release this rank's collectives: device stop, the stop + clean callbacks (a framework drops
        its own references to its process groups there), then mindio destroys every group still
        registered -- all of them, the default group included, when the job registered no such
        callbacks -- one garbage collection, and the groups' last references are dropped in parallel
        (``device.release``) so gloo closes its sockets and peers blocked in a collective with this
        rank fail at once (ARCHITECTURE §3). A group the training code itself still refers to stays
        open until that reference goes; its peers then fail at the group's timeout, which the
        controller counts as secondary (policy.classify)."""
        ms = {}
        self.world.remember()  # a default group made after tft_start_processor: rebuild needs its store
        groups = device.all_groups()  # destroyed in parallel once the framework dropped its references
        backend = device.backend_for()  # picked while the default group exists (its backend)
        t0 = time.monotonic()
        try:  # nccl: communicator abort; hccl: stop_device; gloo: nothing (device.py)
            backend.stop()
        except Exception as exc:
            _log.error("device stop failed: %s", exc)
        ms["device_stop"] = round((time.monotonic() - t0) * 1000, 2)
        if threading.get_ident() == self._main_ident:  # the decorator's teardown: the step's backward may have raised
            device.flush_autograd()
        for name, call in (("stop", lambda f, c: f(self.step_args, c)),
                           ("clean", lambda f, c: f(is_uce, self.step_args, c))):
            if name in self.callbacks:
                func, ctx = self.callbacks[name]
                t0 = time.monotonic()
                try:
                    call(func, ctx)
                except Exception as exc:  # a failed teardown must not stop the report/park protocol
                    _log.error("%s callback failed: %s", name, exc)
                ms[name] = round((time.monotonic() - t0) * 1000, 2)
        left = device.destroy_groups()  # what the callbacks left (no callbacks: every group)
        if left:
            _log.info("teardown: destroyed %d process group(s) left after the stop/clean callbacks", left)
        device.release(groups, unreferenced_only=True)  # dropped by the callbacks: released now
        ms["gc"] = round(device.collect(), 2)  # the one collection of this teardown (device.py)
        device.release(groups)  # the groups the collection freed from reference cycles
        t0 = time.monotonic()
        try:  # nccl: synchronize + empty_cache; hccl: restart_device (the stop's counterpart)
            backend.free_device_memory()
        except Exception as exc:
            _log.error("%s: freeing the device after the teardown failed: %s", backend.name, exc)
        ms["device_free"] = round((time.monotonic() - t0) * 1000, 2)
        _logging.event("teardown", backend=backend.name, destroyed=left, **{f"{k}_ms": v for k, v in ms.items()})

    def wait_next_action(self) -> tuple[Action, int]:
        """Park the main thread until the controller says RETRY or EXIT; EXIT(fault) if the controller
        stays unreachable for MINDIO_CONTROLLER_LOST_EXIT s (a parked rank never waits forever)."""
        lost_since = None
        limit = _knobs.get("MINDIO_CONTROLLER_LOST_EXIT")
        with self._cond:
            self._main = MainState.PARKED
            self._cond.notify_all()
            while self._next is None:
                self._cond.wait(0.2)
                link_ok = self.link is not None and self.link.registered.is_set()
                lost_since = None if link_ok else (lost_since or time.monotonic())
                if lost_since is not None and time.monotonic() - lost_since > limit:
                    _log.error("parked for the controller's decision, but no controller reachable (last tried: "
                               "%s) for %.0f s (MINDIO_CONTROLLER_LOST_EXIT); exiting",
                               self.link.address if self.link is not None else "none", limit)
                    self._next = (Action.EXIT, EXIT_CODE_FAULT)
            action, self._next = self._next, None
            self._main = MainState.RUNNING
            return action

    def decision_pending(self) -> bool:
        """Has the controller's RETRY/EXIT arrived without the main thread taking it yet?"""
        with self._cond:
            return self._next is not None

    # ---------------------------------------------------------------- controller actions (link thread)
    def _on_message(self, env: P.Envelope) -> None:
        if env.type is not P.MsgType.ACTION:
            return
        if env.sn in self._replies:
            self.link.send(P.Envelope(P.MsgType.REPLY, self._replies[env.sn], sn=env.sn))
            return
        if env.sn in self._busy:
            return
        if env.body.name == ActionName.KILL:
            _log.error("controller ordered SIGKILL: %s", env.body.params)  # hung, or running after the stop
            _logging.event("killed_as_hung", **env.body.params)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        if env.body.name == ActionName.EXIT:  # reply before the main thread can leave, then hand it EXIT
            self._replies[env.sn] = P.Reply(ok=True)
            self.link.send(P.Envelope(P.MsgType.REPLY, self._replies[env.sn], sn=env.sn))
            self._do_exit(**env.body.params)
            return
        self._busy.add(env.sn)
        threading.Thread(target=self._run_action, args=(env,), name=f"mindio-action-{env.sn}", daemon=True).start()

    def _run_action(self, env: P.Envelope) -> None:
        name, params = env.body.name, env.body.params
        t0 = time.monotonic()
        handler = self.ACTIONS.get(name)
        try:
            if handler is None:
                raise LookupError(f"unknown action {name!r}")
            # this module's handlers are its methods; the others get the rank's state (rank_state.py)
            target = self if name in self.OWN_ACTIONS else self.state
            reply = P.Reply(ok=True, detail=handler(target, **params) or {})
        except Exception as exc:
            _log.exception("action %s failed", name)
            reply = P.Reply(ok=False, code=1, detail={"error": describe(exc)[:2000]})
        _logging.event("action_done", action=name, sn=env.sn, ok=reply.ok, duration_s=round(time.monotonic() - t0, 6))
        self._replies[env.sn] = reply
        while len(self._replies) > 256:
            self._replies.popitem(last=False)
        self._busy.discard(env.sn)
        link = self.link
        if link is not None:
            link.send(P.Envelope(P.MsgType.REPLY, reply, sn=env.sn))

    def wait_parked(self, timeout: float, force: bool = False) -> MainState:
        """(action thread) RankState.wait_parked: wait up to ``timeout`` s for the main thread to park;
        ``force``: a main thread held at its fence gets FORCE STOP first."""
        end = time.monotonic() + timeout
        with self._cond:
            if force and self._main == MainState.FENCED:
                self._force = True
                self._cond.notify_all()
            while self._main != MainState.PARKED and time.monotonic() < end:
                self._cond.wait(0.01)
            return self._main

    def resume_parked(self) -> None:
        """(action thread) RankState.resume: the parked main thread re-enters train() (RETRY)."""
        with self._cond:
            if self._main != MainState.PARKED:
                raise RuntimeError(f"main thread is {self._main}, not parked: cannot re-enter train()")
            self._hold, self._allow, self._limit = False, None, None
            if self._progress_t is not None:  # training resumes: the time parked by the recovery is no hang
                self._progress_t = time.monotonic()
            self._next = (Action.RETRY, 0)
            self._cond.notify_all()

    def _callback(self, name: str):
        if name not in self.callbacks:
            raise RuntimeError(f"no {name} callback registered (tft_register_{name}_handler)")
        return self.callbacks[name]

    def _do_stop(self, timeout: float = 60.0, stop_clean: bool = False, look: float | None = None,
                 interrupt: bool = False) -> dict:
        """Hold the fence; reply once the main thread is quiet, or after ``timeout`` s, or -- with
        ``look`` -- as soon as it has been running that long and is inside a collective (blocked, most
        likely waiting for a rank the fence holds: stopround.StopRound). With ``interrupt`` (an incident's
        stop), a main thread computing outside its optimizer update is asked to leave its step now
        (:meth:`_interrupt`) rather than compute to its next collective, which a faulty peer fails."""
        with self._cond:
            self._hold = True
            computing = self._main == MainState.RUNNING and self.data_status == OsStatus.UPDATED
            self._cond.notify_all()
        if interrupt and computing:
            self._interrupt()
        main = self._wait_quiet(timeout, look)
        if stop_clean and main == MainState.FENCED:  # TTP_STOP_CLEAN_BEFORE_DUMP: fenced ranks tear down too
            self.teardown(is_uce=False)
        return self._stop_reply(main)

    def _interrupt(self) -> None:
        """Call the framework's interrupt hook (``callbacks["interrupt"]``, set by
        mindio.adapter.register: ``FrameworkAdapter.interrupt``), if any: the main thread then raises
        FORCE STOP at its next check point (Megatron: the next layer of its forward or backward) and
        parks. Without a hook the step runs on to its next fence or collective, as before."""
        hook = self.callbacks.get("interrupt")
        if hook is None:
            return
        func, ctx = hook
        try:
            func(self.step_args, ctx)
            _logging.event("interrupted", step=self.step)
        except Exception as exc:  # the stop goes on: the step then ends at its next collective
            _log.error("interrupt hook failed: %s", exc)

    def _do_wait_quiet(self, timeout: float = 60.0) -> dict:
        """(after ``stop``, to a rank that was still running) Reply once the main thread is quiet, or
        after ``timeout`` s."""
        return self._stop_reply(self._wait_quiet(timeout))

    def _do_teardown(self) -> dict:
        """(after ``stop``) A rank held at its fence releases its collectives (stop + clean callbacks,
        every group destroyed), its main thread staying at the fence: a peer that passed its own fence
        and waits for this rank in a collective fails at once (stopround.StopRound)."""
        if self._main == MainState.FENCED:
            self.teardown(is_uce=False)
        return self._stop_reply(self._main)

    def _do_unblock(self, timeout: float = 60.0, look: float = 1.0) -> dict:
        """(after ``stop``) A rank whose main thread still runs inside a collective -- waiting for a peer
        that vanished without a reset, or for one stuck behind it -- shuts its own collective
        connections down (unblock.py): the collective fails at once, the decorator parks the rank.
        Reply once it is quiet (its teardown may take seconds on a loaded host), or when it is still
        inside a collective ``look`` s later (not released: the controller goes on), at most after
        ``timeout`` s; a rank not in a collective is left as it is."""
        from . import unblock

        n, before = 0, self.last_report
        if self._main == MainState.RUNNING and self._main_in_collective():
            link = self.link
            n = unblock.shutdown_connections(unblock.protected_ports(link.addrs if link is not None else ()))
            _log.warning("unblock: main thread blocked in a collective during an incident; shut down %d "
                         "collective connection(s)", n)
            _logging.event("unblocked", connections=n)
        t0 = time.monotonic()
        with self._cond:  # released: the decorator reports (a new last_report), tears down and parks
            while self._main == MainState.RUNNING:
                now = time.monotonic()
                if now - t0 >= timeout or (now - t0 >= look and self.last_report is before
                                           and self._main_in_collective()):
                    break
                self._cond.wait(min(0.05, t0 + timeout - now))
            main = self._main
        reply = self._stop_reply(main)
        reply["shut"] = n
        return reply

    def _do_advance(self, step: int, timeout: float = 60.0) -> dict:
        """(after ``stop``) A rank held at its fence before its update of ``step`` finishes that update
        -- every peer that holds its shards did (policy.ranks_to_advance) -- and is held at its next
        fence, or parks when its next collective fails (its peers tore their groups down). Reply once
        it is quiet again, at most after ``timeout`` s."""
        t0 = time.monotonic()
        with self._cond:
            if self._main != MainState.FENCED or self.step != step - 1:
                return self._stop_reply(self._main)  # not held before that update (any more)
            self._allow = step
            self._cond.notify_all()
            while time.monotonic() - t0 < timeout and not (
                    self._main == MainState.PARKED or (self._main == MainState.FENCED and self.step >= step)):
                self._cond.wait(0.05)
            main = self._main
        _log.info("advanced to step %d at the controller's request (main thread %s)", self.step, main)
        return self._stop_reply(main)

    def _wait_quiet(self, timeout: float, look: float | None = None) -> str:
        """Wait until the main thread is parked or fenced, at most ``timeout`` s (see ``_do_stop`` for
        ``look``); returns where it is."""
        t0 = time.monotonic()
        with self._cond:
            while self._main == MainState.RUNNING:
                now = time.monotonic()
                if now - t0 >= timeout or (look is not None and now - t0 >= look and self._main_in_collective()):
                    break
                self._cond.wait(min(0.05, t0 + timeout - now))
            return self._main

    def _stop_reply(self, main: str) -> dict:
        """What the controller decides from: step, optimizer-state status, where the main thread is
        (and, running, whether inside a collective), and the recovery handlers this rank lacks."""
        reply = {"step": self.step, "data_status": int(self.data_status), "main": main}
        if main == MainState.RUNNING:  # where it runs: stopround.StopRound._kill_stuck blames ranks outside a collective
            reply["in_collective"] = self._main_in_collective()
        missing = [name for name in IN_PLACE_CALLBACKS if name not in self.callbacks]
        if missing:  # retry / recover need them on every rank (policy.Incident.in_place_possible)
            reply["missing"] = missing
        return reply

    def _do_save(self, step: int, save_info: list, provisional: str = "") -> dict:
        self.repair_type, self.repair_step = "dump", step
        self.dump_provisional = provisional
        func, ctx = self._callback("save_ckpt")
        func(step, save_info, self.step_args, ctx)
        return {}

    def _do_rename(self, step: int, provisional: str = "") -> dict:
        """Make the dump of ``step`` the latest. A provisional dump (``provisional``: the subdirectory
        it goes to) is not: a rename handler that can put it there (marked ``mindio_provisional``, as
        :func:`mindio.adapter.register` marks the Megatron adapter's) completes it there; any other is not
        run -- what the save handlers wrote stays as they left it, and the job's latest checkpoint too."""
        self.dump_provisional = provisional
        func, ctx = self._callback("rename")
        if provisional and not getattr(func, "mindio_provisional", False):
            _log.warning("dump of step %d is provisional (a backup controller that cannot tell node 0's loss from a "
                         "partition): the rename handler is not run, so it is not made the latest checkpoint",
                         step)
            return {"renamed": False}
        func(step, self.step_args, ctx)
        return {"renamed": True}

    def _do_exit(self, code: int) -> dict:
        """Hand EXIT(code) to the main thread: parked, it takes it at once; at its fence, it leaves with
        FORCE STOP and parks; running, at its next fence or park -- watched (:meth:`_watch_exit`)."""
        with self._cond:
            self._next = (Action.EXIT, code)
            self._cond.notify_all()
            watch, self._exit_watched = not self._exit_watched, True
        if watch:
            threading.Thread(target=self._watch_exit, args=(code,), name="mindio-exit-watch", daemon=True).start()
        return {}

    def _watch_exit(self, code: int) -> None:
        """(a thread of its own) A main thread that does not take the exit order within
        MINDIO_EXIT_ORDER_WAIT s -- still setting up outside train(), or blocked where no fence comes --
        would keep the job from ending: the process ends with the order's code, the log naming where its
        main thread was (a controller hosted here first finishes its order: MINDIO_CONTROLLER_EXIT_WAIT)."""
        wait = _knobs.get("MINDIO_EXIT_ORDER_WAIT")
        end = time.monotonic() + wait
        with self._cond:
            while self._next is not None and not self._left and time.monotonic() < end:
                self._cond.wait(min(1.0, max(0.01, end - time.monotonic())))
            if self._next is None or self._left:  # taken: the decorator's exit_process ends the process (bounded)
                return
        frame = sys._current_frames().get(self._main_ident)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "gone"
        _log.error("the controller ordered EXIT(%d) %.0f s ago, but this rank's main thread has not carried it out: "
                   "it reached no fence (tft_start_updating_os, tft_pause_train) and did not park in "
                   "tft_exception_handler (it runs at %s); ending the process with %d (MINDIO_EXIT_ORDER_WAIT)",
                   code, wait, where, code)
        _logging.event("exit_order_forced", code=code, wait_s=wait, where=where[:300])
        ctl = _rt.controller
        if ctl is not None:
            ctl.final.wait(_knobs.get("MINDIO_CONTROLLER_EXIT_WAIT"))
        shutdown.hard_exit(code)

    def _do_unhold(self) -> dict:
        """Release the fence a ``stop`` set, the main thread staying in its step (elastic.py: an upgrade
        whose stop caught the survivors on both sides of a fence lets them run on and stops again)."""
        with self._cond:
            self._hold, self._allow = False, None
            self._cond.notify_all()
        return {"step": self.step}

    # ---------------------------------------------------------------- graceful pause (controller: pause.py)
    def _do_pause_query(self) -> dict:
        """Cap the limit step at step + 1 at once (no rank can run past the pause target), answer it."""
        with self._cond:
            if self._limit is None or self._limit > self.step + 1:
                self._limit = self.step + 1
            self._cond.notify_all()
            return {"step": self.step, "limit": self._limit}

    def _do_pause_at(self, step: int, timeout: float) -> dict:
        """Train up to ``step``, wait until the main thread is parked at the fence there (inside
        tft_pause_train), then run the stream-sync callback."""
        with self._cond:
            self._limit = step
            self._cond.notify_all()
            end = time.monotonic() + timeout
            while not (self._main == MainState.FENCED and self.step == step):
                left = end - time.monotonic()
                if self._main == MainState.PARKED or self.step > step or left <= 0:
                    raise TimeoutError(f"rank {self.rank} did not pause at step {step} within {timeout:.0f} s "
                                       f"(step {self.step}, main thread {self._main})")
                self._cond.wait(min(0.05, left))
        if "stream_sync" in self.callbacks:
            func, _ctx = self.callbacks["stream_sync"]
            func()
        _logging.event("paused_at", step=step)
        return {"step": self.step}

    def _do_pause_resume(self) -> dict:
        with self._cond:
            self._limit = None
            self._progress_t = time.monotonic()  # the pause is no hang
            self._cond.notify_all()
        return {}

    def _do_ping(self) -> dict:
        return {"step": self.step}

    # The controller's actions this processor runs (protocol.py ACTION frames, by name): an explicit
    # table, {name: handler}; a handler takes the frame's params and returns the reply's detail.
    # ``kill`` is answered before any table (_on_message); ``exit`` there too, then by its handler.
    OWN_ACTIONS = {
        # this module: the stop round, checkpoints, pause, lifecycle (methods: they get the processor)
        ActionName.STOP: _do_stop, ActionName.WAIT_QUIET: _do_wait_quiet, ActionName.TEARDOWN: _do_teardown,
        ActionName.UNBLOCK: _do_unblock, ActionName.ADVANCE: _do_advance,
        ActionName.SAVE: _do_save, ActionName.RENAME: _do_rename, ActionName.EXIT: _do_exit,
        ActionName.UNHOLD: _do_unhold, ActionName.PING: _do_ping,
        ActionName.PAUSE_QUERY: _do_pause_query, ActionName.PAUSE_AT: _do_pause_at,
        ActionName.PAUSE_RESUME: _do_pause_resume,
    }
    ACTIONS = {
        **OWN_ACTIONS,
        # the others get the rank's state (RankState)
        # inplace.py: retry (and the recoveries' clean, rebuild, repair, rollback, retry)
        **inplace.ACTIONS,
        # reboot.py: a replacement process (prerepair)
        **reboot.ACTIONS,
        # elastic_rank.py: downgrade and upgrade (zit_rebuild, zit_repair, zit_rollback)
        **elastic_rank.ACTIONS,
    }

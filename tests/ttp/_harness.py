"""Launch the toy job (_toy_train.py) as real processes on loopback; always reap what we started.

Also the in-process control plane of the unit tests (test_control_plane, test_pause_unit,
test_negotiation_unit, test_strategy_plugin): a Controller and Processors in this process over real
loopback sockets (``start_plane`` / ``stop_plane``), a training-shaped ``Loop`` thread per processor,
and ``until``, the poll every wait of those tests goes through."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch

from mindio._ports import free_port  # outside the ephemeral range (mindio/_ports.py)
from mindio.launch import forkserver
from tests._exits import check_codes
from tests._faultplan import FaultPlan

TOY = os.path.join(os.path.dirname(__file__), "_toy_train.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def until(pred, timeout: float = 20.0) -> bool:
    """Poll ``pred`` every 10 ms until it is true (True) or ``timeout`` s passed (False). The deadline
    only bounds a hang: it is generous because a loaded 2-core CI machine can take seconds for what
    takes milliseconds here; the tests assert what happened, not how fast (bench/ measures speed)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def run_ranks(script: str, argvs: list, env: dict, timeout: float) -> tuple[list, list]:
    """Run ``script`` once per argument list of ``argvs`` (one process a rank, ``env``), each with its
    output captured; every process is reaped, killed past ``timeout`` s. ``(exit codes, outputs)``; fails
    if one died by a signal (tests/_exits.py)."""
    procs = [subprocess.Popen([sys.executable, script, *map(str, argv)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    check_codes(codes, context="\n".join(o[-3000:] for o in outs))
    return codes, outs


def start_plane(world: int, key: bytes, *, misses: int = 10, action_limit: float = 2.0, interval: float = 0.2,
                before_start=None):
    """A Controller (rank 0, ``enabled={"dump"}``, no hang detection) on a free loopback port and
    ``world`` Processors registered with it, all in this process; returns ``(controller, processors,
    port)`` once the controller is NORMAL. ``before_start(processors)`` runs before they connect (to
    install callbacks). Undo with :func:`stop_plane`."""
    from mindio.ttp.controller.controller import Controller
    from mindio.ttp.processor.processor import Processor
    from mindio.ttp.controller.states import State

    port = free_port()
    ctl = Controller(rank=0, world_size=world, enabled={"dump"}, key=key, interval=interval, misses=misses,
                     hang_timeout=0)
    ctl.action_limit = action_limit
    ctl.start("127.0.0.1", port)
    procs = [Processor(r, world) for r in range(world)]
    if before_start is not None:
        before_start(procs)
    for p in procs:
        p.start(f"tcp://127.0.0.1:{port}", key)
    if not until(lambda: ctl.sm.state is State.NORMAL):
        stop_plane(ctl, procs)
        raise AssertionError(f"the controller did not reach NORMAL: {ctl.sm.state}")
    return ctl, procs, port


class Loop(threading.Thread):
    """A rank's training loop on an in-process Processor (its "main thread"): fence, update, end of
    step, then tft_pause_train (``pause``). ``stall_at``: stops calling the fence at that step (a rank
    stuck in compute); ``fail_at``: raises once at that step and reports it (RS_UNKNOWN), as
    tft_exception_handler does. After any error it parks for the controller's decision (each one in
    ``decisions``, the last in ``exit``) and trains on after a RETRY; ``done`` ends it."""

    def __init__(self, proc, stall_at=None, fail_at=None, pause=True):
        super().__init__(daemon=True)
        self.proc, self.stall_at, self.fail_at, self.pause = proc, stall_at, fail_at, pause
        self.done, self.exit, self.decisions = threading.Event(), None, []

    def run(self):
        from mindio.ttp._enums import Action, ReportState

        p = self.proc
        while not self.done.is_set():
            try:
                p.start_updating_os(-1)
                p.end_updating_os(p.step + 1)
                if self.stall_at is not None and p.step >= self.stall_at:
                    self.done.wait(30)
                    return
                if p.step == self.fail_at:
                    self.fail_at = None
                    raise RuntimeError("injected fault")
                if self.pause:
                    p.pause_train(p.step)
            except RuntimeError as exc:  # FORCE STOP, or the injected fault: park like the decorator does
                if "FORCE STOP" not in str(exc):
                    p.report(ReportState.RS_UNKNOWN, str(exc))
                self.exit = p.wait_next_action()
                self.decisions.append(self.exit)
                if self.exit[0] is Action.EXIT:
                    return
            time.sleep(0.005)


def stop_plane(ctl, procs) -> None:
    """Destroy the processors, then the controller (the reverse of :func:`start_plane`)."""
    for p in procs:
        p.destroy()
    ctl.destroy()


class Job:
    """One launch of ``world`` ranks; ``wait`` returns the exit codes, ``kill`` reaps leftovers.

    ``plan``: the faults to inject (tests/_faultplan.py). ``wait`` fails if a rank died by a signal the
    test did not cause: a fault of the plan that kills a rank (kill, kill-update*, hang) causes SIGKILL
    on it; ``sent`` adds {rank: signal name} the test causes otherwise (its own ``os.kill``)."""

    def __init__(self, out: str, world: int = 4, args: list | None = None, env: dict | None = None,
                 ctl_port: int | None = None, sent: dict | None = None, plan: FaultPlan | None = None):
        os.makedirs(out, exist_ok=True)
        self.out, self.world = out, world
        plan = plan or FaultPlan()
        args = list(args or []) + plan.argv()
        self.sent = plan.sent(also=sent)
        self.ctl_port = ctl_port or free_port()
        store_port = free_port()
        e = dict(os.environ, PYTHONPATH=ROOT, TTP_LOG_STDOUT="1", TTP_LOG_LEVEL="INFO",
                 MINDIO_EVENT_LOG=os.path.join(out, "events.jsonl"), OMP_NUM_THREADS="1")
        e.update(env or {})
        self.logs = [open(os.path.join(out, f"rank{r}.log"), "w") for r in range(world)]
        argv = [["--rank", str(r), "--world", str(world), "--store-port", str(store_port),
                 "--ctl-port", str(self.ctl_port), "--out", out] + args for r in range(world)]
        # The ranks are forked by mindio-run's own fork server (mindio/launch/forkserver.py) where it can
        # fork: one interpreter imports torch and mindio.ttp for the whole job (each rank's process would
        # pay ~1.5 CPU-s), then each rank is a fork child running the toy as __main__ with its own argv,
        # the job's environment and its output to its log file, exactly as mindio-run starts workers.
        # Every rank gets the same environment, so nothing the imports read differs between the ranks.
        self.server = None
        if not forkserver.unusable(e):
            self.server = forkserver.ForkServer([TOY], e)
        self.procs = []
        for r in range(world):
            log = os.path.join(out, f"rank{r}.log")
            worker = self.server and self.server.take({"env": {}, "argv": argv[r], "stdout": log, "stderr": log})
            if worker is None:  # no fork server, or it cannot fork here: exec the rank
                worker = subprocess.Popen([sys.executable, TOY, *argv[r]], env=e, stdout=self.logs[r],
                                          stderr=subprocess.STDOUT)
            self.procs.append(worker)

    def wait(self, timeout: float) -> list:
        end = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not finish in {timeout} s; logs in {self.out}:\n" + self.tail())
        finally:
            for f in self.logs:
                f.close()
        server = self._close_server()
        codes = [p.returncode for p in self.procs]
        check_codes(codes, self.sent, context=self.tail())
        assert server in (None, 0), f"the ranks' fork server exited {server}\n" + self.tail()
        return codes

    def _close_server(self, wait_s: float = 60.0):
        """Its exit code (None: there was none): it exits once every rank ended (its interpreter's exit
        takes seconds of a loaded machine; killed after ``wait_s``)."""
        server, self.server = self.server, None
        if server is None:
            return None
        server.close(wait_s)
        return server.proc.returncode

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._close_server(5.0)

    def tail(self, n: int = 3000) -> str:
        text = ""
        for r in range(self.world):
            with open(os.path.join(self.out, f"rank{r}.log")) as f:
                text += f"--- rank {r}\n" + f.read()[-n:]
        return text

    def events(self) -> list:
        path = os.path.join(self.out, "events.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]


def final_state(out: str, world: int) -> list:
    return [torch.load(os.path.join(out, f"final_rank{r}.pt")) for r in range(world)]


def fault_free_state(fault_free_run, steps: int) -> list:
    """:func:`final_state` of the toy job run for ``steps`` steps without a fault or extra environment:
    one run per ``steps`` and session (tests/conftest.py's ``fault_free_run``), shared by the e2e tests
    that compare against it (test_dump_e2e, test_negotiation_e2e, test_pause_e2e)."""
    def run(directory) -> list:
        out = str(directory)
        job = Job(out, args=["--steps", str(steps)])
        assert job.wait(120) == [0, 0, 0, 0], job.tail()
        return final_state(out, 4)

    return fault_free_run((TOY, "--steps", str(steps)), run)


def assert_bitwise_equal(a: list, b: list) -> None:
    for r, (x, y) in enumerate(zip(a, b)):
        assert x["it"] == y["it"], (r, x["it"], y["it"])
        for key in ("flat", "master", "m", "v"):
            assert torch.equal(x[key], y[key]), f"rank {r}: {key} differs"


def threadless_controller(n: int, key: bytes, per_relay: int = 8):
    """A real Controller whose threads are not started, with a real ROUTER socket (its acks go out and
    are dropped by zmq), and ``n`` ranks registered through relays ``b"relay<i>"`` of ``per_relay``
    contiguous ranks: the I/O thread's handlers driven by hand (tests/unit/test_rank_table.py,
    bench/beats_cpu.py). Returns (controller, close)."""
    import zmq

    from mindio.ttp.controller.controller import Controller
    from mindio.ttp.wire import protocol as P
    from mindio.ttp.wire.transport import Channel

    ctl = Controller(rank=-1, world_size=n, enabled={"dump"}, key=key, interval=1.0, misses=3, hang_timeout=0,
                     relays=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind_to_random_port("tcp://127.0.0.1")
    ctl._chan = Channel(sock, key, ctl.drops, sess=ctl.sessions.epoch)
    now = time.monotonic()
    for r in range(n):
        ctl._on_register(b"relay%d" % (r // per_relay), r, P.Register(world_size=n, pid=1000 + r, host="h"), now)

    def close() -> None:
        sock.close(0)
        ctx.term()

    return ctl, close

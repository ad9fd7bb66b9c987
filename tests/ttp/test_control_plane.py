"""Controller + processors in one process over real loopback sockets (fast; no torch.distributed)."""
import sys
import time

import msgpack
import pytest
import zmq

from mindio.ttp.wire import protocol as P
from mindio.ttp._enums import Action, ReportState
from mindio.ttp.controller.states import State

from ._harness import start_plane, stop_plane, until as _until

KEY = b"s" * 32


@pytest.fixture
def plane():
    ctl, procs, port = start_plane(2, KEY, misses=3, action_limit=2.0)
    yield ctl, procs, port
    stop_plane(ctl, procs)


def _raw(port, ident=b"1"):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


@pytest.mark.timeout(30)
def test_bad_frames_and_forged_peer_are_dropped(plane):
    ctl, procs, port = plane
    forged = _raw(port, b"7")
    report = P.Envelope(P.MsgType.REPORT, P.Report(state=2, message="UCE ERROR", step=1), rank=1)
    forged.send(P.encode(report, b"wrong-secret"))                        # forged signature
    forged.send(b"\x00garbage" * 10)                                      # malformed
    forged.send(b"x" * (P.MAX_FRAME + 10))                                # oversize
    forged.send(P.encode(report, KEY))                                    # right key, but in no session
    payload = msgpack.packb([9, 5, 0, 7, 0, {"state": 2, "message": "x", "step": 1}])
    import hashlib, hmac
    forged.send(payload + hmac.new(KEY, payload, hashlib.sha256).digest())  # wrong version
    forged.send_multipart([b"a", b"b", b"c"])                              # wrong shape
    assert _until(lambda: ctl.drops.total >= 6), ctl.drops.snapshot()
    assert ctl.drops.snapshot() == {"auth": 2, "protocol": 3, "session": 1}  # garbage fails the MAC check first
    time.sleep(0.5)
    assert ctl.sm.state is State.NORMAL and ctl.last_decision == {}       # no effect
    assert all(r.alive and not r.faulty for r in ctl.ranks.values())
    forged.close()


@pytest.mark.timeout(30)
def test_actions_are_deduplicated_and_replies_replayed(plane):
    ctl, procs, _ = plane
    calls = []
    procs[1].callbacks["rename"] = (lambda step, args, ctx: calls.append(step), None)
    first = ctl._call("rename", {"step": 3}, [1], 5.0)
    assert first[1].ok and calls == [3]
    ctl.actions.sn -= 1  # the same sn again, as after a controller failover or a resend
    again = ctl._call("rename", {"step": 3}, [1], 5.0)
    assert again[1].ok and calls == [3]  # not run twice; cached reply replayed
    bad = ctl._call("no-such-action", {}, [0], 5.0)
    assert not bad[0].ok and "unknown action" in bad[0].detail["error"]
    failing = ctl._call("save", {"step": 1, "save_info": []}, [0], 5.0)
    assert not failing[0].ok and "no save_ckpt callback" in failing[0].detail["error"]


@pytest.mark.timeout(30)
def test_silent_rank_declared_dead_within_misses(plane):
    """A silent rank is declared dead after 3 missed beats of 0.2 s of the controller's observed time.
    The time is taken when the controller declares it (not when this thread next polls), and a stall of
    the controller's I/O thread that the controller detected (its process not scheduled: heartbeat
    silence it could not observe is not counted, by design, watch.Liveness.stalled) is not the
    controller's lateness: the part of each such stall inside the window is subtracted."""
    ctl, procs, _ = plane
    liveness, declared = ctl.liveness, []
    real = liveness.declare_dead

    def declare_dead(ranks, cause, **kw):  # the controller's own call, timed on its thread
        declared.append((time.monotonic(), cause, list(ranks)))
        return real(ranks, cause, **kw)

    liveness.declare_dead = declare_dead
    procs[1].link.stop()  # the process "dies": no BYE, no more heartbeats
    t0 = time.monotonic()
    assert _until(lambda: not ctl.ranks[1].alive, 5.0)
    t1, cause, ranks = declared[0]
    assert (cause, ranks) == ("heartbeat", [1]), declared
    unobserved = sum(min(gap, end - t0) for end, gap in list(liveness.stalls) if t0 < end <= t1)
    dt = t1 - t0 - unobserved
    # 3 missed beats of 0.2 s + sweep granularity (margin for load)
    assert dt < 3 * 0.2 + 0.5, (dt, t1 - t0, list(liveness.stalls))
    assert _until(lambda: ctl.final.is_set(), 10.0)
    # no replica info: rank 1's state exists nowhere else, so no dump is possible: exit
    assert ctl.last_decision["strategy"] == "exit" and ctl.last_decision["faulty"] == [1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("peer_state", [ReportState.RS_UNKNOWN, ReportState.RS_RETRY])
def test_a_peer_timeout_after_the_incident_began_is_secondary(plane, peer_state):
    """Once an incident has begun, a peer's collective timeout reported as RS_UNKNOWN or RS_RETRY (its
    processor did not know of the incident yet; outside its update window a generic exception is RS_RETRY)
    is secondary, never a new fault: the incident keeps one faulty rank."""
    ctl, procs, _ = plane
    procs[1].report(ReportState.RS_UNKNOWN, "RuntimeError: Other ERROR")
    assert _until(lambda: ctl.incidents.current is not None)
    procs[0].report(peer_state, "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                            "waiting 60000ms for recv operation to complete")
    assert _until(lambda: ctl.final.is_set(), 20.0)
    assert ctl.last_decision["faulty"] == [1] and not ctl.ranks[0].faulty


@pytest.mark.timeout(30)
def test_bye_is_not_a_fault(plane):
    ctl, procs, _ = plane
    procs[1].destroy(reason="finished")
    assert _until(lambda: not ctl.ranks[1].registered)  # the BYE reached the controller
    time.sleep(1.0)  # and nothing turned it into a fault since
    assert ctl.sm.state is State.NORMAL and not ctl.ranks[1].faulty


@pytest.mark.timeout(30)
def test_fence_blocks_updates_until_exit(plane):
    ctl, procs, _ = plane
    import threading
    p = procs[0]
    p._main_ident = threading.get_ident()
    done = {}

    def stop_rank0():
        done["stop"] = ctl._call("stop", {"timeout": 5.0}, [0], 5.0)

    p.end_updating_os(5)
    t = threading.Thread(target=stop_rank0)
    t.start()
    assert _until(lambda: p._hold)
    with pytest.raises(RuntimeError, match="FORCE STOP"):
        # blocks at the fence (answering "stop" with main=fenced), until the controller says exit
        threading.Timer(1.0, lambda: ctl._call("exit", {"code": 75}, [0], 5.0)).start()
        p.start_updating_os(-1)
    t.join()
    # no repair / rollback handler registered: named, so the controller knows retry cannot run here
    assert done["stop"][0].detail == {"step": 5, "data_status": 0, "main": "fenced", "missing": ["repair", "rollback"]}
    assert p.wait_next_action()[1] == 75


@pytest.mark.timeout(60)
@pytest.mark.parametrize("choice", ["dump", "exit"])
def test_cluster_brain_negotiation(plane, choice):
    """report_fault_ranks -> report_stop_complete -> report_strategies -> change_strategy -> report_result."""
    ctl, procs, _ = plane
    ctl.action_limit = 1.0  # the in-process "main thread" (pytest) never parks; stop waits this long
    for p in procs:
        p.replica = [{"rank_list": [0, 1], "replica_cnt": 2, "replica_shift": 0}]
        p.send_info()
        p.end_updating_os(3)
    saved = []
    procs[0].callbacks["save_ckpt"] = (lambda step, info, args, ctx: saved.append((step, info)), None)
    procs[0].callbacks["rename"] = (lambda step, args, ctx: None, None)
    seen = []
    ctl.mindx["report_fault_ranks"] = lambda ranks: seen.append(("fault", ranks))
    ctl.mindx["report_stop_complete"] = lambda code, msg, ranks: seen.append(("stopped", code))

    def strategies(ranks, options):
        seen.append(("strategies", options))
        ctl.change_strategy(choice)
    ctl.mindx["report_strategies"] = strategies
    ctl.mindx["report_result"] = lambda code, msg, ranks, strategy: seen.append(("result", code, strategy))
    # INFO and heartbeats carrying step 3 reach the controller
    assert _until(lambda: all(ctl.ranks[p.rank].step == 3 and ctl.ranks[p.rank].replica for p in procs))
    procs[1].report(ReportState.RS_UCE, "RuntimeError: UCE ERROR")
    assert _until(lambda: ctl.final.is_set(), 30)
    assert seen[:3] == [("fault", {1: 0}), ("stopped", 0), ("strategies", ["dump", "exit"])]
    assert ctl.last_decision["strategy"] == choice
    if choice == "dump":
        assert saved == [(3, [{"type": 0, "ranks": [0]}])] and seen[3] == ("result", 0, "dump")
    else:
        assert saved == [] and len(seen) == 3


@pytest.mark.timeout(60)
def test_graceful_dump_on_request(plane):
    """tft_notify_controller_dump: NORMAL -DUMP-> DUMP, every shard saved once, then EXIT(75)."""
    ctl, procs, _ = plane
    ctl.action_limit = 1.0
    saved = []
    for p in procs:
        p.replica = [{"rank_list": [0, 1], "replica_cnt": 1, "replica_shift": 0}]  # two shards, no replica
        p.send_info()
        p.end_updating_os(7)
        p.callbacks["save_ckpt"] = (lambda step, info, args, ctx, r=p.rank: saved.append((r, step)), None)
        p.callbacks["rename"] = (lambda step, args, ctx: saved.append(("rename", step)), None)
    # INFO and heartbeats carrying step 7 reach the controller
    assert _until(lambda: all(ctl.ranks[p.rank].step == 7 and ctl.ranks[p.rank].replica for p in procs))
    assert ctl.notify_dump() == 0
    assert _until(lambda: ctl.final.is_set(), 30)
    assert sorted(saved[:2]) == [(0, 7), (1, 7)] and saved[2] == ("rename", 7)
    assert ctl.exit_code == 75
    assert [(a.value, b.value) for a, _r, b in ctl.sm.history][-3:] == [("NORMAL", "DUMP"), ("DUMP", "EXIT"),
                                                                       ("EXIT", "FINAL")]
    # handed to each main thread (a processor replies to exit before it hands EXIT over: wait for it)
    assert _until(lambda: all(p._next == (Action.EXIT, 75) for p in procs))


@pytest.mark.timeout(60)
def test_a_ranks_dump_request_is_a_last_words_checkpoint(plane):
    """REQUEST("dump") from a rank (mindio.ttp.processor.preempt: its process got SIGTERM): the dump of
    tft_notify_controller_dump, at the first finished step when asked before it; a second request
    starts nothing more; an unknown request changes nothing."""
    ctl, procs, _ = plane
    ctl.action_limit = 1.0
    saved = []
    for p in procs:
        p.replica = [{"rank_list": [0, 1], "replica_cnt": 1, "replica_shift": 0}]
        p.send_info()
        p.callbacks["save_ckpt"] = (lambda step, info, args, ctx, r=p.rank: saved.append((r, step)), None)
        p.callbacks["rename"] = (lambda step, args, ctx: saved.append(("rename", step)), None)
    assert _until(lambda: all(ctl.ranks[p.rank].replica for p in procs))
    procs[0].link.send(P.Envelope(P.MsgType.REQUEST, P.Request("reboot", reason="?")))
    for p in procs:
        p.link.send(P.Envelope(P.MsgType.REQUEST, P.Request("dump", reason="SIGTERM")))
    assert _until(lambda: ctl.incidents.dump_wanted is not None)
    time.sleep(0.5)  # several heartbeats at step 0: nothing trained yet, nothing to save
    assert ctl.sm.state is State.NORMAL and saved == []
    for p in procs:
        p.end_updating_os(5)
    assert _until(lambda: ctl.final.is_set(), 30)
    assert sorted(saved[:2]) == [(0, 5), (1, 5)] and saved[2:] == [("rename", 5)]  # one dump
    assert ctl.exit_code == 75
    assert _until(lambda: all(p._next == (Action.EXIT, 75) for p in procs))


@pytest.mark.timeout(30)
def test_report_is_handed_to_zmq_before_report_returns(plane):
    """The decorator tears the rank down right after ``report`` (a full gc that holds the GIL for
    0.1-0.2 s): the report must not wait in the link's queue behind it (it did, in about half of the
    runs of bench/detection_latency.py: error -> controller 180 ms instead of 1 ms)."""
    ctl, procs, _ = plane
    switch = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # no forced GIL hand-off below: the busy loop keeps it, as gc.collect does
    try:
        procs[1].report(ReportState.RS_UCE, "RuntimeError: UCE ERROR")
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            pass
        handed = procs[1].link._out.empty()  # the I/O thread took it before report returned
    finally:
        sys.setswitchinterval(switch)
    assert handed
    assert _until(lambda: ctl.ranks[1].faulty, 10)  # and it reached the controller


def test_send_with_wait_is_bounded_when_the_io_thread_is_not_running():
    from mindio.ttp.wire.transport import Link

    link = Link(rank=0, key=KEY, addrs=["tcp://127.0.0.1:9"], hello=lambda: None, beat=lambda: None,
                on_message=lambda env: None)  # never started: nobody takes from its queue
    t0 = time.monotonic()
    assert link.send(P.Envelope(P.MsgType.BYE, P.Bye("test")), wait=0.2) is False
    assert 0.2 <= time.monotonic() - t0 < 5
    assert link.send(P.Envelope(P.MsgType.BYE, P.Bye("test"))) is True  # no wait: queued


@pytest.mark.timeout(60)
def test_the_exit_order_reaches_a_rank_that_registers_after_it(caplog):
    """A rank faults before every rank registered and before any step (lock step 0): nothing to save, so
    the controller orders EXIT(76) to the ranks it has. A rank that registers only afterwards (a slow
    start) must get that order too -- else it trains into peers that left and parks for a decision that
    never comes; the order stands for every rank the controller hears from (incident.IncidentFlow.carry)."""
    import logging

    from mindio._ports import free_port
    from mindio.ttp.controller.controller import Controller
    from mindio.ttp.processor.processor import Processor

    caplog.set_level(logging.WARNING, logger="mindio.ttp")
    port = free_port()
    ctl = Controller(rank=0, world_size=3, enabled={"dump"}, key=KEY, interval=0.2, misses=10, hang_timeout=0)
    ctl.action_limit = 2.0
    ctl.start("127.0.0.1", port)
    procs = [Processor(r, 3) for r in range(3)]
    try:
        for p in procs[:2]:
            p.start(f"tcp://127.0.0.1:{port}", KEY)
        assert ctl.sm.state is State.INIT
        procs[1].report(ReportState.RS_UNKNOWN, "RuntimeError: injected before the first step")
        assert _until(lambda: ctl.final.is_set(), 30)
        assert (ctl.last_decision["strategy"], ctl.last_decision["lock_step"], ctl.exit_code) == ("exit", 0, 76)
        assert "dump at step 0 impossible: nothing to save" in caplog.text
        assert _until(lambda: all(p._next == (Action.EXIT, 76) for p in procs[:2]))
        procs[2].start(f"tcp://127.0.0.1:{port}", KEY)  # late: registers after the order went out
        assert _until(lambda: procs[2]._next == (Action.EXIT, 76), 10), caplog.text[-2000:]
        assert "rank 2 heard after the job's exit order without having confirmed it (registered after the " \
               "order went out): sending it the order again, EXIT(76)" in caplog.text
        assert _until(lambda: 2 in ctl.incidents.carried)  # confirmed: not sent again
    finally:
        stop_plane(ctl, procs)


@pytest.mark.parametrize("end", ["exit-order", "training-finished"])
def test_a_waiting_standby_leaves_with_the_jobs_code(end, caplog):
    """A downgrade removed ranks 2 and 3; a standby (``start_standby`` / ``wait_for_scale_out``) waits for
    rank 2 while no standby offers rank 3, so no upgrade comes. The job then ends -- by an exit order
    (a later incident's dump: 75), or because every rank of the world left after its training
    (``train() returned``: 0). The standby is in no rank table, so before it was never told: it left
    MINDIO_CONTROLLER_LOST_EXIT s (30) after the controller was gone, with 76. Now it gets the job's
    code at once, and so does a standby that says hello only after the end."""
    import logging
    import threading

    from mindio.ttp.processor.processor import Processor

    caplog.set_level(logging.WARNING, logger="mindio.ttp")
    ctl, procs, port = start_plane(4, KEY)
    standbys = []

    def standby(rank):
        p = Processor(rank, 4)
        p.standby = True
        p.start(f"tcp://127.0.0.1:{port}", KEY)
        standbys.append(p)
        return p

    try:
        ctl.elastic.remove_ranks([2, 3], [0, 1], {r: [] for r in range(4)})  # the downgrade's bookkeeping
        for p in procs[2:]:
            p.destroy()  # the removed ranks' processes are gone
        ctl.elastic.gone.clear()  # (they shared this process's pid with the standbys: not a removed rank's own exit)
        first = standby(2)
        assert _until(lambda: 2 in ctl.elastic.standbys, 10)
        assert first._next is None
        if end == "exit-order":
            t = threading.Thread(target=ctl.incidents.exit, args=(75,))  # as the dump's end does (dump.py)
            t.start()
            code = 75
        else:
            for p in procs[:2]:
                p.destroy(reason="train() returned")
            code = 0
        assert _until(lambda: first._next == (Action.EXIT, code), 10), caplog.text[-2000:]
        assert f"the job ended (EXIT({code})): the standby for removed rank 2 leaves with that code" in caplog.text
        late = standby(3)  # says hello only after the end
        assert _until(lambda: late._next == (Action.EXIT, code), 10), caplog.text[-2000:]
        if end == "exit-order":
            t.join(timeout=30)
            assert not t.is_alive()
    finally:
        stop_plane(ctl, procs[:2] + standbys)


@pytest.mark.timeout(60)
def test_sub_healthy_ranks_asked_for_are_switched_or_else_handled_as_failed(plane, caplog):
    """REQUEST("switch") (Processor.ask_switch_out: holders found sub-healthy by the replica cross-check,
    mindio.megatron.verified): a rank may ask for itself and known ranks only; here no launcher agent can
    start backups, so the hot switch is refused and the ranks become a fault incident (recovered as failed
    ranks, never left training)."""
    ctl, procs, _ = plane
    caplog.set_level("WARNING")
    procs[0].link.send(P.Envelope(P.MsgType.REQUEST, P.Request("switch", reason="1 not me")))
    procs[0].link.send(P.Envelope(P.MsgType.REQUEST, P.Request("switch", reason="0,7 unknown rank")))
    procs[0].link.send(P.Envelope(P.MsgType.REQUEST, P.Request("switch", reason="x,1 garbage")))
    assert _until(lambda: caplog.text.count("refused (a rank asks for itself and known ranks only") == 3)
    assert ctl.sm.state is State.NORMAL and ctl.incidents.current is None
    assert procs[1].ask_switch_out([0, 1], "rank 1 is sub-healthy: a test") is True
    assert _until(lambda: "rank 0 was not switched out; handled as failed ranks [0, 1]" in caplog.text)
    assert "hot switch of ranks [0] refused: no launcher agent hosts this controller" in caplog.text
    assert _until(lambda: ctl.sm.state is not State.NORMAL or ctl.final.is_set())


@pytest.mark.timeout(60)
def test_closing_the_controller_ends_an_incident_waiting_for_replies_at_once(caplog):
    """Controller.close during an incident whose stop round waits for a rank that never answers (its link
    gone, not yet declared dead): the action in flight ends at once (actions.ControllerClosed), the incident
    ends without acting on partial replies, and every thread has ended well before the action's limit (it
    waited its whole close timeout before, and left the ZeroMQ context open)."""
    ctl, procs, _ = start_plane(2, KEY, misses=1000, action_limit=60.0)
    try:
        caplog.set_level("WARNING")
        procs[1].link.stop()  # rank 1 hears nothing more, and is not declared dead for 200 s
        procs[0].report(ReportState.RS_UNKNOWN, "RuntimeError: boom")
        assert _until(lambda: ctl.actions._pending is not None and ctl.actions._pending.name == "stop")
        t0 = time.monotonic()
        assert ctl.close(timeout=20) is True  # every thread ended (the action's limit is 60 s)
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
        assert "incident handling ended: action stop" in caplog.text, caplog.text
        assert "incident handling failed" not in caplog.text
    finally:
        stop_plane(ctl, procs)

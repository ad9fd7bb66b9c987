"""recover (MindIO ARF) end to end: a lost node's ranks move to a ``--standby`` agent, the job goes on.

Three mindio-run agents on this machine stand for a cluster: node 0 and node 1 (2 ranks each, the toy
job of _recover_toy.py, DP=4 over 2 replica halves {0,1},{2,3}) and a standby. ``kill-node:2:7``
SIGKILLs node 1's agent while rank 2 computes step 7; node 1's workers die with it. Node 0's agent
finds node 1 lost (its beat stops changing, ~1 s), the controller orders the standby to take node 1's
ranks in the running round (no whole-job restart), and the new processes are repaired from their
replicas on node 0 (shards of ranks 2 and 3 live on ranks 0 and 1). The job ends with exit 0 and the
digest of a fault-free run.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from test_recover_inplace import REPO, STEPS, TOY, _port, digest, fault_free_digest

from tests._exits import assert_no_signal_deaths, check_codes, injected, sent_by_faults
from tests._faultplan import FaultPlan

pytestmark = pytest.mark.slow


NODE1_LOST = FaultPlan.of(("kill-node", 2, 7))  # rank 2 SIGKILLs its agent (node 1) at step 7, then itself


def run_nodes(out, plan: FaultPlan, strategies: str, timeout: float = 170, tail=None, env=None, during=None,
              step_sleep: float = 0.1, sleep_from: int = 0, flags=(), killed=None, standby: bool = True):
    """Agents for node 0, node 1 and (``standby``) a standby running ``tail`` (default: the toy with the faults of
    ``plan``; a script of its own names its faults with ``--inject``), with more mindio-run ``flags``
    (e.g. the etcd store); ``killed``: {agent: signal name} the faults kill (default: node 1's, when
    a kill-node fault is planned);
    returns ({name: (code, text)}, events). ``during(procs, events_path)`` runs in a thread meanwhile.
    Fails if an agent or a worker died by a signal the faults do not explain (tests/_exits.py)."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_LOG_STDOUT="1",
               MINDIO_EVENT_LOG=str(events), **(env or {}))
    common = [sys.executable, "-W", "ignore", "-m", "mindio.launch.cli", "--nnodes", "2", "--nproc-per-node", "2",
              "--master-port", str(_port()), "--high-availability", strategies, *flags]
    tail = tail or [str(TOY), "--out", str(out), "--steps", str(STEPS), "--step-sleep", str(step_sleep),
                    "--step-sleep-from", str(sleep_from), *plan.argv()]
    procs = {}
    agents = (("node0", ["--node-rank", "0"]), ("node1", ["--node-rank", "1"]),
              ("standby", ["--standby", "--warm-spares", "2"]))
    for name, own in agents if standby else agents[:2]:
        procs[name] = subprocess.Popen(common + own + tail, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
        time.sleep(0.3)
    if during is not None:
        threading.Thread(target=during, args=(procs, events), daemon=True).start()
    res, end = {}, time.monotonic() + timeout
    try:
        for name, p in procs.items():
            text, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            res[name] = (p.returncode, text)
    except subprocess.TimeoutExpired:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
        texts = {n: p.communicate()[0][-3000:] for n, p in procs.items()}
        raise AssertionError(f"agents did not end within {timeout} s (a hang): {texts}")
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()] if events.exists() else []
    # kill-node SIGKILLs node 1's agent; its two workers die with it (PDEATHSIG)
    spec = injected(tail)
    if killed is None:
        killed = {"node1": "SIGKILL"} if "kill-node:" in spec or any(f.kind == "kill-node" for f in plan.faults) else {}
    check_codes({n: c for n, (c, _t) in res.items()}, killed, what="agent", context=str(
        {n: t[-2000:] for n, (_c, t) in res.items()}))
    sent = sent_by_faults(spec, also=plan.sent(per_node=2), per_node=2)
    for _code, text in res.values():
        assert_no_signal_deaths(text, sent)
    return res, evs


@pytest.mark.timeout(300)
def test_lost_node_moves_to_standby_bitwise(tmp_path, fault_free_run):
    reference = fault_free_digest(fault_free_run)  # the fault-free digest (one agent, same 4 ranks)
    res, events = run_nodes(tmp_path / "run", NODE1_LOST, "recover-in-place,recover,dump")
    code0, text0 = res["node0"]
    assert code0 == 0, text0[-6000:]
    assert res["node1"][0] != 0  # its agent was SIGKILLed
    assert res["standby"][0] == 0, res["standby"][1][-4000:]
    assert digest(text0) == reference
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "recover" and done[0]["replaced"] == [2, 3], done
    takeover = [e for e in events if e["kind"] == "standby_takeover"]
    assert takeover and takeover[0]["node"] == 1 and takeover[0]["round"] == 0  # the running round
    assert not [e for e in events if e["kind"] == "round_failed"]
    fallback = [e for e in events if e["kind"] == "fallback"]
    assert [f["src"] for f in fallback] == ["recover-in-place"]  # its agent is gone: not in place
    fault_t = next(e["t"] for e in events if e["kind"] == "fault_injected")
    resumed = max(e["t"] for e in events if e["kind"] == "train_resumed")
    print(f"\nkill node 1: fault -> every rank training again {resumed - fault_t:.3f} s; "
          f"{ {k: v for k, v in done[0].items() if k.endswith('_s')} }")
    # every step on every rank, the standby's ranks from the lock step on
    for r in range(4):
        its = {int(i) for i in re.findall(rf"\[rank {r}\] iteration (\d+?)(?=\[|\r?\n|\d{{4}}-\d\d-\d\d |$)", text0 + res["standby"][1]
                                            + res["node1"][1])}
        assert its == set(range(1, STEPS + 1)), (r, sorted(its))


@pytest.mark.timeout(300)
def test_a_repair_handler_that_raises_under_recover_falls_back_to_a_dump(tmp_path):
    """A faulty real object under recover: node 1 is lost, the standby takes ranks 2 and 3, and the repair
    handler of their replica holders on node 0 (tft_register_repair_handler) raises while it should send
    the shards. The sequence abandons, recover returns FAILED and the controller falls back to the dump:
    the shards of ranks 2 and 3 are still on ranks 0 and 1, so the lock step is saved and the job ends 75."""
    res, events = run_nodes(tmp_path / "run", FaultPlan.of(("kill-node", 2, 7), fail_repair="raise"),
                            "recover-in-place,recover,dump")
    code0, text0 = res["node0"]
    assert code0 != 0 and "exiting with code 75" in text0, text0[-6000:]  # dumped
    failed = [e for e in events if e["kind"] == "recover_failed"]
    assert failed and failed[0]["step_name"] == "repair", failed
    fallback = [(e["src"], e["dst"]) for e in events if e["kind"] == "fallback"]
    assert ("recover", "dump") in fallback, fallback
    assert not [e for e in events if e["kind"] == "recover_done"]
    lock = next(e for e in events if e["kind"] == "decision")["lock_step"]
    assert (tmp_path / "run" / "ckpt" / "latest").read_text() == str(lock)  # the lock step, complete


def _stall_at(name: str, kind: str, match: str, seconds: float, log: list):
    """A ``during`` hook: when the first event ``kind`` whose line holds ``match`` is logged, SIGSTOP agent ``name`` (its process
    only, not its workers) for ``seconds``, then SIGCONT it. Appends what it did to ``log``."""
    def hook(procs, events):
        end = time.monotonic() + 150
        while time.monotonic() < end:
            lines = events.read_text().splitlines() if events.exists() else []
            if any(f'"kind": "{kind}"' in line and match in line for line in lines):
                pid = procs[name].pid
                os.kill(pid, signal.SIGSTOP)
                log.append(("stopped", name, time.time()))
                time.sleep(seconds)
                os.kill(pid, signal.SIGCONT)
                log.append(("continued", name, time.time()))
                return
            time.sleep(0.02)
    return hook


def _assert_recovered_across_stall(res, events, did, reference) -> str:
    """The stall happened (stopped, then continued), both agents ended normally, node 1's ranks moved
    to the standby once, bitwise, and no rank was declared dead after the replacement was ordered (nor
    any round failed). Returns node 0's output."""
    code0, text0 = res["node0"]
    assert [d[0] for d in did] == ["stopped", "continued"], did
    assert code0 == 0, text0[-6000:]
    assert res["standby"][0] == 0, res["standby"][1][-4000:]
    assert digest(text0) == reference
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "recover" and done[0]["replaced"] == [2, 3], done
    ordered = next(e["t"] for e in events if e["kind"] == "replace_ordered")
    late_deaths = [e for e in events if e["kind"] == "rank_dead" and e["t"] > ordered]
    assert not late_deaths, late_deaths  # nobody alive was declared dead because of the stall
    assert not [e for e in events if e["kind"] == "round_failed"]
    return text0


@pytest.mark.timeout(300)
def test_lost_node_recovers_across_a_stall_of_the_controller_node(tmp_path, fault_free_run):
    """Node 0's agent (store, worker store, controller) is SIGSTOPped for 4 s right after it gave node 1
    to the standby: the standby, the replacements and the survivors all block on it or find it silent,
    longer than the heartbeat and node-loss timeouts. Time nobody could observe is not counted
    (liveness.py, Liveness.stalled in mindio/ttp/controller/watch.py, Link), a survivor that reconnects registers afresh on
    its new connection (session.py): the recovery completes, bitwise, and no live rank is declared dead."""
    reference = fault_free_digest(fault_free_run)
    did: list = []
    res, events = run_nodes(tmp_path / "run", NODE1_LOST, "recover-in-place,recover,dump",
                            during=_stall_at("node0", "replace_ordered", '"strategy": "recover"', 4.0, did))
    _assert_recovered_across_stall(res, events, did, reference)
    assert [e for e in events if e["kind"] == "controller_stalled"], "the 4 s stop was not seen"


@pytest.mark.timeout(300)
def test_lost_node_recovers_across_a_stall_of_the_standby_agent(tmp_path, fault_free_run):
    """The standby agent is SIGSTOPped for 4 s right after it started node 1's ranks again (the steps
    after the fault take 3 s each, 9 s in all: the job still trains meanwhile): its beat stops for
    longer than the node-loss timeout, so node 0 finds node 1 lost again -- but the new ranks (the
    agent's children, not stopped) beat to the controller, so they are left to their own heartbeats
    instead of being declared dead (ha.tick): the job completes, bitwise."""
    reference = fault_free_digest(fault_free_run)
    did: list = []
    res, events = run_nodes(tmp_path / "run", NODE1_LOST, "recover-in-place,recover,dump",
                            during=_stall_at("standby", "ranks_replaced", '"node": 1', 4.0, did), step_sleep=3.0,
                            sleep_from=8)
    text0 = _assert_recovered_across_stall(res, events, did, reference)
    assert "still beat to the controller: left to their heartbeats" in text0, text0[-6000:]  # node 1 was lost
    # and once the standby's agent beats again it is forgotten as lost (ha.RoundWatch._unlose)
    assert [e for e in events if e["kind"] == "node_back" and e["node"] == 1], text0[-6000:]


@pytest.mark.timeout(200)
def test_a_node_lost_after_every_ranks_training_finished_ends_the_job_failed_within_seconds(tmp_path):
    """Training finished on every rank (each left the controller), then node 1's agent is SIGKILLed (rank 2
    does it: TOY_LOSE_NODE_AFTER) and never says that its workers are done. Node 0 must not wait for it
    forever: nothing is left to recover, so its agent ends the job within 10 s, failed (exit 1), naming
    node 1's ranks as lost after their training finished -- a late failure, as a rank's abnormal exit
    after its training is (issue 13: a finished job ends whatever happens after)."""
    res, events = run_nodes(tmp_path / "run", FaultPlan(), "recover-in-place,recover,dump", standby=False,
                            env={"TOY_LOSE_NODE_AFTER": "2"}, killed={"node1": "SIGKILL"})
    code0, text0 = res["node0"]
    killed_at = float(re.search(r"SIGKILL of this node's agent at ([0-9.]+)", res["node1"][1]).group(1))
    assert code0 == 1, text0[-4000:]
    assert re.search(r"rank 2 \(node 1[^)]*\) lost with its node \(its agent stopped beating\) after its "
                     r"training finished", text0), text0[-4000:]
    late = [e for e in events if e["kind"] == "late_node_loss"]
    assert len(late) == 1 and late[0]["node"] == 1 and late[0]["ranks"] == [2, 3], late
    ended = time.time()  # run_nodes waits for node 0 first: it had ended by now
    print(f"\nnode 1 lost after training: found {late[0]['t'] - killed_at:.2f} s, node 0 ended <= "
          f"{ended - killed_at:.2f} s after the kill")
    assert ended - killed_at <= 10, text0[-3000:]
    assert not [e for e in events if e["kind"] in ("recover_done", "dump_done", "decision")], events

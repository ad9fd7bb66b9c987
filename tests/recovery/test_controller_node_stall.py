"""Node 0 only stalls (a long GC pause, a SIGSTOP, a host swapping) with a backup controller on node 1
(MINDIO_BACKUP_CONTROLLERS=1): no rank is lost, the job ends as without the stall.

Node 0's agent hosts the controller and both stores. Stopped for longer than the links' bound
(MINDIO_HEARTBEAT_MISSES x MINDIO_HEARTBEAT_INTERVAL + half an interval: 3.5 s), it leaves every rank's
link to fail over to the backup node 1's agent hosts. That backup is passive: node 1's agent still
reaches node 0's store (its calls only wait), so it is never armed and never takes over. Before the
fix it answered the ranks all the same, they stayed with it, and the primary, running again, heard them
no more and declared the four live ranks dead. Now a passive backup says so in its acks and each link
goes back to the primary as soon as it answers (mindio/ttp/wire/home.py).

Real processes on one host: two mindio-run agents (2 ranks each) of the toy job (_recover_toy.py), gloo
on loopback; the test SIGSTOPs node 0's agent process (not its workers) and SIGCONTs it STALL_S later.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from _two_nodes import two_nodes
from test_recover_inplace import STEPS, digest, fault_free_digest

from tests._exits import assert_no_signal_deaths, check_codes

pytestmark = pytest.mark.slow
STALL_S = 7.0  # twice the links' bound: every link fails over, then stays with the passive backup a while
RANKS = range(4)
# whose links fail over: each rank's, or with relays (mindio-run's default, MINDIO_RELAYS) each node's relay
RELAYS = os.environ.get("MINDIO_RELAYS", "1") != "0"
LINKS = {"relay-0", "relay-1"} if RELAYS else set(RANKS)


def _links(evs, kind: str, **match) -> set:
    """The links events ``kind`` came from: ranks, or with relays one ("relay", pid) per relay process."""
    return {("relay", e["pid"]) if e["rank"] == "relay" else e["rank"] for e in evs
            if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())}


def _all_links(links: set) -> bool:
    return len(links) == 2 and all(isinstance(x, tuple) for x in links) if RELAYS else links == set(RANKS)


def _stall_node0_once_ranks_know_the_backup(did: list):
    """A ``during`` hook: once every rank took a step and its link knows the backup's address (it logged
    its fail-over order with it), SIGSTOP node 0's agent for STALL_S s, then SIGCONT it."""
    def hook(procs, events, outs):
        end = time.monotonic() + 120
        while time.monotonic() < end:
            evs = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
            backup = next((e["address"] for e in evs if e["kind"] == "backup_started"), None)
            stepped = {e["rank"] for e in evs if e["kind"] == "step_done"}
            said = "".join(outs["node0"]) + "".join(outs["node1"])
            knows = {f"relay-{n}" if r == "relay" else int(r) for n, r in re.findall(
                r"^\[([^/\]\n]*)/(\d+|relay)\] [^\n]*fail-over order \[[^\]\n]*" + re.escape(repr(backup)), said,
                re.M)} if backup else set()
            if knows >= LINKS and stepped >= set(RANKS):
                pid = procs["node0"].pid
                os.kill(pid, signal.SIGSTOP)
                did.append(("stopped", time.time(), backup))
                time.sleep(STALL_S)  # the fault itself: how long node 0 stays stopped
                # the time before the signal: nothing of node 0 runs before it, while this thread may be
                # descheduled after it (stress: the ranks were home 2 ms before a time taken after it)
                did.append(("continued", time.time()))
                os.kill(pid, signal.SIGCONT)
                return
            time.sleep(0.05)
        did.append(("never stopped: no backup advertised to every rank within 120 s",))
    return hook


@pytest.mark.timeout(200)
def test_stall_of_node0_with_a_backup_controller_loses_no_rank(tmp_path, fault_free_run):
    """Node 0's agent stopped STALL_S s while the job trains: every link fails over to node 1's passive
    backup, goes back to the primary once it runs again, no rank is declared dead, the backup never
    takes over; both agents and every worker end 0 with the digest of the fault-free run."""
    reference = fault_free_digest(fault_free_run)
    out, did = tmp_path / "run", []
    codes, texts, evs = two_nodes(out, ["--steps", str(STEPS), "--step-sleep", "1.0"],
                                  "retry,recover-in-place,recover,dump", {"MINDIO_BACKUP_CONTROLLERS": "1"},
                                  wait_for="both", during=_stall_node0_once_ranks_know_the_backup(did))
    both = "\n".join(f"--- {n}\n{t[-5000:]}" for n, t in texts.items())
    check_codes(codes, {}, what="agent", context=both)
    for text in texts.values():
        assert_no_signal_deaths(text, {})
    assert [d[0] for d in did] == ["stopped", "continued"], did
    backup, t_stop, t_cont = did[0][2], did[0][1], did[1][1]
    dead = [e for e in evs if e["kind"] == "rank_dead"]
    assert not dead, f"live ranks declared dead after the stall: {dead}\n{both}"
    assert codes == {"node0": 0, "node1": 0}, both
    assert digest(texts["node0"]) == reference
    # the stall was long enough: every rank's link did fail over to the backup ...
    over = _links(evs, "controller_failover", to=backup)
    assert _all_links(over), f"links that failed over to the backup: {sorted(over, key=str)}\n{both}"
    # ... which never took over, and each came back to the primary once it ran again
    assert not [e for e in evs if e["kind"] == "backup_takeover"], both
    home = {(("relay", e["pid"]) if e["rank"] == "relay" else e["rank"]): e for e in evs if e["kind"] == "controller_home"}
    assert _all_links(set(home)), f"links back with the primary: {sorted(home, key=str)}\n{both}"
    back = max(e["t"] for e in home.values()) - t_cont
    assert all(e["t"] >= t_cont for e in home.values()), (home, t_cont)
    assert [e for e in evs if e["kind"] == "controller_stalled"], "the primary did not see its own stall"
    print(f"\nnode 0 stopped {t_cont - t_stop:.1f} s: every link on the passive backup, then back with the "
          f"primary {back:.3f} s after it ran again (slowest rank); no rank declared dead")

"""mindio-run --high-availability relays by default (mindio/launch/relay.py, mindio/ttp/wire/relay.py): each
node agent's relay carries its ranks' control traffic on one connection, and killing an agent -- its relay
with it -- is its node's loss, handled as for any lost node.

Two mindio-run agents stand for two nodes (tests/recovery/_two_nodes.py: the toy job, 2 ranks each, replica
halves {0,1},{2,3}, so node 0 holds a copy of every shard). Rank 2 SIGKILLs node 1's agent at step
FAULT_IT; with no standby to take node 1, the controller falls back to the dump: node 0 saves the lock step
and exits 75.
"""
from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recovery"))
from _two_nodes import two_nodes  # noqa: E402

from tests._exits import check_codes  # noqa: E402
from tests._faultplan import FaultPlan  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, FAULT_IT = 30, 8


@pytest.mark.timeout(200)
def test_killing_a_node_agent_and_its_relay_is_that_nodes_loss(tmp_path):
    out = tmp_path / "run"
    plan = FaultPlan.of(("kill-node", 2, FAULT_IT))
    codes, texts, evs = two_nodes(out, ["--steps", str(STEPS), "--step-sleep", "0.1", *plan.argv()],
                                  "recover-in-place,recover,dump", {}, wait_for="node0")
    text0, text1 = texts["node0"], texts["node1"]
    check_codes(codes, {"node1": "SIGKILL"}, what="agent", context=text0[-6000:])
    assert codes["node1"] == -signal.SIGKILL, text1[-3000:]
    assert codes["node0"] == 75, text0[-6000:]
    # relays by default: one per node, each the only connection of its node's ranks to the controller
    assert re.search(r"relay \(pid \d+\) for ranks 0-1 on ipc://", text0), text0[-6000:]
    assert re.search(r"relay \(pid \d+\) for ranks 2-3 on ipc://", text1), text1[-6000:]
    assert len(re.findall(r"mindio\.ttp\.controller: relay .* registered", text0)) == 2, text0[-6000:]
    assert "did not end within" not in text0  # node 0's relay left when its agent closed its pipe
    # node 1 lost: its ranks dead, recover impossible (no standby), the dump by node 0's ranks
    assert {e["dead_rank"] for e in evs if e["kind"] == "rank_dead"} == {2, 3}, evs
    decision = next(e for e in evs if e["kind"] == "decision")
    assert sorted(decision["faulty"]) == [2, 3] and decision["save_info"] == [{"type": 0, "ranks": [0, 1]}], decision
    assert ("recover-in-place", "dump") in [(e["src"], e["dst"]) for e in evs if e["kind"] == "fallback"], evs
    step = int((out / "ckpt" / "latest").read_text())
    assert step >= FAULT_IT - 1, text0[-6000:]
    # node 0's workers ended by the controller's exit order (75), not stopped by their agent
    assert re.search(r"workers' exit codes: rank 0: exit code 75, rank 1: exit code 75\n", text0), text0[-6000:]

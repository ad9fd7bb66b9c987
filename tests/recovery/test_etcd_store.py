"""mindio-run's agents on an etcd server (``--rdzv-backend etcd --rdzv-endpoint HOST:PORT``; issue 16):
the agents' store outlives node 0, and the controller's leader key (a TTL key, etcdstore.Leader) decides
when node 1's backup controller takes over.

Real processes on one host: an etcd server started by the test (tests/_etcd.py; skipped with the reason
where etcd or python-etcd is missing), mindio-run agents of the toy job (_recover_toy.py: DP=4, 2 ranks
per node, every shard on both nodes), gloo on loopback, faults by the toy's own kill-node (SIGKILL of a
node's agent; its workers die with it). Every agent's exit code is checked, and etcd's.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest

from _two_nodes import two_nodes
from test_recover_inplace import REPO, TOY, digest, fault_free_digest
from test_recover_node import NODE1_LOST, run_nodes

from tests._etcd import etcd_server, skip_without_etcd
from tests._exits import check_codes
from tests._faultplan import FaultPlan

pytestmark = [pytest.mark.slow, skip_without_etcd]


@pytest.fixture(scope="module")
def etcd_endpoint(tmp_path_factory):
    with etcd_server(tmp_path_factory.mktemp("etcd")) as endpoint:
        yield endpoint


def _flags(endpoint: str, run_id: str) -> list:
    return ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]


def _job_keys(endpoint: str, run_id: str):
    """The job's directory on etcd: (its TTL, {store key: value})."""
    import etcd

    from mindio.launch import etcdstore

    store = etcdstore.connect(endpoint, run_id, 5.0)
    node = store.client.get(store.prefix.rstrip("/"))
    return node.ttl, {store._decode(c.key.rsplit("/", 1)[1]).decode(): c.value for c in node.children
                      if not isinstance(c, etcd.EtcdResult) or c.value is not None}


@pytest.mark.timeout(300)
def test_fault_free_on_etcd_and_an_idle_standby_leaves_at_the_end(tmp_path, fault_free_run, etcd_endpoint):
    """No fault: both nodes and the standby (which never takes a node) exit 0, bitwise; the standby leaves
    because the job's keys say it ended (on etcd no store goes away with node 0 to tell it)."""
    reference = fault_free_digest(fault_free_run)
    res, events = run_nodes(tmp_path / "run", FaultPlan(), "recover-in-place,recover,dump",
                            env={"MINDIO_BACKUP_CONTROLLERS": "1"}, flags=_flags(etcd_endpoint, "fault-free"))
    assert {n: c for n, (c, _t) in res.items()} == {"node0": 0, "node1": 0, "standby": 0}, \
        {n: t[-3000:] for n, (_c, t) in res.items()}
    assert digest(res["node0"][1]) == reference
    assert "standby agent: the job ended; leaving" in res["standby"][1], res["standby"][1][-3000:]
    assert not [e for e in events if e["kind"] in ("round_failed", "leader_taken", "backup_takeover")]


@pytest.mark.timeout(300)
def test_lost_node_moves_to_standby_on_etcd_bitwise(tmp_path, fault_free_run, etcd_endpoint):
    """Node 1 lost with the agents on etcd: as on node 0's TCPStore, the controller gives its ranks to the
    standby in the running round, bitwise; at the end the job's keys say it ended and expire."""
    reference = fault_free_digest(fault_free_run)
    res, events = run_nodes(tmp_path / "run", NODE1_LOST, "recover-in-place,recover,dump",
                            flags=_flags(etcd_endpoint, "standby-node1"))
    code0, text0 = res["node0"]
    assert code0 == 0, text0[-6000:]
    assert res["node1"][0] == -signal.SIGKILL
    assert res["standby"][0] == 0, res["standby"][1][-4000:]
    assert digest(text0) == reference
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "recover" and done[0]["replaced"] == [2, 3], done
    takeover = [e for e in events if e["kind"] == "standby_takeover"]
    assert takeover and takeover[0]["node"] == 1 and takeover[0]["round"] == 0, takeover
    assert not [e for e in events if e["kind"] == "round_failed"]
    ttl, keys = _job_keys(etcd_endpoint, "standby-node1")
    assert keys.get("job/ended") is not None and ttl is not None and 0 < ttl <= 60, (ttl, sorted(keys))


@pytest.mark.timeout(200)
def test_node0_lost_backup_takes_the_leader_key_and_dumps(tmp_path, etcd_endpoint):
    """Node 0 lost (agent, controller, workers' store; the agents' store is etcd, it stays): node 1's agent
    finds node 0's beats stopped, takes the controller's leader key once node 0's expired, and its backup
    takes over and ends the job with a last-words checkpoint: one line, exit 75 on node 1."""
    out = tmp_path / "run"
    plan = FaultPlan.of(("kill-node", 0, 12))
    codes, texts, evs = two_nodes(out, ["--steps", "40", "--step-sleep", "0.1", *plan.argv()],
                                  "retry,recover-in-place,recover,dump", {"MINDIO_BACKUP_CONTROLLERS": "1"},
                                  wait_for="node1", flags=_flags(etcd_endpoint, "node0-lost-dump"))
    check_codes(codes, {"node0": "SIGKILL"}, what="agent", context=texts["node1"][-6000:])
    text1 = texts["node1"]
    assert codes == {"node0": -signal.SIGKILL, "node1": 75}, text1[-6000:]
    said = re.findall(r"^mindio-run: node 0 lost.*$", text1, re.M)
    assert len(said) == 1 and "leader key on etcd expired" in said[0] and \
        "saved a last-words checkpoint at step" in said[0], text1[-6000:]
    assert "Traceback" not in text1, text1[-6000:]
    assert [e for e in evs if e["kind"] == "leader_taken" and e["node"] == 1], text1[-6000:]
    step = int((out / "ckpt" / "latest").read_text())
    assert step >= 11, text1[-6000:]
    assert re.search(r"workers' exit codes: rank 2: exit code 75, rank 3: exit code 75\n", text1), text1[-6000:]
    fault_t = next(e["t"] for e in evs if e["kind"] == "fault_injected")
    dumped = next(e for e in evs if e["kind"] == "backup_dumped")
    print(f"\nnode 0 killed (etcd, no standby): node 1 took the leader key "
          f"{next(e['t'] for e in evs if e['kind'] == 'leader_taken') - fault_t:.2f} s, checkpoint complete "
          f"{dumped['t'] - fault_t:.2f} s after the kill")
    ttl, keys = _job_keys(etcd_endpoint, "node0-lost-dump")
    assert keys.get("job/ended") is not None and ttl is not None, (ttl, sorted(keys))


@pytest.mark.timeout(60)
def test_a_job_id_with_keys_left_on_etcd_is_refused(tmp_path, etcd_endpoint):
    """A previous job's keys under the same --rdzv-id would mislead this job: node 0 refuses in one line."""
    from mindio.launch import etcdstore

    etcdstore.connect(etcd_endpoint, "taken", 5.0, create=True)
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "mindio.launch.cli", "--nnodes", "1", "--nproc-per-node",
                        "1", *_flags(etcd_endpoint, "taken"), str(TOY), "--out", str(tmp_path), "--steps", "1"],
                       capture_output=True, text=True, timeout=50, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 1, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("mindio-run: error:")]
    assert len(lines) == 1 and "--rdzv-id taken" in lines[0] and "holds the keys of a job" in lines[0], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.timeout(300)
def test_node0_lost_backup_controller_moves_its_ranks_to_the_standby_bitwise(tmp_path, fault_free_run, etcd_endpoint):
    """Node 0 lost (its agent, the controller, the workers' store, ranks 0 and 1) with the agents on etcd, a
    backup controller on node 1 and a standby: node 1's agent takes the leader key, hosts a new workers'
    store, its backup takes over and gives node 0's ranks to the standby in the running round; the
    survivors rebuild on the moved store; the job ends with exit 0 on node 1 and the standby, bitwise."""
    reference = fault_free_digest(fault_free_run)
    res, events = run_nodes(tmp_path / "run", FaultPlan.of(("kill-node", 0, 7)), "recover-in-place,recover,dump",
                            env={"MINDIO_BACKUP_CONTROLLERS": "1"}, flags=_flags(etcd_endpoint, "node0-standby"),
                            killed={"node0": "SIGKILL"})
    text1, texts = res["node1"][1], {n: t[-4000:] for n, (_c, t) in res.items()}
    assert res["node0"][0] == -signal.SIGKILL, texts
    assert res["node1"][0] == 0 and res["standby"][0] == 0, texts
    assert digest(res["standby"][1]) == reference  # rank 0 prints it: on the standby now
    assert [e for e in events if e["kind"] == "leader_taken" and e["node"] == 1], text1[-6000:]
    assert [e for e in events if e["kind"] == "backup_takeover"], text1[-6000:]
    assert "Traceback" not in text1 + res["standby"][1], texts
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "recover" and done[0]["replaced"] == [0, 1], done
    takeover = [e for e in events if e["kind"] == "standby_takeover"]
    assert takeover and takeover[0]["node"] == 0 and takeover[0]["round"] == 0, takeover
    assert not [e for e in events if e["kind"] == "round_failed"]
    for r in range(4):  # every step on every rank, the standby's ranks from the lock step on
        its = {int(i) for i in re.findall(rf"\[rank {r}\] iteration (\d+?)(?=\[|\r?\n|\d{{4}}-\d\d-\d\d |$)",
                                          "".join(t for _c, t in res.values()))}
        assert its == set(range(1, 11)), (r, sorted(its))
    fault_t = next(e["t"] for e in events if e["kind"] == "fault_injected")
    resumed = max(e["t"] for e in events if e["kind"] == "train_resumed")
    print(f"\nkill node 0 (backup on node 1, standby): fault -> every rank training again {resumed - fault_t:.3f} s")
    ttl, keys = _job_keys(etcd_endpoint, "node0-standby")
    assert keys.get("job/ended") is not None and ttl is not None, (ttl, sorted(keys))


@pytest.mark.timeout(200)
def test_node0_stalled_past_its_leader_key_stops_acting(tmp_path, etcd_endpoint):
    """Split brain, settled by the leader key: node 0's agent (controller, workers' store) is SIGSTOPped
    7 s while the job trains, past its key's TTL. Node 1 takes the key and its backup ends the job with a
    last-words checkpoint (exit 75); node 0, running again, finds the key held by node 1 and stops acting:
    one line, exit 1 -- the two never both go on."""
    from test_controller_node_stall import _stall_node0_once_ranks_know_the_backup

    out, did = tmp_path / "run", []
    codes, texts, evs = two_nodes(out, ["--steps", "40", "--step-sleep", "1.0"], "retry,recover-in-place,recover,dump",
                                  {"MINDIO_BACKUP_CONTROLLERS": "1"}, wait_for="both",
                                  during=_stall_node0_once_ranks_know_the_backup(did),
                                  flags=_flags(etcd_endpoint, "node0-stalled"))
    both = "\n".join(f"--- {n}\n{t[-5000:]}" for n, t in texts.items())
    assert [d[0] for d in did] == ["stopped", "continued"], did
    assert codes == {"node0": 1, "node1": 75}, both
    # node 0, running again, finds its lease lapsed (or the key held by node 1) before it acts: one line, exit 1.
    # (etcd slow under load, "Raft Internal Error: request timed out", once ended node 0 on a store error
    # instead: the agents now ask etcd again for MINDIO_ETCD_RETRY s, tests/launch/test_etcd_retry.py)
    assert re.search(r"^mindio-run: job failed: node 0 could not refresh the controller's leader key",
                     texts["node0"], re.M), both
    said = re.findall(r"^mindio-run: node 0 lost.*$", texts["node1"], re.M)
    assert len(said) == 1 and "saved a last-words checkpoint" in said[0], both
    assert [e["node"] for e in evs if e["kind"] == "leader_taken"] == [1], both
    assert (out / "ckpt" / "latest").exists(), both

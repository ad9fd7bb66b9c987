"""mindio-run inside a Slurm step (no Slurm, no processes): Slurm's host lists expanded as ``scontrol show
hostnames`` does, and the flags a step implies filled in by mindio-run's own parser (``parse_args``), the
command line winning. tests/slurm/test_slurm_real.py checks the parser against a real ``scontrol``."""
from __future__ import annotations

import pytest

from mindio.launch.cli import parse_args
from mindio.launch.slurm import allocation, expand_nodelist

HOSTLISTS = [
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("n1,n2", ["n1", "n2"]),
    ("rack[1-2]-node[01-03]", ["rack1-node01", "rack1-node02", "rack1-node03",
                               "rack2-node01", "rack2-node02", "rack2-node03"]),
    ("a[08-11],b", ["a08", "a09", "a10", "a11", "b"]),
    ("x[1-2]y,z[3]", ["x1y", "x2y", "z3"]),
    ("gpu-[009-011]", ["gpu-009", "gpu-010", "gpu-011"]),
    ("n[1,3-4]-ib", ["n1-ib", "n3-ib", "n4-ib"]),
    ("n[9-10]", ["n9", "n10"]),
    ("single", ["single"]),
]


@pytest.mark.parametrize("text,names", HOSTLISTS)
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text", ["", "n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[]"])
def test_expand_nodelist_refuses_malformed(text):
    with pytest.raises(ValueError):
        expand_nodelist(text)


@pytest.fixture
def script(tmp_path):
    s = tmp_path / "t.py"
    s.write_text("pass\n")
    return str(s)


@pytest.fixture
def step(monkeypatch):
    """A 3-node srun step (one task per node) seen from node ``name``; no scontrol on PATH, so node 0's
    address is its name."""
    for var in ("PET_NNODES", "PET_NODE_RANK", "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")

    def on(name, nodes="gpu[07-09]", job="4242", **extra):
        names = expand_nodelist(nodes)
        env = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_NODELIST": nodes,
               "SLURM_NNODES": str(len(names)), "SLURM_STEP_NUM_NODES": str(len(names)),
               "SLURM_STEP_NUM_TASKS": str(len(names)), "SLURMD_NODENAME": name,
               "SLURM_NODEID": str(names.index(name)), **extra}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    return on


def test_every_node_of_the_step_gets_its_rank_and_node0s_endpoint(step, script):
    for i, name in enumerate(["gpu07", "gpu08", "gpu09"]):
        step(name)
        cfg = parse_args(["--nproc-per-node", "2", script])
        assert (cfg.nnodes, cfg.node_rank, cfg.standby) == (3, i, False)
        assert (cfg.master_addr, cfg.master_port) == ("gpu07", 29400 + 242)
        assert not cfg.dynamic_rank


def test_nodes_beyond_nnodes_are_standbys(step, script):
    step("gpu09")
    cfg = parse_args(["--nnodes", "2", "--nproc-per-node", "2", script])
    assert (cfg.nnodes, cfg.standby, cfg.master_addr) == (2, True, "gpu07")
    step("gpu08")
    cfg = parse_args(["--nnodes", "2", "--nproc-per-node", "2", script])
    assert (cfg.nnodes, cfg.node_rank, cfg.standby) == (2, 1, False)


def test_the_command_line_wins(step, script, monkeypatch):
    step("gpu08")
    cfg = parse_args(["--node-rank", "0", "--rdzv-endpoint", "10.1.2.3:555", "--nproc-per-node", "1", script])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (3, 0, "10.1.2.3", 555)
    cfg = parse_args(["--nnodes", "2", "--master-addr", "10.9.9.9", "--master-port", "777", script])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "10.9.9.9", 777)
    cfg = parse_args(["--master-port", "777", script])  # the port given, node 0's address from Slurm
    assert (cfg.master_addr, cfg.master_port) == ("gpu07", 777)
    monkeypatch.setenv("PET_NNODES", "1")
    monkeypatch.setenv("PET_NODE_RANK", "0")
    cfg = parse_args([script])
    assert (cfg.nnodes, cfg.node_rank) == (1, 0)
    cfg = parse_args(["--standalone", script])
    assert (cfg.nnodes, cfg.master_addr) == (1, "127.0.0.1")


def test_outside_a_step_nothing_changes(step, script, monkeypatch):
    step("gpu08")
    monkeypatch.delenv("SLURM_STEP_ID")  # the batch script's own shell
    cfg = parse_args([script])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr) == (1, 0, "127.0.0.1")


def test_a_step_with_several_tasks_per_node_is_one_line(step, script, capsys):
    step("gpu08", SLURM_STEP_NUM_TASKS="6")
    with pytest.raises(SystemExit) as e:
        parse_args([script])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "run one mindio-run per node (srun --ntasks-per-node=1)" in err, err
    # every flag given: the step's shape is left to the user
    cfg = parse_args(["--nnodes", "6", "--node-rank", "5", "--master-addr", "h0", "--master-port", "9", script])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (6, 5, "h0", 9)


def test_node_index_falls_back_to_slurm_nodeid():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NODEID": "2"}
    a = allocation(env)
    assert (a.nodes, a.index, a.port()) == (("n1", "n2", "n3", "n4"), 2, 29407)
    with pytest.raises(ValueError, match="cannot tell which node"):
        allocation({**env, "SLURM_NODEID": "9"})
    assert allocation({k: v for k, v in env.items() if k != "SLURM_STEP_ID"}) is None

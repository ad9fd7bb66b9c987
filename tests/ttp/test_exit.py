"""The end of a process: mindio's exit teardown (mindio/ttp/shutdown.py) leaves nothing running.

Issue 13: a rank whose training had finished died at exit with SIGABRT ("terminate called without an
active exception") -- a gloo worker thread finished the last collective's work while the interpreter
shut down. The probe (_exit_probe.py) ends exactly like that run, without tearing anything down itself;
what it records just before the interpreter shuts down shows the teardown happened while it was whole.
"""
import json
import os
import subprocess
import sys

import pytest

from mindio._ports import free_port

from ._harness import ROOT, run_ranks

PROBE = os.path.join(os.path.dirname(__file__), "_exit_probe.py")
DYNAMO_PROBE = os.path.join(os.path.dirname(__file__), "_dynamo_probe.py")
pytestmark = pytest.mark.slow


def _run(tmp_path, mode):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, TTP_LOG_STDOUT="1", OMP_NUM_THREADS="1")
    codes, outs = run_ranks(PROBE, [[r, port, tmp_path, mode] for r in range(2)], env, 120)
    for r, code in enumerate(codes):
        assert code == 0, f"rank {r} exited with {code}:\n{outs[r][-3000:]}"
    threads = [json.loads((tmp_path / f"threads{r}.json").read_text()) for r in range(2)]
    return outs, threads


@pytest.mark.timeout(150)
def test_exit_teardown_ends_every_collective_and_control_thread(tmp_path):
    outs, threads = _run(tmp_path, "drop")
    for r, t in enumerate(threads):
        native = [n for n in t["native"] if n.startswith(("pt_gloo", "gloo_", "ZMQbg"))]
        assert native == [], (r, t, outs[r][-2000:])  # groups destroyed (workers joined), zmq terminated
        assert [n for n in t["python"] if n.startswith("mindio")] == [], (r, t)  # links, controller joined
    assert "still run" not in outs[0] + outs[1]


@pytest.mark.timeout(150)
def test_exit_teardown_names_groups_the_script_still_holds(tmp_path):
    outs, threads = _run(tmp_path, "keep")
    for r in range(2):
        line = next((x for x in outs[r].splitlines() if "gloo worker thread(s) still run" in x), "")
        assert "2 gloo worker thread(s) still run: drop the script's references to process groups" in line \
            and len(line) < 250, outs[r][-2000:]  # one short line with the fix (issue 30)
        assert "pt_gloo_runloop" in threads[r]["native"]  # what the message is about


def _probe(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, DYNAMO_PROBE, mode, str(free_port())], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_importing_mindio_ttp_after_torch_lets_destroy_end_the_default_group():
    """torch 2.13: torch._dynamo first imported after init_process_group (here by torch.optim.Adam's
    constructor) keeps the default group alive past destroy_process_group -- its gloo threads run into
    the interpreter shutdown (pytorch/pytorch#190489). ``import torch; from mindio import ttp`` imports it
    before the group exists (shutdown.import_dynamo_early): destroy then ends every gloo thread."""
    plain = _probe("plain")
    assert not plain["dynamo_before_init"] and "pt_gloo_runloop" in plain["threads"], plain  # torch's behaviour
    with_mindio = _probe("mindio")
    assert with_mindio["dynamo_before_init"], with_mindio
    assert not [t for t in with_mindio["threads"] if t.startswith(("pt_gloo", "gloo_"))], with_mindio


def test_dynamo_is_imported_early_only_for_scripts_that_name_what_imports_it(tmp_path):
    """mindio/_dynamo.py: a script that never builds a torch optimizer, DDP, FSDP, torch.compile or megatron
    would pay ~1 CPU-s per process for nothing."""
    from mindio import _dynamo

    cases = {"opt.py": "opt = torch.optim.Adam(model.parameters())\n", "sgd.py": "from torch import optim\n",
             "ddp.py": "from torch.nn.parallel import DistributedDataParallel as DDP\n",
             "mcore.py": "from mindio import megatron as mio\n", "toy.py": "import torch\nx = torch.ones(2)\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    assert {n: _dynamo.wanted(str(tmp_path / n)) for n in cases} == {
        "opt.py": True, "sgd.py": True, "ddp.py": True, "mcore.py": True, "toy.py": False}
    assert not _dynamo.wanted(str(tmp_path / "missing.py")) and not _dynamo.wanted(None)
    code = "import sys, torch, mindio.ttp; print('torch._dynamo' in sys.modules)"
    (tmp_path / "toy_main.py").write_text(code + "\n")
    out = subprocess.run([sys.executable, str(tmp_path / "toy_main.py")], env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_mindio_ttp_imported_before_torch_does_not_import_dynamo():
    """mindio-run's agent imports mindio.ttp for its controller and never torch._dynamo."""
    code = "import sys, mindio.ttp.controller; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr

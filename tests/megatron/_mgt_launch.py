"""Launch a small torchrun job for the megatron tests: loopback, free port, hard timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mindio._ports import free_port  # outside the ephemeral range (mindio/_ports.py)
from tests._exits import assert_no_signal_deaths, check_codes, injected, sent_by_faults

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "megatron" / "pretrain_gpt.py"

__all__ = ["REPO", "PRETRAIN", "free_port", "torchrun", "reference_run", "losses", "assert_steps_logged_once",
           "grad_norms", "digests", "have_megatron", "assert_relaunch_reproduces", "SLOW_MEGATRON", "LAYOUTS",
           "LAYOUT_ITERS", "layout_args", "layout_reference", "ha_reference"]


def _kill_tree(proc) -> None:
    """SIGKILL the launcher and every descendant: torchrun starts its workers in their own
    sessions, so killing the launcher's process group alone would leave them running. ``proc`` may also
    be a process forked by a fork server (mindio.launch.forkserver.ForkedWorker): it shares the server's
    process group, so it is killed alone (through its pidfd), then its descendants."""
    try:
        import psutil

        victims = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing or the launcher already gone
        victims = []
    if isinstance(proc, subprocess.Popen):  # started with start_new_session: its group is its own
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        proc.kill()
    for v in victims:
        try:
            v.kill()
        except Exception:
            pass


def torchrun(script, args, nproc: int = 4, timeout: float = 150, env=None, check=True,
             launcher: str = "torch.distributed.run", sent=None):
    """Run ``script`` under torch.distributed.run; return stdout; fail with the output on error.

    ``check=False``: return ``(returncode, output)`` instead of failing on a non-zero exit.
    ``launcher="mindio.launch.cli"`` runs it under mindio-run instead. Always fails if the launcher
    died by a signal, or reports a worker that did, unless an ``--inject`` fault in ``args`` or ``sent``
    ({rank: signal name}) explains it (tests/_exits.py).
    """
    cmd = [sys.executable, "-W", "ignore", "-m", launcher,
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDIO_ACP_IDLE_EXIT": "20",
                "TTP_PORT": str(free_port()),  # the controller's port (else MASTER_PORT+1)
                "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out = "(no output: a process still holds the pipe)"
        raise AssertionError(f"torchrun timed out after {timeout}s:\n{out[-8000:]}")
    check_codes({launcher: proc.returncode}, what="launcher", context=out[-6000:])
    assert_no_signal_deaths(out, sent_by_faults(injected(args), also=sent, per_node=nproc))
    if not check:
        return proc.returncode, out
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{out[-6000:]}")
    return out


REFERENCE_LAUNCHER = "mindio.launch.cli"


def reference_run(script, args, nproc: int = 4, timeout: float = 400, env=None) -> str:
    """A fault-free run whose only use is its numbers (losses, digests) for a comparison: launched by
    mindio-run, whose fork server imports torch and megatron-core once for all ranks instead of once per
    rank as torchrun does (~7 CPU-s less for 4 ranks of the example on this 2-core CI machine). The
    launcher changes no number (the ranks run the same script with the same environment;
    test_pretrain_gpt.py::test_runs_under_mindio_run checks it, and so does every comparison of a
    torchrun run with such a reference)."""
    return torchrun(script, args, nproc=nproc, timeout=timeout, env=env, launcher=REFERENCE_LAUNCHER)


LOSS_LINE = r"iteration\s+(\d+)/\d+ \| lm loss"  # rank 0's line of an iteration (the example's train())


def losses(out: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(LOSS_LINE + r" ([0-9.eE+-]+)", out)}


def assert_steps_logged_once(out: str, iters: int, node_lost_at: int | None = None,
                             line: str = LOSS_LINE) -> None:
    """Rank 0 printed ``line`` (its group: the iteration) once for every iteration 1..``iters``: none
    repeated, none lost. One exception, for a node loss (``kill-node``) whose lock step is
    ``node_lost_at``: the firing rank kills its node's agent, and the node's other ranks die wherever
    they are -- possibly inside the collectives that follow the lock step's update (the loss all-reduce,
    the replica check). Rank 0's side of that collective then fails (gloo: connection closed), so the
    lock step's line may be missing; its update was made everywhere (the event's lock_step says so)."""
    counts = Counter(int(m.group(1)) for m in re.finditer(line, out))
    twice = sorted(s for s, n in counts.items() if n > 1)
    want = set(range(1, iters + 1))
    missing, extra = sorted(want - set(counts)), sorted(set(counts) - want)
    excused = {node_lost_at} if node_lost_at is not None else set()
    assert not twice and not extra and set(missing) <= excused, \
        f"{line!r}: repeated {twice}, beyond {iters}: {extra}, missing {missing} (excused: {sorted(excused)})"


def grad_norms(out: str) -> dict:
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"iteration\s+(\d+)/\d+ \| .*grad norm ([0-9.eE+-]+)", out)}


def digests(out: str) -> list:
    return re.findall(r"state-digest: ([0-9a-f]{64})", out)


def have_megatron() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def assert_relaunch_reproduces(ckpt: Path, it: int, args: list, out: str, workdir: Path, iters: int,
                               samples: Path | None = None) -> None:
    """The checkpoint of iteration ``it`` under ``ckpt`` (Megatron's iter_XXXXXXX layout), relaunched
    alone with ``args``, reproduces ``out`` (the continuing run's output) bit for bit: the same loss at
    every later iteration and the same final state digest. The relaunch goes through mindio-run's fork
    server, as :func:`reference_run` (the launcher is not what it tests and changes no number). ``samples``: the
    relaunch appends its sample-id log there (``--log-samples``)."""
    import shutil

    again = workdir / "relaunch"
    again.mkdir()
    shutil.copytree(ckpt / f"iter_{it:07d}", again / f"iter_{it:07d}")
    (again / "latest_checkpointed_iteration.txt").write_text(str(it))
    log = ["--log-samples", samples] if samples is not None else []  # appended to the first run's log
    re_out = reference_run(PRETRAIN, list(args) + log + ["--load", again], timeout=400)
    assert f"loaded checkpoint iteration {it}" in re_out
    got, re_losses = losses(out), losses(re_out)
    assert sorted(re_losses) == list(range(it + 1, iters + 1))
    assert all(repr(re_losses[i]) == repr(got[i]) for i in re_losses), \
        [(i, got[i], re_losses[i]) for i in re_losses if got[i] != re_losses[i]][:5]
    assert digests(re_out)[-1] == digests(out)[-1]


# pytestmark of the multi-process Megatron tests: marked, and skipped without megatron-core
SLOW_MEGATRON = [
    pytest.mark.megatron,
    pytest.mark.slow,
    pytest.mark.skipif(not have_megatron(), reason="megatron-core is not installed"),
]


# The parallel layouts of test_layouts_megatron.py and the elastic PP test (4 ranks each). Every one of them
# shares one fault-free reference run per session (layout_reference).
LAYOUTS = {
    "tp1pp2dp2": ["--pipeline-model-parallel-size", 2, "--global-batch-size", 8],
    "moe_ep2dp2": ["--num-experts", 4, "--expert-model-parallel-size", 2],
    # no DP replica exists: --replica-cnt 1; 4 layers in 2 virtual stages per pipeline rank (interleaved)
    "tp2pp2dp1_vpp2": ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, "--num-layers", 4,
                       "--num-layers-per-virtual-pipeline-stage", 1, "--global-batch-size", 4, "--replica-cnt", 1],
}
LAYOUT_ITERS = 20


def layout_args(layout: str, ha_flag: str = "--enable-high-availability", dump: bool = False) -> list:
    """The example's flags for ``layout``; ``dump``: the job plans a last-words checkpoint (the caller gives
    ``--save``), else ``--no-dump`` (high availability without ``--save`` is refused at start)."""
    return ["--use-distributed-optimizer", ha_flag, *([] if dump else ["--no-dump"]), "--train-iters",
            LAYOUT_ITERS, "--seed", 1234, *LAYOUTS[layout]]


def layout_reference(fault_free_run, layout: str) -> str:
    """Output of the fault-free run of ``layout`` (:func:`reference_run`, high availability on, no fault),
    once per session. Its losses and digest are those of any run of the layout with the same seed and
    replica count: the flags that only switch on mindio (which strategies, which launcher) change no number."""
    args = layout_args(layout)
    key = (str(PRETRAIN), REFERENCE_LAUNCHER, tuple(map(str, args)))
    return fault_free_run(key, lambda d: Run(reference_run(PRETRAIN, args + ["--log-samples", d / "samples"]),
                                             d / "samples"))


class Run(str):
    """A reference run's output; ``.samples``: the directory of its sample-id log (``--log-samples``,
    tests/_samples.py), which the run's flags (the cache key) do not name."""

    def __new__(cls, out: str, samples: Path):
        self = super().__new__(cls, out)
        self.samples = samples
        return self


HA_REFERENCE_ENV = {"HIGH_AVAILABILITY": "recover-in-place,dump"}


def ha_reference(fault_free_run, args) -> str:
    """Output of the fault-free run of the example with ``args`` under mindio-run with
    ``HIGH_AVAILABILITY=recover-in-place,dump`` (the controller in node 0's agent), once per session:
    shared by test_recover_megatron.py and test_retry_megatron.py (one group of tests/conftest.py). The
    retry runs (torchrun or mindio-run, the script's flags only) end with the same numbers: the strategies
    switched on and the launcher change none."""
    key = (str(PRETRAIN), REFERENCE_LAUNCHER, tuple(map(str, args)), tuple(sorted(HA_REFERENCE_ENV.items())))

    def run(d: Path) -> str:
        return Run(reference_run(PRETRAIN, list(args) + ["--log-samples", d / "samples"], timeout=330,
                                 env={**HA_REFERENCE_ENV, "MINDIO_EVENT_LOG": str(d / "ref.jsonl"),
                                      "MINDIO_DRILL_DIR": str(d), "TTP_LOG_PATH": str(d / "logs")}),
                   d / "samples")

    return fault_free_run(key, run)

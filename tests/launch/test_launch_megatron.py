"""The Megatron example (examples/megatron/pretrain_gpt.py) asks for worker reboot with its own flag
(--enable-worker-reboot) under mindio-run without --high-availability: no launcher agent would replace a
dead rank, so the job fails at start with one line naming the flag to add, before any step (it used to
train, and end with 76 at its first dead rank). With the flag, recover-in-place on this example is
tests/recovery/test_recover_megatron.py; with ``--high-availability dump`` only, the launcher enables it
from the ranks' registration (test_launch_ha.py)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from _mgt_launch import PRETRAIN, SLOW_MEGATRON, torchrun  # noqa: E402

import pytest  # noqa: E402

pytestmark = SLOW_MEGATRON


@pytest.mark.timeout(240)
def test_worker_reboot_without_the_launcher_flag_fails_at_start(tmp_path):
    args = ["--use-distributed-optimizer", "--enable-high-availability", "--no-dump", "--enable-worker-reboot",
            "--inject", "kill:rank=1,step=7", "--train-iters", 10, "--seed", 1234]
    code, out = torchrun(PRETRAIN, args, nproc=2, timeout=220, launcher="mindio.launch.cli", check=False,
                         env={"TTP_LOG_PATH": str(tmp_path / "logs"), "MINDIO_DRILL_DIR": str(tmp_path)})
    assert code == 1, out[-6000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("mindio-run: job failed"))
    assert "ConfigError: worker reboot" in line, line
    assert "add `--high-availability dump,recover-in-place` to mindio-run" in line, line
    assert "iteration" not in out and "injecting" not in out, out[-6000:]  # it failed before any step

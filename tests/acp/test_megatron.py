"""MINDIO_AUTO_PATCH_MEGATRON against the real megatron-core 0.16.1 (skipped if it is not installed)."""
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(acp_env, patch: str) -> str:
    ckpt = os.path.join(acp_env["ck"], f"iter_{patch}")
    os.makedirs(ckpt)
    env = dict(os.environ, MINDIO_AUTO_PATCH_MEGATRON=patch)
    proc = subprocess.run([sys.executable, "-m", "tests.acp._megatron_child", ckpt], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_patch_routes_megatron_common_state_through_mindio(acp_env):
    out = _run(acp_env, "1")
    assert "COMMON_MINDIO True" in out       # written by the mindio daemon, in mindio's format
    assert "PATCHED True" in out and "ROUNDTRIP True" in out


def test_without_the_variable_megatron_is_untouched(acp_env):
    out = _run(acp_env, "0")
    assert "COMMON_MINDIO False" in out            # torch.save's own file
    assert "PATCHED False" in out and "ROUNDTRIP True" in out

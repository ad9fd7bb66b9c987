"""The SDK core imports no megatron, and importing the adapter patches nothing."""

import subprocess
import sys

import pytest

from _mgt_launch import REPO, have_megatron


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.timeout(150)
def test_core_imports_no_megatron():
    code = ("import sys, mindio, mindio.ttp, mindio.acp, mindio.adapter; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    assert _run(code) == "[]"


@pytest.mark.timeout(150)
@pytest.mark.skipif(not have_megatron(), reason="megatron-core is not installed")
def test_importing_the_adapter_applies_no_cpu_patch():
    code = ("import sys, torch; before = (torch.cuda.current_device, torch.zeros, torch.Tensor.type, torch.compile); "
            "import mindio.megatron as m; from mindio.megatron import _cpu_compat; "
            "print(before == (torch.cuda.current_device, torch.zeros, torch.Tensor.type, torch.compile), "
            "_cpu_compat.is_applied(), 'torch._dynamo' in sys.modules)")
    # megatron's torch.compile decorations are deferred to their first call (mindio/_lazy_compile.py):
    # nothing of torch._dynamo is imported, and torch.compile itself is left as it was
    assert _run(code) == "True False False"

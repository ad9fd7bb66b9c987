"""mindio/_lazy_compile.py: under ``deferred_compile`` a function given to ``torch.compile`` is compiled
by the real ``torch.compile`` (same arguments) at its first call; nothing of torch._dynamo is imported
before. Run in a fresh interpreter: pytest's own may have imported torch._dynamo already."""
import subprocess
import sys

CODE = r"""
import sys, torch
from mindio._lazy_compile import deferred_compile

real = torch.compile
def f(x):
    return x * 2 + 1
with deferred_compile():
    g = torch.compile(f, backend="eager")             # as megatron's @jit_fuser
    h = torch.compile(backend="eager", dynamic=False)(f)  # the decorator-with-arguments form
assert torch.compile is real
assert "torch._dynamo" not in sys.modules, "compiled at decoration time"
assert g.__wrapped__ is f and g.__name__ == "f"
x = torch.arange(4.0)
assert torch.equal(g(x), f(x)) and torch.equal(h(x), f(x)) and torch.equal(g(x + 1), f(x + 1))
assert "torch._dynamo" in sys.modules, "the first call did not compile"
with deferred_compile():
    m = torch.compile(torch.nn.Linear(2, 2), backend="eager")  # a module: compiled as before
from torch._dynamo.eval_frame import OptimizedModule
assert isinstance(m, OptimizedModule)
print("ok")
"""


def test_compile_is_deferred_to_the_first_call():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]

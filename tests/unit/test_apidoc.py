"""docs/api.md is generated from the docstrings (scripts/apidoc.py) and is up to date; every tft_*
function documents its arguments and what it returns."""
import inspect
import subprocess
import sys
from pathlib import Path

import mindio.ttp as ttp

ROOT = Path(__file__).resolve().parents[2]


def test_docs_api_md_is_up_to_date():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "apidoc.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_every_tft_function_documents_its_arguments_and_return():
    names = [n for n in ttp.__all__ if n.startswith("tft_")]
    assert len(names) >= 46
    for name in names:
        func = getattr(ttp, name)
        doc = inspect.getdoc(func) or ""
        assert "Returns:" in doc, f"{name}: no Returns section"
        params = [p for p in inspect.signature(func).parameters]
        if params:
            assert "Args:" in doc, f"{name}: no Args section"
            for p in params:
                assert p in doc, f"{name}: argument {p} not documented"


def test_the_lazy_package_names_every_api_function_and_loads_without_torch():
    """mindio.ttp loads its API on first use (PEP 562): its name list is the API's, and importing the
    package -- or a part of it such as the relay's wire -- imports neither torch nor the processor."""
    from mindio.ttp import api

    assert sorted(ttp._API) == sorted(api.__all__)
    assert all(getattr(ttp, name) is getattr(api, name) for name in api.__all__)
    code = ("import sys, mindio.ttp, mindio.ttp.wire.relay, mindio.ttp.controller.controller; "
            "print(sorted(m for m in ('torch', 'mindio.ttp.api', 'mindio.ttp.processor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])

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

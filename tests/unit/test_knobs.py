"""Every environment variable mindio reads is declared in mindio/_knobs.py (and so listed by
``python -m mindio._knobs``). The reads are found in the source, not in a list kept by hand."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from mindio import _knobs

PACKAGES = [Path(__file__).resolve().parents[2] / name for name in ("mindio", "mindio_ttp", "mindio_acp")]
_ENVIRON_NAMES = {"environ", "env"}  # os.environ, and the ``env = os.environ if environ is None`` idiom


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in _ENVIRON_NAMES) or \
        (isinstance(node, ast.Name) and node.id in _ENVIRON_NAMES)


def _name(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def reads(tree) -> set:
    """Names read through ``os.environ[...]``, ``os.environ.get/pop/setdefault``, ``os.getenv`` and
    ``_knobs.get`` (a knob read by name)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            found.add(_name(node.slice))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in ("get", "pop", "setdefault") and _is_environ(func.value):
                found.add(_name(node.args[0]))
            elif func.attr == "getenv" or (func.attr == "get" and isinstance(func.value, ast.Name)
                                           and func.value.id in ("_knobs", "knobs")):
                found.add(_name(node.args[0]))
    return found - {None}


def test_every_environment_variable_read_is_declared():
    read_where: dict[str, list] = {}
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            if path.name == "_knobs.py":
                continue
            for name in reads(ast.parse(path.read_text(), str(path))):
                read_where.setdefault(name, []).append(str(path.relative_to(package.parent)))
    assert len(read_where) > 30, "the scan found too few reads: is it still looking at the right calls?"
    undeclared = {name: where for name, where in read_where.items() if name not in _knobs.KNOBS}
    assert not undeclared, f"read but not declared in mindio/_knobs.py: {undeclared}"


def test_the_scan_sees_every_form_of_read():
    src = ('import os\nos.environ["A"]\nos.environ.get("B", "")\nos.getenv("C")\nenv.get("D")\n'
           '_knobs.get("E")\nos.environ["F"] = "1"\n')
    assert reads(ast.parse(src)) == {"A", "B", "C", "D", "E"}


def test_python_m_knobs_lists_user_settings_and_launcher_variables():
    out = subprocess.run([sys.executable, "-m", "mindio._knobs"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    for name in ("MINDIO_NATIVE", "MINDIO_PG_TIMEOUT", "TTP_LOG_PATH", "MINDIO_REBOOT_GEN"):
        assert name in out
    user, _, launcher = out.partition("set by mindio-run / torchrun")
    assert "MINDIO_PG_TIMEOUT" in user and "MINDIO_REBOOT_GEN" in launcher and "MINDIO_REBOOT_GEN" not in user

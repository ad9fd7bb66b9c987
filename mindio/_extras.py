"""mindio's optional dependencies (pyproject's extras): which extra provides a missing module.

``hint(exc)`` turns a ``ModuleNotFoundError`` for a module of an extra into the command that installs it
(``pip install 'mindio[megatron]'``); ``require("megatron.core", "megatron")`` raises that error with the
command in its message. The extras are read from mindio's installed metadata, so this stays true to
pyproject.toml; the table below only names distributions whose import name differs from theirs.
"""
from __future__ import annotations

import re

__all__ = ["extra_of", "hint", "require"]

# distribution (normalised) -> its top-level import name, where the two differ
_IMPORT_NAME = {"megatron-core": "megatron", "pyzmq": "zmq"}


def _extras() -> dict[str, str]:
    """{top-level module: extra} from mindio's ``Requires-Dist: X; extra == "E"`` entries."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("mindio") or []
    except PackageNotFoundError:  # running from a source tree that was never installed
        return {}
    out = {}
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if m:
            dist = re.sub(r"[-_.]+", "-", m.group(1)).lower()
            out[_IMPORT_NAME.get(dist, dist.replace("-", "_"))] = m.group(2)
    return out


def extra_of(module: str) -> str | None:
    """The mindio extra that installs ``module`` (any dotted name), or None."""
    return _extras().get(module.partition(".")[0]) if module else None


def hint(exc: BaseException) -> str | None:
    """``"pip install 'mindio[E]'"`` when ``exc`` is a missing module of extra ``E``, else None."""
    if isinstance(exc, ModuleNotFoundError):
        extra = extra_of(exc.name or "")
        if extra:
            return f"module {exc.name!r} is part of mindio's optional {extra!r} dependencies: pip install 'mindio[{extra}]'"
    return None


def require(module: str, extra: str) -> None:
    """Import ``module``; when it is missing, raise ModuleNotFoundError naming the extra to install."""
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"{exc}; install mindio's optional {extra!r} dependencies: "
                                  f"pip install 'mindio[{extra}]'", name=exc.name) from None

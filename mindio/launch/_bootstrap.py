"""Worker bootstrap: a warm interpreter that becomes a training process when told to.

Protocol (agent -> bootstrap, on the bootstrap's stdin):

1. The agent starts ``python -m mindio.launch._bootstrap SCRIPT`` (or ``-m MODULE``) with the node-wide
   environment (OMP_NUM_THREADS, MASTER_ADDR, ...). The bootstrap arranges to die with its agent
   (PR_SET_PDEATHSIG), imports torch and torch.distributed, then imports the modules the training
   script imports at top level (found by parsing the script with ``ast``; nothing of the script runs).
   This is the expensive part of a process start (~1-5 s) and happens *before* a rank needs it.
2. It then blocks reading one JSON line ``{"env": {...}, "argv": [...]}`` from stdin: the assignment.
   An empty line or EOF means "not needed": it exits 0.
3. It applies the environment (RANK, LOCAL_RANK, WORLD_SIZE, ...), sets ``sys.argv`` and runs the
   script as ``__main__``; its exit status is the script's. A replacement process (recover-in-place /
   recover: ``MINDIO_REBOOT_GEN`` set) first gets :func:`mindio.ttp.reboot.install`, so the script's
   ``init_process_group`` joins the survivors' new generation.
"""
from __future__ import annotations

import ast
import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the agent kills its workers explicitly anyway
        pass
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)


def top_level_imports(path: str) -> list[str]:
    """Module names imported at the top level of ``path`` (not inside functions or __main__ blocks)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _preload(target: str, is_module: bool) -> None:
    import torch  # noqa: F401  (the dominant start-up cost)
    import torch.distributed  # noqa: F401

    if is_module:
        return
    script_dir = os.path.dirname(os.path.abspath(target))
    sys.path.insert(0, script_dir)
    try:
        for name in top_level_imports(target):
            try:
                importlib.import_module(name)
            except Exception:  # the script will raise the same error itself, with its own context
                pass
    finally:
        sys.path.remove(script_dir)


def main() -> None:
    _die_with_parent()
    args = sys.argv[1:]
    if not args:
        sys.exit("usage: python -m mindio.launch._bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    is_module = args[0] == "-m"
    target = args[1] if is_module else args[0]
    t0 = time.monotonic()
    _preload(target, is_module)
    warm_s = time.monotonic() - t0
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    assignment = json.loads(line)
    os.environ.update({k: str(v) for k, v in assignment["env"].items()})
    os.environ["MINDIO_WORKER_WARMUP_S"] = f"{warm_s:.3f}"
    if os.environ.get("MINDIO_REBOOT_GEN"):  # a replacement process joins the survivors' generation
        from mindio.ttp import reboot

        reboot.install()
    argv = assignment.get("argv") or []
    # stdin was the assignment channel; give the script an empty one, as torchrun does.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if is_module:
        sys.argv = [target, *argv]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()

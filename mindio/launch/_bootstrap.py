"""Worker bootstrap: a warm interpreter that becomes a training process when told to.

Protocol (agent -> bootstrap, on the bootstrap's stdin):

1. The agent starts ``python -m mindio.launch._bootstrap SCRIPT`` (or ``-m MODULE``) with the node-wide
   environment (OMP_NUM_THREADS, MASTER_ADDR, ...). The bootstrap arranges to die with its agent
   (PR_SET_PDEATHSIG) and imports what is expensive and cannot depend on which rank it becomes:
   torch, torch.distributed, torch._dynamo (when the script wants it: mindio/_dynamo.py), and those of
   the script's top-level imports (found by parsing the script with ``ast``; nothing of the script runs;
   ``from X import Y``: ``X``, and ``X.Y`` where that is a module; the body of a top-level ``try:``
   counts) that belong to packages known not to read the rank environment at import time
   (:data:`PRELOAD_SAFE`, plus ``MINDIO_PRELOAD``), and the torch modules that functions the script
   calls import at their first call (:data:`FIRST_CALL_IMPORTS`). The script's own
   modules are NOT imported here: a module that reads ``LOCAL_RANK`` at import time must see its
   rank's value, as under torchrun. This is the expensive part of a process start (~1-5 s) and happens
   *before* a rank needs it.
2. It then blocks reading one JSON line from stdin, the assignment: ``{"env": {...}, "argv": [...],
   "stdout": PATH|null, "stderr": PATH|null}``. An empty line or EOF means "not needed": it exits 0.
3. It applies the environment (RANK, LOCAL_RANK, WORLD_SIZE, ... TORCHELASTIC_ERROR_FILE), sends its
   stdout/stderr to the given files (``--redirects`` / ``--tee`` / ``--local-ranks-filter``; null: the
   agent's console), sets ``sys.argv`` and runs the script as ``__main__``; its exit status is the
   script's. A replacement process (recover-in-place / recover: ``MINDIO_REBOOT_GEN`` set) first gets
   :func:`mindio.ttp.processor.reboot.install`, so the script's ``init_process_group`` joins the survivors' new
   generation. ``--exec PROGRAM`` (``mindio-run --no-python``): nothing is preloaded; once assigned, the
   bootstrap replaces itself with PROGRAM (it still dies with its agent: PR_SET_PDEATHSIG survives exec).
4. An exception that escapes the script is printed as Python would, but starting at the script's frame
   (the bootstrap's and runpy's frames are dropped), recorded in TORCHELASTIC_ERROR_FILE as torchrun's
   ``@record`` does (mindio.launch.failures), with the ``pip install`` command when it is a missing
   module of one of mindio's extras; the exit status is 1, as for any uncaught exception.
"""
from __future__ import annotations

import ast
import atexit
import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1

# Packages whose import reads no rank variable (RANK, LOCAL_RANK, WORLD_SIZE, ...): preloading them in
# an interpreter that has no rank yet is invisible to the script. Extend with MINDIO_PRELOAD=a,b.
PRELOAD_SAFE = ("torch", "numpy", "megatron.core", "mindio")


def _die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent (the agent; a fork server's child: the fork server) ends.
    ``parent``: its pid, when known (a fork child); else the parent is gone when init adopted us."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the agent kills its workers explicitly anyway
        pass
    if os.getppid() != parent if parent is not None else os.getppid() == 1:  # it died before prctl took effect
        os._exit(1)


def _parse(path: str):
    """The script at ``path`` parsed (not run), or None if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _top_level(path: str) -> list:
    """The top-level statements of the script at ``path``, with those of a top-level ``try:`` body (the
    ``try: from mindio import ttp / except ImportError:`` of an optional dependency); [] if it cannot be read."""
    tree = _parse(path)
    body = tree.body if tree else []
    return [n for node in body for n in (node.body if isinstance(node, ast.Try) else [node])]


# torch functions that import a module of torch at their first call: a script that calls one of them
# anywhere gets that module preloaded too (torch.use_deterministic_algorithms imports torch._inductor,
# ~0.5 CPU-s in each worker that calls it).
FIRST_CALL_IMPORTS = {"use_deterministic_algorithms": "torch._inductor.config"}


def first_call_imports(path: str) -> list[str]:
    """The modules of :data:`FIRST_CALL_IMPORTS` that the script at ``path`` calls for, anywhere in it."""
    tree = _parse(path)
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
              for node in (ast.walk(tree) if tree else ()) if isinstance(node, ast.Call)}
    return [module for name, module in FIRST_CALL_IMPORTS.items() if name in called]


def top_level_imports(path: str) -> list[str]:
    """Module names imported at the top level of ``path`` (not inside functions or __main__ blocks)."""
    names: list[str] = []
    for node in _top_level(path):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def submodule_imports(path: str) -> list[str]:
    """``X.Y`` for each name ``Y`` of a top-level ``from X import Y`` in ``path``: ``Y`` may be a submodule
    that importing ``X`` alone does not import (``from mindio import megatron as mio``, as docs/megatron.md
    writes it, imports megatron-core)."""
    return [f"{node.module}.{alias.name}" for node in _top_level(path)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            for alias in node.names if alias.name != "*"]


def preloadable(names, extra=()) -> list[str]:
    """Those of ``names`` inside a package of :data:`PRELOAD_SAFE` or ``extra``."""
    safe = PRELOAD_SAFE + tuple(extra)
    return [n for n in names if any(n == s or n.startswith(s + ".") for s in safe)]


def preload_plan(target: str, is_module: bool, env=None) -> tuple[bool, list[str]]:
    """What :func:`_preload` imports for ``target`` beyond torch and torch.distributed: whether torch._dynamo
    comes first (mindio/_dynamo.py), and the modules, in order (megatron-core's first when one of them is
    of megatron). Reads the script, never runs it; ``env``: the environment whose ``MINDIO_PRELOAD`` counts."""
    from .. import _dynamo

    env = os.environ if env is None else env
    extra = tuple(filter(None, (s.strip() for s in env.get("MINDIO_PRELOAD", "").split(","))))
    names = [] if is_module else top_level_imports(target)
    wanted = preloadable(names, extra) + [n for n in extra if n not in names]
    # then the submodules a ``from X import Y`` names (a Y that is no module fails to import: skipped below)
    wanted += [n for n in preloadable([] if is_module else submodule_imports(target), extra) if n not in wanted]
    wanted += [] if is_module else first_call_imports(target)
    return (not is_module and _dynamo.wanted(target)), wanted


def wants_megatron(wanted: list[str]) -> bool:
    return any(n == "megatron" or n.startswith("megatron.") for n in wanted)


def _preload(target: str, is_module: bool) -> list[str]:
    import torch  # noqa: F401  (the dominant start-up cost)
    import torch.distributed  # noqa: F401

    if not is_module:  # before the script's init_process_group, if it wants it (mindio/_dynamo.py)
        from .. import _dynamo

        _dynamo.import_early(target)

    done = []
    _, wanted = preload_plan(target, is_module)
    if wants_megatron(wanted):
        try:  # first, with its torch.compile decorations deferred to their first call (mindio/_lazy_compile.py)
            from mindio._lazy_compile import import_megatron_core

            import_megatron_core()
            from mindio.megatron import torch_dist

            torch_dist.warm()  # what a dump imports (the adapter would, in every rank)
        except Exception:  # not installed or broken: the script raises the same error itself
            pass
    for name in wanted:
        try:  # the script's directory is not on sys.path yet: only installed packages are found
            module = importlib.import_module(name)
            for public in getattr(module, "__all__", ()):  # a package that loads its names on first use
                getattr(module, public, None)  # (PEP 562: mindio.ttp) loads them now, in the warm parent
            done.append(name)
        except Exception:  # the script will raise the same error itself, with its own context
            pass
    return done


def _redirect(fd: int, path: str | None) -> None:
    """Send ``fd`` (1 or 2) to ``path`` (appended: a replacement continues its rank's file)."""
    if not path:
        return
    (sys.stdout if fd == 1 else sys.stderr).flush()
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)  # the umask applies
    os.dup2(target, fd)
    os.close(target)


def _report(exc: BaseException) -> None:
    """Print ``exc`` from the script's first frame on, and record it for the agent (failures.py)."""
    from . import failures

    if failures.report_one_line(exc):  # a refused setting, no controller: its message says it all
        return
    trace = failures.format_exception(exc)
    sys.stderr.write(trace)
    failures.record(f"{type(exc).__name__}: {exc}", trace)
    from .._extras import hint

    h = hint(exc)
    if h and "pip install" not in str(exc):
        print(f"mindio-run: rank {os.environ.get('RANK', '?')}: {h}", file=sys.stderr)
    sys.stderr.flush()


def _run(target: str, is_module: bool, argv: list) -> None:
    sys.argv = [target, *argv]
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:  # sys.exit("why"): the launcher's summary names why, not only "exit code 1"
        if isinstance(exc.code, str):
            from . import failures

            failures.record(f"SystemExit: {exc.code}", f"SystemExit: {exc.code}\n")
        raise
    except Exception as exc:  # KeyboardInterrupt and mindio's AbortTraining pass through
        _report(exc)
        sys.exit(1)


def parse_target(args: list) -> tuple:
    """``(target, is_module, is_program)`` from ``SCRIPT`` / ``-m MODULE`` / ``--exec PROGRAM``."""
    if not args:
        sys.exit("usage: python -m mindio.launch._bootstrap (SCRIPT | -m MODULE | --exec PROGRAM) [ARGS...]")
    is_module, is_program = args[0] == "-m", args[0] == "--exec"
    return (args[1] if is_module or is_program else args[0]), is_module, is_program


def _release_groups_at_exit() -> None:
    """(atexit, every worker) Release the process groups the script left while the interpreter is whole
    (mindio/ttp/shutdown.py): a gloo group left to the interpreter's shutdown can abort the process with
    SIGABRT, e.g. a plain worker (no mindio in its script) that raised on a lost peer's "Connection reset
    by peer". Imported here, at exit, not before the script: importing mindio.ttp first would run its
    torch._dynamo check (shutdown.import_dynamo_early) while this module is ``__main__`` -- where it does
    nothing -- and the script's own import of mindio.ttp would not run it again. A script
    that started mindio's processor ran the same teardown already (shutdown.at_exit runs once)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():  # else the script destroyed its own
        from mindio.ttp import shutdown

        shutdown.at_exit(quiet=True)  # a mindio script's own teardown (install()) ran first, and warns


def become(assignment: dict, target: str, is_module: bool, is_program: bool, warm_s: float) -> None:
    """Steps 3-4 of the protocol: become the worker ``assignment`` describes (also the fork server's
    children, mindio/launch/_zygote.py, after their fork)."""
    os.environ.update({k: str(v) for k, v in assignment["env"].items()})
    os.environ["MINDIO_WORKER_WARMUP_S"] = f"{warm_s:.3f}"
    _redirect(1, assignment.get("stdout"))
    _redirect(2, assignment.get("stderr"))
    argv = assignment.get("argv") or []
    if is_program:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        try:
            os.execvp(target, [target, *argv])
        except OSError as exc:
            sys.exit(f"mindio-run: cannot run {target!r} (--no-python): {exc}")
    import faulthandler

    faulthandler.enable(all_threads=True)  # as torchrun's @record: a fatal signal prints every thread's stack
    if os.environ.get("MINDIO_REBOOT_GEN"):  # a replacement process joins the survivors' generation
        from mindio.ttp.processor import reboot

        reboot.install()
    atexit.register(_release_groups_at_exit)  # before the script's own handlers: it runs after them
    # stdin was the assignment channel; give the script an empty one, as torchrun does.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _run(target, is_module, argv)


def main() -> None:
    _die_with_parent()
    target, is_module, is_program = parse_target(sys.argv[1:])
    t0 = time.monotonic()
    if not is_program:
        _preload(target, is_module)
    warm_s = time.monotonic() - t0
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    become(json.loads(line), target, is_module, is_program, warm_s)


if __name__ == "__main__":
    main()

"""Why a worker failed, told the way torchrun tells it, and which failure came first.

Worker side: an exception that escapes the training script (mindio.launch._bootstrap) is printed
without the launcher's own frames (the traceback starts at the script) and recorded in the worker's
error file, ``TORCHELASTIC_ERROR_FILE``, in the JSON format of torch.distributed.elastic's
``ErrorHandler`` (what ``@record`` writes; a script decorated with ``@record`` keeps its own file). A
fault that ``tft_exception_handler`` caught and that ended the process (exit 75 after a dump, 76) is
recorded too (mindio.ttp.decorator), so the launcher can name it.

Agent side: :func:`read` turns a failed worker's exit code and error file into a :class:`Failure`; every
agent posts its failures to node 0's store (agent.py), so :func:`first` can name the root cause of a
round -- the earliest failure that is not a consequence of another (a peer's "connection closed",
a collective timeout, a signal the agents sent) -- whichever node it ran on.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
import traceback
from dataclasses import asdict, dataclass

from ..vocab import EXIT_CODE_DUMPED, EXIT_CODE_REPEATED

__all__ = ["Failure", "describe", "first", "read", "record", "summary", "outcome", "trim", "one_line",
           "report_one_line", "install_excepthook"]


_MAX_FILE = 1 << 20  # an error file larger than this is read only in part
_MAX_TRACE_LINES = 40  # lines of a root cause's traceback other nodes print
_MAX_ERROR, _MAX_TRACE = 2000, 16000  # characters of a failure kept (and posted to the store)
# what a rank sees when a peer it waits for in a collective failed (gloo, TCPStore)
_SECONDARY = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
              "distnetworkerror", "distbackenderror", "connection refused")


def describe(code: int) -> str:
    """``exit code 7`` / ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# ----------------------------------------------------------------------------------- worker side
def trim(tb, skip: tuple):
    """``tb`` without its leading frames from files in ``skip`` (the bootstrap, runpy)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    return tb


def launcher_frames() -> tuple:
    """The file names of the frames that run a script under mindio-run (the bootstrap, runpy)."""
    import runpy

    # the bootstrap's path, not the module (it imports this one: no circle)
    files = (os.path.abspath(os.path.join(os.path.dirname(__file__), "_bootstrap.py")), runpy.__file__)
    return tuple(os.path.realpath(p) for p in files) + files + ("<frozen runpy>",)


def format_exception(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, from the script's first frame on."""
    return "".join(traceback.format_exception(type(exc), exc, trim(exc.__traceback__, launcher_frames())))


def record(message: str, trace: str, path: str | None = None, replace: bool = False,
           when: float | None = None, consequence: bool = False) -> None:
    """Write ``message`` ("Type: text") and the formatted ``trace`` to the error file ``path`` (default:
    TORCHELASTIC_ERROR_FILE) as torch's ErrorHandler does. ``replace=False`` keeps a file the script's
    own ``@record`` wrote. ``when``: the time it happened (default now); ``consequence``: mindio knows it
    was caused by another rank's failure (a FORCE STOP, a peer's closed connection). Never raises: the
    exit of the worker must not depend on its error file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "") if path is None else path
    if not path or (not replace and os.path.exists(path)):
        return
    when = time.time() if when is None else when
    # torchrun's root cause is the failure with the smallest whole-second "timestamp", ties to the lowest
    # rank: a consequence (which comes after its cause) is stamped with the next second, so that a peer's
    # "connection closed" in the cause's second never outranks it. mindio-run reads "mindio_time".
    stamp = int(when) + (1 if consequence or _secondary_text(message) else 0)
    data = {"message": {
        "message": message,
        "extraInfo": {"py_callstack": trace, "timestamp": str(stamp), "mindio_time": when,
                      "mindio_consequence": consequence, "host": socket.gethostname()},
    }}
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the script's @record wrote it meanwhile
            os.unlink(tmp)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def one_line(exc: BaseException) -> str | None:
    """``Type: message`` for an error whose message says all a user needs (a refused setting, no
    controller answering): printed as one line instead of a traceback; None for any other."""
    from ..errors import ConfigError, NoController

    return f"{type(exc).__name__}: {exc}" if isinstance(exc, (ConfigError, NoController)) else None


def report_one_line(exc: BaseException) -> bool:
    """Print ``exc`` as one line and record it in the error file (the launcher's summary, torchrun's
    root cause), when :func:`one_line` takes it; False otherwise (nothing done)."""
    import sys

    line = one_line(exc)
    if line is None:
        return False
    rank = os.environ.get("RANK")
    who = f"rank {rank}: " if rank and not str(exc).startswith("rank ") else ""
    sys.stderr.write(f"mindio: {who}{line}\n")
    sys.stderr.flush()
    record(line, line + "\n")
    return True


def install_excepthook() -> None:
    """(import of mindio.ttp) An uncaught :func:`one_line` error ends the process with that one line,
    recorded in TORCHELASTIC_ERROR_FILE, instead of a traceback per rank (a script under torchrun);
    any other exception goes to the hook there was."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "mindio_one_line", False):
        return

    def hook(kind, exc, tb):
        if not report_one_line(exc):
            previous(kind, exc, tb)

    hook.mindio_one_line = True
    sys.excepthook = hook


def _secondary_text(error: str) -> bool:
    """What a rank sees when a peer it waited for failed (a lost connection, a collective timeout)."""
    low = error.lower()
    return any(s in low for s in _SECONDARY)


# ------------------------------------------------------------------------------------ agent side
@dataclass
class Failure:
    """One worker's failure: which rank, how it ended and, from its error file, why."""

    rank: int
    code: int
    node: int = 0
    host: str = ""
    error: str = ""         # "Type: message" from the error file; "" without one
    trace: str = ""         # its traceback (launcher frames already trimmed)
    time: float = 0.0       # when it failed (the error file's time, else when its agent saw it)
    late: bool = False      # it ended after its training had finished (ha.py)
    consequence: bool = False  # its worker knew it was caused by another rank's failure (mindio.ttp)
    lost: bool = False      # its node was lost (its agent stopped beating): how it ended is unknown
    stopped: bool = False   # it had failed on its own and was exiting when its agent signalled it (``code``)

    @property
    def secondary(self) -> bool:
        """A consequence of another failure: killed by the agents, or a peer's lost connection or a
        collective timeout seen by a rank that was waiting for the failed one."""
        if self.consequence or (self.code in (-signal.SIGTERM, -signal.SIGKILL) and not self.error):
            return True
        return _secondary_text(self.error)

    def line(self) -> str:
        where = f" (node {self.node}{', ' + self.host if self.host else ''})"
        why = f": {self.error.splitlines()[0][:300]}" if self.error else ""
        when = " after its training finished" if self.late else ""
        if self.lost:
            return f"rank {self.rank}{where} lost with its node (its agent stopped beating){when}{why}"
        if self.stopped:  # not "exited with signal ...": its end is its own failure, the signal only hurried it
            return f"rank {self.rank}{where} failed{when}{why} (its agent's {describe(self.code)} came while it exited)"
        return f"rank {self.rank}{where} exited with {describe(self.code)}{when}{why}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text) -> "Failure":
        return cls(**json.loads(text))


def read(rank: int, code: int, error_file: str | None, node: int = 0) -> Failure:
    """The failure of ``rank`` that ended with ``code``, with its error file's message when it wrote one."""
    f = Failure(rank=rank, code=code, node=node, host=socket.gethostname(), time=time.time())
    if not error_file or not os.path.isfile(error_file):
        return f
    try:
        with open(error_file, encoding="utf-8", errors="replace") as fp:
            data = json.loads(fp.read(_MAX_FILE))
        msg = data.get("message", "")
        if isinstance(msg, dict):  # torch's ErrorHandler format
            info = msg.get("extraInfo") or {}
            f.error = str(msg.get("message", ""))[:_MAX_ERROR]
            f.trace = str(info.get("py_callstack", ""))[-_MAX_TRACE:]
            f.time = float(info.get("mindio_time") or info.get("timestamp") or f.time)
            f.host = str(info.get("host") or f.host)
            f.consequence = bool(info.get("mindio_consequence"))
        else:  # the plain {"message": str, "timestamp": int} format
            f.error, f.time = str(msg)[:_MAX_ERROR], float(data.get("timestamp") or f.time)
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # a torn or foreign file: the exit code still says how it ended
    return f


def first(failures) -> Failure | None:
    """The root cause: the earliest failure that is not a consequence of another (else the earliest)."""
    failures = list(failures)
    if not failures:
        return None
    return min(failures, key=lambda f: (f.secondary, f.time, f.rank))


def summary(failures) -> str:
    """One line: the root cause, then the other ranks that failed on their own, then those that failed
    as a consequence (of a peer's failure: connection closed, FORCE STOP, the agents' signals)."""
    failures = list(failures)
    root = first(failures)
    if root is None:
        return ""

    def ranks(fs) -> str:
        rs = sorted({f.rank for f in fs} - {root.rank})
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:16]))}{' ...' if len(rs) > 16 else ''}" \
            if rs else ""

    own, then = ranks(f for f in failures if not f.secondary), ranks(f for f in failures if f.secondary)
    return root.line() + (f"; also failed: {own}" if own else "") + \
        (f"; then {then} failed as a consequence" if then else "")


def root_trace(failure: Failure) -> str:
    """The last lines of the root cause's traceback, for the consoles of other nodes."""
    lines = failure.trace.rstrip().splitlines()
    if len(lines) > _MAX_TRACE_LINES:
        lines = ["  ..."] + lines[-_MAX_TRACE_LINES:]
    return "\n".join(lines)


def outcome(fails, reason: str, rnd: int, max_restarts: int, stopping: bool = False, dumped: bool = False,
            node: int = 0) -> tuple[str, int | None]:
    """How round ``rnd`` ended, for the console, and the agent's exit code (None: every worker restarts).

    A round whose workers exited 75 (or whose controller said so: ``dumped``) ended with a last-words
    checkpoint: that is said, and relaunched while restarts remain (the script resumes from it); with
    none left the agent exits 75 too. A round where a worker exited 79 (a rank met the exception the
    previous launch dumped after, at the same step) is not restarted. Otherwise the round failed: the root cause of ``fails`` (any node's)
    is named, else ``reason``; a root cause from another node than ``node`` comes with its traceback."""
    fails = list(fails)
    dumped = dumped or any(f.code == EXIT_CODE_DUMPED for f in fails)
    # a worker that exited 75 after the dump is no cause, unless its error file names a fault of its own
    causes = [f for f in fails if f.code != EXIT_CODE_DUMPED or (f.error and not f.secondary)]
    cause = summary(causes) or reason
    if causes and "controller" in reason and cause not in reason:  # the controller's word, not the cause again
        cause += f" ({reason.partition(': ')[2] or reason})"
    # a rank met the fault the previous launch dumped after, at the same step (79): a relaunch meets it again
    repeated = any(f.code == EXIT_CODE_REPEATED for f in fails)
    restart = not stopping and rnd < max_restarts and not repeated
    more = f"restart {rnd + 1} of {max_restarts}"
    if dumped:
        what = f"a last-words checkpoint was written (workers exited {EXIT_CODE_DUMPED}) after: {cause}"
        if restart:
            return f"mindio-run: round {rnd}: {what}; relaunching every worker to resume from it ({more})", None
        return (f"mindio-run: job stopped: {what}; run it again (or with --max-restarts) to resume from it",
                EXIT_CODE_DUMPED)
    if restart:
        return f"mindio-run: round {rnd} failed: {cause}; restarting every worker ({more})", None
    text = f"mindio-run: job failed: {cause} (restarts used: {rnd} of {max_restarts}" + \
        (f"; not restarted: workers exited {EXIT_CODE_REPEATED}, a deterministic fault)" if repeated else ")")
    root = first(causes)
    if root is not None and root.node != node and root.trace:
        text += f"\nmindio-run: root cause, from node {root.node} ({root.host}):\n{root_trace(root)}"
    return text, 1

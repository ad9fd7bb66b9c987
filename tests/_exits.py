"""Every process a test starts ends as the test expects -- never by a signal the test did not send.

Issue 13: a rank died at exit with SIGABRT after training finished, and only a hang made it visible.
Two ways to see a signal death:

* a process the test started itself: its return code is negative (:func:`check_codes`);
* a worker started by a launcher: the launcher reports it in its output -- mindio-run's agent ("rank 1
  exited with signal SIGABRT", a switched-out or backup process "exited with -6"), torchrun's failure
  summary ("exitcode : -6") -- and an aborting C++ runtime prints "terminate called ...". 
  :func:`signal_deaths` finds them in the output, :func:`assert_no_signal_deaths` fails naming the rank
  and the signal.

``sent`` maps a rank to the signals the test caused on purpose (its own ``os.kill``, an injected
``kill`` fault, a ``hang`` the controller turns into SIGKILL); :func:`sent_by_faults` derives it from a
fault spec of the toy jobs (``kill:1:7,hang:2:7``) or of ``--inject`` (``kill:rank=3,step=7``).
"""
from __future__ import annotations

import re
import signal

# faults after which the rank dies by SIGKILL (the toys' fault plan and --inject share the kinds)
from tests._faultplan import KILLING as _KILLING

__all__ = ["signal_name", "check_codes", "signal_deaths", "assert_no_signal_deaths", "sent_by_faults", "injected"]

KILL = "SIGKILL"


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def check_codes(codes, sent: dict | None = None, what: str = "rank", context: str = "") -> None:
    """Fail if a return code in ``codes`` (a list by rank, or a dict name -> code) is a death by a
    signal that ``sent`` does not list for that rank."""
    items = codes.items() if isinstance(codes, dict) else enumerate(codes)
    sent = sent or {}
    bad = [f"{what} {r} died by {signal_name(c)}" for r, c in items
           if c is not None and c < 0 and signal_name(c) not in _names(sent.get(r))]
    assert not bad, "; ".join(bad) + " (a signal the test did not send)" + (f"\n{context}" if context else "")


def _names(value) -> set:
    if value is None:
        return set()
    return {value} if isinstance(value, str) else set(value)


_PATTERNS = (
    # mindio-run agent (launch/ha.py, launch/failures.py): "rank 1 exited with signal SIGABRT",
    # "rank 1 replacement exited with signal SIGKILL", "rank 1 (node 0, host) exited with signal SIGABRT"
    re.compile(r"rank (?P<rank>\d+)(?: \([^)]*\))? (?:replacement )?exited with signal (?P<sig>SIG[A-Z0-9]+)"),
    # a switched-out process or a hot-switch backup: "... exited with -6"
    re.compile(r"rank (?P<rank>\d+): switched-out process \d+ exited with (?P<code>-\d+)"),
    re.compile(r"backup of rank (?P<rank>\d+) \(pid \d+\) exited with (?P<code>-\d+)"),
    # torchrun's failure summary: "rank : 1 (local_rank: 1)" then "exitcode : -6 (pid: ...)"
    re.compile(r"rank\s*:\s*(?P<rank>\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(?P<code>-\d+)"),
)
_ABORTS = re.compile(r"terminate called|Fatal Python error|\(core dumped\)")
# mindio's exit teardown (mindio/ttp/shutdown.py) could not end a process group's gloo worker threads: the
# interpreter shutdown that follows is the window of pytorch/pytorch#190489 (SIGABRT in a few percent of
# exits on a loaded machine). Seen in a test's output it fails the test every time, not once in 20 runs.
_LEFT_THREADS = re.compile(r"exit: \d+ gloo worker thread\(s\) still run")


def signal_deaths(text: str) -> list:
    """[(rank or None, signal name)] for every signal death reported in a launcher's ``text``."""
    found = []
    for pattern in _PATTERNS:
        for m in pattern.finditer(text):
            sig = m.group("sig") if "sig" in pattern.groupindex else signal_name(int(m.group("code")))
            found.append((int(m.group("rank")), sig))
    found += [(None, m.group(0)) for m in _ABORTS.finditer(text)]
    found += [(None, m.group(0) + " (the SIGABRT window at exit)") for m in _LEFT_THREADS.finditer(text)]
    return found


def assert_no_signal_deaths(text: str, sent: dict | None = None) -> None:
    """Fail naming each death by a signal that ``sent`` does not list for its rank. The abort messages
    name no rank: they pass only when the test sent some rank a SIGABRT (its own os.abort())."""
    sent = sent or {}
    aborted = any("SIGABRT" in _names(v) for v in sent.values())
    bad = sorted({(r, s) for r, s in signal_deaths(text)
                  if (r is None and not aborted) or (r is not None and s not in _names(sent.get(r)))}, key=str)
    assert not bad, ("died by a signal the test did not send: "
                     + ", ".join(f"rank {r}: {s}" if r is not None else s for r, s in bad)
                     + "\n" + text[-6000:])


def sent_by_faults(spec: str, also: dict | None = None, per_node: int | None = None) -> dict:
    """rank -> {"SIGKILL"} for every rank a fault in ``spec`` kills (module docstring), plus ``also``
    ({rank: signal name}). ``kill-node`` (``kill-node:R:IT`` names a rank of the node, ``--inject``'s
    ``kill-node:node=N,...`` the node) kills every rank of that node: ``per_node`` ranks a node."""
    sent: dict = {r: set(_names(s)) for r, s in (also or {}).items()}
    for part in re.split(r"[;,]\s*(?=[a-z-]+:)", spec or ""):
        kind, _, rest = part.strip().partition(":")
        if kind not in _KILLING:
            continue
        node = re.search(r"node=(\d+)", rest)
        m = re.search(r"rank=(\d+)", rest) or re.match(r"(\d+)", rest)
        if kind == "kill-node" and per_node and (node or m):
            n = int(node.group(1)) if node else int(m.group(1)) // per_node
            ranks = range(n * per_node, (n + 1) * per_node)
        elif m is not None:
            ranks = [int(m.group(1))]
        else:
            continue
        for r in ranks:
            sent.setdefault(r, set()).add(KILL)
    return sent


def injected(args) -> str:
    """The fault specs of every ``--inject``/``--fault`` in a command line's ``args``, joined."""
    args = [str(a) for a in args]
    return ",".join(args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--inject", "--fault"))

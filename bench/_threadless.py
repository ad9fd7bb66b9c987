"""What bench/beats_cpu.py and bench/replies_cpu.py share: the mindio they measure (this checkout, or the one in
``MINDIO_SRC``: another commit's, ``git archive C mindio``), the job secret, and their common arguments (N ranks
behind relays of ``--per-relay`` ranks, ``--rounds`` measured). Each drives a real Controller whose threads are
not started (tests/ttp/_harness.threadless_controller)."""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (os.environ.get("MINDIO_SRC"), ROOT) if p]  # MINDIO_SRC: another commit's mindio

KEY = b"bench-secret-0123456789abcdef0123"


def parser(doc: str, what: str) -> argparse.ArgumentParser:
    """The arguments both benches take; ``what``: what one round is."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100000, help="ranks")
    p.add_argument("--per-relay", type=int, default=8, help="ranks per relay connection")
    p.add_argument("--rounds", type=int, default=5, help=f"{what} measured")
    return p

"""mindio._ports.free_port: ports for services bound later by another process."""
import socket

from mindio import _ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = _ports._ephemeral_low()
    for _ in range(20):
        port = _ports.free_port()
        if low - 1 - _ports._LOWEST >= 1000:
            assert _ports._LOWEST <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        picks = iter([taken, taken, free])
        monkeypatch.setattr(_ports._rng, "randint", lambda a, b: next(picks))
        monkeypatch.setattr(_ports, "_ephemeral_low", lambda: 65000)
        assert _ports.free_port() == free

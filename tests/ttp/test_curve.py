"""enable_tls=True with CURVE keys: encrypted control traffic over real sockets, no talk without the
right server key, and a backup controller's own link to the primary is a CURVE client too."""
import json
import socket
import threading
import time

import pytest
import zmq

from mindio.errors import ConfigError
from mindio.ttp.wire import protocol as P
from mindio.ttp.controller.controller import Controller
from mindio.ttp.processor.processor import Processor
from mindio.ttp.controller.states import State
from mindio.ttp.wire.transport import Link, curve_options, job_curve_keypair, with_client_keys

from ._harness import free_port

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
KEY = b"c" * 32


def _keys():
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    return {"server_public": spub.decode(), "server_secret": ssec.decode(),
            "client_public": cpub.decode(), "client_secret": csec.decode()}


def _until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


class _Tap(threading.Thread):
    """A TCP forwarder between the processors and the controller that records every byte it carries."""

    def __init__(self, target_port: int):
        super().__init__(daemon=True)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.seen, self._lock = self.srv.getsockname()[1], target_port, bytearray(), threading.Lock()

    def _pump(self, a, b):
        try:
            while data := a.recv(65536):
                with self._lock:
                    self.seen += data
                b.sendall(data)
        except OSError:
            pass

    def run(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((c, s), (s, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()


def test_tls_info_forms_and_errors(tmp_path):
    k = _keys()
    text = "(server_public: %s; server_secret: %s)" % (k["server_public"], k["server_secret"])  # reference layout
    assert curve_options(True, text, server=True)[zmq.CURVE_SECRETKEY] == k["server_secret"].encode()
    keyfile = tmp_path / "server.pub"
    keyfile.write_text(k["server_public"] + "\n")
    opts = curve_options(True, {"server_public": str(keyfile)}, server=False)
    # no client keys given: the link uses the job's keypair, derived from the secret (the controller's ZAP
    # handler lets that key in), filled in when it connects
    assert opts == {zmq.CURVE_SERVERKEY: k["server_public"].encode()}
    full = with_client_keys(opts, KEY)
    assert full[zmq.CURVE_PUBLICKEY] == job_curve_keypair(KEY)[0] == zmq.curve_public(full[zmq.CURVE_SECRETKEY])
    assert curve_options(True, json.dumps(k), server=False)[zmq.CURVE_PUBLICKEY] == k["client_public"].encode()
    assert curve_options(False, k, server=True) == {} and curve_options(True, "", server=True) == {}
    with pytest.raises(ConfigError, match="not X.509"):
        curve_options(True, "tlsCert: /etc/ssl/certs/cert.pem; tlsCaPath: /etc/ssl/ca/", server=True)
    with pytest.raises(ConfigError, match="40-character z85"):
        curve_options(True, {"server_public": "short"}, server=False)
    with pytest.raises(ConfigError, match="lacks CURVE key"):
        curve_options(True, {"server_public": k["server_public"]}, server=True)
    with pytest.raises(ConfigError, match="client_public/client_secret pair"):
        curve_options(True, {"server_public": k["server_public"], "client_public": k["client_public"]}, server=False)


def test_keys_that_begin_or_end_with_brackets_survive_the_reference_layout():
    # "(" and ")" are z85 characters; CI once drew a server_secret ending in "(" and the parser's
    # strip("()") of the surrounding brackets ate it
    pub, sec = "(" + "a" * 38 + ")", "b" * 38 + "()"
    text = "(server_public: %s; server_secret: %s)" % (pub, sec)
    assert curve_options(True, text, server=True)[zmq.CURVE_SECRETKEY] == sec.encode()
    assert curve_options(True, text, server=False)[zmq.CURVE_SERVERKEY] == pub.encode()
    bare = "server_public: %s; server_secret: %s" % (pub, sec)  # without the brackets
    assert curve_options(True, bare, server=True)[zmq.CURVE_SECRETKEY] == sec.encode()
    assert curve_options(True, bare, server=False)[zmq.CURVE_SERVERKEY] == pub.encode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", [True, False])
def test_curve_encrypts_the_control_traffic(tls):
    k = _keys()
    port = free_port()
    ctl = Controller(rank=-1, world_size=1, enabled={"dump"}, key=KEY, interval=0.2, misses=5, hang_timeout=0,
                     curve=curve_options(tls, k, server=True), curve_clients=[k["client_public"].encode()])
    ctl.start("127.0.0.1", port)
    tap = _Tap(port)
    tap.start()
    proc = Processor(0, 1, curve=curve_options(tls, k, server=False))
    try:
        proc.start(f"tcp://127.0.0.1:{tap.port}", KEY)
        assert _until(lambda: ctl.sm.state is State.NORMAL)
        replies = ctl._call("ping", {}, [0], 10.0)  # an action and its reply cross the tap both ways
        assert replies[0].ok
        with tap._lock:
            seen = bytes(tap.seen)
        # words every frame type carries in clear without CURVE; the host name (in the registration) only
        # when long enough to mean something: this machine's is "vm", two bytes that the ciphertext
        # contained by chance in one full run
        host = socket.gethostname().encode()
        plaintext = (b"world_size", b"ping", b"data_status") + ((host,) if len(host) >= 8 else ())
        if tls:  # the ZMTP greeting names the mechanism in clear; everything after it is encrypted
            assert b"CURVE" in seen and not any(p in seen for p in plaintext), "plaintext on the wire"
        else:  # the same traffic without keys is readable: the check above can fail
            assert all(p in seen for p in plaintext)
    finally:
        proc.destroy("test over")
        ctl.destroy()
        tap.srv.close()


@pytest.mark.timeout(60)
def test_wrong_or_missing_keys_cannot_talk(caplog):
    """No talk with a wrong or no server key (the client refuses the server), nor with the right server
    key but a client key that is not the job's (the controller's ZAP handler refuses the client)."""
    k = _keys()
    port = free_port()
    ctl = Controller(rank=-1, world_size=2, enabled={"dump"}, key=KEY, interval=0.2, misses=5, hang_timeout=0,
                     curve=curve_options(True, k, server=True), curve_clients=[k["client_public"].encode()])
    ctl.start("127.0.0.1", port)
    wrong = dict(k, server_public=zmq.curve_keypair()[0].decode())
    pub, sec = zmq.curve_keypair()
    stranger = dict(k, client_public=pub.decode(), client_secret=sec.decode())  # server key known, client key not
    hello = lambda: P.Register(world_size=2, pid=0, host="x")
    beat = lambda: P.Heartbeat(step=0, data_status=0)
    addr = [f"tcp://127.0.0.1:{port}"]
    links = [Link(0, KEY, addr, hello, beat, lambda env: None, interval=0.2,
                  curve=curve_options(True, wrong, server=False)),                       # wrong server key
             Link(1, KEY, addr, hello, beat, lambda env: None, interval=0.2),             # no CURVE
             Link(1, KEY, addr, hello, beat, lambda env: None, interval=0.2,
                  curve=curve_options(True, stranger, server=False))]                     # client key not allowed
    try:
        for link in links:
            link.start()
        assert not any(link.registered.wait(2.0) for link in links)
        assert ctl.ranks == {} and ctl.sm.state is State.INIT
        assert f"key {pub.decode()} is not a key of this job" in caplog.text  # the refusal, with its reason
        good = [Link(0, KEY, addr, hello, beat, lambda env: None, interval=0.2,
                     curve=curve_options(True, k, server=False)),                        # tls_info's client keys
                Link(1, KEY, addr, hello, beat, lambda env: None, interval=0.2,           # the job's own client key
                     curve=curve_options(True, {"server_public": k["server_public"]}, server=False))]
        links += good
        for link in good:
            link.start()
        assert all(link.registered.wait(10.0) for link in good) and set(ctl.ranks) == {0, 1}
    finally:
        for link in links:
            link.stop()
        ctl.destroy()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_keys", [True, False])
def test_backup_link_to_primary_uses_curve(client_keys):
    k = _keys()
    port, bport = free_port(), free_port()
    primary = Controller(rank=-1, world_size=1, enabled={"dump"}, key=KEY, interval=0.2, misses=5, hang_timeout=0,
                         curve=curve_options(True, k, server=True), backups_allowed=1,
                         curve_clients=[k["client_public"].encode()])
    primary.start("127.0.0.1", port)
    # with client keys from tls_info (as tft's start_backup_controller passes them), or without: the backup
    # then derives the primary's public key from the server keypair they share
    backup = Controller(rank=1, world_size=1, enabled={"dump"}, key=KEY, interval=0.2, misses=5, hang_timeout=0,
                        backup=True, curve=curve_options(True, k, server=True),
                        curve_client=curve_options(True, k, server=False) if client_keys else None)
    try:
        backup.start("127.0.0.1", bport, primary=f"tcp://127.0.0.1:{port}")
        assert _until(lambda: primary.backups == [f"tcp://127.0.0.1:{bport}"])
        assert _until(backup._primary_link.registered.is_set)  # the primary's REGISTER_ACK came back
    finally:
        backup.destroy()
        primary.destroy()

"""A controller alone in its own process (as a launcher agent would host it), for the failover and
security tests.

    _controller_proc.py WORLD PORT [--dump-when FILE] [--tls TLS_INFO]

Prints "controller up" once it listens. With --dump-when: once FILE exists, asks for a graceful dump
(tft_notify_controller_dump). It exits 0 when the job is over (the controller reached FINAL) or after
600 s."""
import argparse
import os
import time

import mindio.ttp as ttp
from mindio.ttp._runtime import state

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("world", type=int)
    p.add_argument("port", type=int)
    p.add_argument("--dump-when", default="")
    p.add_argument("--tls", default="")
    a = p.parse_args()
    ttp.tft_init_controller(-1, a.world, enable_local_copy=False)
    ttp.tft_start_controller("127.0.0.1", a.port, enable_tls=bool(a.tls), tls_info=a.tls)
    print("controller up", flush=True)
    end, asked = time.monotonic() + 600, False
    while time.monotonic() < end and not state.controller.final.is_set():
        if a.dump_when and not asked and os.path.exists(a.dump_when):
            asked = ttp.tft_notify_controller_dump() == 0
        time.sleep(0.05)
    ttp.tft_destroy_controller()

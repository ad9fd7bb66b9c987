"""A controller alone in its own process (as a launcher agent would host it), for the failover test."""
import sys
import time

import mindio.ttp as ttp

if __name__ == "__main__":
    world, port = int(sys.argv[1]), int(sys.argv[2])
    ttp.tft_init_controller(-1, world, enable_local_copy=False)
    ttp.tft_start_controller("127.0.0.1", port, enable_tls=False)
    print("controller up", flush=True)
    time.sleep(600)

"""A 2-rank job through the tft_* API whose rank 1 is still setting up, outside train(), when the
controller orders the exit (tests/ttp/test_exit_order.py): ``python _late_main.py RANK CTL_PORT OUT``.

Rank 0 hosts the controller; once rank 1 registered (it writes ``OUT/registered1``), rank 0's decorated
train() raises before its first step, so the job has nothing to save and the controller orders EXIT(76).
Rank 1 then "loads its data" for 300 s before its train(): its main thread reaches no fence and does not
park, so only its processor can carry the order out (MINDIO_EXIT_ORDER_WAIT)."""
import os
import sys
import time

import mindio.ttp as ttp

RANK, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def main() -> None:
    if RANK == 0:
        ttp.tft_init_controller(0, 2, enable_local_copy=False)
        ttp.tft_start_controller("127.0.0.1", PORT, enable_tls=False)
    ttp.tft_init_processor(RANK, 2, enable_local_copy=False, enable_tls=False)
    ttp.tft_start_processor("127.0.0.1", PORT)

    @ttp.tft_exception_handler
    def train():
        raise ValueError("injected: rank 0 fails before its first step")

    if RANK == 1:
        open(os.path.join(OUT, "registered1"), "w").close()
        time.sleep(300)  # a long setup outside train(): no fence comes
    else:
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(OUT, "registered1")) and time.monotonic() < end:
            time.sleep(0.01)
    train()


main()

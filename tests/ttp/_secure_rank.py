"""A rank of the security tests (test_security.py), written as user code: the tft_* API around a loop
that knows nothing of mindio's internals (no torch.distributed: the control plane is what is attacked).

    _secure_rank.py RANK WORLD CONTROLLER_PORT OUT [TLS_INFO]

Registers (OUT/registered<rank> once it did), trains until the controller ends the job; its save_ckpt
callback writes OUT/saved<rank>. The job secret comes from the environment (MINDIO_SECRET)."""
import os
import sys
import time

from mindio.ttp import (tft_end_updating_os, tft_exception_handler, tft_init_processor, tft_register_rename_handler,
                        tft_register_save_ckpt_handler, tft_set_optimizer_replica, tft_start_processor,
                        tft_start_updating_os)

if __name__ == "__main__":
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tls = sys.argv[5] if len(sys.argv) > 5 else ""
    tft_init_processor(rank, world, False, enable_tls=bool(tls), tls_info=tls)

    def save(step, save_info, args, ctx):
        with open(os.path.join(out, f"saved{rank}"), "w") as f:
            f.write(str(step))

    tft_register_save_ckpt_handler(save)
    tft_register_rename_handler(lambda step, args, ctx: None)
    tft_start_processor("127.0.0.1", port)
    tft_set_optimizer_replica(rank, [{"rank_list": list(range(world)), "replica_cnt": 1, "replica_shift": 0}])
    open(os.path.join(out, f"registered{rank}"), "w").close()

    @tft_exception_handler
    def train():
        while True:  # step 1, again and again: the ranks (which never synchronize) stay at one step
            tft_start_updating_os(-1)
            tft_end_updating_os(1)
            time.sleep(0.05)

    train()

"""Worker for test_interrupt.py (2 gloo ranks, TP=2): rank 1's step is interrupted in its forward while rank 0
goes on into its next tensor-parallel all-reduce and blocks there; rank 1 then tears down as mindio's
processor does (stop + clean callbacks: the Megatron adapter keeps the model with its groups unplugged,
regroup.py; every group destroyed; garbage collected; references released: Processor.teardown). Nothing rank 1 keeps may
hold a group: rank 0's all-reduce must fail within seconds (``released after ...``), else it prints
``BLOCKED`` and exits 3.

    _park_release_worker.py forward|backward DONE_FILE
"""

import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from _example_job import built, step as one_step  # tests/megatron/_example_job.py

from mindio import megatron as mio
from mindio.ttp.processor.processor import Processor

BOUND_S = 20.0


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    _args, dataset, ctx = built(["--use-distributed-optimizer", "--replica-cnt", "1",
                                 "--tensor-model-parallel-size", "2"])
    adapter = mio.MegatronAdapter(ctx)
    rank = dist.get_rank()

    def step():
        one_step(ctx, dataset)

    step()
    where = sys.argv[1]
    if rank == 1 and where == "forward":
        ctx.model[0].module.decoder.layers[0].register_forward_hook(lambda *_a: adapter.interrupt())
    elif rank == 1:  # in the backward, once half the gradients were accumulated
        params = [p for p in ctx.model[0].parameters() if p.requires_grad]
        params[len(params) // 2].register_post_accumulate_grad_hook(lambda _p: adapter.interrupt())
    else:
        def watchdog():
            time.sleep(BOUND_S)
            say(f"BLOCKED: rank 0 still inside its all-reduce {BOUND_S:.0f} s after rank 1 tore down")
            os._exit(3)
        threading.Thread(target=watchdog, daemon=True).start()
    t0 = time.monotonic()
    try:
        step()
        raise AssertionError("the step went through")
    except RuntimeError as exc:
        message = str(exc)
        exc = None  # noqa: F841  (what the decorator does: no frame of the step survives)
    if rank == 0:
        say(f"released after {time.monotonic() - t0:.2f} s: {message[:80]}")
        Path(sys.argv[2]).write_text("released")
        os._exit(0)
    assert "FORCE STOP" in message, message
    proc = Processor(rank, 2)  # the decorator's teardown, with the adapter's stop and clean callbacks
    proc.callbacks = {"stop": (lambda a, c: adapter.stop(), None), "clean": (lambda u, a, c: adapter.clean(u), None)}
    proc.teardown(is_uce=False)
    assert ctx._parked is not None, "the model was not kept"
    say("rank 1 tore down, model kept")
    deadline = time.monotonic() + BOUND_S + 5  # keep this process (and what it kept) alive while rank 0 is watched
    while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()

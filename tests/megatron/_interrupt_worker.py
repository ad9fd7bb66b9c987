"""Worker for test_interrupt.py (2 gloo ranks, DP=2): the Megatron check points (adapter.install_stop_checks)
make a step leave with FORCE STOP once the stop is requested -- here in the middle of its backward, after
some gradients were accumulated -- and after the rollback the next steps are bitwise those of a run that
was never interrupted.

    _interrupt_worker.py plain|backward|forward|cleaned-twice

Prints ``grad-norms [...]`` and ``params-digest <hex>`` after 3 completed steps.
"""

import hashlib
import sys

import torch

from _example_job import built, step as one_step  # tests/megatron/_example_job.py
from mindio import megatron as mio


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the two ranks' lines never interleave in the pipe
    sys.stdout.flush()


def main():
    where = sys.argv[1]
    _args, dataset, ctx = built(["--use-distributed-optimizer", "--replica-cnt", "1"])
    adapter = mio.MegatronAdapter(ctx)
    norms = []

    def step():
        norms.append(one_step(ctx, dataset))

    step()
    if where == "cleaned-twice":  # a fenced rank torn down at the stop, then cleaned again (FORCE STOP)
        from mindio.ttp.processor import inplace
        from mindio.ttp.processor.processor import Processor

        proc = Processor(torch.distributed.get_rank(), 2)

        def rebuild(fault_ranks, _args, _ctx):
            adapter.rebuild_same_layout = True  # what mindio.adapter.register's wrapper sets for a retry
            adapter.rebuild_groups(fault_ranks)
        proc.callbacks = {"stop": (lambda a, c: adapter.stop(), None),
                          "clean": (lambda u, a, c: adapter.clean(u), None), "rebuild_group": (rebuild, None)}
        model = ctx.model
        proc.teardown(is_uce=False)
        proc.teardown(is_uce=False)
        assert ctx._parked is not None and ctx._parked[0] is model, "the second clean lost the kept model"
        inplace.rebuild(proc.state, gen=1, fault_ranks=[], same_layout=True)
        assert ctx.model is model and len(ctx.shard_groups()) == 1, "the kept model was not taken back"
        say("kept across two cleans")
        adapter.rollback(ctx.iteration)
    elif where != "plain":
        params = [p for p in ctx.model[0].parameters() if p.requires_grad]
        trigger = params[len(params) // 2]
        if where == "backward":  # the stop arrives once half the gradients were accumulated
            handle = trigger.register_post_accumulate_grad_hook(lambda _p: adapter.interrupt())
        else:  # during the forward, after the first layers ran
            handle = ctx.model[0].module.decoder.layers[0].register_forward_hook(lambda *_a: adapter.interrupt())
        try:
            step()
            raise AssertionError("the step was not interrupted")
        except RuntimeError as exc:
            assert "FORCE STOP" in str(exc), exc
        say(f"interrupted in the {where}")
        if where == "backward":
            assert any(p.grad is not None for p in params), "no gradient was left to clean"
        handle.remove()
        adapter.rollback(ctx.iteration)  # what a retry ends with (the stop flag is cleared there too)
    step()
    step()
    digest = hashlib.sha256()
    for p in ctx.model[0].parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    say(f"grad-norms {norms}")
    say(f"params-digest {digest.hexdigest()}")


if __name__ == "__main__":
    main()

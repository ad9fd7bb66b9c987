"""A training script written against MindIO TFT/ACP the way MindSpeed-LLM integrates it: reference
import paths only (``mindio_ttp.framework_ttp``, ``mindio_ttp.utils``, ``mindio_acp``), the controller
in rank 0, ``enable_tls`` passed positionally, ``set_mindio_export_version`` inside the decorated
``train()``, callbacks that get ``train()``'s arguments. Nothing in it names ``mindio``.

Plain data parallelism on gloo: every rank holds the whole model and optimizer (one shard, replicated
on every rank). ``--fault RANK:STEP`` makes that rank raise after its backward pass of that step, before the
gradients' all-reduce (the other ranks wait in it, so none completes that step); the job then writes a
last-words checkpoint at the last completed step (STEP - 1) and exits. ``--resume DIR`` loads
it. The final state is written to ``OUT/final_rank<r>.pt``.
"""
import argparse
import os

import torch
import torch.distributed as dist

import mindio_acp
from mindio_ttp.framework_ttp import (set_mindio_export_version, tft_end_updating_os, tft_exception_handler,
                                      tft_init_controller, tft_init_processor, tft_register_clean_handler,
                                      tft_register_exception_handler, tft_register_rename_handler,
                                      tft_register_save_ckpt_handler, tft_register_stop_handler,
                                      tft_set_dp_group_info, tft_set_optimizer_replica, tft_start_controller,
                                      tft_start_processor, tft_start_updating_os)
from mindio_ttp.framework_ttp.ttp_decorator import get_mindio_export_version
from mindio_ttp.utils import tft_set_update_end_time, tft_set_update_start_time

WORLD_BATCH, DIM, LR = 4, 8, 0.1


def build():
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, DIM)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(WORLD_BATCH, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))


def reference_state(world: int, steps: int) -> dict:
    """What ``world`` ranks hold after ``steps`` fault-free steps, computed in one process (the gloo
    all-reduce of two ranks is one addition, so the result is bitwise the same)."""
    model, opt = build()
    for step in range(1, steps + 1):
        grads = []
        for rank in range(world):
            model.zero_grad()
            model(batch(step, rank)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs[1:], gs[0]) / world
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fault", default="")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    model, opt = build()
    start = 0
    if args.resume:
        step = int(open(os.path.join(args.resume, "latest_checkpointed_iteration.txt")).read())
        state = mindio_acp.load(os.path.join(args.resume, f"iter_{step:07d}", "state.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]

    # --- as MindSpeed-LLM's tft_init_controller_processor (port from the environment: tests run in parallel)
    ip, port = os.getenv("TTP_ADDR", "127.0.0.1"), int(os.getenv("TTP_PORT", "8000"))
    if rank == 0:
        tft_init_controller(rank, world, False, False, False)
        tft_start_controller(ip, port, False, "")
    tft_init_processor(rank, world, False, False, "", True, False, False)
    tft_start_processor(ip, port)

    # --- as MindSpeed-LLM's tft_register_processor
    tft_set_optimizer_replica(rank, [{"rank_list": list(range(world)), "replica_cnt": world, "replica_shift": 0}])
    tft_set_dp_group_info(rank, list(range(world)))

    def save_callback(step, save_info, train_args, ctx):
        assert get_mindio_export_version() == "MindSpeed-LLM"
        model_, opt_, out = train_args
        if rank in save_info[0]["ranks"]:
            folder = os.path.join(out, "ckpt", f"iter_{step:07d}")
            os.makedirs(folder, exist_ok=True)
            state = {"model": model_.state_dict(), "optimizer": opt_.state_dict(), "step": step}
            assert mindio_acp.save(state, os.path.join(folder, "state.pt")) in (0, 1, 2)
            assert mindio_acp.flush() == 0

    def rename_callback(step, train_args, ctx):
        if rank == 0:
            with open(os.path.join(train_args[2], "ckpt", "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(step))

    def stop_callback(train_args, ctx):
        pass

    def clean_callback(is_uce_error, train_args, ctx):
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0

    tft_register_save_ckpt_handler(save_callback)
    tft_register_rename_handler(rename_callback)
    tft_register_stop_handler(stop_callback)
    tft_register_clean_handler(clean_callback)
    tft_register_exception_handler("PRECISION ERROR", "RS_RETRY", lambda err_str: "PRECISION ERROR")

    fault_rank, fault_step = map(int, args.fault.split(":")) if args.fault else (-1, -1)

    @tft_exception_handler
    def train(model_, opt_, out):
        set_mindio_export_version("MindSpeed-LLM")
        for step in range(start + 1, args.steps + 1):
            opt_.zero_grad()
            model_(batch(step, rank)).pow(2).mean().backward()
            if (rank, step) == (fault_rank, fault_step):
                raise RuntimeError(f"injected fault on rank {rank} at step {step}")
            for p in model_.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            tft_set_update_start_time()
            tft_start_updating_os(-1)
            opt_.step()
            tft_end_updating_os(step)
            tft_set_update_end_time()
        return args.steps

    train(model, opt, args.out)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               os.path.join(args.out, f"final_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

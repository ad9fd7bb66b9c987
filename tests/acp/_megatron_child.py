"""Saves and loads a real megatron-core dist checkpoint; prints what reached the disk (for test_megatron)."""
import os
import sys
import warnings


def main(ckpt_dir: str) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from mindio import acp                     # before megatron: the import hook patches it
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from mindio.megatron import _cpu_compat
    _cpu_compat.apply()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import common

    w = torch.randn(4, 6)
    sd = {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0), "iteration": 12,
          "common_t": torch.arange(3), "opt": {"lr": 0.5, "step": torch.tensor(7)}}
    dist_checkpointing.save(sd, ckpt_dir)
    assert acp.flush() == 0
    with open(os.path.join(ckpt_dir, "common.pt"), "rb") as f:
        from mindio.acp import format as fmt
        print("COMMON_MINDIO", fmt.is_container(f.read(fmt.SNIFF)))
    print("PATCHED", acp._megatron.is_patched(common))
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), replica_id=0)},
                                  ckpt_dir)
    ok = torch.equal(out["w"], w) and out["iteration"] == 12 and torch.equal(out["common_t"], torch.arange(3)) \
        and out["opt"]["lr"] == 0.5 and int(out["opt"]["step"]) == 7
    print("ROUNDTRIP", ok)
    acp.shutdown_server()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

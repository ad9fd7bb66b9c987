"""Writes a last-words checkpoint with mindio's torch_dist writer into the checkpoint store's pool and reads
it back with megatron-core's own ``dist_checkpointing.load`` (for test_checkpoint_index.py).

    _pooled_dump_child.py CKPT_DIR

Tensors: a contiguous fp32 view of a bigger buffer (a distributed optimizer's shard: aliased, not cloned),
a bf16 view, a 2-D tensor of 4 MiB (written by the store's parallel copy), and a non-sharded common part.
Prints ``POOLED <bool>`` (the data went into the pool), ``ROUNDTRIP <bool>`` and ``RATE <GB/s>``."""
import logging
import sys
import warnings


def main(ckpt_dir: str) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from mindio import acp
    from mindio.megatron import _cpu_compat, torch_dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
    _cpu_compat.apply()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("mindio.megatron.torch_dist").addHandler(handler)
    logging.getLogger("mindio.megatron.torch_dist").setLevel(logging.INFO)

    flat = torch.randn(1000)
    half = torch.randn(300).bfloat16()
    big = torch.randn(1024, 1024)
    tensors = {"shard": flat[100:600], "half": half[50:250], "big": big}
    sd = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
    sd.update(iteration=7, opt={"lr": 0.25})
    common = torch_dist.write_local(sd, ckpt_dir, 0, "s1", [0], world=1, last_words=True)
    torch_dist.write_common(common, ckpt_dir)
    torch_dist.finalize(ckpt_dir, 0)
    assert acp.flush() == 0  # megatron reads the files on storage
    print("POOLED", any("into the store's pool" in ln for ln in lines), flush=True)
    print("RATE", next((ln.split("(")[1].split(" ")[0] for ln in lines if "GB/s" in ln), "?"), flush=True)
    out = dist_checkpointing.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t), replica_id=0)
                                   for k, t in tensors.items()}, ckpt_dir)
    ok = all(torch.equal(out[k], t) for k, t in tensors.items()) and out["iteration"] == 7 \
        and out["opt"]["lr"] == 0.25
    print("ROUNDTRIP", ok, flush=True)
    acp.shutdown_server()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""A trainer process for the device-path tests: saves and loads through mindio.save/load only, checks
what it got back bitwise, and prints one JSON line of findings last.

    python -m tests.acp._device_child cpu  DIR   # CPU state only: must never touch CUDA
    python -m tests.acp._device_child cuda DIR   # CUDA (and mixed) state, CUDA in use before initialize()
"""
import json
import logging
import os
import sys

import torch

import mindio
from mindio import acp


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def cpu(ckpt: str) -> dict:
    sd = {"w": torch.randn(1000, 64), "step": 3}
    assert acp.initialize() == 0
    path = os.path.join(ckpt, "cpu.pt")
    assert mindio.save(sd, path) == 1
    back = mindio.load(path)
    assert same_bits(back["w"], sd["w"]) and back["step"] == 3
    assert same_bits(mindio.load(path, map_location="cpu")["w"], sd["w"])
    from mindio.acp import api
    return {"cuda_initialized": torch.cuda.is_initialized(), "paths": api._client.device.paths}


def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    big = torch.randn((150 << 20) // 4, device="cuda", generator=g)          # > 2 staging chunks
    base = torch.randn(64, 33, device="cuda", generator=g)
    return {
        "big": big,
        "base": base,
        "view": base[3:10, ::2],                                  # shares base's storage, strided
        "bf16": torch.randn(257, device="cuda", generator=g).to(torch.bfloat16),
        "i64": torch.arange(1001, device="cuda"),
        "empty": torch.empty(0, device="cuda"),
        "param": torch.nn.Parameter(torch.randn(5, 5, device="cuda", generator=g)),
        "cpu": torch.randn(300, 7),                               # mixed object: keeps the CPU path
        "step": 11,
    }


def check(back: dict, sd: dict, device: str) -> None:
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            assert back[k] == v, k
            continue
        want = device if device != "saved" else str(v.device)
        assert str(back[k].device) == want, (k, back[k].device, want)
        assert same_bits(back[k], v), k
    assert isinstance(back["param"], torch.nn.Parameter)
    # the view and its base share one storage, as with torch.load
    assert back["view"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()
    back["base"][3, 0] = 12345.0
    assert back["view"][0, 0].item() == 12345.0


def cuda(ckpt: str) -> dict:
    from mindio.acp import api

    sd = cuda_state()                              # CUDA in use before initialize(): pool registered up front
    assert acp.initialize() == 0
    found = {"paths_after_initialize": dict(api._client.device.paths)}
    path = os.path.join(ckpt, "gpu.pt")
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    before = host_stats() if host_stats else None
    assert mindio.save(sd, path) == 1
    # the copies were waited for: overwrite the source right away, the pool keeps the saved bytes
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    # producer ordering: a kernel queued on the current stream just before the save must be in it
    sd["big"].mul_(-1.0)
    assert mindio.save(sd, path) == 1
    if before is not None:
        after = host_stats()          # pinned host allocations made by the two saves (none expected)
        found["host_alloc"] = {k: after[k] - before.get(k, 0) for k in after
                               if "alloc" in k and isinstance(after[k], (int, float))}
    check(mindio.load(path), sd, "saved")
    assert not same_bits(sd["big"], saved["big"])
    check(mindio.load(path, map_location="cuda"), sd, "cuda:0")
    check(mindio.load(path, map_location=torch.device("cuda:0")), sd, "cuda:0")
    check(mindio.load(path, map_location={"cuda:0": "cuda:0"}), sd, "saved")
    check(mindio.load(path, map_location="cpu"), sd, "cpu")
    cpu_back = mindio.load(path, map_location="cpu")
    assert cpu_back["big"].device.type == "cpu"
    assert acp.flush() == 0
    check(mindio.load(path, open_way="fopen", map_location="cuda"), sd, "cuda:0")    # from storage
    check(mindio.load(path, open_way="fopen"), sd, "saved")
    found["paths"] = dict(api._client.device.paths)
    found["counts"] = acp.fallback_counts()
    return found


def main(mode: str, ckpt: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(message)s")
    found = cpu(ckpt) if mode == "cpu" else cuda(ckpt)
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

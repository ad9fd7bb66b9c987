"""Worker for test_device.py: 2 gloo ranks all_reduce in a loop; rank 1 raises after a few steps,
tears down through mindio.ttp.processor.device, records when, and stays alive until rank 0 has written its record
(so a release of rank 0 is due to the teardown, not to the process exiting). Rank 0 records when its blocked all_reduce raised."""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mindio.ttp.processor import device

rank, out = int(sys.argv[1]), sys.argv[2]
os.environ.update(RANK=str(rank), WORLD_SIZE="2")
dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # backstop: never what releases
sub = dist.new_group([0, 1])  # a subgroup too: every group must go
model = {"group": sub}  # a framework-held reference, dropped by the callback
t = torch.ones(4)
result = {"rank": rank, "backend": device.backend_for().name}
try:
    for step in range(10_000):
        if rank == 1 and step == 20:
            raise RuntimeError("injected fault on rank 1")
        dist.all_reduce(t, group=sub if step % 2 else None)
    result["error"] = None
except RuntimeError as exc:
    result["t_error"] = time.time()
    result["error"] = str(exc)[:200]
    if rank == 1:
        time.sleep(0.5)  # rank 0 is now blocked in an all_reduce with us
        result["t_teardown"] = time.time()
        result["backend_used"] = device.teardown(drop_references=model.clear)
        result["initialized_after"] = dist.is_initialized()
    else:  # the released peer cleans too (a secondary failure), as the recovery flows do
        device.teardown(drop_references=model.clear)
with open(os.path.join(out, f"rank{rank}.json.part"), "w") as f:
    json.dump(result, f)
os.replace(os.path.join(out, f"rank{rank}.json.part"), os.path.join(out, f"rank{rank}.json"))
if rank == 1:  # alive until rank 0 has recorded its release (at most 60 s), not a fixed 5 s
    end = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "rank0.json")) and time.monotonic() < end:
        time.sleep(0.01)

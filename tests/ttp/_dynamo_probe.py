"""One gloo rank (world size 1) as a training script writes it: torch, then (argv[1] == "mindio")
mindio.ttp, init_process_group, a model and a torch optimizer, one collective, destroy_process_group,
a collection. Prints one JSON line: whether torch._dynamo was imported before init_process_group, and
the names of the process's native threads at the end."""
import gc
import json
import os
import sys

import torch

if sys.argv[1] == "mindio":
    from mindio import ttp  # noqa: F401

import torch.distributed as dist  # noqa: E402

early = "torch._dynamo" in sys.modules
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
opt = torch.optim.Adam(model.parameters())  # imports torch._dynamo if nothing did before
x = torch.ones(2)
dist.all_reduce(x)
dist.destroy_process_group()
gc.collect()
threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(json.dumps({"dynamo_before_init": early, "threads": threads}))

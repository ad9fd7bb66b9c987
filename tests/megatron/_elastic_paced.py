"""examples/megatron/pretrain_gpt.py for the elastic test through mindio-run: unchanged, except that while
the world is shrunk (a downgrade removed ranks) every step is followed by a pause of up to
ELASTIC_TEST_PACE seconds, cut short as soon as the controller holds the fence (the upgrade's stop). The
steps at the smaller size thus leave a ``mindio-run --standby`` agent started after the scale-in time to
come up on a loaded machine; nothing is paced at full size, so the losses and digests are those of the
example. ``MINDIO_STANDBY=1`` (set by the standby agent) makes it a standby process, as the example."""
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from mindio import megatron  # noqa: F401  (a warm spare imports megatron-core before its rank is assigned)
from mindio.ttp._runtime import state

PRETRAIN = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "pretrain_gpt.py"
spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
pretrain_gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain_gpt)
_train_step = pretrain_gpt.train_step


def paced_train_step(*args, **kwargs):
    out = _train_step(*args, **kwargs)
    if dist.get_world_size() < int(os.environ["WORLD_SIZE"]):  # downgraded
        end = time.monotonic() + float(os.environ.get("ELASTIC_TEST_PACE", "2"))
        while time.monotonic() < end and not getattr(state.processor, "_hold", False):
            time.sleep(0.05)
    return out


pretrain_gpt.train_step = paced_train_step

if __name__ == "__main__":  # megatron's async checkpoint writer spawns: keep the guard
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pretrain_gpt.pretrain(pretrain_gpt.parse_args(sys.argv[1:]))

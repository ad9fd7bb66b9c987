"""examples/megatron/pretrain_gpt.py, unchanged except that some recovery handlers raise on some ranks: faulty
real objects under a recovery (test_recover_megatron.py). ``FAULTY_HANDLERS`` names them, comma-separated
``HANDLER@RANK``: ``repair@2`` -- rank 2's repair handler (tft_register_repair_handler, MegatronAdapter.repair)
raises instead of sending or receiving; ``save@0`` -- rank 0's dump save (MegatronAdapter.save) raises before
writing anything. The example registers its handlers through mindio.megatron.register, whose callbacks look
the adapter's methods up when they are called; a replacement process runs this script too."""
import importlib.util
import logging
import os
import sys
from pathlib import Path

from mindio.megatron import MegatronAdapter

PRETRAIN = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "pretrain_gpt.py"
spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
pretrain_gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain_gpt)

FAULTY = {tuple(item.split("@")) for item in os.environ.get("FAULTY_HANDLERS", "").split(",") if item}
RANK = os.environ["RANK"]


def _faulty(name: str):
    plain = getattr(MegatronAdapter, name)

    def handler(self, *args, **kwargs):
        if (name, RANK) in FAULTY:
            raise RuntimeError(f"injected: rank {RANK}'s {name} handler failed")
        return plain(self, *args, **kwargs)
    return handler


for _name in {n for n, _r in FAULTY}:
    if _name not in ("repair", "save"):
        raise SystemExit(f"FAULTY_HANDLERS: unknown handler {_name!r} (repair, save)")
    setattr(MegatronAdapter, _name, _faulty(_name))

if __name__ == "__main__":  # megatron's async checkpoint writer spawns: keep the guard
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pretrain_gpt.pretrain(pretrain_gpt.parse_args(sys.argv[1:]))

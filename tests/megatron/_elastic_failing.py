"""examples/megatron/pretrain_gpt.py, unchanged except that rank 0's zit downgrade-rebuild handler raises: a
faulty real object under the downgrade (test_elastic_megatron.py). The example registers the handler through
mindio.megatron.elastic.register_elastic, whose handler looks ``downgrade_rebuild`` up when it is called."""
import importlib.util
import logging
import os
import sys
from pathlib import Path

from mindio.megatron import elastic as mio_elastic

PRETRAIN = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "pretrain_gpt.py"
spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
pretrain_gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain_gpt)
_downgrade_rebuild = mio_elastic.downgrade_rebuild


def failing_downgrade_rebuild(adapter, new_dp_ranks, new_world_ranks):
    if os.environ["RANK"] == "0":
        raise RuntimeError("injected: rank 0's zit_downgrade_rebuild handler failed")
    return _downgrade_rebuild(adapter, new_dp_ranks, new_world_ranks)


mio_elastic.downgrade_rebuild = failing_downgrade_rebuild

if __name__ == "__main__":  # megatron's async checkpoint writer spawns: keep the guard
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pretrain_gpt.pretrain(pretrain_gpt.parse_args(sys.argv[1:]))

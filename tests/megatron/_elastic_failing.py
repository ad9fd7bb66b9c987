"""examples/megatron/pretrain_gpt.py, unchanged except that rank 0's zit rebuild handler raises: a faulty real
object under the downgrade or the upgrade (test_elastic_megatron.py). ``ELASTIC_FAILING`` = ``downgrade``
(default: rank 0's zit_downgrade_rebuild raises) or ``upgrade`` (rank 0's zit_upgrade_rebuild raises; the
steps at the smaller size are paced as in _elastic_paced.py, so that the standbys come up). The example
registers the handlers through mindio.megatron.elastic.register_elastic, whose handlers look
``downgrade_rebuild`` / ``upgrade_rebuild`` up when they are called."""
import importlib.util
import logging
import os
import sys
from pathlib import Path

from mindio.megatron import elastic as mio_elastic

HERE = Path(__file__).resolve().parent
WHICH = os.environ.get("ELASTIC_FAILING", "downgrade")
if WHICH not in ("downgrade", "upgrade"):
    raise SystemExit(f"ELASTIC_FAILING={WHICH!r}: 'downgrade' or 'upgrade'")
SOURCE = HERE / "_elastic_paced.py" if WHICH == "upgrade" else HERE.parents[1] / "examples" / "megatron" / "pretrain_gpt.py"
spec = importlib.util.spec_from_file_location("_elastic_base", SOURCE)
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)
pretrain_gpt = getattr(base, "pretrain_gpt", base)
_plain = getattr(mio_elastic, f"{WHICH}_rebuild")


def failing_rebuild(adapter, *args):
    if os.environ["RANK"] == "0":
        raise RuntimeError(f"injected: rank 0's zit_{WHICH}_rebuild handler failed")
    return _plain(adapter, *args)


setattr(mio_elastic, f"{WHICH}_rebuild", failing_rebuild)

if __name__ == "__main__":  # megatron's async checkpoint writer spawns: keep the guard
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pretrain_gpt.pretrain(pretrain_gpt.parse_args(sys.argv[1:]))

"""A standby process for the elastic tests: pretrain_gpt.py in standby mode, started by the test at the
job's start (imports done, like a warm spare) and offering its rank once ``ELASTIC_TEST_GO`` exists --
the moment "a node came back" in the scenario."""
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

os.environ["MINDIO_STANDBY"] = "1"
PRETRAIN = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "pretrain_gpt.py"
spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
pretrain_gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain_gpt)

if __name__ == "__main__":
    args = pretrain_gpt.parse_args(sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    go, end = Path(os.environ["ELASTIC_TEST_GO"]), time.monotonic() + float(os.environ.get("ELASTIC_TEST_GO_WAIT", 300))
    while not go.exists():
        if time.monotonic() > end:
            raise SystemExit(f"standby: {go} never appeared")
        time.sleep(0.05)
    pretrain_gpt.pretrain(args)

"""The job recovery_bench.py launches: examples/megatron/pretrain_gpt.py, plus two things a
relaunch needs that the example leaves to its launcher script.

* ``BENCH_RESUME_DIR``: when it holds a checkpoint (the last periodic one, or a dump), ``--load`` it,
  as a resubmitted job's script would; the first launch starts from scratch.
* ``BENCH_TORCH_SAVE=1``: periodic checkpoints are written with plain ``torch.save`` (no mindio
  checkpoint store), the baseline everyone uses today.
* ``BENCH_TIMINGS=1``: the data path is timed where it moves state, one line each, for the
  benchmark's bytes-and-rate columns: ``bench-job: save|load|dump|repair-send|repair-recv rank=R
  bytes=N s=T`` (periodic save and load on rank 0; every dumping, sending and receiving rank).
* a replacement process (recover-in-place, recover) prints ``bench-job: replacement rank=R start t=..
  imports t=.. warm-spare import_s=..``: when its script started, and how long its warm spare imported.
* ``--inject`` is the example's own flag (:mod:`mindio.drill`: fires once per job, also across
  relaunches when MINDIO_DRILL_DIR is set, as the benchmark does).

It prints ``bench-job: start`` before and ``bench-job: imports`` after its heavy imports (rank 0),
so the benchmark can tell process start-up from initialisation. The imports are at top level so
that mindio-run's warm interpreters pre-import them (mindio.launch._bootstrap).
"""
import os
import sys
import time

_T0 = time.time()

import importlib.util  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import megatron.core  # noqa: E402,F401
import mindio.megatron  # noqa: E402,F401
import mindio.ttp  # noqa: E402,F401
import mindio.drill  # noqa: E402,F401
from mindio.megatron import checkpoint  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron" / "pretrain_gpt.py"


def _shard_bytes(ctx) -> int:
    """Bytes of this rank's optimizer shard (fp32 main params, moments, steps): what a save writes,
    a load reads and a repair sends, per rank."""
    return sum(t.numel() * t.element_size() for t in ctx.shard_tensors())


def _dump_bytes(ctx, step, _save_info=None, root=None) -> int:
    """Bytes this rank's dump wrote: the items its index piece lists (a writer of the weights writes
    more than its optimizer shard)."""
    import json

    directory = checkpoint.checkpoint_dir(root or ctx.args.save, step)
    piece = json.loads((directory / f"__{checkpoint._rank(ctx)}.mindio.json").read_text())
    return sum(int(r["length"]) for r in piece["results"])


def _timed(module, name: str, label: str, nbytes, rank0_only: bool = False) -> None:
    """Replace ``module.name`` with a wrapper printing ``bench-job: <label> rank= bytes= s=`` (no line
    when ``nbytes`` returns None: a dump call on a rank that writes nothing)."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        took = time.perf_counter() - t0
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
        n = nbytes(args, out)
        if n is not None and (not rank0_only or rank == 0):
            print(f"bench-job: {label} rank={rank} bytes={n} s={took:.6f}", flush=True)
        return out
    setattr(module, name, wrapper)


def time_data_path() -> None:
    from mindio.megatron import adapter

    tensor_bytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    _timed(checkpoint, "save_checkpoint", "save", lambda a, out: _shard_bytes(a[0]), rank0_only=True)
    _timed(checkpoint, "load_checkpoint", "load", lambda a, out: _shard_bytes(a[0]), rank0_only=True)
    _timed(checkpoint, "save_dump", "dump", lambda a, out: _dump_bytes(*a[:4]) if out else None)
    _timed(adapter, "send_state", "repair-send", lambda a, out: tensor_bytes(a[0]))
    _timed(adapter, "recv_state", "repair-recv", lambda a, out: tensor_bytes(a[0]))


def time_phases(example) -> None:
    """``BENCH_PHASES=1``: where a (re)launch's initialisation goes, rank 0's wall clock around each part of the
    example's ``pretrain()`` before the load: ``bench-job: phase <name> rank=R s=T t=<end>``."""
    rank = int(os.environ.get("RANK", 0))

    def wrap(owner, name, label):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            if rank == 0:
                print(f"bench-job: phase {label} rank={rank} s={time.perf_counter() - t0:.6f} t={time.time():.6f}",
                      flush=True)
            return out
        setattr(owner, name, wrapper)

    wrap(example, "CorpusDataset", "dataset")
    wrap(example, "initialize", "init-groups")
    wrap(example.mio.TrainingContext, "init_parallel", "init-parallel")
    wrap(example, "setup_model_and_optimizer", "build")
    wrap(checkpoint, "initialize_store", "store")
    wrap(checkpoint, "load_checkpoint", "load")


def main() -> None:
    rank = os.environ.get("RANK", "0")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if rank == "0":
        print(f"bench-job: start restart={restart} t={_T0:.6f}", flush=True)
        print(f"bench-job: imports restart={restart} t={time.time():.6f}", flush=True)
    if os.environ.get("MINDIO_REBOOT_GEN"):  # a replacement process (recover-in-place, recover)
        print(f"bench-job: replacement rank={rank} start t={_T0:.6f} imports t={time.time():.6f} warm-spare "
              f"import_s={os.environ.get('MINDIO_WORKER_WARMUP_S', '-')}", flush=True)
    argv = sys.argv[1:]
    resume = os.environ.get("BENCH_RESUME_DIR")
    if resume and checkpoint.read_tracker(Path(resume)) is not None:
        argv += ["--load", resume]
    if os.environ.get("BENCH_TORCH_SAVE") == "1":
        checkpoint.torch_dist._acp = lambda: None  # checkpoint files go straight to storage (no store)
        checkpoint.initialize_store = lambda *a, **k: False
    if os.environ.get("BENCH_TIMINGS") == "1":
        time_data_path()
    sys.argv = [str(EXAMPLE), *argv]
    spec = importlib.util.spec_from_file_location("pretrain_gpt", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_gpt"] = example
    spec.loader.exec_module(example)  # defines everything; its __main__ block does not run
    if os.environ.get("BENCH_PHASES") == "1":
        time_phases(example)
    args = example.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    example.pretrain(args)


if __name__ == "__main__":
    main()

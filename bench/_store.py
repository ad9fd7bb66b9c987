"""A private checkpoint store for one benchmark run (bench/acp_bench.py, bench/acp_gpu_bench.py).

``private_store(...)`` makes a checkpoint directory and a runtime directory of its own (so the run
starts its own daemon, with its own pool), connects, waits until the client's copy-on-write load
view is faulted in (a job connects long before it loads: the figures start from that steady state),
and on exit stops the daemon and removes both directories.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Store:
    work: str          # checkpoint directory
    init_s: float      # initialize(): daemon start, pool mapped and faulted in (and registered, with CUDA)
    view_s: float      # the load view's background fault-in, after initialize()


@contextlib.contextmanager
def private_store(checkpoint_parent=None, server_info=None, pool_mb=None, prefix="mindio-bench"):
    from mindio import acp
    from mindio.acp import api

    work = tempfile.mkdtemp(prefix=f"{prefix}-", dir=checkpoint_parent or "/var/tmp")
    run_dir = tempfile.mkdtemp(prefix=f"{prefix}-rt-")
    os.environ["MINDIO_ACP_DIR"] = run_dir             # a private daemon, stopped at the end
    if pool_mb:
        os.environ["MINDIO_ACP_POOL_MB"] = str(pool_mb)
    try:
        t0 = time.perf_counter()
        assert acp.initialize(server_info) == 0
        api._client.populated.wait(120)  # the pool's page tables (in the background since initialize)
        took = time.perf_counter() - t0
        view, t1 = api._client.loadview, time.perf_counter()
        while view is not None and view.populated < view.size and time.perf_counter() - t1 < 120:
            time.sleep(0.05)
        yield Store(work, took, time.perf_counter() - t1)
    finally:
        acp.shutdown_server()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)

"""What the processor costs a training loop: step time with vs without it, in the same run.

    python bench/processor_overhead.py [--step-ms 100] [--blocks 6] [--steps 20]

One rank (world size 1) with a CPU-bound step of about ``--step-ms`` (torch matmuls, calibrated at
start). The controller runs in a child process, as it would in rank 0 or a launcher. Blocks of
``--steps`` steps alternate between the bare loop and the loop with a started processor and the
per-step calls a framework makes (tft_start_updating_os / tft_end_updating_os / tft_pause_train), so
drift of the machine hits both alike; in the bare blocks no processor exists at all. Reported: median
and mean step time of each and the overhead ratio.
Target (issue 3): < 1 % at 100 ms steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) used so far by thread ``tid`` of this process (Linux /proc)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    os.environ.setdefault("MINDIO_SECRET", "processor-overhead-bench")
    os.environ.setdefault("TTP_LOG_STDOUT", "1")
    os.environ.setdefault("TTP_LOG_LEVEL", "WARNING")
    import torch

    import mindio.ttp as ttp
    from mindio.ttp._runtime import state as _rt
    from tests.ttp._harness import free_port
    torch.set_num_threads(1)
    x = torch.randn(192, 192)

    def work(k: int) -> None:
        y = x
        for _ in range(k):
            y = torch.tanh(y @ x) * 0.5

    t = time.perf_counter()
    work(200)
    k = max(1, int(200 * a.step_ms / 1000 / (time.perf_counter() - t)))

    port = free_port()
    ctl = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "ttp", "_controller_proc.py"), "1", str(port)],
                           env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bare, managed, step, link_cpu, link_wall = [], [], 0, 0.0, 0.0
        for block in range(2 * a.blocks):
            with_proc = block % 2 == 1
            if with_proc:  # a fresh processor each managed block; none at all in the bare blocks
                ttp.tft_init_processor(0, 1, enable_local_copy=False, enable_tls=False)
                ttp.tft_start_processor("127.0.0.1", port)
                tid = _rt.processor.link.native_id
                c0, w0 = _thread_cpu(tid), time.perf_counter()
            for _ in range(a.steps):
                t0 = time.perf_counter()
                if with_proc:
                    ttp.tft_start_updating_os(-1)
                work(k)
                if with_proc:
                    step += 1
                    ttp.tft_end_updating_os(step)
                    ttp.tft_pause_train(step)
                (managed if with_proc else bare).append(time.perf_counter() - t0)
            if with_proc:
                link_cpu += _thread_cpu(tid) - c0
                link_wall += time.perf_counter() - w0
                if block == 2 * a.blocks - 1:  # cost of the three per-step calls, measured directly
                    n = 20000
                    t0 = time.perf_counter()
                    for i in range(n):
                        ttp.tft_start_updating_os(-1)
                        ttp.tft_end_updating_os(step + i + 1)
                        ttp.tft_pause_train(step + i + 1)
                    per_step_calls = (time.perf_counter() - t0) / n
                ttp.tft_destroy_processor()
    finally:
        ctl.kill()
        ctl.wait()
    mb, mm = statistics.median(bare), statistics.median(managed)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; step = {k} x (192x192 matmul + tanh); "
          f"{a.blocks} blocks x {a.steps} steps each way, alternating")
    print(f"median step without a processor           : {mb * 1000:8.3f} ms  (mean {statistics.mean(bare) * 1000:.3f})")
    print(f"median step with processor + per-step calls: {mm * 1000:8.3f} ms  (mean {statistics.mean(managed) * 1000:.3f})")
    print(f"processor overhead: {(mm / mb - 1) * 100:+.2f} % of step time (median), "
          f"{(statistics.mean(managed) / statistics.mean(bare) - 1) * 100:+.2f} % (mean)")
    tick = 1 / os.sysconf("SC_CLK_TCK")
    cpu_share = max(link_cpu, tick) / link_wall  # /proc counts whole ticks: at least an upper bound
    print(f"load-independent estimate: link thread CPU {'<= ' if link_cpu < tick else ''}{cpu_share * 100:.3f} % "
          f"of wall time ({link_cpu:.2f} s in {link_wall:.1f} s) + per-step calls "
          f"{per_step_calls * 1e6:.1f} us = {(cpu_share + per_step_calls / mb) * 100:.3f} % of a {mb * 1000:.0f} ms step")

if __name__ == "__main__":
    main()

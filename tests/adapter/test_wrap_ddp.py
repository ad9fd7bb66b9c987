"""mindio.adapter.wrap_ddp: DistributedDataParallel whose gradient buckets are fixed when it is built
(issue 30 item 3). A plain wrapper rebuilds its buckets after its first backward, so one re-created by a
recovery reduces its first step in another order than the uninterrupted run;
tests/dropin/test_quickstart_ddp.py shows the bitwise end on 4 ranks. Here, in a real one-rank gloo world
(a child process), what makes it so: the wrapper has rebuilt its buckets before any step, in parameter
order, every wrapper of the module alike, and they stay so while it trains."""
import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist
    from mindio.adapter import wrap_ddp
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    seen = []
    for _ in range(2):  # the first wrapper, then one re-created as a recovery does
        ddp = wrap_ddp(module)
        log = lambda: {k: v for k, v in ddp._get_ddp_logging_data().items() if "rebuilt" in k}
        seen.append(ddp._has_rebuilt_buckets)  # rebuilt already, before any step
        for _ in range(3):
            ddp(torch.randn(4, 8)).sum().backward()
        seen.append(log())
        del ddp
    dist.destroy_process_group()
    print(json.dumps(seen))
""")


def test_every_wrapper_reduces_with_the_same_buckets_from_its_first_step():
    out = subprocess.run([sys.executable, "-c", CHILD], env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen[0] is True and seen[2] is True, seen
    assert seen[1] == seen[3] and seen[1]["rebuilt_per_bucket_param_indices"] == "0 1 2 3", seen

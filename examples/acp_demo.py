"""mindio checkpoint store walk-through: save, kill -9 the trainer, the daemon still persists, resume.

    .venv/bin/python examples/acp_demo.py

1. A trainer process trains a tiny model and calls ``mindio.save`` after every step: the call
   returns once the checkpoint is in the node's shared-memory pool (return code 1).
2. Right after the save of step 3 returns, the demo kills the trainer with SIGKILL. The file is
   not on disk yet (the daemon persists with a 2 s delay here, to make the window visible); an
   in-progress marker says so.
3. The mindio-acp-server daemon, which outlived the trainer, writes the file anyway: temp file,
   fsync, rename, checksums. The demo loads it from storage and checks it bit for bit.
4. A new trainer resumes from that checkpoint (served from memory) and finishes.
Everything runs in private temporary directories, and the daemon is stopped at the end.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer(ckpt: str, steps: int, resume: bool) -> None:
    """The training process: a linear model, SGD, a checkpoint after every step."""
    import torch

    import mindio
    from mindio import acp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    assert acp.initialize() == 0
    if resume:
        state = mindio.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"  [trainer {os.getpid()}] resumed from step {start} (mindio.load: memory pool first, else storage)", flush=True)
    data = torch.randn(512, 256, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True) * 0.1
    for step in range(start + 1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(data), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        t0 = time.perf_counter()
        rc = mindio.save(state, ckpt)
        took = (time.perf_counter() - t0) * 1000
        digest = float(sum(p.detach().double().sum() for p in model.parameters()))
        print(f"  [trainer {os.getpid()}] step {step} loss {loss.item():.4f}: mindio.save returned {rc} "
              f"in {took:.1f} ms (param sum {digest:.6f})", flush=True)
        time.sleep(0.2)


def main() -> int:
    work = tempfile.mkdtemp(prefix="mindio-demo-")
    ckpt = os.path.join(work, "ckpt", "model.pt")
    os.makedirs(os.path.dirname(ckpt))
    env = dict(os.environ, MINDIO_ACP_DIR=os.path.join(work, "run"), MINDIO_ACP_POOL_MB="256",
               MINDIO_ACP_PERSIST_DELAY="2.0", MINDIO_ACP_IDLE_EXIT="30", PYTHONPATH=ROOT)
    os.environ.update({k: env[k] for k in ("MINDIO_ACP_DIR", "MINDIO_ACP_POOL_MB", "MINDIO_ACP_IDLE_EXIT")})
    marker = os.path.join(os.path.dirname(ckpt), ".model.pt.mindio-pending")
    from mindio import acp            # imported up front: the crash window below is short

    def on_disk():
        try:
            return acp.load(ckpt, open_way="fopen")["step"]         # storage only, never the pool
        except FileNotFoundError:
            return None
    try:
        print(f"1. trainer saves every step to {ckpt}")
        proc = subprocess.Popen([sys.executable, __file__, "--trainer", ckpt, "6"], env=env,
                                stdout=subprocess.PIPE, text=True)
        last = None
        for line in proc.stdout:
            print(line, end="")
            if " step 3 " in line:
                last = line
                break
        if last is None:
            raise SystemExit("trainer never reached step 3")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        print(f"2. kill -9 trainer right after its step-3 save returned (exit status {proc.returncode})")
        now = on_disk()
        print(f"   on disk now: step {now}, in-progress marker {'present' if os.path.exists(marker) else 'absent'}"
              + (": step 3 exists only in the daemon's memory" if now != 3 else " (already persisted)"))
        t0 = time.monotonic()
        while os.path.exists(marker) or on_disk() != 3:
            if time.monotonic() - t0 > 30:
                raise SystemExit("the daemon did not persist the checkpoint within 30 s")
            time.sleep(0.05)
        print(f"3. the daemon persisted it {time.monotonic() - t0:.2f} s after the kill; marker removed")

        state = acp.load(ckpt, open_way="fopen")                       # from storage, checksums verified
        digest = sum(v.double().sum() for k, v in state["model"].items())
        print(f"   loaded from storage: step {state['step']}, param sum {float(digest):.6f} "
              "(equals the trainer's step-3 line)")
        expected = float(last.split("param sum ")[1].rstrip(")\n"))
        assert state["step"] == 3 and abs(float(digest) - expected) < 1e-6, "persisted checkpoint differs"
        del state
        print("4. a new trainer resumes from it")
        subprocess.run([sys.executable, __file__, "--trainer", ckpt, "6", "--resume"], env=env, check=True,
                       timeout=120)
        assert acp.initialize() == 0 and acp.flush() == 0
        final = acp.load(ckpt, open_way="fopen")
        print(f"   done: step {final['step']} is on disk; fallbacks used: {acp.fallback_counts() or 'none'}")
        acp.shutdown_server()
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        trainer(sys.argv[2], int(sys.argv[3]), resume="--resume" in sys.argv)
    else:
        sys.exit(main())

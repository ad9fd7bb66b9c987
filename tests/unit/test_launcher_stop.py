"""A launcher's SIGTERM after one of its workers died is no preemption (issue 30 item 5): a worker tells
the two apart by its siblings (mindio/ttp/processor/preempt.py, ``gone_siblings``). Real processes: a
stand-in launcher starts three workers with torchrun's environment, one of them ends (SIGKILL), and a
survivor names it by its global rank; with every sibling alive it names none."""
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAUNCHER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    worker = "import sys, time; time.sleep(60)"
    ask = ("import sys; from mindio.ttp.processor.preempt import gone_siblings; "
           "print(gone_siblings(), flush=True)")
    env = lambda i: dict(os.environ, LOCAL_RANK=str(i), RANK=str(4 + i), LOCAL_WORLD_SIZE="3")
    sleepers = [subprocess.Popen([sys.executable, "-c", worker], env=env(i)) for i in (1, 2)]
    time.sleep(0.5)
    subprocess.run([sys.executable, "-c", ask], env=env(0), check=True)     # every worker alive
    os.kill(sleepers[0].pid, signal.SIGKILL)                                # local rank 1 = global 5 dies
    time.sleep(0.3)
    subprocess.run([sys.executable, "-c", ask], env=env(0), check=True)     # a zombie: ended
    sleepers[0].wait()
    subprocess.run([sys.executable, "-c", ask], env=env(0), check=True)     # reaped, as torchrun does
    sleepers[1].kill()
    sleepers[1].wait()
""")


def test_a_survivor_names_the_sibling_that_died():
    out = subprocess.run([sys.executable, "-c", LAUNCHER], env=dict(os.environ, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["[]", "[5]", "[5]"], (out.stdout, out.stderr)

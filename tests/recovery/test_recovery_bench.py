"""bench/recovery_bench.py: the timeline analysis (pure) and strategy availability."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "recovery_bench.py"
spec = importlib.util.spec_from_file_location("recovery_bench", BENCH)
rb = importlib.util.module_from_spec(spec)
sys.modules["recovery_bench"] = rb  # dataclasses look their module up
spec.loader.exec_module(rb)


def test_dump_relaunch_timeline_and_steps_lost():
    t = 1000.0
    run = rb.Run(
        lines=[(t - 1, "iteration      7/10 | lm loss 5.8"), (t + 0.001, "[rank 1] injecting raise at step 8"),
               (t + 9.0, "bench-job: start restart=1 t=1004.5"), (t + 9.1, "bench-job: imports restart=1 t=1004.6"),
               (t + 7.0, "loaded checkpoint iteration 7: state-digest: ab"),
               (t + 8.0, "iteration      8/10 | lm loss 5.7"), (t + 9.0, "state-digest: ab12")],
        events=[{"t": t, "kind": "fault_injected"}, {"t": t + 0.01, "kind": "report_received"},
                {"t": t + 0.5, "kind": "action", "action": "stop"},
                {"t": t + 0.1, "kind": "decision", "strategy": "dump"},
                {"t": t + 1.5, "kind": "action", "action": "rename"}],
        codes=[0])
    r = rb.analyse(run, fault_step=8)
    assert r["ok"] and r["steps_lost"] == 0 and r["first_step_after"] == 8
    assert r["recovery_s"] == 8.0 and r["decision"] == "dump" and r["loaded_iteration"] == 7
    assert r["phases"] == {"detect": 0.01, "stop": 0.49, "dump": 1.0, "restart": 3.0, "imports": 0.1,
                           "init+load": 2.4, "first step": 1.0}
    assert r["final_digest"] == "ab12"


def test_baseline_from_periodic_checkpoint_loses_steps():
    t = 50.0
    run = rb.Run(lines=[(t, "[rank 1] injecting raise at step 8"),
                        (t + 0.2, "W1121 ... Sending process 1 closing signal SIGTERM"),
                        (t + 20, "iteration      6/10 | lm loss 5.9")], events=[], codes=[1, 0])
    r = rb.analyse(run, fault_step=8)
    assert r["ok"] and r["steps_lost"] == 2 and r["recovery_s"] == 20
    assert r["phases"]["detect"] == 0.2


def test_a_fault_that_never_fired_is_an_error_not_a_figure():
    r = rb.analyse(rb.Run(lines=[(1.0, "iteration      1/10 |")]), fault_step=8)
    assert not r["ok"] and "never fired" in r["error"]


def test_strategies_the_controller_lacks_are_not_run():
    have = rb.implemented()
    assert "baseline" in have and "dump" in have

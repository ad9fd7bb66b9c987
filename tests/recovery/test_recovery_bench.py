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
                           "load": 2.4, "first step": 1.0}
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


def test_state_step_time_and_periodic_save_come_from_the_job_lines():
    lines = [(1.0, "optimizer-state-bytes: 600 on rank 0 (P=100, R=2, d=4, 12*P*R/d=600)"),
             (2.0, "iteration      1/10 | lm loss 6.0 | step 900.0 ms"),
             (3.0, "iteration      2/10 | lm loss 5.9 | step 100.0 ms"),
             (4.0, "iteration      3/10 | lm loss 5.8 | step 120.0 ms"),
             (4.1, "bench-job: save rank=0 bytes=650 s=0.5"),
             (9.0, "iteration      4/10 | lm loss 5.7 | step 9999.0 ms")]  # after the fault: not counted
    facts = rb.job_facts(lines, before=5.0)
    assert facts["params"] == 100 and facts["shard_bytes"] == 600 and facts["state_bytes"] == 1000
    assert facts["step_s"] == 0.11 and facts["save"] == {"bytes": 650, "s": 0.5}


def test_bytes_moved_by_a_dump_and_relaunch_and_by_a_repair():
    tr = rb.transfers([(1, "bench-job: dump rank=0 bytes=1000 s=0.5"), (1, "bench-job: dump rank=1 bytes=1000 s=1.0"),
                       (2, "bench-job: load rank=0 bytes=1000 s=0.25"), (3, "not a transfer line")])
    moved = {m["what"]: m for m in rb.moved(tr, dp=4)}
    assert moved["dump write"] == {"what": "dump write", "bytes": 2000, "s": 1.0, "gbps": 0.0}
    assert moved["load"]["bytes"] == 4000 and moved["load"]["s"] == 0.25  # every rank reads its shard
    rep = rb.moved(rb.transfers([(1, "bench-job: repair-send rank=3 bytes=2000000000 s=2.0")]), dp=4)
    assert rep == [{"what": "repair", "bytes": 2000000000, "s": 2.0, "gbps": 1.0}]


def _ok(again_s, digest="d", **kw):
    return {"ok": True, "recovery_s": again_s + 1, "again_s": again_s, "final_digest": digest, "steps_lost": 0, **kw}


def test_training_again_discounts_one_normal_step_but_not_the_recovery():
    r = {"recovery_s": 5.0, "phases": {"rollback": 0.5, "first step": 2.0}}
    assert rb.training_again(r, step_s=1.5) == 3.5   # the first step took 0.5 s more than a normal one
    assert rb.training_again(r, step_s=4.0) == 3.0   # never before train() was re-entered
    assert rb.training_again(r, step_s=None) == 5.0
    results = {"reference": {"ok": True, "step_s": 1.5}, "retry": {"ok": True, **r}, "dump": {"ok": False}}
    rb.add_training_again(results)
    assert results["retry"]["again_s"] == 3.5 and "again_s" not in results["dump"]


def test_targets_compare_with_the_bounds_and_the_fault_free_digest():
    gb = {"what": "repair", "bytes": 10**9, "s": 0.5, "gbps": 2.0}
    results = {"reference": {"ok": True, "final_digest": "d"},
               "baseline": _ok(40.0, steps_lost=2),
               "dump": _ok(7.0, steps_lost=1),
               "retry": _ok(1.9, moved=[gb]),                       # <= 1 s + 1 GB / 1 GB/s
               "recover-in-place": _ok(2.5, digest="x", state_bytes=10**9)}  # fast, but not bitwise
    lines = rb.targets(results)
    assert any(x.startswith("PASS: retry 1.90 s <= 1 s + 1000000000 B") for x in lines)
    assert any(x.startswith("FAIL: recover-in-place") and "NOT equal" in x for x in lines)
    assert any(x.startswith("PASS: dump + relaunch lost 1 step(s)") for x in lines)
    assert any(x.startswith("PASS: dump 5.7x sooner") for x in lines)
    assert any(x.startswith("PASS: recover-in-place 16.0x sooner") for x in lines)
    assert not any(x.startswith("n/a") for x in lines)


def test_targets_without_a_reference_run_say_the_final_state_was_not_compared():
    """--no-reference: no fault-free final state to compare with; the lines say so (they said "NOT equal")."""
    lines = rb.targets({"reference": {"ok": False}, "retry": _ok(0.8, moved=[]), "dump": _ok(7.0, steps_lost=1)})
    assert any(x.startswith("PASS: retry 0.80 s") and "not compared (no fault-free reference run" in x for x in lines)
    assert any(x.startswith("PASS: dump + relaunch lost 1") and "not compared" in x for x in lines)
    assert not any("NOT equal" in x for x in lines), lines


def test_targets_say_which_figures_are_missing():
    lines = rb.targets({"reference": {"ok": True, "final_digest": "d"}, "baseline": {"ok": False}})
    assert lines == ["n/a: no figure for baseline, dump, retry, recover-in-place (not run, or failed above)"]


def test_sizes_match_megatron_parameter_counts():
    import _sizes  # bench/ is on sys.path once recovery_bench is loaded

    assert _sizes.get("tiny").params == 169728  # what examples/megatron/pretrain_gpt.py reports (P=...)
    big = _sizes.get("1g")
    assert big.state_bytes() >= 2**30 and big.state_bytes() == 4 * big.params + 6 * big.params


def test_the_strategy_carried_out_is_reported_not_only_the_decision():
    t = 100.0
    run = rb.Run(lines=[(t + 5, "iteration      8/10 | lm loss 5.7 | step 100.0 ms")],
                 events=[{"t": t, "kind": "fault_injected"}, {"t": t + 0.1, "kind": "decision", "strategy": "recover-in-place"},
                         {"t": t + 4, "kind": "recover_done", "strategy": "recover"}], codes=[0])
    assert rb.analyse(run, fault_step=8)["decision"] == "recover"

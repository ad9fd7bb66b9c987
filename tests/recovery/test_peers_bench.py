"""bench/peers/run_all.py: how the drills' records become figures, and the table (pure; no peer installed)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RUN_ALL = Path(__file__).resolve().parents[2] / "bench" / "peers" / "run_all.py"
spec = importlib.util.spec_from_file_location("peers_run_all", RUN_ALL)
ra = importlib.util.module_from_spec(spec)
sys.modules["peers_run_all"] = ra
spec.loader.exec_module(ra)


def step(rank, s, t, participants=4, ms="100.0"):
    return {"event": "step", "rank": rank, "step": s, "t": t, "participants": participants, "ms": ms}


def test_kill_drill_times_survivors_and_the_replaced_rank_from_the_fault():
    recs = [step(r, 7, 10.0) for r in range(4)]
    recs += [{"event": "fault", "rank": 1, "step": 8, "t": 10.5, "kind": "kill"},
             step(0, 7, 10.6),                              # the step before, read after the fault: ignored
             step(0, 8, 16.0, 3), step(2, 8, 16.1, 3), step(3, 8, 16.2, 3),   # survivors without rank 1
             step(1, 12, 25.0, 1),                          # the restarted rank alone: not "back"
             step(0, 13, 30.0), step(1, 13, 30.5), step(2, 13, 30.1), step(3, 13, 30.2)]
    recs += [{"event": "digest", "rank": r, "sha": "abc", "t": 40.0} for r in range(4)]
    fig = ra.drill_figures({"records": recs, "codes": [0, 0, 0, 0]})
    assert fig["ok"] and fig["survivors_s"] == 5.7 and fig["back_s"] == 20.0 and fig["steps_lost"] == 0
    assert fig["digests_equal"] and fig["back_participants"] == 4 and fig["ended"] == "clean"
    hung = ra.drill_figures({"records": recs[:-1], "codes": [-9], "timed_out": 900.0})
    assert hung["ok"] and hung["back_s"] == 20.0 and not hung["digests_equal"]  # recovered, then hung
    assert hung["ended"] == "hung: killed at this run's 900 s bound, final states not all written"


def test_a_rollback_counts_the_steps_run_again_and_a_missing_rank_is_an_error():
    recs = [{"event": "fault", "rank": 1, "step": 8, "t": 10.0, "kind": "raise"},
            step(0, 6, 20.0), step(2, 6, 20.0), step(3, 6, 20.0), step(0, 8, 22.0), step(2, 8, 22.0),
            step(3, 8, 22.0)]
    fig = ra.drill_figures({"records": recs, "codes": [1]})
    assert fig["steps_lost"] == 2 and fig["survivors_s"] == 12.0
    assert not fig["ok"] and "not every rank" in fig["error"] and not fig["digests_equal"]
    assert ra.drill_figures({"records": [], "codes": [0]})["error"] == "the fault never fired"


def test_steady_state_uses_rank_0_after_the_warmup_with_every_rank_in():
    recs = [step(0, 1, 1.0, ms="900"), step(0, 2, 2.0, ms="100"), step(0, 3, 3.0, 3, ms="500"),
            step(1, 3, 3.0, ms="700"), step(0, 4, 4.0, ms="120")]
    assert ra.steady_ms({"records": recs, "codes": [0]}, warmup=1) == [100.0, 120.0]
    assert ra.steady_ms({"records": recs, "codes": [1]}, warmup=1) is None


def test_table_has_every_comparison_and_the_ratio_mindio_over_peer():
    res = {"recovery": {"recover-in-place": {"ok": True, "recovery_s": 2.0}, "dump": {"ok": True, "recovery_s": 8.0},
                        "retry-raise": {"ok": False}},
           "ha": {"configs": {"on": {"ratio": 1.04}}},
           "peers": {"torchft-kill-default": {"survivors_s": 5.0, "back_s": 20.0},
                     "nvrx-raise-tuned": {"ok": True, "back_s": 4.0},
                     "steady-ddp": {"median_ms": 100.0}, "steady-torchft": {"median_ms": 130.0}}}
    rows = ra.rows(res)
    assert len(rows) == 18  # 4 kill, 12 raise (retry and dump against NVRx, torchft's survivors and its raising rank), 2 steady
    text = ra.table(res)
    assert "2.00 s recover-in-place" in text and "5.00 s torchft default" in text
    kill = [line for line in text.splitlines() if "survivors" in line and "kill" in line]
    assert kill[0].split()[-1] == "0.40" and kill[1].split()[-1] == "-"   # tuned not run: no ratio
    steady = [line for line in text.splitlines() if "torchft DDP" in line][0]
    assert "x1.040" in steady and "x1.300" in steady and steady.split()[-1] == "0.80"
    retry = [line for line in text.splitlines() if "retry" in line and "tuned" in line][0]
    assert retry.split()[-1] == "-"  # retry failed: no figure, no ratio


def test_a_peer_that_recovered_then_hung_is_marked_in_the_table():
    """Seen at 1g (2026-11-26): NVRx tuned brought every rank back in 15.9 s, then all 4 ranks hung in
    its store barrier until the run's bound killed them; the figure stays, marked, with the reason."""
    res = {"recovery": {"retry-raise": {"ok": True, "recovery_s": 16.5}},
           "peers": {"nvrx-raise-tuned": {"ok": True, "back_s": 15.92,
                                          "ended": "hung: killed at this run's 900 s bound, final states not all written"}}}
    text = ra.table(res)
    retry = [line for line in text.splitlines() if "retry" in line and "tuned" in line][0]
    assert "15.92 s* NVRx in-process tuned" in retry and retry.split()[-1] == "1.04"
    assert text.splitlines()[-1] == ("* that run recovered in this time, then: hung: killed at this run's "
                                     "900 s bound, final states not all written")

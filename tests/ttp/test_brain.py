"""The built-in cluster brain (mindio.ttp.controller.brain): classification, escalation, fallback order, table validation."""
import json

import pytest
from hypothesis import given, strategies as st

from mindio import _knobs
from mindio.errors import ConfigError
from mindio.ttp.controller import brain
from mindio.ttp._enums import ReportState, ResultCode
from mindio.ttp.controller.brain import Brain, RankFault, load_table, order_strategies, result_code
from mindio.ttp.controller.policy import STRATEGY_ORDER

ALL = ("retry", "recover-in-place", "recover", "downgrade", "dump", "exit")


# ------------------------------------------------------------------ classification
@pytest.mark.parametrize("key,message,level", [
    ("RS_UCE", "UCE ERROR", "RestartRequest"),
    ("RS_HCCL_FAILED", "HCCL OP RETRY FAILED", "RestartRequest"),
    ("RS_UCE_CORRUPTED", "HBM MULTI BIT ECC", "RestartBusiness"),
    ("RS_UNKNOWN", "ValueError: x", "RestartBusiness"),
    ("DEAD", "", "RestartBusiness"),
    ("RS_RETRY", "", "RestartRequest"),
])
def test_default_classification(key, message, level):
    assert Brain().judge([RankFault(3, key, message)], now=0.0).level == level


def test_patterns_first_then_faults_then_severest():
    b = Brain(load_table({"patterns": [{"pattern": "link flap", "level": "SeparateNPU"}],
                          "faults": {"RS_UCE": "RestartRequest"}}))
    assert b.base_level(RankFault(0, "RS_UCE", "UCE ERROR after link flap"))[0] == "SeparateNPU"
    assert b.base_level(RankFault(0, "RS_UCE", "UCE ERROR"))[0] == "RestartRequest"
    # "faults" replaced whole: a key the table does not name gets the most severe level
    assert b.base_level(RankFault(0, "DEAD"))[0] == "ManuallySeparateNPU"


def test_fault_key():
    assert brain.fault_key(ReportState.RS_UCE) == "RS_UCE"
    assert brain.fault_key(ReportState.RS_UCE, alive=False) == "DEAD"
    assert brain.fault_key(None) == "RS_UNKNOWN"


def test_incident_takes_the_most_severe_rank():
    v = Brain().judge([RankFault(0, "RS_UCE"), RankFault(1, "DEAD")], now=0.0)
    assert v.level == "RestartBusiness" and "retry" not in v.allowed
    assert v.ranks[0][0] == "RestartRequest" and v.ranks[1][0] == "RestartBusiness"


# ------------------------------------------------------------------ escalation
def test_frequency_same_rank_is_no_longer_retried_in_place():
    b = Brain()  # default: RS_UCE / RS_HCCL_FAILED 3 times within 3600 s -> RestartBusiness
    levels = [b.judge([RankFault(5, "RS_UCE")], now=t).level for t in (0.0, 100.0, 200.0)]
    assert levels == ["RestartRequest", "RestartRequest", "RestartBusiness"]
    # another rank is counted on its own
    assert b.judge([RankFault(6, "RS_UCE")], now=300.0).level == "RestartRequest"


def test_frequency_window_slides():
    b = Brain()
    assert b.judge([RankFault(5, "RS_UCE")], now=0.0).level == "RestartRequest"
    assert b.judge([RankFault(5, "RS_HCCL_FAILED")], now=1000.0).level == "RestartRequest"
    assert b.judge([RankFault(5, "RS_UCE")], now=4000.0).level == "RestartRequest"  # first one left the window
    assert b.judge([RankFault(5, "RS_UCE")], now=4005.0).level == "RestartBusiness"


def test_frequency_any_fault_wildcard_and_most_severe_rule():
    b = Brain()  # "*" 5 times within a day -> SeparateNPU
    levels = [b.judge([RankFault(1, k)], now=t).level
              for t, k in enumerate(["RS_UNKNOWN", "DEAD", "RS_UNKNOWN", "DEAD", "RS_UNKNOWN"])]
    assert levels[-1] == "SeparateNPU" and levels[:4] == ["RestartBusiness"] * 4


def test_duration_escalates_a_long_fault():
    b = Brain()  # RS_HCCL_FAILED lasting >= 60 s -> RestartBusiness
    assert b.judge([RankFault(0, "RS_HCCL_FAILED", first_seen=100.0)], now=130.0).level == "RestartRequest"
    v = Brain().judge([RankFault(0, "RS_HCCL_FAILED", first_seen=100.0)], now=161.0)
    assert v.level == "RestartBusiness" and "lasted 61.0 s" in v.ranks[0][1][-1]


def test_escalation_never_lowers_a_level():
    b = Brain(load_table({"frequency": [{"faults": ["*"], "time_window": 60, "times": 1,
                                         "level": "RestartRequest"}]}))
    assert b.judge([RankFault(0, "DEAD")], now=0.0).level == "RestartBusiness"


# ------------------------------------------------------------------ fallback order
@pytest.mark.parametrize("allowed,feasible,implemented,order,skipped", [
    (brain.STRATEGIES, ALL, ALL, list(ALL), []),
    (brain.STRATEGIES, ["retry", "dump", "exit"], ALL, ["retry", "dump", "exit"], []),
    (("recover-in-place", "recover", "elastic-training", "dump", "exit"), ALL, ALL,
     ["recover-in-place", "recover", "downgrade", "dump", "exit"], []),
    (("dump", "exit"), ALL, ALL, ["dump", "exit"], []),
    (brain.STRATEGIES, ALL, ("retry", "dump", "exit"), ["retry", "dump", "exit"],
     ["recover-in-place", "recover", "downgrade"]),
    (brain.STRATEGIES, ["exit"], ALL, ["exit"], []),
    (("retry",), ["retry", "dump", "exit"], ALL, ["retry", "exit"], []),   # exit always closes the list
    (brain.STRATEGIES, ["dump", "retry", "exit"], ALL, ["retry", "dump", "exit"], []),  # fallback order kept
])
def test_order(allowed, feasible, implemented, order, skipped):
    assert order_strategies(allowed, feasible, implemented) == (order, skipped)


@given(st.sets(st.sampled_from(brain.STRATEGIES)), st.sets(st.sampled_from(ALL)), st.sets(st.sampled_from(ALL)))
def test_order_properties(allowed, feasible, implemented):
    order, skipped = order_strategies(allowed, feasible, implemented)
    assert order[-1] == "exit" and order.count("exit") == 1
    assert order == sorted(order, key=STRATEGY_ORDER.index)  # fallback order
    body = order[:-1]
    allowed_p = {"downgrade" if s == "elastic-training" else s for s in allowed}
    assert set(body) <= set(feasible) & allowed_p & set(implemented)
    assert set(body) | set(skipped) == (set(feasible) & allowed_p) - {"exit"}


@pytest.mark.parametrize("remaining,code", [
    (["recover", "dump", "exit"], ResultCode.RETRY_FAILED),
    (["downgrade", "exit"], ResultCode.RETRY_FAILED),
    (["dump", "exit"], ResultCode.DUMP_OR_EXIT),
    (["exit"], ResultCode.EXIT_ONLY),
    ([], ResultCode.EXIT_ONLY),
])
def test_result_code(remaining, code):
    assert result_code(remaining) is code and int(code) in (405, 406, 499)


def test_plan_for_an_incident():
    b = Brain()
    order, v = b.plan([RankFault(2, "RS_UCE")], ["retry", "dump", "exit"], ("retry", "dump", "exit"), now=0.0)
    assert order == ["retry", "dump", "exit"] and v.level == "RestartRequest"
    order, v = b.plan([RankFault(2, "RS_UNKNOWN")], ["dump", "exit"], ("retry", "dump", "exit"), now=1.0)
    assert order == ["dump", "exit"]
    order, v = b.plan([], ["dump", "exit"], ("retry", "dump", "exit"), now=2.0)   # graceful dump: no fault
    assert order == ["dump", "exit"] and v.level is None


def test_recover_strategy_from_table_or_job():
    assert Brain().enabled({"retry", "dump"}) == {"retry", "dump"}
    b = Brain(load_table({"recover_strategy": ["dump", "exit"]}))
    assert b.enabled({"retry", "dump"}) == {"dump", "exit"}


def test_high_availability_accepts_exit_and_rejects_unknown():
    assert _knobs.get("HIGH_AVAILABILITY", {"HIGH_AVAILABILITY": "retry,dump,exit"}) == ("retry", "dump", "exit")
    with pytest.raises(ConfigError, match="teleport"):
        _knobs.get("HIGH_AVAILABILITY", {"HIGH_AVAILABILITY": "retry,teleport"})


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("table,match", [
    ({"levls": {}}, r"unknown key 'levls' in the table; allowed: duration, faults, frequency, levels"),
    ({"faults": {"RS_FOO": "RestartRequest"}}, r"unknown key 'RS_FOO' in faults; allowed: .*RS_UCE"),
    ({"faults": {"RS_UCE": "Reboot"}}, r"faults.RS_UCE = 'Reboot' is not a defined level; allowed: .*SeparateNPU"),
    ({"levels": {"X": {"severity": 1, "strategies": ["teleport"]}}},
     r"levels.X.strategies: unknown strategy 'teleport'; allowed: retry, recover-in-place"),
    ({"levels": {"X": {"severity": -1, "strategies": ["dump"]}}}, r"levels.X.severity = -1 is not valid"),
    ({"levels": {"X": {"severity": 1, "strategies": ["dump"], "color": "red"}}}, r"unknown key 'color' in levels.X"),
    ({"frequency": [{"faults": ["RS_UCE"], "time_window": 3600, "times": 0, "level": "SeparateNPU"}]},
     r"frequency\[0\].times = 0 is not valid; allowed: an integer in \[1, 100\]"),
    ({"frequency": [{"faults": ["RS_UCE"], "time_window": 1e9, "times": 2, "level": "SeparateNPU"}]},
     r"frequency\[0\].time_window = 1000000000.0 is not valid"),
    ({"frequency": [{"faults": ["RS_UCE"], "times": 2, "level": "SeparateNPU"}]}, r"frequency\[0\] needs 'time_window'"),
    ({"frequency": [{"faults": ["NOPE"], "time_window": 60, "times": 2, "level": "SeparateNPU"}]},
     r"frequency\[0\].faults: unknown fault key 'NOPE'"),
    ({"duration": [{"faults": ["*"], "timeout": 601, "level": "SeparateNPU"}]}, r"duration\[0\].timeout = 601"),
    ({"duration": [{"faults": ["*"], "timeout": 6, "level": "SeparateNPU", "EventId": "x"}]},
     r"unknown key 'EventId' in duration\[0\]"),
    ({"patterns": [{"pattern": "", "level": "SeparateNPU"}]}, r"patterns\[0\].pattern must be a non-empty string"),
    ({"recover_strategy": ["retry", "warp"]}, r"recover_strategy: unknown strategy 'warp'"),
    ({"frequency": [{"faults": ["RS_UCE"], "time_window": 60, "times": True, "level": "SeparateNPU"}]},
     r"times = True is not valid"),
])
def test_bad_tables_are_rejected(table, match):
    with pytest.raises(ConfigError, match=match):
        load_table(table)


def test_table_file_from_env(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"faults": {"RS_UCE": "ManuallySeparateNPU"}}))
    monkeypatch.setenv("MINDIO_FAULT_TABLE", str(path))
    assert Brain().judge([RankFault(0, "RS_UCE")], now=0.0).allowed == ("dump", "exit")
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"fault table {path}: not valid JSON"):
        load_table()
    monkeypatch.setenv("MINDIO_FAULT_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot read it"):
        load_table()


def test_bad_env_table_fails_at_controller_start(tmp_path, monkeypatch):
    import mindio.ttp as ttp
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"faults": {"RS_UCE": "Nope"}}))
    monkeypatch.setenv("MINDIO_FAULT_TABLE", str(path))
    ttp.tft_init_controller(0, 1, enable_local_copy=False)
    with pytest.raises(ConfigError, match="'Nope' is not a defined level"):
        ttp.tft_start_controller("127.0.0.1", 23456, enable_tls=False)


def test_default_table_is_valid_and_covers_every_fault():
    t = load_table()
    assert set(t.faults) == set(brain.FAULT_KEYS) and t.recover_strategy is None
    for lv in t.levels.values():
        assert lv.strategies[-1] == "exit"

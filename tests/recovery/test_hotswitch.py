"""Hot switch (亚健康热切) end to end under mindio-run, and its API's bad input.

Real processes: node 0's mindio-run agent hosting the controller (rank -1), driven by a cluster brain in
the same process (_hotswitch_brain.py), 4 workers of the toy job (_recover_toy.py: DP=4, ZeRO-1 Adam
over 2 replica halves), gloo on loopback. Once every rank passed step 5 the brain asks for a hot switch
of rank 1 (rank 0 too): a backup process starts and registers while training goes on, then every rank
pauses at one step, the rank's old process exits (EXIT_CODE_SWITCHED) and the backup takes the rank with
its shard from the replica; training goes on with no step lost, bitwise equal to the uninterrupted run.
"stop switch" instead dismisses the backup and leaves every process and the result unchanged.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from test_recover_inplace import _port, digest  # tests/recovery is on sys.path (rootdir import mode)

from tests._exits import assert_no_signal_deaths, check_codes
from tests._faultplan import Fault, FaultPlan

import mindio.ttp as ttp
from mindio.errors import ConfigError
from mindio.ttp._runtime import state as _rt
from mindio.ttp.controller.controller import Controller
from mindio.ttp.controller.hotswitch import EXIT_CODE_SWITCHED

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS = 12
pytestmark = pytest.mark.slow


def run(out: Path, scenario: str = "", timeout=150, victim: int = 1, env=None, plan: FaultPlan = FaultPlan()):
    """One mindio-run job of the toy (with the brain when ``scenario``; ``plan``: the toy's faults, to
    which a scenario adds rank 0's hold of step 7); (exit code, output, events, brain)."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.jsonl"
    e = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}", OMP_NUM_THREADS="1", TTP_LOG_STDOUT="1",
             MINDIO_EVENT_LOG=str(events), HS_RANK=str(victim), **(env or {}))
    launch = ["--nproc-per-node", "4", "--master-port", str(_port()), "--high-availability",
              "recover-in-place,dump", str(HERE / "_recover_toy.py"), "--out", str(out), "--steps", str(STEPS),
              "--step-sleep", "0.15"]
    if scenario:  # rank 0 holds step 7 until the brain saw the backup registered: the job still trains then
        plan = replace(plan, faults=plan.faults + (Fault("hold", 0, 7),))
    launch += plan.argv()
    cmd = ([sys.executable, str(HERE / "_hotswitch_brain.py"), scenario, str(out), "--"] if scenario
           else [sys.executable, "-m", "mindio.launch.cli"]) + launch
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        text, _ = p.communicate()
        raise AssertionError(f"job did not end within {timeout} s (a hang):\n{text[-6000:]}")
    (out / "output.txt").write_text(text)
    check_codes({"mindio-run": p.returncode}, what="process", context=text[-6000:])
    assert_no_signal_deaths(text)  # no fault here kills a process: the switched-out rank exits with 78
    read = lambda f: [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []
    return p.returncode, text, read(events), read(out / "brain.jsonl")


def pids_by_rank(events) -> dict:
    pids: dict = {}
    for e in events:
        if isinstance(e.get("rank"), int) and e["rank"] >= 0 and "pid" in e:
            pids.setdefault(e["rank"], set()).add(e["pid"])
    return pids


def pause_s(events) -> float:
    """Training stopped (the first rank parked at the pause step) -> every rank training again."""
    stopped = min(e["t"] for e in events if e["kind"] == "paused_at")
    return max(e["t"] for e in events if e["kind"] == "train_resumed") - stopped


def assert_backup_registered_before_the_pause(events, victim):
    ready = next(e for e in events if e["kind"] == "hot_switch_backups_ready")
    assert ready["ranks"] == [victim], ready
    assert ready["t"] < min(e["t"] for e in events if e["kind"] == "paused_at")  # training went on meanwhile
    return ready["pids"][str(victim)]


def assert_every_step_once(text):
    for r in range(4):
        # workers share one pipe: a line may run into the next one's "[rank" or log timestamp
        line = rf"\[rank {r}\] iteration (\d+?)(?=\[|\r?\n|\d{{4}}-\d\d-\d\d |$)"
        its = [int(i) for i in re.findall(line, text)]
        assert sorted(its) == list(range(1, STEPS + 1)), (r, its)  # each step exactly once: none lost or redone


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # bounded by run()'s own timeout; the tests' pytest timeouts count only their own body (func_only):
    # counted with this setup, the first test of the module got 200 s for up to 150 s of reference + its job
    code, text, _, _ = run(tmp_path_factory.mktemp("ref"))
    assert code == 0, text[-4000:]
    return digest(text)


@pytest.mark.timeout(200, func_only=True)  # the shared reference run has its own bound (run())
@pytest.mark.parametrize("scenario,victim", [("switch", 1), ("direct", 1), ("direct", 0)])
def test_hot_switch_moves_a_rank_without_losing_a_step(reference, tmp_path, scenario, victim):
    """Rank 0 too (the reference cannot switch its rank 0: its controller lives there; ours is the agent's)."""
    code, text, events, brain = run(tmp_path / "run", scenario, victim=victim)
    assert code == 0, text[-6000:]
    assert digest(text) == reference  # bitwise equal to the uninterrupted run
    assert_every_step_once(text)
    prep = next(b for b in brain if b["kind"] == "prepare_action")
    assert prep["rc"] == 0
    old_pid = prep["pids"][str(victim)]
    gone = [e for e in events if e["kind"] == "switched_out_exit"]
    assert len(gone) == 1 and gone[0]["old_pid"] == old_pid and gone[0]["code"] == EXIT_CODE_SWITCHED, gone
    pids = pids_by_rank(events)
    assert old_pid in pids[victim] and len(pids[victim]) == 2, pids  # a new process serves the rank
    assert pids[victim] == {old_pid, assert_backup_registered_before_the_pause(events, victim)}, pids
    assert all(pids[r] == {prep["pids"][str(r)]} for r in range(4) if r != victim), pids  # others kept theirs
    done = [e for e in events if e["kind"] == "recover_done"]
    assert len(done) == 1 and done[0]["strategy"] == "hot switch" and done[0]["replaced"] == [victim], done
    paused = next(e for e in events if e["kind"] == "hot_switch_paused")
    assert done[0]["lock_step"] == paused["step"] >= 5
    assert "replacement process (hot switch)" in text  # tft_get_reboot_type() in the backup
    assert "round_failed" not in [e["kind"] for e in events]
    if scenario == "switch":
        kinds = [b["kind"] for b in brain]
        assert kinds[:4] == ["report_stop_complete", "change_strategy", "prepare_action", "report_result"] or \
            kinds[:4] == ["prepare_action", "report_stop_complete", "change_strategy", "report_result"], brain
        res = [b for b in brain if b["kind"] == "report_result"]
        assert res[-1]["code"] == 0 and res[-1]["strategy"] == "hot switch", res
    resumed = max(e["t"] for e in events if e["kind"] == "train_resumed")
    print(f"\nhot switch ({scenario}, rank {victim}): request -> every rank training again "
          f"{resumed - prep['t']:.3f} s, of which paused {pause_s(events):.3f} s; "
          f"{ {k: v for k, v in done[0].items() if k.endswith('_s')} }")


@pytest.mark.timeout(200, func_only=True)  # the shared reference run has its own bound (run())
@pytest.mark.parametrize("scenario", ["stop", "silent"])
def test_stop_switch_cancels_and_changes_nothing(reference, tmp_path, scenario):
    """``stop switch`` after the pause, or no answer within MINDIO_WAIT_MINDX_TIME (2 s): cancelled."""
    code, text, events, brain = run(tmp_path / "run", scenario, env={"MINDIO_WAIT_MINDX_TIME": "2"})
    assert code == 0, text[-6000:]
    assert digest(text) == reference
    assert_every_step_once(text)
    prep = next(b for b in brain if b["kind"] == "prepare_action")
    assert prep["rc"] == 0
    if scenario == "stop":
        assert next(b for b in brain if b["kind"] == "stop_switch")["rc"] == 0
    why = next(e for e in events if e["kind"] == "hot_switch_cancelled")["why"]
    assert why == ("stop switch" if scenario == "stop" else "no decision"), why
    kinds = [e["kind"] for e in events]
    assert "hot_switch_cancelled" in kinds and "recover_done" not in kinds and "switched_out_exit" not in kinds
    pids = pids_by_rank(events)
    assert all(pids[r] == {prep["pids"][str(r)]} for r in range(4)), pids  # no process replaced
    res = [b for b in brain if b["kind"] == "report_result"]
    assert res and res[-1]["strategy"] == "continue" and "cancelled" in res[-1]["msg"], res
    assert_backup_registered_before_the_pause(events, 1)
    assert "switch_backups_dismissed" in kinds and "hot-switch backup of rank 1 leaves" in text
    assert "switch_backup_exited" not in kinds  # it left as told (exit 0), not taken for a failure


@pytest.mark.timeout(200, func_only=True)  # the shared reference run has its own bound (run())
def test_stop_switch_while_the_backups_start_cancels_before_the_pause(reference, tmp_path):
    """``stop switch`` right after the request, before the backup registered: dismissed, no rank paused."""
    code, text, events, brain = run(tmp_path / "run", "early")
    assert code == 0, text[-6000:]
    assert digest(text) == reference
    assert_every_step_once(text)
    assert next(b for b in brain if b["kind"] == "stop_switch")["rc"] == 0
    assert next(b for b in brain if b["kind"] == "prepare_action")["rc"] == 0
    kinds = [e["kind"] for e in events]
    assert next(e for e in events if e["kind"] == "hot_switch_cancelled")["why"] == "stop switch"
    assert "switch_backups_dismissed" in kinds, kinds
    assert "paused_at" not in kinds and "switched_out" not in kinds and "recover_done" not in kinds, kinds
    assert "replacement process" not in text  # the backup never became a rank


@pytest.mark.timeout(200, func_only=True)  # the shared reference run has its own bound (run())
def test_backup_failing_before_it_registers_cancels_the_switch(reference, tmp_path):
    """The backup process dies at start (before its init_process_group): the switch is cancelled before
    any rank paused; the old rank-1 process stays and the result is the uninterrupted run's."""
    code, text, events, brain = run(tmp_path / "run", "direct", plan=FaultPlan(replacement_fails="start"))
    assert code == 0, text[-6000:]
    assert digest(text) == reference
    assert_every_step_once(text)
    kinds = [e["kind"] for e in events]
    assert "switch_backup_exited" in kinds, kinds
    why = next(e for e in events if e["kind"] == "hot_switch_cancelled")["why"]
    assert "exited before it registered" in why, why
    assert "paused_at" not in kinds and "switched_out" not in kinds and "recover_done" not in kinds, kinds
    assert next(b for b in brain if b["kind"] == "prepare_action")["rc"] == 0
    assert "switched_out_exit" not in kinds and "replacement process" not in text  # the old processes stayed


@pytest.mark.timeout(200)
def test_backup_failing_after_release_falls_back_to_a_dump(tmp_path):
    """The backup dies right after it joined the new generation, after the old rank-1 process left: the
    remaining ranks dump at the pause step (rank 1's shard lives on its replica, rank 3) and the job exits
    75, at once."""
    code, text, events, brain = run(tmp_path / "run", "direct", plan=FaultPlan(replacement_fails="joined"))
    assert code != 0
    assert "exiting with code 75" in text, text[-6000:]  # dumped
    kinds = [e["kind"] for e in events]
    assert "replacement_died" in kinds and "switched_out_exit" in kinds, kinds
    fallback = [e for e in events if e["kind"] == "fallback"]
    assert fallback and fallback[0]["src"] == "hot switch" and fallback[0]["dst"] == "dump", fallback
    died = next(e for e in events if e["kind"] == "replacement_died")
    failed = next(e for e in events if e["kind"] == "recover_failed")
    assert failed["t"] - died["t"] < 5  # at once, not at the 60 s recover deadline
    paused = next(e for e in events if e["kind"] == "hot_switch_paused")
    assert (tmp_path / "run" / "ckpt" / f"iter_{paused['step']:07d}").is_dir()  # the pause step was saved


@pytest.mark.timeout(200)
def test_a_repair_handler_that_raises_during_the_switch_in_falls_back_to_a_dump(tmp_path):
    """A faulty real object: the replica's repair handler raises while it should send rank 1's shard to
    the backup that switches in (the old rank-1 process has left): the recover sequence of the switch
    fails at the repair, and the remaining ranks dump at the pause step and exit 75."""
    code, text, events, brain = run(tmp_path / "run", "direct", plan=FaultPlan(fail_repair="raise"))
    assert code != 0
    assert "exiting with code 75" in text, text[-6000:]  # dumped
    kinds = [e["kind"] for e in events]
    assert "switched_out_exit" in kinds, kinds
    failed = next(e for e in events if e["kind"] == "recover_failed")
    assert failed["step_name"] == "repair", failed
    fallback = [e for e in events if e["kind"] == "fallback"]
    assert fallback and fallback[0]["src"] == "hot switch" and fallback[0]["dst"] == "dump", fallback
    paused = next(e for e in events if e["kind"] == "hot_switch_paused")
    assert (tmp_path / "run" / "ckpt" / f"iter_{paused['step']:07d}").is_dir()  # the pause step was saved


def test_prepare_action_bad_input(monkeypatch):
    ctl = Controller(rank=-1, world_size=4, enabled={"recover-in-place"}, key=b"k" * 32)
    monkeypatch.setattr(_rt, "controller", ctl)
    with pytest.raises(ConfigError, match="use 'hot switch' or 'stop switch'"):
        ttp.tft_notify_controller_prepare_action("hotswitch", {1: 1})
    with pytest.raises(ConfigError, match=r"rank in \[0, 4\)"):
        ttp.tft_notify_controller_prepare_action("hot switch", {4: 1})
    with pytest.raises(ConfigError, match="errtype 0, 1 or 2"):
        ttp.tft_notify_controller_prepare_action("hot switch", {1: 3})
    with pytest.raises(ConfigError, match="needs fault_ranks"):
        ttp.tft_notify_controller_prepare_action("hot switch")
    # well-formed but not possible now: refused with 1 (reference return code), the reason logged
    assert ttp.tft_notify_controller_prepare_action("hot switch", {1: 1}) == 1  # not in NORMAL, no ranks
    assert ttp.tft_notify_controller_prepare_action("stop switch") == 1  # nothing to cancel
    monkeypatch.setattr(_rt, "controller", None)
    with pytest.raises(RuntimeError, match="no controller in this process"):
        ttp.tft_notify_controller_prepare_action("hot switch", {1: 1})


def test_prepare_action_refused_without_a_launcher_agent(caplog):
    """Well-formed and in NORMAL training, but nothing can start a backup (no mindio-run agent): 1, logged;
    no incident is opened and training is not touched."""
    from mindio.ttp.controller.controller import _Rank
    from mindio.ttp.controller.states import Result, State

    ctl = Controller(rank=-1, world_size=4, enabled={"recover-in-place"}, key=b"k" * 32)
    for r in range(4):
        ctl.ranks[r] = _Rank(r, str(r).encode(), pid=100 + r)
    ctl.sm.fire(Result.ALL_REGISTERED)
    assert ctl.notify_prepare_action("hot switch", [1]) == 1
    assert "no launcher agent hosts this controller" in caplog.text
    assert ctl.incidents.current is None and ctl.sm.state is State.NORMAL

    class Replacer:  # an agent whose node cannot start rank 1 again
        def possible(self, ranks, strategy):
            assert strategy == "hot switch"
            return False

    ctl.attach_replacer(Replacer())
    assert ctl.notify_prepare_action("hot switch", [1]) == 1
    assert "cannot start backups for ranks [1]" in caplog.text
    ctl.ranks[2].alive = False
    assert ctl.notify_prepare_action("hot switch", [2]) == 1
    assert "not all registered and alive" in caplog.text

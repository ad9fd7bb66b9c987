"""A rank's memory of its generic exceptions (mindio/ttp/processor/repeats.py), on real files: one retry
per (step, exception), then the dump; a relaunch of the same job that meets the same exception at the
same step reports RS_REPEATED with a line naming the step, the rank and the exception; a first launch
forgets an older job's record; the record is private (0600 in a 0700 directory)."""
import os
import stat

from mindio.ttp._enums import ReportState
from mindio.ttp.processor.repeats import Repeats

RETRY, UNKNOWN, REPEATED = ReportState.RS_RETRY, ReportState.RS_UNKNOWN, ReportState.RS_REPEATED
MSG = "ValueError: bad batch"


def _env(tmp_path, restart):
    return {"TORCHELASTIC_RUN_ID": "job/1", "TORCHELASTIC_RESTART_COUNT": str(restart), "XDG_RUNTIME_DIR": str(tmp_path),
            "MINDIO_AGENT_STORE": "10.0.0.1:29500"}


def test_one_retry_then_the_dump_then_no_loop(tmp_path):
    first = Repeats(1, _env(tmp_path, 0))
    assert first.judge(RETRY, 8, MSG) == (RETRY, MSG)        # retried once
    assert first.judge(RETRY, 9, MSG) == (RETRY, MSG)        # another step: a retry of its own
    assert first.judge(RETRY, 8, MSG) == (UNKNOWN, MSG)      # the same again: the dump
    path = first.path
    assert os.path.basename(path) == "job_1_10.0.0.1_29500.rank1.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700

    relaunch = Repeats(1, _env(tmp_path, 1))
    state, line = relaunch.judge(UNKNOWN, 8, MSG)            # before its first update: not retryable anyway
    assert state is REPEATED
    assert line.startswith(MSG) and "rank 1 raised it again at step 8" in line and "\n" not in line
    assert Repeats(2, _env(tmp_path, 1)).judge(UNKNOWN, 8, MSG) == (UNKNOWN, MSG)  # another rank
    other_job = dict(_env(tmp_path, 1), MINDIO_AGENT_STORE="10.0.0.1:29501")  # same run id, another job
    assert Repeats(1, other_job).judge(UNKNOWN, 8, MSG)[0] is UNKNOWN
    assert Repeats(1, _env(tmp_path, 1)).judge(UNKNOWN, 9, MSG)[0] is UNKNOWN     # another step
    assert Repeats(1, _env(tmp_path, 1)).judge(RETRY, 8, "ValueError: other")[0] is RETRY  # another exception

    Repeats(1, _env(tmp_path, 0))                            # a new job with the same run id
    assert not os.path.exists(path)

    Repeats(1, _env(tmp_path, 0)).judge(UNKNOWN, 8, MSG)     # recorded again, then the relaunch trains on
    done = Repeats(1, _env(tmp_path, 1))
    done.forget()                                            # (its train() returned)
    assert not os.path.exists(path) and done.judge(UNKNOWN, 8, MSG)[0] is UNKNOWN


def test_exceptions_not_retried_are_remembered_and_without_a_run_id_nothing_is_written(tmp_path):
    Repeats(0, _env(tmp_path, 0)).judge(UNKNOWN, 3, MSG)     # inside the update window: dumped at once
    assert Repeats(0, _env(tmp_path, 1)).judge(UNKNOWN, 3, MSG)[0] is REPEATED
    alone = Repeats(0, {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert alone.judge(RETRY, 3, MSG) == (RETRY, MSG) and alone.judge(RETRY, 3, MSG) == (UNKNOWN, MSG)
    assert alone.path is None

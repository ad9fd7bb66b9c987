"""What a mindio process writes by default: WARNING and above on stderr with a ``[node/rank]`` prefix,
no file anywhere unless TTP_LOG_PATH asks for one; TTP_LOG_* keep the reference's meaning; a failure
without a message still says what failed; enable_tls without keys warns once."""
from __future__ import annotations

import os
import subprocess
import sys

from mindio.errors import describe

LOG_SOME = """
import logging
from mindio import _logging
_logging.setup(rank=3)
_logging.set_context(step=12)
log = logging.getLogger("mindio.ttp.incident")
log.info("an info line")
log.warning("dump at step 12 by 2 ranks")
"""


def _run(code: str, cwd, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TTP_LOG_")}
    full.update(GROUP_RANK="1", **env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=120, check=True)


def test_by_default_warnings_go_to_stderr_with_node_and_rank_and_no_file_is_written(tmp_path):
    out = _run(LOG_SOME, tmp_path)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("[1/3] ") and "WARNING mindio.ttp.incident (after step 12): dump at step 12" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no ./logs


def test_ttp_log_path_adds_a_file_with_every_line(tmp_path):
    logs = tmp_path / "logs"
    out = _run(LOG_SOME, tmp_path, TTP_LOG_PATH=str(logs))
    assert "dump at step 12" in out.stderr and "an info line" not in out.stderr
    files = list(logs.iterdir())
    assert len(files) == 1 and files[0].name.startswith("ttp_log.log.")  # PER_PROC: the reference's name
    text = files[0].read_text()
    assert "INFO [1/3 step 12] mindio.ttp.incident: an info line" in text and "dump at step 12" in text
    _run(LOG_SOME, tmp_path, TTP_LOG_PATH=str(logs), TTP_LOG_MODE="ONLY_ONE")
    assert (logs / "ttp_log.log").exists()


def test_ttp_log_stdout_prints_every_line_and_writes_no_file(tmp_path):
    out = _run(LOG_SOME, tmp_path, TTP_LOG_STDOUT="1", TTP_LOG_PATH=str(tmp_path / "logs"))
    assert "an info line" in out.stderr and "dump at step 12" in out.stderr
    assert not (tmp_path / "logs").exists()


def test_a_failure_without_a_message_says_what_failed():
    def save_callback():
        raise AssertionError()  # what a bare ``assert`` raises (pytest rewrites the asserts of this file)

    try:
        save_callback()
    except AssertionError as exc:
        text = describe(exc)
    assert text.startswith("AssertionError: raise AssertionError()  # what a bare")
    assert "(at test_consoles.py:" in text
    assert text.endswith(" in save_callback)")
    assert describe(ValueError("bad"), where=False) == "ValueError: bad"


def test_enable_tls_without_keys_warns_once(tmp_path):
    code = ("import os; os.environ['MINDIO_SECRET'] = 'ab' * 16\n"
            "from mindio import ttp\n"
            "ttp.tft_init_processor(0, 1, False)\n"
            "ttp.tft_init_processor(0, 1, False, enable_tls=True, tls_info='')\n"
            "ttp.tft_init_processor(0, 1, False, enable_tls=False)\n")
    err = _run(code, tmp_path).stderr
    assert err.count("NOT encrypted") == 1 and "zmq.curve_keypair()" in err, err

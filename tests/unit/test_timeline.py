"""``mindio timeline`` draws the event logs of real runs (tests/unit/data: the demo's retry, recover-in-place
and dump + relaunch runs, 4 Megatron ranks) with every phase of each recovery, and its command line
writes SVG and HTML."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mindio import timeline

DATA = Path(__file__).with_name("data")
SVG = "{http://www.w3.org/2000/svg}"


def _draw(name: str):
    events = timeline.load(DATA / name)
    svg = timeline.render_svg(events, "test")
    root = ET.fromstring(svg)  # well-formed
    titles = [t.text for t in root.iter(f"{SVG}title")]
    texts = [t.text for t in root.iter(f"{SVG}text")]
    return events, titles, texts


def _bars(titles, name: str) -> list:
    return [t for t in titles if re.fullmatch(rf"{name}: [0-9.]+ m?s", t)]


@pytest.mark.parametrize("log,strategy,phases", [
    ("events-retry.jsonl", "retry", ("stop", "clean", "rebuild", "repair", "rollback", "retry")),
    ("events-recover-in-place.jsonl", "recover-in-place", ("clean", "rebuild", "repair", "rollback", "retry")),
    ("events-dump-relaunch.jsonl", "dump", ("stop", "save", "rename", "exit")),
])
def test_every_phase_of_the_recovery_is_drawn(log, strategy, phases):
    events, titles, texts = _draw(log)
    found = timeline.incidents(events)
    assert len(found) == 1 and found[0].decision["strategy"] == strategy
    assert [t for t in texts if t == f"decision: {strategy} @ step {found[0].decision['lock_step']}"]
    assert _bars(titles, "decide")
    for phase in phases:  # the controller's action and each rank's part of it
        assert len(_bars(titles, phase)) >= 2, (phase, [t for t in titles if t and phase in t])
    for rank in range(4):
        assert f"rank {rank}" in texts
    faulty = found[0].decision["faulty"][0]
    assert any(t and t.startswith("fault injected") for t in titles)
    assert any(t and (t.startswith("RS_") or t.startswith("rank_dead")) for t in titles), faulty
    firsts = [t for t in titles if t and t.startswith("first step completed:")]
    assert len(firsts) == 4  # every rank trains again


def test_the_summary_gives_the_controllers_phase_times():
    events = timeline.load(DATA / "events-retry.jsonl")
    done = next(e for e in events if e["kind"] == "retry_done")
    lines = timeline.summary(timeline.incidents(events)[0])
    assert lines[0].startswith("decision after") and "retry at lock step 4" in lines[0]
    assert "rebuild" in lines[1] and f"total {done['total_s'] * 1000:.0f} ms" in lines[1]
    assert lines[2].startswith("first step after the fault: step 5")


def test_a_dump_and_relaunch_shows_the_relaunch_and_a_zoom_on_the_dump():
    _events, titles, texts = _draw("events-dump-relaunch.jsonl")
    assert any(t and t.startswith("round 1: workers start, load, register") for t in titles)
    assert "incident, zoomed on the controller's work" in texts


def test_a_log_without_faults_and_broken_lines(tmp_path):
    log = tmp_path / "events.jsonl"
    good = {"t": 1.0, "pid": 1, "kind": "step_done", "rank": 0, "step": 1}
    log.write_text(json.dumps(good) + "\nnot json\n[1, 2]\n" + json.dumps({**good, "t": 2.0}) + "\n")
    events = timeline.load(log)
    assert len(events) == 2 and timeline.incidents(events) == []
    ET.fromstring(timeline.render_svg(events))
    ET.fromstring(timeline.render_svg([]))


def test_the_command_writes_svg_and_html_and_refuses_other_formats(tmp_path):
    cmd = [sys.executable, "-m", "mindio.cli", "timeline", str(DATA / "events-retry.jsonl")]
    out = subprocess.run(cmd + ["-o", str(tmp_path / "t.svg")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "1 incident(s)" in out.stdout and "retry phases" in out.stdout
    ET.parse(tmp_path / "t.svg")
    out = subprocess.run(cmd + ["-o", str(tmp_path / "t.html")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and (tmp_path / "t.html").read_text().startswith("<!doctype html>")
    out = subprocess.run(cmd + ["-o", str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and ".svg or .html" in out.stderr
    missing = subprocess.run(cmd[:-1] + [str(tmp_path / "none.jsonl")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_the_command_refuses_a_file_that_is_not_an_event_log(tmp_path):
    """#30 item 13: a file with no mindio event (another file given by mistake, an empty one) exits
    non-zero, says why in one line and writes no picture."""
    other = tmp_path / "train.py"
    other.write_text("import torch\nprint('not events')\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    binary = tmp_path / "ckpt.pt"
    binary.write_bytes(bytes(range(256)) * 4)
    for path, why in ((other, "none of its 2 line(s) is a JSON object"), (empty, "it is empty"),
                      (binary, "is a JSON object")):
        svg = tmp_path / f"{path.stem}.svg"
        out = subprocess.run([sys.executable, "-m", "mindio.cli", "timeline", str(path), "-o", str(svg)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (path, out)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mindio timeline: {path} is not a mindio event log: "), lines
        assert why in out.stderr and "Traceback" not in out.stderr and not svg.exists()

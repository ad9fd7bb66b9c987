"""``mindio timeline``: draw a job's event log (MINDIO_EVENT_LOG) so a person sees where the seconds went.

One panel per incident, scaled to it: a lane for the controller (its state, the decision, every action
as a bar as long as it took: stop, clean, rebuild, repair, rollback, save, rename, exit, ...), a lane
for the launcher when there is one (worker exits, replacements, restarts), and a lane per rank (the
injected fault, the error it reported or the peer failure that released it, its teardown, its part of
each action, its return to ``train()`` and its first completed step). Below each panel a table gives
the decision and the duration of every phase, as the controller measured them (``*_done`` events).

The picture is plain SVG written here (no plotting dependency); ``-o x.html`` wraps it in a page.
Events: mindio/_logging.py ``event()``; the kinds drawn are listed in ``RANK_KINDS`` and below.
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field

__all__ = ["NotAnEventLog", "load", "incidents", "render_svg", "render_html", "Incident"]

# a fault begins an incident; a rank's first completed step after the decision ends it
START_KINDS = ("fault_injected", "rank_dead", "rank_hung", "killed_as_hung")
DONE_KINDS = ("retry_done", "recover_done", "downgrade_done", "upgrade_done")
LAUNCHER_KINDS = ("round_start", "round_failed", "workers_stopped", "worker_exited", "ranks_replaced",
                  "replace_ordered", "standby_takeover", "switch_backups_started", "switch_backup_exited",
                  "switched_out_exit", "node_offered", "standbys_started", "agent_stalled")
RANK_KINDS = ("fault_injected", "fault_seen", "teardown", "action_done", "train_resumed", "step_done",
              "killed_as_hung", "paused_at", "device_teardown")
PHASE_COLORS = {"stop": "#8c6d31", "clean": "#d6616b", "rebuild": "#e7969c", "repair": "#6b6ecf",
                "rollback": "#9c9ede", "retry": "#3182bd", "resume": "#3182bd", "save": "#e6550d",
                "rename": "#fd8d3c", "exit": "#636363", "decide": "#bdbdbd", "teardown": "#d6616b",
                "prerepair": "#6b6ecf", "zit_rebuild": "#e7969c", "zit_repair": "#6b6ecf",
                "zit_rollback": "#9c9ede", "upgrade": "#31a354", "pause_at": "#74c476"}
STATE_COLORS = {"NORMAL": "#c7e9c0", "ABNORMAL": "#fcae91", "DUMP": "#fdd0a2", "EXIT": "#d9d9d9",
                "FINAL": "#f0f0f0", "INIT": "#f0f0f0", "REPAIR": "#c6dbef", "PAUSE": "#dadaeb"}


@dataclass
class Incident:
    start: float
    end: float
    events: list = field(default_factory=list)
    decision: dict | None = None
    done: dict | None = None


class NotAnEventLog(ValueError):
    """The file holds no mindio event (``mindio timeline`` says why and exits non-zero)."""


def load(path) -> list:
    """The events of ``path`` (JSON lines), oldest first; lines that are not JSON objects are skipped.
    Raises NotAnEventLog when no line is a mindio event (an empty file, another file given by mistake)."""
    events, lines = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            lines += bool(line.strip())
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and isinstance(e.get("t"), (int, float)) and isinstance(e.get("kind"), str):
                events.append(e)
    if not events:
        why = "it is empty" if not lines else \
            f"none of its {lines} line(s) is a JSON object with a time \"t\" and a \"kind\""
        raise NotAnEventLog(f"{path} is not a mindio event log: {why} (give the file MINDIO_EVENT_LOG named "
                            f"in the job)")
    return sorted(events, key=lambda e: e["t"])


def _is_start(e: dict) -> bool:
    return e["kind"] in START_KINDS or (e["kind"] == "fault_seen" and e.get("state") != "RS_NORMAL")


def incidents(events: list) -> list:
    """Split ``events`` into incidents: from a fault to the first step a rank completes after the
    controller's decision (for a dump, after the relaunch), or the log's end."""
    found, i = [], 0
    while i < len(events):
        if not _is_start(events[i]):
            i += 1
            continue
        inc = Incident(start=events[i]["t"], end=events[-1]["t"])
        for e in events[i:]:
            if e["kind"] == "decision" and inc.decision is None:
                inc.decision = e
            elif e["kind"] in DONE_KINDS and inc.done is None:
                inc.done = e
            elif e["kind"] == "step_done" and inc.decision is not None:
                inc.end = e["t"]
                break
        inc.events = [e for e in events if inc.start <= e["t"] <= inc.end + 0.05
                      or (inc.start - 0.5 <= e["t"] < inc.start and e["kind"] in ("fault_injected", "fault_seen"))]
        found.append(inc)
        while i < len(events) and events[i]["t"] <= inc.end:
            i += 1
    return found


def _lane_of(e: dict):
    kind = e["kind"]
    if kind in LAUNCHER_KINDS:
        return "launcher"
    if kind in RANK_KINDS and isinstance(e.get("rank"), int) and e["rank"] >= 0:
        return e["rank"]
    return "controller"


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _tick_step(span: float) -> float:
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


class _Svg:
    def __init__(self):
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def text(self, x, y, s, size=11, anchor="start", weight="normal", color="#222") -> None:
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                 f'font-weight="{weight}" fill="{color}">{html.escape(str(s))}</text>')

    def rect(self, x, y, w, h, color, title="", opacity=1.0) -> None:
        tip = f"<title>{html.escape(title)}</title>" if title else ""
        self.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 1.5):.1f}" height="{h:.1f}" fill="{color}" '
                 f'fill-opacity="{opacity}" stroke="#555" stroke-width="0.3">{tip}</rect>')

    def mark(self, x, y, shape, color, title) -> None:
        tip = f"<title>{html.escape(title)}</title>"
        if shape == "x":
            self.add(f'<path d="M{x-5:.1f},{y-5:.1f} L{x+5:.1f},{y+5:.1f} M{x-5:.1f},{y+5:.1f} L{x+5:.1f},{y-5:.1f}" '
                     f'stroke="{color}" stroke-width="2.5">{tip}</path>')
        elif shape == "tri":
            self.add(f'<path d="M{x:.1f},{y-6:.1f} L{x+6:.1f},{y+5:.1f} L{x-6:.1f},{y+5:.1f} Z" fill="{color}">{tip}</path>')
        elif shape == "diamond":
            self.add(f'<path d="M{x:.1f},{y-6:.1f} L{x+6:.1f},{y:.1f} L{x:.1f},{y+6:.1f} L{x-6:.1f},{y:.1f} Z" '
                     f'fill="{color}">{tip}</path>')
        else:
            self.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="{color}">{tip}</circle>')


def _rank_mark(e: dict):
    """(shape, color, label, tooltip) of a point event, or None for a bar or nothing."""
    k = e["kind"]
    if k == "fault_injected":
        return "diamond", "#000", f"inject {e.get('fault')}", f"fault injected: {e.get('fault')} at step {e.get('step')}"
    if k == "fault_seen":
        if e.get("state") == "RS_NORMAL":
            return "dot", "#999", "", f"released by a peer's failure: {e.get('message', '')[:200]}"
        return "x", "#d62728", e.get("state", ""), f"{e.get('state')}: {e.get('message', '')[:300]}"
    if k in ("rank_dead", "rank_hung", "killed_as_hung"):
        return "x", "#7f0000", k.replace("_", " "), f"{k}: {e.get('cause', '')}"
    if k == "rank_slow" and e.get("cause") == "communication":  # controller/slow.py: a group (controller's lane)
        return "dot", "#ff7f0e", "slow comm", (f"slow communication in process group {e.get('group')}: its members "
                                               f"wait {e.get('wait_s')} s per step in it, {e.get('ratio')}x its "
                                               f"floor ({e.get('floor_wait_s')} s)")
    if k == "rank_slow":  # controller/slow.py
        return "dot", "#ff7f0e", "slow", (f"slow ({e.get('cause')}): {e.get('ratio')}x its peers' own time per step"
                                          f" ({e.get('own_s', e.get('compute_s'))} s; waits {e.get('wait_s')} s)")
    if k == "train_resumed":
        return "tri", "#2ca02c", "", f"back in train() at step {e.get('step')} (generation {e.get('gen')})"
    if k == "step_done":
        return "dot", "#2ca02c", f"step {e.get('step')}", f"first step completed: {e.get('step')}"
    if k == "worker_exited":
        return "x", "#555", f"exit {e.get('code')}", f"worker exited with code {e.get('code')}"
    return None


def _bar(e: dict):
    """(start, end, name) of an event that reports a duration, else None."""
    k = e["kind"]
    if k in ("action", "action_done") and isinstance(e.get("duration_s"), (int, float)):
        return e["t"] - e["duration_s"], e["t"], e.get("action", "?")
    if k == "teardown":
        ms = sum(v for key, v in e.items() if key.endswith("_ms") and isinstance(v, (int, float)))
        return e["t"] - ms / 1000, e["t"], "teardown"
    return None


def _panel(svg: _Svg, inc: Incident, top: float, width: float, title: str, window=None) -> float:
    """Draw one incident at ``top`` (over ``window`` = (t0, t1) when given); return the height used."""
    ranks = sorted({lane for e in inc.events if isinstance(lane := _lane_of(e), int)}
                   | {e["dead_rank"] for e in inc.events if isinstance(e.get("dead_rank"), int)})
    lanes = ["controller"] + (["launcher"] if any(_lane_of(e) == "launcher" for e in inc.events) else []) + ranks
    left, head = 120.0, 44.0
    height = {lane: 50.0 if lane == "controller" else 40.0 for lane in lanes}
    span = max(inc.end - inc.start, 0.5)
    t0, t1 = window or (inc.start - 0.04 * span, inc.start + 1.04 * span)
    scale = (width - left - 60) / (t1 - t0)
    x = lambda t: left + (min(max(t, t0), t1) - t0) * scale  # noqa: E731
    y_of, y = {}, top + head
    for lane in lanes:
        y_of[lane], y = y, y + height[lane]
    lanes_bottom = y
    svg.text(10, top + 16, title, size=14, weight="bold")
    step = _tick_step(t1 - t0)
    first = inc.start + math.ceil((t0 - inc.start) / step) * step
    for i in range(int((t1 - t0) / step) + 1):
        t = first + i * step
        if t > t1:
            break
        svg.add(f'<line x1="{x(t):.1f}" y1="{top + head - 6:.1f}" x2="{x(t):.1f}" '
                f'y2="{lanes_bottom:.1f}" stroke="#e0e0e0"/>')
        svg.text(x(t), top + head - 10, f"{round(t - inc.start, 6):+g} s", size=10, anchor="middle", color="#666")
    for lane, y in y_of.items():
        name = f"rank {lane}" if isinstance(lane, int) else lane
        svg.text(10, y + height[lane] / 2 + 4, name, size=12, weight="bold" if lane == "controller" else "normal")
        svg.add(f'<line x1="{left}" y1="{y + height[lane]:.1f}" x2="{width - 20}" y2="{y + height[lane]:.1f}" '
                f'stroke="#ddd"/>')
    # controller state bands (thin strip at the top of its lane)
    transitions = [e for e in inc.events if e["kind"] == "transition"]
    for a, b in zip(transitions, transitions[1:] + [None]):
        end = b["t"] if b else t1
        svg.rect(x(a["t"]), y_of["controller"] + 1, x(end) - x(a["t"]), 7, STATE_COLORS.get(a["dst"], "#eee"),
                 f"state {a['dst']} ({_fmt(end - a['t'])})")
    if inc.decision is not None:  # decide: from the fault to the decision
        d = inc.decision
        svg.rect(x(inc.start), y_of["controller"] + 11, x(d["t"]) - x(inc.start), 12, PHASE_COLORS["decide"],
                 f"decide: {_fmt(d['t'] - inc.start)}")
        svg.mark(x(d["t"]), y_of["controller"] + 17, "diamond", "#111",
                 f"decision: {d.get('strategy')} (lock step {d.get('lock_step')}, faulty {d.get('faulty')})")
        svg.text(x(d["t"]) + 8, y_of["controller"] + 21, f"decision: {d.get('strategy')} @ step {d.get('lock_step')}",
                 size=10, weight="bold")
    for e in inc.events:  # a relaunched job: from the launcher's new round until every rank registered
        if e["kind"] == "round_start" and "launcher" in y_of:
            ready = next((n["t"] for n in inc.events if n["t"] > e["t"] and n["kind"] == "transition"
                          and n.get("dst") == "NORMAL"), inc.end)
            svg.rect(x(e["t"]), y_of["launcher"] + 4, x(ready) - x(e["t"]), 15, "#c7e9c0",
                     f"round {e.get('round')}: workers start, load, register: {_fmt(ready - e['t'])}")
            if x(ready) - x(e["t"]) > 200:
                svg.text((x(e["t"]) + x(ready)) / 2, y_of["launcher"] + 15,
                         f"relaunch: workers start, load the checkpoint, register {_fmt(ready - e['t'])}",
                         size=10, anchor="middle")
    for e in inc.events:
        lane = _lane_of(e)
        if lane not in y_of or not t0 <= e["t"] <= t1:
            continue
        y = y_of[lane]
        bar = _bar(e)
        if bar is not None:
            a, b, name = bar
            color = PHASE_COLORS.get(name, "#74a9cf")
            # controller: actions under the decide row; ranks: their part of an action above, teardown below
            row = y + (28 if lane == "controller" else 4 if e["kind"] == "action_done" else 21)
            svg.rect(x(a), row, x(b) - x(a), 15, color, f"{name}: {_fmt(b - a)}", 0.9)
            if x(b) - x(a) > 6.5 * len(name) + 34:
                svg.text((x(a) + x(b)) / 2, row + 11, f"{name} {_fmt(b - a)}", size=10, anchor="middle")
            continue
        target = e.get("dead_rank", e.get("hung_rank", e.get("slow_rank", e.get("target_rank"))))
        if e["kind"] in ("rank_dead", "rank_hung", "rank_slow") and target in y_of:
            y = y_of[target]
        elif e["kind"] == "worker_exited" and e.get("dead_rank") in y_of:
            y = y_of[e["dead_rank"]]
        elif e["kind"] == "fault_injected" and e.get("target_rank") in y_of:
            y = y_of[e["target_rank"]]
        shape = _rank_mark(e)
        if shape is not None:
            kind, color, label, tip = shape
            svg.mark(x(e["t"]), y + 28, kind, color, tip)
            if label:
                svg.text(x(e["t"]) + 7, y + (38 if e["kind"] == "fault_injected" else 17), label, size=9,
                         color=color)
        elif lane in ("controller", "launcher") and e["kind"] not in ("transition", "decision", "report_received"):
            svg.mark(x(e["t"]), y + (46 if lane == "controller" else 20), "dot", "#555", f"{e['kind']}: " + ", ".join(
                f"{k}={v}" for k, v in e.items() if k not in ("t", "pid", "kind", "rank"))[:300])
    bottom = lanes_bottom + 8
    for line in summary(inc):
        svg.text(left, bottom + 12, line, size=11)
        bottom += 15
    return bottom - top + 18


def summary(inc: Incident) -> list:
    """Lines under a panel: the decision, the phases the controller timed, the first step after."""
    lines = []
    d = inc.decision
    if d is not None:
        lines.append(f"decision after {_fmt(d['t'] - inc.start)}: {d.get('strategy')} at lock step {d.get('lock_step')}"
                     f", faulty ranks {d.get('faulty')}, order {d.get('order')}")
    if inc.done is not None:
        phases = [(k[:-2], v) for k, v in inc.done.items() if k.endswith("_s") and k != "total_s"]
        lines.append(f"{inc.done['kind'].replace('_done', '')} phases: " +
                     ", ".join(f"{k} {_fmt(v)}" for k, v in phases) + f"; total {_fmt(inc.done.get('total_s', 0))}")
    actions = [e for e in inc.events if e["kind"] == "action"]
    if actions and inc.done is None:
        lines.append("actions: " + ", ".join(f"{e['action']} {_fmt(e['duration_s'])}" for e in actions[:12]))
    steps = [e for e in inc.events if e["kind"] == "step_done" and d is not None and e["t"] >= d["t"]]
    if steps:
        lines.append(f"first step after the fault: step {steps[0].get('step')} on rank {steps[0].get('rank')}, "
                     f"{_fmt(steps[0]['t'] - inc.start)} after it")
    elif d is not None:
        lines.append("no step completed after the decision in this log")
    return lines


def render_svg(events: list, title: str = "mindio recovery timeline", width: int = 1200) -> str:
    found = incidents(events)
    if not found and events:  # no fault: one panel over the whole log
        found = [Incident(start=events[0]["t"], end=events[-1]["t"], events=events)]
    svg, top = _Svg(), 34.0
    svg.text(10, 22, title, size=16, weight="bold")
    for i, inc in enumerate(found, 1):
        name = f"incident {i} of {len(found)}" if len(found) > 1 else "incident"
        top += _panel(svg, inc, top, width, name)
        busy = [e["t"] for e in inc.events if e["kind"] in ("action", "decision") + DONE_KINDS]
        if busy and max(busy) - inc.start < 0.4 * (inc.end - inc.start):  # e.g. a dump, then a long relaunch
            top += _panel(svg, inc, top, width, f"{name}, zoomed on the controller's work",
                          (inc.start - 0.05, max(busy) + 0.1))
    if not found:
        svg.text(10, top + 20, "the event log is empty")
        top += 40
    legend = [("decide", "decide"), ("stop", "stop"), ("clean", "clean / teardown"), ("rebuild", "rebuild"),
              ("repair", "repair"), ("rollback", "rollback"), ("retry", "resume"), ("save", "save"),
              ("rename", "rename"), ("exit", "exit")]
    x = 10.0
    for key, label in legend:
        svg.rect(x, top, 12, 12, PHASE_COLORS[key])
        svg.text(x + 16, top + 10, label, size=10)
        x += 22 + 6.5 * len(label)
    top += 20
    x = 10.0
    for shape, color, label in (("diamond", "#000", "fault injected"), ("x", "#d62728", "error reported"),
                                ("dot", "#999", "released by a peer's failure"), ("x", "#7f0000", "process lost"),
                                ("tri", "#2ca02c", "back in train()"), ("dot", "#2ca02c", "first step completed")):
        svg.mark(x + 6, top + 6, shape, color, label)
        svg.text(x + 16, top + 10, label, size=10)
        x += 26 + 6.2 * len(label)
    top += 24
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top:.0f}" '
            f'viewBox="0 0 {width} {top:.0f}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>')
    return head + "".join(svg.parts) + "</svg>\n"


def render_html(events: list, title: str = "mindio recovery timeline") -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='margin:16px'>{render_svg(events, title)}"
            "<p style='font:12px sans-serif;color:#555'>Hover a bar or a mark for its details.</p></body></html>\n")

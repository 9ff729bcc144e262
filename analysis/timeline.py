"""Every client's tasks on a time axis, from a run's message log: `fedbus timeline RUN`.

One bar per task the server sent (a "task" record of the log), from the moment it left to
the moment its answer arrived (an update, a relay's merged update naming it, a refusal or
a handler failure), or, for a task never answered, to the moment the server stopped
waiting for it (its round's aggregation in sync mode; the client's next task, its node's
leaving or the aggregation that names the failure in async mode). Each bar is coloured by
what became of the task (FATES), read from the log and from the aggregation records of
metrics.jsonl, which share the log's clock (a record's `time` is the moment of its
aggregation):

- an answer counted in the first aggregation after it arrived is *on time*, or *folded*
  when that aggregation lists it in `stale` (a sync straggler's late update, or an async
  update made from an older version, weighted by its staleness);
- an answer not counted (discarded under federation.late = drop, or arriving after the
  last aggregation) is *late*;
- a task carrying a simulated drop is *dropped*; a refused update (the log's "refused"
  record) or a failed handler is *refused*;
- an unanswered task takes its failure from the aggregation record that names it: *late*,
  *timed out*, *dead* (or *refused* for a lost secure-aggregation input).

Nothing is recorded for this: it reads what `fedbus log` and `fedbus replay` read.
`build_timeline` is pure (logged messages and records in, bars out); `load_timeline`
reads a run directory; `write_png` and `write_html` draw it.
"""
from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# fate -> (legend label, colour); the colours are the participation plot's
# (fedbus.analysis.plots.STATUSES) for the same outcomes
FATES: dict[str, tuple[str, str]] = {
    "on_time": ("on time", "#1b7837"),
    "folded": ("late or stale, folded in", "#4393c3"),
    "late": ("late, not counted", "#f4a442"),
    "timed_out": ("timed out (async)", "#e6b800"),
    "dropped": ("dropped its task", "#d6301f"),
    "refused": ("refused / error", "#8c6bb1"),
    "dead": ("dead (lost with its node)", "#3a3a3a"),
}
# a record's failure codes (fedbus.node.engine.FAILURES) -> the fate of the task
FAILURE_FATE = {"late": "late", "timed_out": "timed_out", "dropped": "dropped",
                "dead": "dead", "rejected": "refused", "error": "refused", "secagg": "refused"}
# the message kinds whose bodies the timeline reads (the rest need the index line only)
BODY_KINDS = frozenset({"task", "update", "merged", "join", "leave", "error", "tasks",
                        "updates"})


class NoMessageLog(FileNotFoundError):
    """The run kept no message log; the message says how to record one."""


@dataclass
class Logged:
    """One message log record as the timeline reads it."""
    time: float
    direction: str  # in | out | tick | refused | resume
    kind: str
    src: str
    dst: str
    round: int
    nbytes: int
    body: Any = None  # decoded, for BODY_KINDS and refusals; None otherwise


@dataclass
class Bar:
    client: int
    round: int  # the wire's round: sync, the round; async, the version it was made from
    task: int
    version: int
    start: float  # seconds since the log's first record
    end: float
    fate: str = "late"  # a key of FATES
    detail: str = ""  # why, in words
    answered: bool = False  # an answer (update, merged, refusal, error) arrived
    bytes_down: int = 0
    bytes_up: int | None = None
    work: dict[str, Any] | None = None  # the update's work record
    via: str = ""  # the relay that merged it
    # a client's tasks that overlap in time (a straggler's late task beside its next one)
    # share its row in lanes: this bar's lane, of its row's `lanes`
    lane: int = 0
    lanes: int = 1
    # internal: when the server stopped waiting, if unanswered (see module docstring)
    _stops: list[float] = field(default_factory=list, repr=False)

    def tooltip(self) -> str:
        lines = [(f"client c{self.client}, round {self.round}, task {self.task} "
                  f"(version {self.version})"),
                 f"{FATES[self.fate][0]}" + (f": {self.detail}" if self.detail else "")]
        took = f"{self.end - self.start:.3f} s"
        lines.append(f"sent at {self.start:.3f} s, " +
                     (f"answered at {self.end:.3f} s ({took})" if self.answered else
                      f"no answer; given up at {self.end:.3f} s ({took})"))
        lines.append("work: " + work_text(self.work))
        up = "none" if self.bytes_up is None else f"{self.bytes_up:,} B up" + \
            (f" (its share of {self.via}'s merged update)" if self.via else "")
        lines.append(f"bytes: {self.bytes_down:,} B down, {up}")
        return "\n".join(lines)


@dataclass
class Aggregation:
    round: int
    version: int  # the version it made
    time: float  # seconds since the log's first record
    updates: int


@dataclass
class Timeline:
    bars: list[Bar]
    aggregations: list[Aggregation]
    round_starts: dict[int, float]  # sync: a round's first task; async: none
    clients: int  # rows: 0 .. clients - 1
    duration: float  # the log's span, seconds
    mode: str  # sync | async
    title: str = ""

    def counts(self) -> dict[str, int]:
        out = {fate: 0 for fate in FATES}
        for bar in self.bars:
            out[bar.fate] += 1
        return out


def work_text(work: Mapping[str, Any] | None) -> str:
    if not work:
        return "none reported"
    done, asked = work.get("epochs_done"), work.get("epochs_asked")
    text = (f"{done:g}" if isinstance(done, (int, float)) else "?") + \
        f"/{asked if asked is not None else '?'} epochs, {work.get('steps', '?')} steps, " \
        f"{work.get('samples', '?')} samples seen"
    stopped = work.get("stopped", "done")
    return text if stopped in (None, "done") else f"{text}, stopped: {stopped}"


def _client(address: Any) -> int | None:
    address = str(address)
    return int(address[1:]) if address[:1] == "c" and address[1:].isdigit() else None


# ------------------------------------------------------------------ log -> bars

def build_timeline(messages: Iterable[Logged], records: list[Mapping[str, Any]], *,
                   mode: str = "sync", clients: int = 0, title: str = "") -> Timeline:
    """The bars of every task in `messages` (in log order) and the aggregations of
    `records` (metrics.jsonl, same clock), each bar's fate as the module docstring says."""
    messages = list(messages)
    t0 = messages[0].time if messages else 0.0
    end = messages[-1].time - t0 if messages else 0.0
    bars: list[Bar] = []
    by_task: dict[int, Bar] = {}  # the latest task of each id (a resumed run may resend)
    open_of: dict[int, list[Bar]] = {}  # client -> its tasks not answered yet
    hosts: dict[str, list[int]] = {}  # node -> its clients
    round_starts: dict[int, float] = {}
    for m in messages:
        t = m.time - t0
        body = m.body if isinstance(m.body, Mapping) else {}
        if m.direction == "out" and m.kind == "task" and _client(m.dst) is not None:
            c = _client(m.dst)
            for earlier in open_of.get(c, ()):  # a new task: the server stopped waiting
                earlier._stops.append(t)
            bar = Bar(c, m.round, int(body.get("task", -1)), int(body.get("version", m.round)),
                      t, t, bytes_down=m.nbytes)
            sim = body.get("sim") if isinstance(body.get("sim"), Mapping) else {}
            if sim.get("drop"):
                bar.fate = "dropped"
                bar.detail = f"the client dropped it (at {sim.get('drop_stage', 'task')}; " \
                             "system.drop_prob or drop_clients)"
            bars.append(bar)
            by_task[bar.task] = bar
            open_of.setdefault(c, []).append(bar)
            round_starts.setdefault(m.round, t)
        elif m.direction == "in" and m.kind == "update":
            _answer(by_task.get(body.get("task")), _client(m.src), t, open_of,
                    nbytes=m.nbytes, work=body.get("work"))
        elif m.direction == "in" and m.kind == "merged":
            members = [x for x in body.get("members") or () if isinstance(x, (list, tuple))
                       and len(x) >= 2]
            for member in members:
                _answer(by_task.get(member[1]), _client(member[0]), t, open_of,
                        nbytes=m.nbytes // max(len(members), 1), via=m.src,
                        work=member[3] if len(member) > 3 else None)
        elif m.direction == "refused":
            tasks = [[body.get("src"), body.get("task")]] if body.get("task") is not None \
                else list(body.get("tasks") or ())
            for address, tid in (x for x in tasks if len(x) >= 2):
                bar = _answer(by_task.get(tid), _client(address), t, open_of)
                if bar is not None:
                    bar.fate, bar.detail = "refused", str(body.get("reason", ""))[:300]
        elif m.direction == "in" and m.kind == "error" and body.get("code") == "handler_failed":
            bar = _answer(by_task.get(body.get("task")), _client(m.src), t, open_of)
            if bar is not None:
                bar.fate, bar.detail = "refused", "its handler failed"
        elif m.direction == "in" and m.kind in ("join", "leave") and body.get("node"):
            ids = [c for c in map(_client, body.get("clients") or ()) if c is not None]
            if m.kind == "join":
                hosts[str(body["node"])] = ids
            else:
                for c in hosts.pop(str(body["node"]), ids):
                    for bar in open_of.get(c, ()):
                        bar._stops.append(t)
    # the index keeps times to the microsecond (fedbus.record.msglog): a record's time is
    # the moment of the message that made its aggregation, so it is compared as rounded
    recs = sorted(({**r, "time": round(float(r["time"]), 6)} for r in records
                   if isinstance(r.get("time"), (int, float))), key=lambda r: r["time"])
    aggregations = [Aggregation(int(r.get("round", -1)), int(r.get("version", -1)),
                                r["time"] - t0, int(r.get("updates", 0))) for r in recs]
    for bar in bars:
        _settle(bar, recs, t0, end, mode)
    _assign_lanes(bars)
    seen = max((b.client for b in bars), default=-1) + 1
    return Timeline(bars, aggregations, round_starts if mode == "sync" else {},
                    max(clients, seen), end, mode, title)


def _answer(bar: Bar | None, client: int | None, t: float, open_of: dict[int, list[Bar]], *,
            nbytes: int | None = None, work: Any = None, via: str = "") -> Bar | None:
    """The task's answer arrived at t (a task of another client is no match)."""
    if bar is None or bar.client != client or bar.answered:
        return None
    bar.answered, bar.end = True, t
    bar.bytes_up, bar.via = nbytes, via
    bar.work = dict(work) if isinstance(work, Mapping) else None
    if bar in open_of.get(bar.client, ()):
        open_of[bar.client].remove(bar)
    return bar


def _assign_lanes(bars: list[Bar]) -> None:
    """Each bar the first lane of its client's row that is free when it starts."""
    by_client: dict[int, list[Bar]] = {}
    for bar in bars:
        by_client.setdefault(bar.client, []).append(bar)
    for mine in by_client.values():
        lane_ends: list[float] = []
        for bar in sorted(mine, key=lambda b: (b.start, b.task)):
            free = next((i for i, e in enumerate(lane_ends) if e <= bar.start), None)
            if free is None:
                free = len(lane_ends)
                lane_ends.append(bar.end)
            lane_ends[free] = bar.end
            bar.lane = free
        for bar in mine:
            bar.lanes = len(lane_ends)


def _stale_entry(rec: Mapping[str, Any], bar: Bar) -> list | None:
    for entry in rec.get("stale") or ():
        if isinstance(entry, (list, tuple)) and len(entry) >= 2 and \
                int(entry[0]) == bar.client and int(entry[1]) == bar.version:
            return list(entry)
    return None


def _fresh(rec: Mapping[str, Any]) -> set[int]:
    """The clients whose fresh update a record aggregated (participants less stale ones)."""
    counts: dict[int, int] = {}
    for c in rec.get("participants") or ():
        counts[int(c)] = counts.get(int(c), 0) + 1
    for entry in rec.get("stale") or ():
        counts[int(entry[0])] = counts.get(int(entry[0]), 0) - 1
    return {c for c, n in counts.items() if n > 0}


def _settle(bar: Bar, recs: list[Mapping[str, Any]], t0: float, end: float, mode: str) -> None:
    """The bar's fate (where the log did not already say it) and, unanswered, its end."""
    if bar.answered:
        if bar.fate in ("refused", "dropped"):
            return
        # counted, if at all, by the first aggregation at or after its arrival
        rec = next((r for r in recs if r["time"] - t0 >= bar.end), None)
        stale = _stale_entry(rec, bar) if rec is not None else None
        if rec is None:
            bar.fate, bar.detail = "late", "arrived after the last aggregation: not counted"
        elif stale is not None:
            weight = f", weight {stale[3]:.3g}" if len(stale) > 3 else ""
            staleness = f"staleness {stale[2]}" if len(stale) > 2 else "stale"
            bar.fate = "folded"
            bar.detail = f"folded into round {rec.get('round')} ({staleness}{weight})"
        elif bar.client in _fresh(rec) and (mode != "sync" or rec.get("round") == bar.round):
            bar.fate, bar.detail = "on_time", f"aggregated in round {rec.get('round')}"
        else:
            where = next((r.get("round") for r in recs
                          if [bar.client, bar.round] in (r.get("late_discarded") or ())), None)
            bar.fate = "late"
            bar.detail = f"discarded in round {where} (federation.late = drop)" \
                if where is not None else "arrived after its round closed: not counted"
        return
    # unanswered: the record that names its failure
    if mode == "sync":
        rec = next((r for r in recs if r.get("round") == bar.round), None)
        named = rec if rec is not None and str(bar.client) in (rec.get("failures") or {}) \
            else None
    else:
        named = rec = next((r for r in recs if r["time"] - t0 >= bar.start
                            and str(bar.client) in (r.get("failures") or {})), None)
    stops = list(bar._stops) + ([rec["time"] - t0] if rec is not None else [])
    bar.end = max(bar.start, min(stops, default=end))
    if bar.fate == "dropped":
        return
    if named is None:
        bar.fate, bar.detail = "late", "no answer before the log ends"
        return
    why = str(named["failures"][str(bar.client)])
    bar.fate = FAILURE_FATE.get(why, "refused")
    refusal = (named.get("refusals") or {}).get(str(bar.client))
    bar.detail = f"round {named.get('round')} names it {why}" + \
        (f": {refusal}" if refusal else "")


# ------------------------------------------------------------------ reading a run

def _config(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line
    return out


def require_message_log(run: Path) -> None:
    """NoMessageLog, saying how to record one, if the run kept no message log."""
    if (run / "messages.bin").exists() and (run / "messages.jsonl").exists():
        return
    if not (run / "config.json").exists() and not (run / "metrics.jsonl").exists():
        raise NoMessageLog(f"{run} is not a run directory (no config.json, metrics.jsonl or "
                           "message log)")
    if (_config(run).get("log") or {}).get("messages") is False:
        raise NoMessageLog(f"{run} ran with log.messages = false and kept no message log: "
                           "run it again with log.messages = true (the default; "
                           "--set log.messages=true) to record one")
    raise NoMessageLog(f"{run} has no message log (messages.bin and messages.jsonl): record "
                       "one with log.messages = true (the default; --set log.messages=true)")


def read_messages(run: Path) -> list[Logged]:
    """The log's records in order: the index's fields, and the bodies of the kinds the
    timeline reads (each found by its index offset, so the rest is not decoded)."""
    from fedbus.broker.wire import WireError, decode_body
    from fedbus.record.msglog import LogCorrupt, RecordReader

    out = []
    with RecordReader(run / "messages.bin") as reader:
        for e in _json_lines(run / "messages.jsonl"):
            body = None
            if e.get("dir") == "refused" or e.get("kind") in BODY_KINDS:
                rec = reader.at(int(e["off"]), int(e.get("i", -1)))
                if len(rec.frames) > 1 and rec.frames[1]:
                    try:
                        body = decode_body(rec.frames[1], max_frame=len(rec.frames[1]) + 1)
                    except WireError as err:
                        raise LogCorrupt(f"{reader.path}: record {e.get('i')} at offset "
                                         f"{e['off']}: body does not decode: {err}") from None
            logged = Logged(float(e["t"]), str(e.get("dir", "")), str(e.get("kind", "")),
                            str(e.get("src", "")), str(e.get("dst", "")),
                            int(e.get("round", -1)), int(e.get("bytes", 0)), body)
            out += _members(logged) if logged.kind in ("tasks", "updates") else [logged]
    return out


def _members(m: Logged) -> list[Logged]:
    """A `tasks` or `updates` batch (bus.batch, PROTOCOL.md §4.3) as the `task` or `update`
    messages its members stand for, at its time, each with an equal share of its bytes: the
    timeline draws a bar per task whichever way the tasks travelled. A batch whose body
    does not decode as one is kept as it is (nothing is drawn for it)."""
    from fedbus.node.engine import unbatch_tasks, unbatch_updates

    try:
        members = (unbatch_tasks if m.kind == "tasks" else unbatch_updates)(m.body)
    except (ValueError, TypeError, KeyError):
        return [m]
    if not members:
        return [m]
    share = m.nbytes // len(members)
    if m.kind == "tasks":
        return [Logged(m.time, m.direction, "task", m.src, to, m.round, share, body)
                for to, body in members]
    return [Logged(m.time, m.direction, "update", frm, m.dst, m.round, share, body)
            for frm, body in members]


def load_timeline(run: str | Path) -> Timeline:
    """The timeline of a run directory. NoMessageLog if it kept no message log;
    fedbus.record.msglog.LogCorrupt if the log is damaged."""
    run = Path(run)
    require_message_log(run)
    cfg = _config(run)
    fed = cfg.get("federation") or {}
    mode = str(fed.get("mode", "sync"))
    algorithm = (cfg.get("algorithm") or {}).get("name", "?")
    title = f"{run.name}: {algorithm}, {mode}"
    return build_timeline(read_messages(run), _json_lines(run / "metrics.jsonl"), mode=mode,
                          clients=int(fed.get("clients", 0) or 0), title=title)


# ------------------------------------------------------------------ drawing

def _tick_step(span: float, target: int = 8) -> float:
    raw = max(span, 1e-9) / target
    base = 10 ** math.floor(math.log10(raw))
    return next(base * m for m in (1, 2, 5, 10) if base * m >= raw)


def _label_every(n: int, room: float, width: float) -> int:
    """Label every k-th of n marks so labels `width` apart fit in `room`."""
    return max(1, math.ceil(n * width / max(room, 1.0)))


def _band(bar: Bar, fill: float = 0.76) -> tuple[float, float]:
    """(top, height) of a bar in its client's row, in row units from the row's top."""
    height = fill / bar.lanes
    return (1 - fill) / 2 + bar.lane * height, height


def write_png(tl: Timeline, path: str | Path) -> Path:
    """The timeline as a PNG, on matplotlib's Agg canvas (no display needed).
    ModuleNotFoundError when matplotlib is not installed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    rows = max(tl.clients, 1)
    fig = Figure(figsize=(13, min(2.0 + 0.3 * rows, 30)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    least = max(tl.duration, 1e-3) * 0.002  # an instant's bar is still seen
    for b in tl.bars:
        colour = FATES[b.fate][1]
        offset, height = _band(b)
        # a task with no answer is hatched and faded: its bar ends where the server
        # stopped waiting, not with an answer
        ax.broken_barh([(b.start, max(b.end - b.start, least))],
                       (b.client - 0.5 + offset, height), facecolors=colour,
                       edgecolors="white" if b.answered else colour,
                       hatch=None if b.answered else "////", linewidth=0.3,
                       alpha=1.0 if b.answered else 0.55)
    top = ax.get_xaxis_transform()  # x in data, y in axes fractions
    every = _label_every(len(tl.round_starts), 1000, 28)
    for i, (r, t) in enumerate(sorted(tl.round_starts.items())):
        ax.axvline(t, color="#888888", linestyle=":", linewidth=0.9, zorder=0)
        if i % every == 0:
            ax.text(t, 1.005, f"r{r}", transform=top, fontsize=7, color="#777777",
                    ha="left", va="bottom")
    every = _label_every(len(tl.aggregations), 1000, 28)
    for i, a in enumerate(tl.aggregations):
        ax.axvline(a.time, color="#222222", linewidth=0.8, alpha=0.75, zorder=0)
        if i % every == 0:
            ax.text(a.time, 1.04 if tl.round_starts else 1.005, f"v{a.version}",
                    transform=top, fontsize=7, color="#222222", ha="center", va="bottom")
    ax.set_ylim(rows - 0.5, -0.5)
    step = _label_every(rows, 40, 1)
    ax.set_yticks(list(range(0, rows, step)))
    ax.set_yticklabels([f"c{c}" for c in range(0, rows, step)], fontsize=8)
    ax.set_xlim(0, max(tl.duration, 1e-3) * 1.01)
    ax.set_xlabel("seconds since the log's first record")
    ax.set_ylabel("client")
    counts = tl.counts()
    handles = [Patch(facecolor=colour, label=f"{label} ({counts[fate]})")
               for fate, (label, colour) in FATES.items() if counts[fate]]
    if any(not b.answered for b in tl.bars):
        handles.append(Patch(facecolor="#bbbbbb", edgecolor="#888888", hatch="////",
                             alpha=0.55, label="no answer: ends where\nthe server stopped "
                             "waiting"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False, title="task fate (count)", title_fontsize=8)
    marks = "dotted: a round's first task (rN); solid: an aggregation (vN: the version made)" \
        if tl.round_starts else "solid lines: aggregations (vN: the version made)"
    ax.set_title(f"{tl.title}: {len(tl.bars)} tasks\n{marks}", fontsize=9,
                 pad=24 if tl.round_starts else 14)
    fig.tight_layout()
    fig.savefig(path)
    return path


def render_html(tl: Timeline) -> str:
    """A self-contained page: the timeline as inline SVG, one <rect class="bar"> per task,
    each with a tooltip (its <title>, shown by any browser; a small inline script shows
    it at once and styled). No network access, no external script or style."""
    esc = html.escape
    rows = max(tl.clients, 1)
    left, right, top = 60, 20, 34
    row_h = 26 if rows <= 20 else 18 if rows <= 60 else max(3, 1080 // rows)
    width = 1100
    plot_w = width - left - right
    height = top + rows * row_h + 40
    span = max(tl.duration, 1e-3) * 1.01

    def x(t: float) -> float:
        return left + plot_w * t / span

    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline" width="{width}" '
              f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" '
              'font-size="11">')]
    for c in range(rows):
        if c % 2:
            parts.append(f'<rect class="row" x="{left}" y="{top + c * row_h}" '
                         f'width="{plot_w}" height="{row_h}" fill="#f6f6f6"/>')
    label_step = _label_every(rows, rows * row_h, 12)
    for c in range(0, rows, label_step):
        parts.append(f'<text x="{left - 6}" y="{top + c * row_h + row_h / 2 + 4:.1f}" '
                     f'text-anchor="end">c{c}</text>')
    step = _tick_step(span)
    n_ticks = int(span / step) + 1
    for i in range(n_ticks):
        t = i * step
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top + rows * row_h}" '
                     f'y2="{top + rows * row_h + 5}" stroke="#444"/>'
                     f'<text x="{x(t):.1f}" y="{top + rows * row_h + 17}" '
                     f'text-anchor="middle">{t:g}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle">'
                 "seconds since the log's first record</text>")
    every = _label_every(len(tl.round_starts), plot_w, 28)
    for i, (r, t) in enumerate(sorted(tl.round_starts.items())):
        parts.append(f'<line class="round-start" data-round="{r}" x1="{x(t):.1f}" '
                     f'x2="{x(t):.1f}" y1="{top - 14}" y2="{top + rows * row_h}" '
                     'stroke="#999" stroke-dasharray="2,3"/>')
        if i % every == 0:
            parts.append(f'<text x="{x(t) + 2:.1f}" y="{top - 16}" fill="#666">r{r}</text>')
    every = _label_every(len(tl.aggregations), plot_w, 28)
    for i, a in enumerate(tl.aggregations):
        parts.append(f'<line class="aggregation" data-version="{a.version}" x1="{x(a.time):.1f}"'
                     f' x2="{x(a.time):.1f}" y1="{top - 4}" y2="{top + rows * row_h}" '
                     f'stroke="#222" stroke-opacity="0.7"><title>aggregation of round {a.round}'
                     f' at {a.time:.3f} s: {a.updates} updates, made version {a.version}'
                     '</title></line>')
        if i % every == 0:
            parts.append(f'<text x="{x(a.time):.1f}" y="{top - 4}" text-anchor="middle" '
                         f'font-weight="bold">v{a.version}</text>')
    for b in tl.bars:
        colour = FATES[b.fate][1]
        w = max(x(b.end) - x(b.start), 1.5)
        offset, height = _band(b, fill=0.7)
        style = "" if b.answered else ' fill-opacity="0.5" stroke-dasharray="3,2"'
        parts.append(
            f'<rect class="bar fate-{b.fate}" data-client="{b.client}" data-round="{b.round}" '
            f'data-task="{b.task}" data-fate="{b.fate}" x="{x(b.start):.2f}" '
            f'y="{top + (b.client + offset) * row_h:.2f}" width="{w:.2f}" '
            f'height="{height * row_h:.2f}" fill="{colour}" stroke="{colour}"{style}>'
            f"<title>{esc(b.tooltip())}</title></rect>")
    parts.append("</svg>")
    counts = tl.counts()
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{colour}"></span>'
        f"{esc(label)} ({counts[fate]})</span>" for fate, (label, colour) in FATES.items())
    marks = ("dotted lines: a round's first task; " if tl.round_starts else "") + \
        "solid lines: aggregations (vN: the version made). A faded, dashed bar had no " \
        "answer: it ends where the server stopped waiting. Hover a bar for its task."
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>fedbus timeline: {esc(tl.title)}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 16px; }} p {{ font-size: 12px; color: #444; max-width: 1100px; }}
.key {{ display: inline-block; margin-right: 14px; font-size: 12px; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -2px; }}
rect.bar:hover {{ stroke: #000; stroke-width: 1.5; }}
#tip {{ position: fixed; display: none; background: #fffff0; border: 1px solid #888;
  padding: 4px 6px; font-size: 12px; white-space: pre; pointer-events: none; }}
</style></head>
<body>
<h1>{esc(tl.title)}: {len(tl.bars)} tasks, {len(tl.aggregations)} aggregations</h1>
<div id="legend">{legend}</div>
<p>{esc(marks)}</p>
{"".join(parts)}
<div id="tip"></div>
<script>
(function () {{
  var tip = document.getElementById("tip");
  document.querySelectorAll("rect.bar").forEach(function (bar) {{
    var title = bar.querySelector("title");
    bar.addEventListener("mousemove", function (ev) {{
      tip.textContent = title.textContent; tip.style.display = "block";
      tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
    }});
    bar.addEventListener("mouseleave", function () {{ tip.style.display = "none"; }});
  }});
}})();
</script>
</body></html>
"""


def write_html(tl: Timeline, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render_html(tl), encoding="utf-8")
    return path

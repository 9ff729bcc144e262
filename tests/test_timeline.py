"""`fedbus timeline RUN` on real runs (processes on loopback, digits): one bar per task of
the message log, each bar's fate agreeing with the aggregation records (failures, stale,
participants), the PNG a real PNG, the HTML page one bar element per task with its tooltip,
and the page rendered by a real headless Chromium (skipped, saying so, where there is none).

The sync run has a client that drops every task (system.drop_clients) and a straggler late
by events (system.hold_clients, federation.quorum): no verdict here depends on the
machine's speed. The async run's slow client makes its timing vary from machine to machine,
so its checks are of agreement between the bars and the records, whatever happened."""
from __future__ import annotations

import json
import shlex
import shutil
import struct
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fedbus.analysis.timeline import FAILURE_FATE, FATES, load_timeline, render_html, write_png
from fedbus.node.engine import client_index
from tests.helpers import SMALL, fedbus, logged_messages, merged, metrics, run_federation

DROPS, HELD, SLOW = 1, 2, 2
SYNC = merged(SMALL, federation={"clients": 5, "rounds": 3, "quorum": 3, "late": "fold"},
              system={"drop_clients": [DROPS], "hold_clients": [HELD]},
              launch={"threads": 1}, bus={"liveness": 10, "batch": "off"},
              log={"messages": True})
ASYNC = merged(SMALL, federation={"clients": 5, "rounds": 6, "mode": "async",
                                  "concurrency": 3, "buffer": 2},
               system={"slow_clients": [SLOW], "slow_factor": 20.0, "drop_clients": [4]},
               launch={"threads": 1}, bus={"liveness": 10}, log={"messages": True})


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Path:
    run, _ = run_federation(tmp_path_factory.mktemp("timeline"), SYNC, name="sync")
    return run


@pytest.fixture(scope="module")
def batched_run(tmp_path_factory) -> Path:
    cfg = merged(SYNC, bus={"batch": "auto"})
    run, _ = run_federation(tmp_path_factory.mktemp("timeline"), cfg, name="batched")
    return run


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    run, _ = run_federation(tmp_path_factory.mktemp("timeline"), ASYNC, name="async")
    return run


def logged_tasks(run: Path) -> list[tuple[int, int]]:
    """(client, task id) of every task the server sent, a `tasks` batch's members too, read
    from the message log itself."""
    return [(client_index(m.dst), m.body["task"]) for m in logged_messages(run, "task", "out")]


def fresh(rec: dict) -> Counter:
    return Counter(rec["participants"]) - Counter(s[0] for s in rec["stale"])


def test_a_batched_run_draws_a_bar_per_task_with_the_same_fates(sync_run, batched_run):
    """bus.batch = auto: a round's tasks leave a node as one `tasks` message and come back
    as `updates`; the timeline reads their members, so the bars (and their fates, which
    the events decide: the drop, the held update) are the unbatched run's."""
    index = [json.loads(x) for x in (batched_run / "messages.jsonl").read_text().splitlines()]
    assert {"tasks", "updates"} <= {e["kind"] for e in index}
    assert not any(e["kind"] == "task" for e in index)
    tl, plain = load_timeline(batched_run), load_timeline(sync_run)
    assert len(tl.bars) == len(plain.bars) == 5 * 3
    fates = Counter((b.client, b.round, b.fate) for b in tl.bars)
    assert fates == Counter((b.client, b.round, b.fate) for b in plain.bars)
    assert [a.version for a in tl.aggregations] == [1, 2, 3]


def test_sync_one_bar_per_task_with_the_records_fates(sync_run):
    tl = load_timeline(sync_run)
    records = metrics(sync_run)
    tasks = logged_tasks(sync_run)
    assert len(tl.bars) == len(tasks) == 5 * 3
    assert sorted((b.client, b.task) for b in tl.bars) == sorted(tasks)
    assert len({b.task for b in tl.bars}) == len(tl.bars)
    bar = {(b.client, b.round): b for b in tl.bars}
    for rec in records:
        r = rec["round"]
        for c, why in rec["failures"].items():
            # a late update that came after all is folded into a later round
            allowed = {"late", "folded"} if why == "late" else {FAILURE_FATE[why]}
            assert bar[int(c), r].fate in allowed, (r, c, why, bar[int(c), r])
        for c in fresh(rec):
            assert bar[c, r].fate == "on_time", (r, c, bar[c, r])
    on_time = Counter((b.client, b.round) for b in tl.bars if b.fate == "on_time")
    assert on_time == Counter((c, rec["round"]) for rec in records for c in fresh(rec))
    folded = Counter((b.client, b.version) for b in tl.bars if b.fate == "folded")
    assert folded == Counter((s[0], s[1]) for rec in records for s in rec["stale"])
    assert {b.fate for b in tl.bars if b.client == DROPS} == {"dropped"}
    assert {b.fate for b in tl.bars if b.client == HELD} <= {"folded", "late"}
    assert {"on_time", "folded", "dropped", "late"} <= {b.fate for b in tl.bars}
    # the marks: a start per round, an aggregation per record, in the log's time span
    assert sorted(tl.round_starts) == [0, 1, 2]
    assert [a.version for a in tl.aggregations] == [1, 2, 3]
    for b in tl.bars:
        assert 0 <= b.start <= b.end <= tl.duration, b
        assert (b.bytes_up is not None) == b.answered, b
    # an answered bar ends with its update's arrival, which its round's aggregation follows
    for b in tl.bars:
        if b.fate == "on_time":
            assert b.end <= tl.aggregations[b.round].time
            assert b.work and b.work["epochs_done"] == b.work["epochs_asked"] == 1
            assert b.bytes_up > 0 and b.bytes_down > 0


def test_async_bars_agree_with_the_records(async_run):
    tl = load_timeline(async_run)
    records = metrics(async_run)
    tasks = logged_tasks(async_run)
    assert sorted((b.client, b.task) for b in tl.bars) == sorted(tasks)
    assert tl.mode == "async" and not tl.round_starts
    assert len(tl.aggregations) == 6
    folded = Counter((b.client, b.version) for b in tl.bars if b.fate == "folded")
    assert folded == Counter((s[0], s[1]) for rec in records for s in rec["stale"])
    on_time = Counter(b.client for b in tl.bars if b.fate == "on_time")
    assert on_time == sum((fresh(rec) for rec in records), Counter())
    named = Counter((int(c), FAILURE_FATE[why]) for rec in records
                    for c, why in rec["failures"].items())
    assert not named - Counter((b.client, b.fate) for b in tl.bars), named
    assert {b.fate for b in tl.bars if b.client == 4} == {"dropped"}
    assert all(b.fate == "late" for b in tl.bars if b.answered and b.end >
               tl.aggregations[-1].time), "an answer after the last aggregation counts nowhere"


def test_the_png_is_a_real_png(sync_run, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    path = write_png(load_timeline(sync_run), tmp_path / "t.png")
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    pixels = image.imread(path)
    assert pixels.shape[:2] == (height, width) and width > 500
    assert pixels[..., :3].std() > 0.05  # not blank


class Bars(HTMLParser):
    """The SVG bars of the page, with their tooltips; every external reference."""

    def __init__(self):
        super().__init__()
        self.bars: list[dict] = []
        self.external: list[str] = []
        self._in_bar = self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("src", "href"):
            if a.get(key):
                self.external.append(f"{tag} {key}={a[key]}")
        if tag == "link":
            self.external.append("link")
        if tag == "rect" and "bar" in (a.get("class") or "").split():
            self.bars.append({**a, "title": ""})
            self._in_bar = True
        self._in_title = self._in_bar and tag == "title"

    def handle_data(self, data):
        if self._in_title:
            self.bars[-1]["title"] += data

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        elif tag == "rect":
            self._in_bar = False


def parsed(page: str) -> Bars:
    p = Bars()
    p.feed(page)
    p.close()
    return p


def test_the_html_page_has_one_bar_per_task_with_its_tooltip(sync_run):
    tl = load_timeline(sync_run)
    page = render_html(tl)
    p = parsed(page)
    assert len(p.bars) == len(logged_tasks(sync_run)) == len(tl.bars)
    assert p.external == []  # self-contained: no script, style or image fetched
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for bar, b in zip(p.bars, tl.bars):
        assert (int(bar["data-client"]), int(bar["data-task"])) == (b.client, b.task)
        assert bar["data-fate"] == b.fate and f"fate-{b.fate}" in bar["class"]
        tip = bar["title"]
        assert f"client c{b.client}, round {b.round}, task {b.task}" in tip, tip
        assert "work: " in tip and "bytes: " in tip and f"{b.bytes_down:,} B down" in tip
        if b.fate == "on_time":
            assert "1/1 epochs" in tip and f"{b.bytes_up:,} B up" in tip, tip


def test_the_command_writes_both_files_and_its_help_examples_run_as_written(sync_run,
                                                                             tmp_path):
    """The --help examples, from a directory where runs/cmp/fedavg-s0 (a run the sweep's
    example makes) is this real run."""
    from fedbus.launch.timeline_cmd import EXAMPLES

    (tmp_path / "runs" / "cmp").mkdir(parents=True)
    shutil.copytree(sync_run, tmp_path / "runs" / "cmp" / "fedavg-s0")
    lines = EXAMPLES.split("\n\n")[0].splitlines()[1:]
    assert len(lines) == 2
    for line in lines:
        argv = shlex.split(line, comments=True)
        assert argv[:2] == ["fedbus", "timeline"]
        out = fedbus(*argv[1:], cwd=tmp_path).stdout
        assert "15 tasks (" in out and "3 aggregations" in out, out
    made = tmp_path / "runs" / "cmp" / "fedavg-s0" / "plots"
    assert (made / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(parsed((made / "timeline.html").read_text()).bars) == 15
    assert sorted(p.name for p in (tmp_path / "timelines").iterdir()) == ["timeline.html"]


def test_a_run_without_a_message_log_gets_one_line_naming_the_config_key(sync_run, tmp_path):
    run = tmp_path / "nolog"
    shutil.copytree(sync_run, run)
    (run / "messages.bin").unlink()
    (run / "messages.jsonl").unlink()
    cfg = json.loads((run / "config.json").read_text())
    cfg["log"]["messages"] = False
    (run / "config.json").write_text(json.dumps(cfg))
    proc = fedbus("timeline", str(run), check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "log.messages = true" in proc.stderr, proc.stderr
    proc = fedbus("timeline", str(tmp_path), check=False)  # no run directory at all
    assert proc.returncode == 2 and "not a run directory" in proc.stderr, proc.stderr


def test_without_matplotlib_the_png_is_one_line_naming_the_extra_and_html_still_works(
        sync_run, tmp_path):
    """matplotlib made unimportable in the child (as where the plot extra is missing)."""
    code = ("import sys; sys.modules['matplotlib'] = None; from fedbus.launch import cli; "
            "sys.exit(cli.main(sys.argv[1:]))")
    run = [sys.executable, "-c", code, "timeline", str(sync_run), "--out", str(tmp_path)]
    proc = subprocess.run(run, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pip install 'fedbus[plot]'" in proc.stderr and "--format html" in proc.stderr
    proc = subprocess.run([*run, "--format", "html"], check=False, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.html"]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not on PATH (Debian: apt-get install "
                    "chromium; .ci/run installs it as root)")
def test_headless_chromium_renders_the_page(sync_run, tmp_path):
    """A real browser loads the page from disk (no network): its DOM after scripts ran has
    one bar per task, and its screenshot is a real PNG of the window's size in which the
    on-time and folded bars' colours are drawn."""
    image = pytest.importorskip("matplotlib.image")
    tl = load_timeline(sync_run)
    page = tmp_path / "timeline.html"
    page.write_text(render_html(tl))
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
               "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    # timeouts: liveness guards only (a browser that never exits fails, late)
    proc = subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1200,600",
                           page.as_uri()], check=False, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    pixels = image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (600, 1200)
    for fate in ("on_time", "folded"):
        rgb = [int(FATES[fate][1][i:i + 2], 16) / 255 for i in (1, 3, 5)]
        drawn = (abs(pixels - rgb) < 2 / 255).all(axis=-1).sum()
        assert drawn > 200, f"{fate}: {drawn} pixels of its colour"
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], check=False,
                         capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert len(parsed(dom.stdout).bars) == len(tl.bars) == 15
    assert 'id="tip"' in dom.stdout

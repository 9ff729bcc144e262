"""`fedbus bench rounds --quick`, CI's perf smoke: every time it prints stands beside the
raw-zmq floor measured in the same run and the ratio of the two. Only the output's
structure is checked here (present, finite, positive), never a value: speed is
`fedbus bench`'s business, not a test's."""
from __future__ import annotations

import json
import math

from fedbus.bench.common import FIGURE_HEAD, figure_line, zmq_floor
from fedbus.bench.rounds import TIMES
from tests.helpers import fedbus


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_quick_bench_prints_each_time_with_its_floor_and_ratio(tmp_path):
    out = fedbus("bench", "rounds", "--quick", "--clients", "6", "--rounds", "3", "--json",
                 "--out", str(tmp_path), timeout=300)
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert figures["rounds_completed"] == 3 and figures["nodes"] == 1
    assert _finite_positive(figures["floor_ms"])
    assert _finite_positive(figures["ratio"])
    assert figures["ratio"] == figures["ratios"]["round_ms_median"]
    assert sorted(figures["ratios"]) == sorted(TIMES)
    for key in TIMES:
        assert _finite_positive(figures[key]) and _finite_positive(figures["ratios"][key])
    # the table: its head, then one line per time: label, fedbus ms, floor ms, ratio
    text = lines[:-1]
    assert text[0].startswith("fedbus bench rounds --quick: 6 clients, 1 node, 3 rounds")
    assert "not a verdict" in text[0]
    assert text[1] == FIGURE_HEAD
    for line, label in zip(text[2:2 + len(TIMES)], TIMES.values(), strict=True):
        assert line.strip().startswith(label)
        ms, floor, ratio = line.split()[-3:]
        assert _finite_positive(float(ms)) and _finite_positive(float(floor))
        assert ratio.endswith("x") and _finite_positive(float(ratio[:-1]))
    assert any("raw-zmq floor" in x and "measured in this run" in x for x in text)
    assert len(text) <= 8  # short enough for CI's log


def test_no_floor_leaves_the_ratios_out(tmp_path):
    out = fedbus("bench", "rounds", "--quick", "--clients", "4", "--rounds", "2",
                 "--no-floor", "--json", "--out", str(tmp_path), timeout=300)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert "floor_ms" not in figures and "ratio" not in figures
    assert "raw-zmq floor" not in out.stdout


def test_eval_every_puts_an_evaluation_in_every_round(tmp_path):
    out = fedbus("bench", "rounds", "--quick", "--clients", "4", "--rounds", "3",
                 "--no-floor", "--eval-every", "1", "--out", str(tmp_path), timeout=300)
    assert "an evaluation every 1 round(s)" in out.stdout
    (run,) = [p.parent for p in tmp_path.rglob("metrics.jsonl")]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(r["eval_clients"] == 4 for r in records), records


def test_quick_refuses_relays_before_anything_runs(tmp_path):
    out = fedbus("bench", "rounds", "--quick", "--relays", "1", "--out", str(tmp_path),
                 check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == ("fedbus bench rounds: --quick measures the flat federation "
                                  "only (no --relays)")
    assert not list(tmp_path.iterdir())


def test_the_floor_is_a_real_round_trip_over_several_dealers():
    floor = zmq_floor(7, 300, 50, nodes=3, repeats=2)
    assert (floor.messages, floor.down_bytes, floor.up_bytes, floor.nodes) == (7, 300, 50, 3)
    assert _finite_positive(floor.ms)
    assert floor.figures(2 * floor.ms) == {"floor_ms": floor.ms, "ratio": 2.0}
    # an empty payload stops a DEALER, so the floor sends at least one byte
    assert zmq_floor(1, 0, 0, repeats=1).down_bytes == 1
    assert "7 messages of 300 B out and 50 B back, 3 DEALER processes" in floor.describe()


def test_a_figure_line_without_a_floor_shows_no_ratio():
    assert figure_line("x", 12.0, None).split()[-2:] == ["-", "-"]
    assert figure_line("x", 12.0, 4.0).split()[-1] == "3.0x"

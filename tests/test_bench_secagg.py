"""`fedbus bench secagg`: the plain and the secure federation of each cohort run back to back
in real processes, compared on time and bytes a round; its figures' structure, the secure
run's records, and the phases read off the server's message log (never the times)."""
from __future__ import annotations

import json

import pytest

from fedbus.bench.secagg import PHASES, dropped, round_marks, round_phases
from tests.helpers import fedbus, metrics


def test_the_message_log_splits_a_secure_round_into_its_phases():
    # the server's log of one secure round of two clients (times made up): tasks out, keys
    # in, peers out, shares in, masking out, masked inputs in, unmask out, reveals in
    rows = [{"round": 3, "dir": d, "kind": k, "t": t} for d, k, t in (
        ("out", "task", 10.1), ("out", "task", 10.2), ("in", "secagg", 10.3),
        ("in", "secagg", 10.4), ("out", "secagg", 10.5), ("out", "secagg", 10.6),
        ("in", "secagg", 11.0), ("in", "secagg", 11.5), ("out", "secagg", 11.6),
        ("out", "secagg", 11.7), ("in", "update", 12.0), ("in", "update", 12.2),
        ("out", "secagg", 12.3), ("out", "secagg", 12.4), ("in", "secagg", 12.5),
        ("in", "secagg", 12.8))]
    rows.insert(0, {"round": 2, "dir": "in", "kind": "secagg", "t": 9.0})  # another round
    record = {"round": 3, "time": 12.8, "round_s": 3.0}
    ph = round_phases(round_marks(rows, record))
    assert list(ph) == list(PHASES)
    assert ph == pytest.approx({"close prev": 0.3, "tasks": 0.1, "keys": 0.2, "peers": 0.2,
                                "shares": 0.9, "masking": 0.2, "inputs": 0.5, "unmask": 0.2,
                                "reveals": 0.4})
    assert sum(ph.values()) == pytest.approx(record["round_s"])
    # a plain round: its tasks, then the updates
    plain = round_phases(round_marks([r for r in rows if r["kind"] != "secagg"], record))
    assert list(plain) == ["close prev", "tasks", "inputs"]
    assert sum(plain.values()) == pytest.approx(record["round_s"])


def test_dropping_clients_are_spread_over_the_cohort():
    assert dropped(10, 2) == [0, 5]
    assert dropped(1000, 4) == [0, 250, 500, 750]


def test_too_many_dropouts_are_refused_before_anything_runs(tmp_path):
    out = fedbus("bench", "secagg", "--clients", "4,10", "--dropout-clients", "3",
                 "--out", str(tmp_path), check=False)
    assert out.returncode == 2
    assert "--dropout-clients must lie in 0..2" in out.stderr
    assert not list(tmp_path.iterdir())


def test_plain_and_secure_runs_of_a_tiny_cohort_compare_time_and_bytes(tmp_path):
    out = fedbus("bench", "secagg", "--clients", "4", "--rounds", "2", "--nodes", "2",
                 "--json", "--out", str(tmp_path), timeout=300)
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
    # the table: one row of 4 clients, the target named, the phases below
    assert "plain s/rd" in text and "secure s/rd" in text and "secure B/rd" in text
    assert "target at 100 clients: <= 2x time, <= 1.5x bytes" in text
    assert "failed:" not in text
    # the plain run travels as the secure one must, one message a client (--plain-batch)
    assert "plain runs' bus.batch off" in text
    plain_cfg = json.loads((tmp_path / "secagg-4-plain" / "config.json").read_text())
    assert plain_cfg["bus"]["batch"] == "off"
    (row,) = figures["rows"]
    assert (row["clients"], row["rounds"], row["nodes"]) == (4, 2, 2)
    plain, secure = row["plain"], row["secure"]
    assert plain["rounds_completed"] == secure["rounds_completed"] == 2
    assert plain["updates_min"] == secure["updates_min"] == 4
    # every secure round summed all four clients' masked inputs, none failed
    sa = secure["secagg"]
    assert sa["failed"] == [] and sa["missing"] == [] and sa["survivors_min"] == 4
    assert len(sa["records"]) == 2
    for rec in sa["records"]:
        assert rec["survivors"] == rec["keys"] == 4 and rec["dropped"] == 0
        assert "failed" not in rec and rec["reveal_s"] >= 0
        assert rec["bytes_up"] > 0 and rec["bytes_down"] > 0
    assert (sa["t"], sa["neighbours"]) == (3, 3)  # every other client of a small cohort
    assert sa["ring_bits"] > 32 and sa["quant_bound"] > 0
    # the run directories themselves say the same
    secure_records = metrics(tmp_path / "secagg-4-secure")
    assert [r["secagg"]["survivors"] for r in secure_records] == [4, 4]
    assert not any("failed" in r["secagg"] for r in secure_records)
    assert not any("secagg" in r for r in metrics(tmp_path / "secagg-4-plain"))
    # bytes: masked inputs (ring_bits / 8 bytes an element, not 4) plus the steps both ways
    assert plain["secagg_bytes_up_per_round"] == plain["secagg_bytes_down_per_round"] == 0
    assert secure["updates_bytes_per_round"] > plain["updates_bytes_per_round"]
    assert secure["secagg_bytes_up_per_round"] > 0
    assert secure["bytes_per_round"] > plain["bytes_per_round"]
    assert secure["bytes_per_round"] == pytest.approx(sum(secure[k] for k in (
        "updates_bytes_per_round", "tasks_bytes_per_round", "secagg_bytes_up_per_round",
        "secagg_bytes_down_per_round")))
    assert row["bytes_ratio"] == pytest.approx(
        secure["bytes_per_round"] / plain["bytes_per_round"])
    assert row["bytes_ratio"] > 1
    # phases from the message log: the secure round went through every step, the plain
    # one through its tasks and updates only
    assert all(secure["phases_s"][p] is not None for p in PHASES)
    assert [p for p in PHASES if plain["phases_s"][p] is not None] == \
        ["close prev", "tasks", "inputs"]
    assert secure["after_close_s"] is not None

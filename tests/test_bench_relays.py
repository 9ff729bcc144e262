"""`fedbus bench rounds --relays`: the flat federation and the same one through real
`fedbus relay` processes in one invocation, compared on the server's side."""
from __future__ import annotations

import json

import psutil

from fedbus.bench.rounds import relay_nodes
from tests.helpers import fedbus, metrics, wait_until

# noop's "prototypes" payload: a (10, 512) float32 state a client; a merged update carries
# it summed in float64 (ArraySums), twice the bytes, plus one member entry per client
STATE = 10 * 512


def test_nodes_split_among_relays_in_order():
    assert relay_nodes(4, 4) == [0, 1, 2, 3]
    assert relay_nodes(4, 2) == [0, 0, 1, 1]
    assert relay_nodes(5, 2) == [0, 0, 0, 1, 1]
    assert relay_nodes(3, 1) == [0, 0, 0]


def test_more_relays_than_nodes_is_refused(tmp_path):
    out = fedbus("bench", "rounds", "--clients", "20", "--nodes", "2", "--relays", "3",
                 "--out", str(tmp_path), check=False)
    assert out.returncode == 2
    assert "--relays must lie in 0..2" in out.stderr
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_the_relays_run_sends_the_server_one_merged_update_per_relay(tmp_path):
    out = fedbus("bench", "rounds", "--clients", "20", "--nodes", "2", "--relays", "2",
                 "--rounds", "2", "--no-floor", "--json", "--out", str(tmp_path), timeout=600)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    # the flat run's own figures stay at the top level
    assert figures["rounds_completed"] == 2 and figures["sampled"] == 20
    assert figures["bytes_up"] > 2 * 20 * STATE * 4
    tree, flat = figures["relays"], figures["relays"]["flat"]
    assert tree["relays"] == 2 and tree["nodes_per_relay"] == [1, 1]
    assert tree["rounds_completed"] == flat["rounds_completed"] == 2
    assert flat["bytes_up"] == figures["bytes_up"]
    for t, f in zip(tree["per_round"], flat["per_round"], strict=True):
        assert t["round"] == f["round"]
        assert t["updates"] == f["updates"] == 20  # every client took part
        assert (f["merged"], f["messages_up"]) == (0, 20)
        assert (t["merged"], t["messages_up"]) == (2, 2)  # one update per relay
        # two float64 sums of 10 clients each against twenty float32 states
        assert 2 * STATE * 8 < t["bytes_up"] < f["bytes_up"]
        assert f["bytes_up"] > 20 * STATE * 4
    assert tree["ratio"]["messages_up_per_round"] == 0.1
    assert tree["ratio"]["bytes_up_per_round"] == \
        tree["bytes_up_per_round"] / flat["bytes_up_per_round"] < 0.25
    # the server counted every client's update, merged or not
    runs = {p.name: p for p in tmp_path.iterdir() if p.is_dir()}
    assert sorted(runs) == ["rounds-20-prototypes", "rounds-20-prototypes-relays2"]
    for run in runs.values():
        assert metrics(run)[-1]["agg"]["updates_seen"] == 2 * 20
    # real processes: two relays, each with its site broker beside the server's broker
    assert len(tree["peak_rss_by_role"]["relay"]) == 2
    assert len(tree["peak_rss_by_role"]["broker"]) == 3
    assert "relay" not in flat["peak_rss_by_role"]
    # and none of them outlives the benchmark (a site broker stops on its relay's death)
    wait_until(lambda: not _running_in(tmp_path), 15, "the benchmark's processes to stop")


def _running_in(folder) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if str(folder) in " ".join(p.info["cmdline"] or ()) and \
                p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
    return out

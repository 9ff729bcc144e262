"""`--metrics-port` on broker, server and relay: a live federation (server site, one relay
with two nodes below it) is scraped over HTTP and each page parsed with prometheus-client's
own parser. The scrape happens while the nodes are stopped (SIGSTOP) after round 2's
record, so the run is held where it is (no deadline; the broker does not purge a stopped
node for 1,000 heartbeats) and two scrapes read the same state, on any machine."""
from __future__ import annotations

import signal
import urllib.request

import pytest
from helpers import SMALL, Processes, free_port, merged, metrics, wait_until, write_config

parser = pytest.importorskip("prometheus_client.parser",
                             reason="prometheus-client (the metrics extra) is not installed")

SLOW_PURGE = ("--heartbeat-s", "0.3", "--liveness", "1000")


def scrape(port: int) -> dict[str, dict]:
    """name -> {labels tuple: value} for every sample of the page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, dict] = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(page: dict, name: str, **labels) -> float:
    return page[name][tuple(sorted(labels.items()))]


def test_broker_server_and_relay_serve_metrics_a_parser_reads(tmp_path):
    sections = merged(SMALL, federation={"clients": 4, "rounds": 200, "eval_every": 1000},
                      algorithm={"name": "fedavg"}, bus={"liveness": 1000})
    cfg = write_config(tmp_path / "cfg.toml", sections)
    run = tmp_path / "run"
    ports = {name: free_port() for name in ("broker", "server", "relay")}
    broker, site = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    procs = Processes(tmp_path)
    try:
        procs.start("broker", "broker", "--bind", broker, *SLOW_PURGE,
                    "--metrics-port", str(ports["broker"]))
        procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run),
                    "--metrics-port", str(ports["server"]))
        procs.start("relay", "relay", "--upstream", broker, "--bind", site, "--name",
                    "relay-a", *SLOW_PURGE, "--metrics-port", str(ports["relay"]))
        for i, ids in enumerate(("0-1", "2-3")):
            procs.start(f"node-{i}", "node", "--broker", site, "--clients", ids, "--name",
                        f"n{i}", *SLOW_PURGE)
        wait_until(lambda: (run / "metrics.jsonl").exists() and len(metrics(run)) >= 2, 300,
                   "round 2's record", interval=0.05)
        for i in range(2):
            procs.procs[f"node-{i}"].send_signal(signal.SIGSTOP)
        first = {name: scrape(port) for name, port in ports.items()}
        second = {name: scrape(port) for name, port in ports.items()}
    finally:
        procs.close()  # (SIGKILL: the stopped nodes too)
    records = [r for r in metrics(run) if "participants" in r]
    server = first["server"]
    done = one(server, "fedbus_rounds_completed")
    assert done == len(records) >= 2 and one(second["server"], "fedbus_rounds_completed") == done
    assert one(server, "fedbus_rounds_planned") == 200
    assert one(server, "fedbus_clients_live") == 4
    assert one(server, "fedbus_clients_sampled") == 4  # the round in progress, held
    assert one(server, "fedbus_updates_accepted_total") == \
        sum(len(r["participants"]) for r in records)
    assert one(server, "fedbus_bytes_up_total") == sum(r["bytes_up"] for r in records) > 0
    assert one(server, "fedbus_round_duration_seconds_count") == done
    buckets = sorted((float(dict(k)["le"]), v) for k, v in
                     server["fedbus_round_duration_seconds_bucket"].items())
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == done
    assert "fedbus_task_failures_total" not in server  # no failure: the family is empty

    page = first["broker"]
    assert one(page, "fedbus_broker_nodes", role="server") == 1
    assert one(page, "fedbus_broker_nodes", role="client") == 1  # the relay, for its site
    assert one(page, "fedbus_broker_clients") == 4
    assert one(page, "fedbus_broker_messages_routed_total") > 0
    assert one(page, "fedbus_broker_bytes_routed_total") > 0

    page = first["relay"]
    assert one(page, "fedbus_relay_nodes") == 2 and one(page, "fedbus_relay_clients") == 4
    merged_ = sum(r.get("merged", 0) for r in records)
    assert one(page, "fedbus_relay_merged_sent_total") == merged_ >= 2


def test_a_taken_port_or_a_bad_one_is_one_line(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "fedbus.launch", "broker", "--bind",
                              f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and f"--metrics-port {port}" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "server", "--broker",
                          "tcp://127.0.0.1:1", "--metrics-port", "0", "--out",
                          str(tmp_path / "r")], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 2 and "must lie in 1..65535" in out.stderr, out.stderr

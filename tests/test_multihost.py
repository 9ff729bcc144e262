"""Nodes on separate hosts, for real: Linux network namespaces joined by a bridge (tests/netns.py),
every process started with the CLI a user types on its own machine, inside its host's
namespace, with CurveZMQ keys made by `fedbus keygen` on each host and exchanged as
SECURITY.md says:

    broker host:  fedbus broker --bind tcp://0.0.0.0:5555 --keys-dir keys
    server host:  fedbus server --broker tcp://10.77.0.2:5555 --keys-dir keys CONFIG --out RUN
    node hosts:   fedbus node --broker tcp://10.77.0.2:5555 --keys-dir keys --key nI --clients A-B

Scenarios:

1. 50 ms +- 10 ms delay and 1 % loss on every link: the run completes with the accuracy, and
   the global prototypes, of the same processes on loopback (bit for bit: every client
   answers every round, the server aggregates in client order, so arrival times change
   nothing);
2. a node host cut off (link down) for 20 s mid-round: its clients fail that round ("dead":
   the broker purges the silent node), the federation goes on without them, the node
   reconnects, registers again and its clients take part in a later round;
3. the broker host restarted (broker killed mid-round, the same command started again): the
   server and nodes reconnect and the run completes, every client in the last round;
4. a 1 Mbit/s link to one node: its FedAvg updates arrive after the round's deadline and are
   folded into a later aggregation with weight 1/sqrt(1 + staleness).

Each test prints its figures (round times, recovery times, rounds affected, the impairer
that ran) as one JSON line, visible with -s, and writes them to
$FEDBUS_MULTIHOST_REPORT/<scenario>.json when that variable names a folder. They are
skipped, with the reason, where namespaces cannot be built (not root, no iproute2).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import netns
import numpy as np
import pytest
from helpers import write_config
from netns import HostProcess, Impairment, Network

from fedbus.node.server import read_checkpoint

_why_not = netns.unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_why_not is not None, reason=f"multi-host: {_why_not}")]

PORT = 5555
_script = Path(sys.executable).with_name("fedbus")
# the console script a user types; the module where the venv has none (an odd install)
FEDBUS = [str(_script)] if _script.exists() else [sys.executable, "-m", "fedbus.launch"]
# generous: 2 shared cores, several processes importing torch at once
RUN_TIMEOUT = 240.0

# Small real federations on scikit-learn's digits. Every node trains on one thread, so a
# node's arithmetic is the same wherever it runs.
BASE = {
    "federation": {"clients": 6, "rounds": 4, "seed": 3, "start_timeout_s": 300.0},
    "data": {"dataset": "digits", "partition": "nway-kshot", "ways": 3, "ways_std": 1.0,
             "shots": 30, "shots_std": 3.0},
    "model": {"arch": "cnn"},
    "algorithm": {"name": "fedproto"},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    "launch": {"threads": 1},
}

# Tasks that last a few seconds on any machine, so that a link can be cut or the broker
# killed mid-round: every client a simulated device 50x slower, whose time budget stops it
# at BUDGET_S (virtual) seconds, its update held back by its node until then.
BUDGET_S = 2.0
SLOW_TASKS = {"train": {"budget_s": BUDGET_S},
              "system": {"slow_clients": list(range(6)), "slow_factor": 50.0}}
# Rounds of exactly DEADLINE_S seconds on any machine: client 0 is a straggler that never
# answers in time (a device a million times slower), so each round closes at its deadline
# with the other clients' updates; a busy straggler is left out of evaluations.
DEADLINE_S = 2.0
PACED_ROUNDS = {"federation": {"deadline_s": DEADLINE_S},
                "system": {"slow_clients": [0], "slow_factor": 1e6}}


def sections(*changes: dict) -> dict:
    out = {k: dict(v) for k, v in BASE.items()}
    for change in changes:
        for section, table in change.items():
            out.setdefault(section, {}).update(table)
    return out


def report(scenario: str, figures: dict) -> None:
    """Print the scenario's figures; also write them to $FEDBUS_MULTIHOST_REPORT/."""
    figures = {"scenario": scenario, "load_average": list(os.getloadavg()), **figures}
    text = json.dumps(figures, sort_keys=True)
    print(f"\nmultihost {scenario}: {text}")
    folder = os.environ.get("FEDBUS_MULTIHOST_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{scenario}.json").write_text(json.dumps(figures, indent=1,
                                                                   sort_keys=True))


def read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return out


def stamp(rec: dict) -> float:
    """A log record's time (structlog's ISO timestamp) as time.time() seconds."""
    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()


class Federation:
    """One federation over a Network: a broker host, a server host and client-node hosts,
    each with its own keys folder, every process started there with the `fedbus` CLI."""

    def __init__(self, net: Network, workdir: Path, nodes: dict[str, str], *,
                 broker_host: str = "broker", server_host: str = "server"):
        self.net = net
        self.workdir = workdir
        self.nodes = nodes  # host (also the node's name and key) -> its client ids, "0-2"
        self.broker_host, self.server_host = broker_host, server_host
        self.run_dir = workdir / "run"
        self.keys = {h: workdir / "keys" / h for h in (broker_host, server_host, *nodes)}
        self.broker: HostProcess | None = None
        self.server: HostProcess | None = None
        self.node_procs: dict[str, HostProcess] = {}
        self.broker_starts = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.net.address(self.broker_host)}:{PORT}"

    def make_keys(self) -> None:
        """`fedbus keygen` on each host, then the public certificates exchanged: the broker
        gets every node's and the server's, each node and the server get the broker's."""
        def keygen(host: str, *args: str) -> None:
            subprocess.run([*FEDBUS, "keygen", *args, "--dir", str(self.keys[host])],
                           check=True, capture_output=True, timeout=120)

        keygen(self.broker_host, "broker")
        keygen(self.server_host, "server")
        for host, clients in self.nodes.items():
            keygen(host, host, "--clients", clients)
        broker_pub = self.keys[self.broker_host] / "broker.key"
        for host in (self.server_host, *self.nodes):
            name = "server" if host == self.server_host else host
            shutil.copy(self.keys[host] / f"{name}.key", self.keys[self.broker_host])
            shutil.copy(broker_pub, self.keys[host])

    def start_broker(self) -> HostProcess:
        self.broker_starts += 1
        self.broker = self.net.spawn(
            self.broker_host, f"broker-{self.broker_starts}",
            [*FEDBUS, "broker", "--bind", f"tcp://0.0.0.0:{PORT}",
             "--keys-dir", str(self.keys[self.broker_host]),
             "--log-file", str(self.workdir / "broker.jsonl")])
        return self.broker

    def start_server(self, config: Path) -> HostProcess:
        self.server = self.net.spawn(
            self.server_host, "server",
            [*FEDBUS, "server", "--broker", self.endpoint,
             "--keys-dir", str(self.keys[self.server_host]), str(config),
             "--out", str(self.run_dir)])
        return self.server

    def start_node(self, host: str) -> HostProcess:
        self.node_procs[host] = self.net.spawn(
            host, host,
            [*FEDBUS, "node", "--broker", self.endpoint, "--keys-dir", str(self.keys[host]),
             "--key", host, "--clients", self.nodes[host],
             "--log-file", str(self.workdir / f"{host}.jsonl")])
        return self.node_procs[host]

    def start(self, config: dict) -> None:
        self.make_keys()
        cfg = write_config(self.workdir / "federation.toml", config)
        self.start_broker()
        self.wait(lambda: self.broker_log("broker listening"), 120, "the broker to listen")
        self.start_server(cfg)
        for host in self.nodes:
            self.start_node(host)

    # --- reading what happened
    def broker_log(self, event: str | None = None, **match) -> list[dict]:
        return _select(read_jsonl(self.workdir / "broker.jsonl"), event, match)

    def server_log(self, event: str | None = None, **match) -> list[dict]:
        return _select(read_jsonl(self.run_dir / "logs" / "server.jsonl"), event, match)

    def node_log(self, host: str, event: str | None = None, **match) -> list[dict]:
        return _select(read_jsonl(self.workdir / f"{host}.jsonl"), event, match)

    def records(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def clients_of(self, host: str) -> set[int]:
        lo, _, hi = self.nodes[host].partition("-")
        return set(range(int(lo), int(hi or lo) + 1))

    def diagnose(self) -> str:
        procs = [p for p in (self.broker, self.server, *self.node_procs.values()) if p]
        return "\n".join(f"--- {p.name} (exit {p.returncode}):\n{p.log(2500)}" for p in procs)

    def wait(self, predicate, timeout: float, what: str):
        """Poll predicate until it returns something truthy; fail with every log on timeout
        or when the server died."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.server is not None and self.server.returncode not in (None, 0):
                raise AssertionError(f"the server died waiting for {what}\n{self.diagnose()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                                     f"{self.diagnose()}")
            time.sleep(0.1)

    def finish(self, timeout: float = RUN_TIMEOUT) -> dict:
        """Wait for the server to finish the run; its summary."""
        self.wait(lambda: not self.server.alive, timeout, "the run to finish")
        assert self.server.returncode == 0, self.diagnose()
        return json.loads((self.run_dir / "summary.json").read_text())


def _select(recs: list[dict], event: str | None, match: dict) -> list[dict]:
    if event is not None:
        recs = [r for r in recs if r.get("event") == event]
    return [r for r in recs if all(r.get(k) == v for k, v in match.items())]


def global_state(run_dir: Path) -> dict:
    return read_checkpoint(run_dir / "checkpoint.fbk")[1]["handler"]


def round_times(recs: list[dict]) -> dict:
    rounds = [r["round_s"] for r in recs]
    evals = [r.get("eval_s", 0.0) for r in recs]
    return {"round_s": [round(x, 3) for x in rounds], "round_s_mean": round(float(np.mean(rounds)), 3),
            "eval_s_mean": round(float(np.mean(evals)), 3)}


# --------------------------------------------------------------------------- scenario 1
def test_delay_and_loss_on_every_link_match_the_loopback_run(tmp_path):
    choice, why = netns.impairer_choice()
    if choice is None:
        pytest.skip(f"multi-host: no impairer: {why}")
    nodes = {"n0": "0-1", "n1": "2-3", "n2": "4-5"}
    hosts = ["broker", "server", *nodes]
    config = sections()
    impairment = Impairment(delay_ms=50.0, jitter_ms=10.0, loss=0.01, seed=1)
    results = {}
    for label, kw in (("loopback", {"loopback": True}), ("impaired", {"impairment": impairment})):
        work = tmp_path / label
        with Network(hosts, work / "net", **kw) as net:
            fed = Federation(net, work, nodes)
            started = time.monotonic()
            fed.start(config)
            summary = fed.finish()
            results[label] = {"fed": fed, "summary": summary, "records": fed.records(),
                              "wall_s": time.monotonic() - started, "impairer": net.impairer}
        if label == "impaired":
            results[label]["impairer_stats"] = net.impairer_stats
    plain, impaired = results["loopback"], results["impaired"]
    for res in (plain, impaired):
        assert res["summary"]["rounds_completed"] == 4
        assert [r["participants"] for r in res["records"]] == [list(range(6))] * 4
        assert all(r["failed"] == 0 for r in res["records"])
    keys = ("acc_mean", "acc_std", "proto_acc_mean", "per_client")
    assert [{k: r[k] for k in keys} for r in impaired["records"]] == \
        [{k: r[k] for k in keys} for r in plain["records"]]
    a, b = global_state(plain["fed"].run_dir), global_state(impaired["fed"].run_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key
    stats = impaired.get("impairer_stats") or {}
    if stats:  # the userspace impairer counts what it did: the links were impaired
        assert sum(link["lost"] for link in stats.values()) > 0
        assert sum(link["forwarded"] for link in stats.values()) > 0
    report("delay_loss", {
        "impairer": impaired["impairer"],
        "impairment": {"delay_ms": 50, "jitter_ms": 10, "loss": 0.01, "links": len(hosts)},
        "impairer_frames": stats,
        "final_acc_mean": impaired["summary"]["final"]["acc_mean"],
        "identical_to_loopback": True,
        "loopback": {**round_times(plain["records"]), "wall_s": round(plain["wall_s"], 1)},
        "impaired": {**round_times(impaired["records"]), "wall_s": round(impaired["wall_s"], 1)},
    })


# --------------------------------------------------------------------------- scenario 2
CUT_S = 20.0


def test_node_host_cut_off_for_20_s_rejoins(tmp_path):
    nodes = {"n0": "0-2", "n1": "3-5"}
    # Rounds of DEADLINE_S: 30 of them last >= 60 s, more than the cut and the node's
    # reconnection (its backoff: at most ~11 s after the link is back, then its config) with
    # rounds to spare under load, so the run ends with rounds n1's clients take part in again.
    rounds = 30
    config = sections(PACED_ROUNDS, {"federation": {"rounds": rounds}})
    with Network(["broker", "server", *nodes], tmp_path / "net") as net:
        fed = Federation(net, tmp_path, nodes)
        fed.start(config)
        fed.wait(lambda: fed.server_log("round_start", round=1), 180, "round 1 to start")
        t_cut = net.cut("n1")
        time.sleep(CUT_S)
        t_heal = net.heal("n1")
        summary = fed.finish()
        recs = fed.records()
        server_ready = [stamp(r) for r in fed.server_log("node_ready", node="n1")]
        registered = [stamp(r) for r in fed.broker_log("node registered", node="n1")]
        purged = [stamp(r) for r in fed.broker_log("node purged", node="n1")]
        lost = [stamp(r) for r in fed.node_log("n1", "broker lost")]
        starts = {r["round"]: stamp(r) for r in fed.server_log("round_start")}
        rejected = fed.server_log("rejected")

    lost_clients = fed.clients_of("n1")
    by_round = {r["round"]: r for r in recs}
    assert summary["rounds_completed"] == rounds and sorted(by_round) == list(range(rounds))
    cut_round = max(r for r, t in starts.items() if t <= t_cut)  # under way at the cut
    # n1's clients that had not answered the round under way when the link went down fail
    # it by the engine's rules ("late" at its deadline, "dead" when the broker purges the
    # node), and so do those of the next round if it samples them before the purge; a round
    # that starts after the purge does not sample them. Under load the server may start the
    # next round only after the purge, with every update of the round under way beating the
    # cut: then no round records a failure (CI saw it once), so the fates, not a failure,
    # are what is checked, in every round until they return (below)
    # the broker purged the silent node; the node noticed the silence and registered again
    assert any(t_cut < t < t_heal for t in purged), (t_cut, purged)
    assert any(t_cut < t < t_heal for t in lost), (t_cut, lost)
    back = [t for t in registered if t > t_heal]
    ready = [t for t in server_ready if t > t_heal]
    assert back and ready, (t_heal, registered, server_ready)
    # a later round has all of n1's clients again
    rejoined = [r for r in sorted(by_round) if r > cut_round and starts[r] > ready[0]
                and lost_clients <= set(by_round[r]["participants"])]
    assert rejoined, [(r["round"], r["participants"]) for r in recs]
    # between the cut and their return, none of n1's clients took part in a round
    affected = [r for r in sorted(by_round) if r < rejoined[0]
                and not lost_clients <= set(by_round[r]["participants"])]
    assert affected[0] in (cut_round, cut_round + 1)
    seen = fates(affected, by_round, lost_clients)
    assert all(set(fate.split("/")) - {"took part"} and set(fate.split("/")) <= {
        "took part", "late", "dead", "not sampled"} for fate in seen), seen
    assert not any(lost_clients & set(by_round[r]["participants"])
                   for r in range(cut_round + 1, rejoined[0]))
    report("link_cut", {
        "cut_s": CUT_S, "cut_in_round": cut_round,
        "node_saw_broker_lost_after_s": round(min(t for t in lost if t > t_cut) - t_cut, 2),
        "broker_purged_node_after_s": round(min(t for t in purged if t > t_cut) - t_cut, 2),
        "recovery_link_up_to_registered_s": round(back[0] - t_heal, 2),
        "recovery_link_up_to_node_ready_s": round(ready[0] - t_heal, 2),
        "recovery_link_up_to_round_with_its_clients_s": round(starts[rejoined[0]] - t_heal, 2),
        "rounds_affected": affected,
        # the affected rounds by what became of n1's clients in them: a failure ("late",
        # "dead"), or "not sampled" (not live: the broker had purged the node)
        "rounds_affected_by_fate": fates(affected, by_round, lost_clients),
        "first_round_back": rejoined[0],
        "updates_rejected_after_rejoin": len(rejected),
        "rounds": len(recs), "round_s_mean": round(float(np.mean([r["round_s"] for r in recs])), 3),
    })


def fates(rounds: list[int], by_round: dict[int, dict], clients: set[int]) -> dict:
    """{what became of `clients` in a round: [rounds]}, e.g. {"dead": [2], "not sampled":
    [3, 4]}; a round where they fared differently is listed under each fate, joined by /."""
    out: dict[str, list[int]] = {}
    for r in rounds:
        rec = by_round[r]
        fate = {"took part" if c in rec["participants"]
                else rec["failures"].get(str(c), "not sampled") for c in clients}
        out.setdefault("/".join(sorted(fate)), []).append(r)
    return out


# --------------------------------------------------------------------------- scenario 3
BROKER_DOWN_S = 10.0


def test_broker_host_restarted_mid_run(tmp_path):
    nodes = {"n0": "0-2", "n1": "3-5"}
    config = sections(SLOW_TASKS, {"federation": {"rounds": 6}})
    with Network(["broker", "server", *nodes], tmp_path / "net") as net:
        fed = Federation(net, tmp_path, nodes)
        fed.start(config)
        kill_round = 2
        fed.wait(lambda: fed.server_log("round_start", round=kill_round), 180,
                 f"round {kill_round} to start")
        fed.broker.kill(signal.SIGKILL)
        t_kill = time.time()
        time.sleep(BROKER_DOWN_S)  # the host reboots; the others notice the silence
        fed.start_broker()
        t_up = stamp(fed.wait(lambda: fed.broker_log("broker listening")[1:], 120,
                              "the restarted broker to listen")[0])
        names = {"server", *nodes}
        fed.wait(lambda: names <= {r["node"] for r in fed.broker_log("node registered")
                                   if stamp(r) >= t_up}, 120, "every node to register again")
        summary = fed.finish()
        recs = fed.records()
        again = {}
        for r in fed.broker_log("node registered"):
            if stamp(r) >= t_up:
                again.setdefault(r["node"], stamp(r))
        resent = [r for name in nodes for r in fed.node_log(name, "resent unacknowledged messages")]
        lost = {name: [stamp(r) for r in fed.node_log(name, "broker lost")] for name in nodes}
        lost["server"] = [stamp(r) for r in fed.server_log("broker lost")]

    by_round = {r["round"]: r for r in recs}
    assert summary["rounds_completed"] == 6 and sorted(by_round) == list(range(6))
    assert by_round[5]["participants"] == list(range(6))
    after = [r for r in recs if r["time"] > t_up]
    # everyone took the broker for lost while it was down, and came back
    assert all(any(t_kill < t < t_up for t in times) for times in lost.values()), lost
    report("broker_restart", {
        "killed_in_round": kill_round, "broker_down_s": round(t_up - t_kill, 2),
        "broker_lost_noticed_after_s": {n: round(min(t for t in times if t > t_kill) - t_kill, 2)
                                        for n, times in lost.items()},
        "recovery_broker_up_to_registered_s": {n: round(t - t_up, 2) for n, t in again.items()},
        "recovery_broker_up_to_next_round_closed_s": round(after[0]["time"] - t_up, 2),
        "killed_round": {k: by_round[kill_round][k] for k in ("updates", "failures", "round_s")},
        "messages_resent_by_nodes": sum(r.get("count", 0) for r in resent),
        "rounds_with_failures": [r["round"] for r in recs if r["failed"]],
    })


# --------------------------------------------------------------------------- scenario 4
def test_one_node_on_a_1_mbit_link_is_folded_with_staleness_weights(tmp_path):
    nodes = {"n0": "0-4", "n1": "5"}
    # FedAvg ships the whole model both ways: cnn4's 188,810 float32 weights, 755 kB a
    # message, take >= 6 s each way at 1 Mbit/s. So an update from n1 needs >= 12 s (a task
    # down, an update up), past the 4 s deadline that n0's clients (fast link) make by
    # seconds, and is folded into a later aggregation; the 6 rounds last >= 24 s. Each
    # message is also longer on the wire than the liveness limit (1 s x 3): n1 must stay
    # registered all the same, the data arriving on its connection showing it alive.
    deadline_s = 4.0
    config = sections({"algorithm": {"name": "fedavg"}, "model": {"arch": "cnn4"},
                       "federation": {"rounds": 6, "deadline_s": deadline_s, "late": "fold"}})
    with Network(["broker", "server", *nodes], tmp_path / "net") as net:
        net.rate_limit("n1", "1mbit")
        fed = Federation(net, tmp_path, nodes)
        fed.start(config)
        summary = fed.finish()
        recs = fed.records()
        purged = fed.broker_log("node purged")
        lost = fed.node_log("n1", "broker lost")
        in_transit = {"broker": len(fed.broker_log("node silent but its data still arriving: a "
                                                   "long message in transit", node="n1")),
                      "n1": len([r for r in fed.node_log("n1")
                                 if "long message in transit" in r.get("event", "")])}
        resent = {name: sum(r.get("count", 0) for r in log
                            if r.get("event", "").startswith("resent"))
                  for name, log in (("server", fed.server_log()), ("n1", fed.node_log("n1")))}

    slow = fed.clients_of("n1")
    assert summary["rounds_completed"] == 6
    # n1 was never taken for dead, nor did it take the broker for lost
    assert not purged and not lost, (purged, lost)
    assert in_transit["broker"] > 0 and in_transit["n1"] > 0, in_transit
    stale = [entry for r in recs for entry in r["stale"]]
    for r in recs:
        assert r["folded"] == len(r["stale"])
        for client, version, staleness, weight in r["stale"]:
            assert staleness == r["round"] - version >= 1
            assert weight == pytest.approx(1 / math.sqrt(1 + staleness))
    assert {client for client, *_ in stale} & slow, \
        [(r["round"], r["participants"], r["failures"]) for r in recs]
    # n1's updates never make their own round's deadline
    assert not any(slow & set(r["participants"]) - {c for c, *_ in r["stale"]} for r in recs)
    fresh = [r["bytes_up"] / (r["updates"] - r["folded"]) for r in recs
             if r["updates"] > r["folded"]]
    report("rate_limit", {
        "rate": "1mbit", "model": "cnn4 (fedavg)", "slow_node_clients": sorted(slow),
        "deadline_s": deadline_s, "update_bytes": round(float(np.mean(fresh))),
        "seconds_per_update_at_1_mbit": round(float(np.mean(fresh)) * 8 / 1e6, 2),
        "folded_per_round": {r["round"]: r["folded"] for r in recs},
        "stale": stale, "late_folded_total": summary["late_folded"],
        "late_dropped_total": summary["late_dropped"],
        "failures": {r["round"]: r["failures"] for r in recs},
        "long_message_in_transit_notes": in_transit, "messages_resent": resent,
        **round_times(recs),
    })

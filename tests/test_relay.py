"""Regional relays (`fedbus relay`): a federation through two relays computes what the
flat federation computes, with one update per relay per round into the server."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fedbus.algorithms.core.handlers import Work
from fedbus.algorithms.core.merge import DeltaSums, PrototypeSums
from fedbus.algorithms.core.protos import aggregate_prototypes
from fedbus.broker import wire
from fedbus.broker.wire import Message
from fedbus.node.server import read_checkpoint
from fedbus.node.config import build_config
from fedbus.node.engine import client_address
from fedbus.node.relay import Relay
from fedbus.node.server import build_engine, dispatch
from tests.helpers import (SMALL, Processes, fedbus, free_port, merged, metrics, wait_until,
                           write_config)

# 10 missed 0.3 s heartbeats: no live process is taken for dead on a loaded machine (4, as
# SMALL has, is a stall of 1.2 s), while a killed one still is, in 3 s
FAST = ("--heartbeat-s", "0.3", "--liveness", "10")
# Six clients, all sampled every round, one torch thread everywhere: on the CPU every
# client trains exactly as in the flat run, whichever node hosts it.
EQUIV = merged(SMALL, federation={"clients": 6, "rounds": 3, "deadline_s": 0.0,
                                  "hard_deadline_s": 120.0},
               launch={"threads": 1}, bus={"liveness": 10})


def _final_state(run) -> dict:
    return read_checkpoint(run / "checkpoint.fbk")[1]["handler"]


def _federation(tmp_path, sections, *, relays: bool, name: str,
                relay_args: tuple = ((), ()), clients: tuple = ("0-2", "3-5")) -> tuple:
    """Broker + server, and two nodes hosting `clients` (0-2 and 3-5): directly, or each
    node below its own relay (its own site broker), relay i started with relay_args[i].
    Returns (run dir, Processes)."""
    d = tmp_path / name
    d.mkdir()
    procs = Processes(d)
    broker = f"tcp://127.0.0.1:{free_port()}"
    cfg = write_config(d / "cfg.toml", sections)
    run = d / "run"
    procs.start("broker", "broker", "--bind", broker, *FAST)
    procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
    for i, hosted in enumerate(clients):
        target = broker
        if relays:
            site = f"tcp://127.0.0.1:{free_port()}"
            procs.start(f"relay-{i}", "relay", "--upstream", broker, "--bind", site,
                        "--name", f"relay-{i}", *FAST, *relay_args[i])
            target = site
        procs.start(f"node-{i}", "node", "--broker", target, "--clients", hosted,
                    "--name", f"n{i}", *FAST)
    return run, procs


def _finish(run, procs, what: str) -> None:
    wait_until(lambda: procs.procs["server"].poll() is not None, 240, f"the {what} run")
    assert procs.procs["server"].returncode == 0, procs.log("server")


def _arrays(state: dict) -> dict:
    """The global state's arrays by path: FedProto's prototypes, FedAvg's weights, MP-FedCL's
    weights and prototype pool."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in _arrays(value).items()})
        elif isinstance(value, np.ndarray):
            out[key] = value
    return out


def run_to_end(tmp_path, sections, *, relays: bool, name: str):
    """A federation (flat, or through two relays) run to its end: its run directory."""
    run, procs = _federation(tmp_path, sections, relays=relays, name=name)
    try:
        _finish(run, procs, name)
    finally:
        procs.close()
    return run


def assert_relays_give_the_flat_run(runs: dict, flat: dict, tree: dict, algorithm: str):
    """The relays' run ("relays") equals the flat one ("flat"): every array of the global
    state, and each of the 3 rounds' participants and accuracy, with one merged update per
    relay (2 messages into the server a round instead of 6). Returns the (flat, relays)
    record pairs for further checks."""
    for key in flat:
        np.testing.assert_allclose(np.asarray(tree[key], dtype=np.float64),
                                   np.asarray(flat[key], dtype=np.float64), rtol=0, atol=1e-6,
                                   err_msg=f"{algorithm} {key}")
    flat_recs, tree_recs = metrics(runs["flat"]), metrics(runs["relays"])
    assert len(tree_recs) == len(flat_recs) == 3
    for f, t in zip(flat_recs, tree_recs):
        assert t["participants"] == f["participants"] == list(range(6))
        assert t["merged"] == 2 and f["merged"] == 0
        assert (t["messages_up"], f["messages_up"]) == (2, 6)
        assert t["acc_mean"] == pytest.approx(f["acc_mean"], abs=1e-6)
    return list(zip(flat_recs, tree_recs))


@pytest.mark.parametrize("algorithm", ["fedproto", "fedavg", "mpfedcl"])
def test_two_relays_give_the_flat_federations_global_state(tmp_path, algorithm):
    sections = merged(EQUIV, algorithm={"name": algorithm})
    runs = {name: run_to_end(tmp_path, sections, relays=relays, name=name)
            for name, relays in (("flat", False), ("relays", True))}
    flat, tree = (_arrays(_final_state(runs[k])) for k in ("flat", "relays"))
    want = {"fedproto": {"protos"}, "fedavg": {"weights/"}, "mpfedcl": {"weights/", "pool"}}
    assert all(any(k.startswith(w) for k in flat) for w in want[algorithm]), sorted(flat)
    assert sorted(flat) == sorted(tree)
    for f, t in assert_relays_give_the_flat_run(runs, flat, tree, algorithm):
        assert 0 < t["bytes_up"] < f["bytes_up"]
    summary = json.loads((runs["relays"] / "summary.json").read_text())
    assert summary["rounds_completed"] == 3


def test_a_late_update_through_a_relay_is_folded_in_the_next_round(tmp_path):
    """Client 2 is a straggler by events: its node (below relay-0, with client 1) holds its
    update until the next round's task (system.hold_clients), and the server's rounds close
    on a quorum of the other five (c0 and c3-c5 merged by relay-1). Relay-0 forwards
    its updates as they come (--no-merge: a merging relay would hold c1's until its
    deadline, as c2's never comes in time); c2's held update leaves its node before c1's
    answer to the next round, so, FIFO up the same path, it reaches the server before
    that round can close, which folds it with weight 1/sqrt(2). No deadline decides
    anything; the relay's deadline is tested event by event below, on its own clock."""
    sections = merged(EQUIV, federation={"rounds": 2, "quorum": 5, "late": "fold"},
                      algorithm={"name": "fedproto"}, system={"hold_clients": [2]})
    run, procs = _federation(tmp_path, sections, relays=True, name="slow",
                             clients=("1-2", "0,3-5"), relay_args=(("--no-merge",), ()))
    try:
        _finish(run, procs, "slow-client")
        wait_until(lambda: procs.procs["relay-0"].poll() is not None, 120, "relay-0 to stop")
        relay_log = procs.log("relay-0")
    finally:
        procs.close()
    recs = metrics(run)
    assert [r["failures"] for r in recs] == [{"2": "late"}] * 2
    assert [(r["merged"], r["messages_up"]) for r in recs] == [(1, 2)] * 2  # c1, relay-1
    assert [r["participants"] for r in recs] == [[0, 1, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert recs[1]["stale"] == [[2, 0, 1, pytest.approx(1 / np.sqrt(2))]]
    # c1's two updates and c2's first (its second was still held when the run ended)
    assert "merged_sent=0" in relay_log and "forwarded_updates=3" in relay_log, relay_log


def test_relays_under_curve_keys_made_by_keygen(tmp_path):
    """Two sites with their own keys: the server site's broker allow-lists the server and the
    two relays (each for the client ids below it); each site's folder holds its broker, the
    relay's site-server key and its node's key (PROTOCOL.md §10, docs/RELAYS.md)."""
    up, sites = tmp_path / "keys", [tmp_path / "site-0", tmp_path / "site-1"]
    fedbus_cli = Processes(tmp_path)
    gen = [("broker", up, ()), ("server", up, ()), ("relay-0", up, ("--clients", "0-2")),
           ("relay-1", up, ("--clients", "3-5"))]
    for i, site in enumerate(sites):
        gen += [("broker", site, ()), ("server", site, ()),
                (f"n{i}", site, ("--clients", ("0-2", "3-5")[i]))]
    for name, folder, extra in gen:
        fedbus("keygen", name, "--dir", str(folder), *extra)
    cfg = write_config(tmp_path / "cfg.toml", merged(EQUIV, algorithm={"name": "fedproto"},
                                                     federation={"rounds": 2}))
    run = tmp_path / "run"
    broker = f"tcp://127.0.0.1:{free_port()}"
    procs = fedbus_cli
    try:
        procs.start("broker", "broker", "--bind", broker, "--curve", "--keys-dir", str(up), *FAST)
        procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run),
                    "--keys-dir", str(up), "--key", "server")
        for i, site in enumerate(sites):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            procs.start(f"relay-{i}", "relay", "--upstream", broker, "--bind", endpoint,
                        "--keys-dir", str(up), "--key", f"relay-{i}",
                        "--site-keys-dir", str(site), *FAST)
            procs.start(f"node-{i}", "node", "--broker", endpoint, "--clients",
                        ("0-2", "3-5")[i], "--keys-dir", str(site), "--key", f"n{i}", *FAST)
        _finish(run, procs, "CURVE relay")
    finally:
        procs.close()
    recs = metrics(run)
    assert [r["merged"] for r in recs] == [2, 2]
    assert all(r["participants"] == list(range(6)) for r in recs)


def test_a_node_below_a_relay_that_dies_is_dropped_and_its_restart_rejoins(tmp_path):
    """Partial participation one level down: node n1 (below relay-1) is killed with a task
    open. The relay registers again without its clients, the server fails their open tasks
    as "dead" and closes the round on the others; a restarted n1 joins relay-1's site again
    and its clients come back."""
    # Events, not seconds, on any machine: n1 holds client 3's update (system.hold_clients),
    # and is killed once its log says so, so round 0 is open on n1 when it dies; no round
    # has a deadline (deadline_s = 0: every sampled client answers or fails; the relay's
    # share of the 120 s hard deadline is only a liveness guard), so round 0 can end only
    # by the death, which the site broker notices by n1's silence (FAST). The restarted n1 hosts
    # clients 4 and 5 (client 3, which holds its update, stays away, or every later round
    # would wait on the relay's deadline); min_clients = 5 makes round 1 wait for it.
    sections = merged(EQUIV, federation={"rounds": 4, "min_clients": 5, "deadline_s": 0.0,
                                         "eval_every": 100},
                      algorithm={"name": "fedproto"}, system={"hold_clients": [3]})
    run, procs = _federation(tmp_path, sections, relays=True, name="dies")
    try:
        wait_until(lambda: "event='update held'" in procs.log("node-1"), 120,
                   "n1 holding client 3's update of round 0")
        assert metrics(run) == [], "round 0 ended without client 3"
        procs.kill("node-1")
        wait_until(lambda: len(metrics(run)) >= 1, 120, "round 0 ended by n1's death")
        site = procs.log("relay-1")
        endpoint = site.split("downstream='", 1)[1].split("'", 1)[0]
        procs.start("node-1b", "node", "--broker", endpoint, "--clients", "4-5",
                    "--name", "n1", *FAST)
        _finish(run, procs, "node-restart")
        relay_log = procs.log("relay-1")
    finally:
        procs.close()
    recs = metrics(run)
    assert len(recs) == 4
    dead = recs[0]
    assert "3" in dead["failures"] and set(dead["failures"].values()) == {"dead"}, \
        dead["failures"]
    assert set(dead["failures"]) <= {"3", "4", "5"}, dead["failures"]
    assert {0, 1, 2} <= set(dead["participants"]) <= {0, 1, 2, 4, 5}, \
        "the round closed without n1's clients"
    assert all(r["failures"] == {} for r in recs[1:]), [r["failures"] for r in recs]
    assert all(r["participants"] == [0, 1, 2, 4, 5] and r["merged"] == 2
               for r in recs[1:]), "the restarted n1's clients came back"
    assert relay_log.count("node joined") >= 2 and "node left" in relay_log


def test_updates_whose_sum_would_exceed_the_frame_limit_go_up_alone(tmp_path):
    """ResNet-18-sized updates (the no-op's 45 MB of float32): their float64 sum, 89 MB,
    would exceed the bus's 64 MiB frame limit and be dropped by the broker, so the relay
    forwards each update as it is and says why."""
    sections = merged(EQUIV, federation={"clients": 2, "rounds": 2},
                      algorithm={"name": "noop", "payload": "resnet18"},
                      launch={"nodes": 1})
    d = tmp_path / "big"
    d.mkdir()
    procs = Processes(d)
    broker, site = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    cfg, run = write_config(d / "cfg.toml", sections), d / "run"
    try:
        procs.start("broker", "broker", "--bind", broker, *FAST)
        procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
        procs.start("relay-0", "relay", "--upstream", broker, "--bind", site,
                    "--name", "relay-0", *FAST)
        procs.start("node-0", "node", "--broker", site, "--clients", "0-1", "--name", "n0",
                    *FAST)
        _finish(run, procs, "large-update")
        relay_log = procs.log("relay-0")
    finally:
        procs.close()
    recs = metrics(run)
    assert [(r["merged"], r["messages_up"], r["participants"]) for r in recs] == \
        [(0, 2, [0, 1])] * 2
    assert "sum form exceeds the frame limit" in relay_log


# --- the server's side of merged updates, event by event (a real engine, no sockets) ---

WORK = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1}


def _engine(**federation):
    cfg = build_config({"federation": {"clients": 6, "rounds": 3, **federation},
                        "data": {"dataset": "digits", "partition": "iid"},
                        "model": {"arch": "mlp"}, "algorithm": {"name": "noop"}})
    engine = build_engine(cfg, "r")
    engine.on_join("relay", [client_address(c) for c in range(4)], 0.0)
    engine.on_join("n", [client_address(c) for c in range(4, 6)], 0.0)
    engine.on_configured("n", "r", 0.0)
    return engine, engine.on_configured("relay", "r", 0.0)


def _merged(tasks, *, src="relay", run="r"):
    state = sum(np.asarray(t.body["payload"]["state"], dtype=np.float64) for t in tasks)
    body = {"version": tasks[0].body["version"], "rule": "array-sums",
            "members": [[t.dst, t.body["task"], 1, WORK] for t in tasks],
            "payload": {"state": state, "mass": np.array([float(len(tasks))])}}
    return Message("merged", src, "server", body, run=run, round=tasks[0].round)


def _update(task, now=1.0):
    body = {"task": task.body["task"], "version": task.body["version"], "num_samples": 1,
            "work": WORK, "payload": {"state": np.asarray(task.body["payload"]["state"])}}
    return Message("update", task.dst, "server", body, run="r", round=task.round)


def test_a_round_takes_one_merged_update_for_the_relays_clients():
    engine, tasks = _engine()
    assert [t.body["node_tasks"] for t in tasks] == [4, 4, 4, 4, 2, 2]
    dispatch(engine, _merged(tasks[:4]), 1.0)
    assert engine.version == 0 and sorted(engine.round.updates) == [0, 1, 2, 3]
    for t in tasks[4:]:
        dispatch(engine, _update(t), 1.5)
    assert engine.version == 1
    rec = engine.records[-1] if engine.records else engine.evals[min(engine.evals)].record
    assert rec["participants"] == list(range(6)) and rec["merged"] == 1
    assert rec["agg"]["updates_seen"] == 6.0  # the handler counted the relay's members


def test_a_merged_update_for_clients_the_sender_does_not_host_is_refused():
    engine, tasks = _engine()
    # n hosts c4 and c5 only: it cannot answer c0's task, nor end it
    outs = dispatch(engine, _merged(tasks[:2], src="n"), 1.0)
    assert [o.kind for o in outs] == ["error"] and "not hosted by 'n'" in outs[0].body["reason"]
    assert not engine.round.updates and not engine.round.failures
    # a merged update of another run, or answering a task twice, is refused too; a refused
    # one from the relay ends its members' tasks so the round need not wait for them
    outs = dispatch(engine, _merged(tasks[:2], run="other"), 1.0)
    assert outs[0].kind == "error" and sorted(engine.round.failures) == [0, 1]
    outs = dispatch(engine, _merged(tasks[:2]), 1.0)
    assert outs[0].kind == "error" and "not outstanding" in outs[0].body["reason"]


def test_a_merged_update_that_misses_its_round_is_folded_with_its_staleness_weight():
    engine, tasks = _engine(deadline_s=5.0, min_updates=1, late="fold")
    for t in tasks[4:]:
        dispatch(engine, _update(t), 1.0)
    engine.on_tick(5.0)  # closes round 0 without the relay's clients
    assert engine.version == 1 and engine.totals["late_folded"] == 0
    dispatch(engine, _merged(tasks[:4]), 6.0)
    # set aside now; its four members count as folded when the next aggregation folds it
    assert engine.totals["late_folded"] == 0 and len(engine.late) == 1
    for now in (20.0, 700.0):  # round 0's evaluation ends; round 1 closes at its hard deadline
        engine.on_tick(now)
    assert engine.version == 2 and engine.totals["late_folded"] == 4 and not engine.late


def test_a_node_that_registers_again_with_fewer_clients_no_longer_hosts_the_rest():
    engine, _ = _engine()
    engine.on_join("relay", [client_address(c) for c in (0, 1)], 2.0)
    assert engine.live == {0, 1, 4, 5}
    assert engine.round.failures == {2: "dead", 3: "dead"}
    assert 2 not in engine.host and engine.host[0] == "relay"


class _Outbox:
    """A Peer's sending side, keeping what the relay sends: the relay's round is the subject
    here, the sockets are tested above."""

    def __init__(self):
        self.sent: list[Message] = []
        self.addresses: tuple = ()
        self.run = ""

    def send(self, kind, dst, body, *, src=None, round=-1, encoded=None):
        frames = wire.encode(Message(kind, src or "relay-0", dst, body, run="r", round=round))
        self.sent.append(wire.decode(frames))  # as the wire carries it

    def set_addresses(self, addresses):
        self.addresses = tuple(addresses)

    def take(self) -> list[Message]:
        out, self.sent = self.sent, []
        return out


def _from_server(out) -> Message:
    return wire.decode(wire.encode(Message(out.kind, "server", out.dst, out.body, run="r",
                                           round=out.round)))


def test_a_relay_closes_its_round_at_its_deadline_and_its_late_update_is_folded():
    """Relay-0 hosts c0-c2 (one site node), n hosts c3-c5 directly; rounds close on a quorum
    of five. c2 answers round 0 only after round 1's task: at the relay's deadline (on the
    relay's own clock, handed to close_expired) c0's and c1's updates go up as one merged
    update, not a moment before; c2's goes up alone when it comes and the server folds it
    into round 1 with weight 1/sqrt(2). Real relay, real engine, real wire frames; no
    sockets, no seconds."""
    raw = {"federation": {"clients": 6, "rounds": 2, "quorum": 5, "late": "fold",
                          "hard_deadline_s": 120.0, "eval_every": 100},
           "data": {"dataset": "digits", "partition": "iid"},
           "model": {"arch": "mlp"}, "algorithm": {"name": "noop"}}
    engine = build_engine(build_config(raw), "r")
    relay = Relay("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "relay-0", deadline_fraction=0.1)
    relay.up, relay.down = _Outbox(), _Outbox()
    relay.on_join("n0", [client_address(c) for c in range(3)])
    relay.on_config("r", {"run": "r", "config": raw})
    relay.from_site(Message("config", "n0", "server", {"node": "n0", "run": "r"}))
    assert relay.up.addresses == ("c0", "c1", "c2")
    assert [m.kind for m in relay.up.take()] == ["config"]  # the relay's answer: configured
    engine.on_join("relay-0", list(relay.up.addresses), 0.0)
    engine.on_join("n", [client_address(c) for c in range(3, 6)], 0.0)
    engine.on_configured("n", "r", 0.0)
    tasks = engine.on_configured("relay-0", "r", 0.0)

    def round_(tasks, now, late=None):
        """One round: the relay's tasks through it, c0 and c1 answering at its site, c3-c5
        at the server; `late` (an update of an earlier round) reaches the relay after
        this round's tasks. Returns (the relay's messages up, the engine's outputs, c2's
        task)."""
        below = {t.dst: t for t in tasks if t.dst in ("c0", "c1", "c2")}
        for t in below.values():
            relay.from_server(_from_server(t))
        assert [m.dst for m in relay.down.take() if m.kind == "task"] == ["c0", "c1", "c2"]
        group = relay.groups[tasks[0].round]
        if late is not None:
            relay.from_site(late)
        for c in ("c0", "c1"):
            relay.from_site(_update(below[c]))
        outs = []
        for t in tasks:
            if t.dst in ("c3", "c4", "c5"):
                outs += dispatch(engine, _update(t), now)
        relay.close_expired(group.deadline - 1e-3)
        early = relay.up.take()
        assert not [m for m in early if m.kind == "merged"], "merged before its deadline"
        relay.close_expired(group.deadline)
        up = early + relay.up.take()
        for m in up:
            outs += dispatch(engine, m, now + 1)
        return up, outs, below["c2"]

    up, outs, c2_task = round_(tasks, 1.0)
    assert [(m.kind, [x[0] for x in m.body["members"]]) for m in up] == \
        [("merged", ["c0", "c1"])]
    assert engine.version == 1
    rec = engine.records[-1]
    assert rec["failures"] == {"2": "late"} and rec["participants"] == [0, 1, 3, 4, 5]
    # c2's update of round 0 comes after round 1's task: up alone, folded in round 1
    tasks = [o for o in outs if o.kind == "task"]
    up, outs, _ = round_(tasks, 10.0, late=_update(c2_task))
    assert [(m.kind, m.src) for m in up] == [("update", "c2"), ("merged", "relay-0")]
    assert relay.stats["late_forwarded"] == 1 and relay.stats["merged_sent"] == 2
    assert engine.version == 2 and engine.totals["late_folded"] == 1
    rec = next(ev.record for ev in engine.evals.values())  # the last round's, evaluated now
    assert rec["round"] == 1 and rec["failures"] == {"2": "late"}
    assert rec["stale"] == [[2, 0, 1, pytest.approx(1 / np.sqrt(2))]]


def test_prototype_sums_merged_in_any_grouping_give_eq_6():
    rng = np.random.default_rng(0)
    protos = rng.normal(size=(7, 5, 3)).astype(np.float32)
    counts = rng.integers(0, 4, size=(7, 5))
    weights = np.ones(7)
    rule = PrototypeSums()
    for mode in ("weighted", "mean"):
        params = {"aggregate": mode}
        want, want_mass = aggregate_prototypes(protos, counts, weights,
                                               by_count=mode == "weighted")
        total = None
        for group in ([0, 1, 2], [3], [4, 5, 6]):  # three relays, merged at the server
            part = None
            for i in group:
                part = rule.add(part, rule.lift({"protos": protos[i], "counts": counts[i]},
                                                10, Work(1, 1.0, 1, 1), params))
            total = rule.add(total, part)
        mass = total["mass"]
        got = np.where(mass[:, None] > 0, total["sums"] / np.where(mass > 0, mass, 1)[:, None], 0)
        np.testing.assert_allclose(mass, want_mass)
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=0, atol=1e-6)


def test_fedavg_does_not_merge_partial_work_it_is_told_to_drop():
    rule = DeltaSums()
    payload = {"delta": {"w": np.ones((2, 2), dtype=np.float32)}}
    partial = Work(2, 1.0, 1, 1)
    assert rule.lift(payload, 5, partial, {"partial": "drop"}) is None
    form = rule.lift(payload, 5, partial, {"partial": "tolerate"})
    assert form["mass"].tolist() == [5.0] and form["delta_sum"]["w"].tolist() == [[5, 5], [5, 5]]


def test_an_evaluation_ends_when_the_clients_it_still_waits_for_are_gone():
    engine, tasks = _engine()
    for t in tasks[:4]:
        dispatch(engine, _update(t), 1.0)
    outs = []
    for t in tasks[4:]:
        outs += dispatch(engine, _update(t), 1.5)
    evals = [o for o in outs if o.kind == "eval"]
    assert len(evals) == 6 and engine.evals
    for o in evals[:4]:  # the relay's clients answer; n's two never will
        engine.on_eval_result(o.dst, {"eval": o.body["eval"], "metrics": {"acc": 1.0}}, 2.0)
    assert engine.evals
    outs = engine.on_leave("n", [], 3.0)  # without it, the evaluation waits for its deadline
    assert not engine.evals and engine.records[-1]["eval_clients"] == 4
    assert [o.kind for o in outs] == ["task"] * 4 and engine.round.round == 1


def test_merge_rules_refuse_shapes_that_would_broadcast():
    rule = PrototypeSums()
    good = rule.lift({"protos": np.ones((3, 4), np.float32), "counts": np.ones(3, np.int64)},
                     1, Work(1, 1.0, 1, 1), {"aggregate": "weighted"})
    with pytest.raises(ValueError):
        rule.lift({"protos": np.ones(4, np.float32), "counts": np.ones(3, np.int64)},
                  1, Work(1, 1.0, 1, 1), {})
    with pytest.raises(ValueError):
        rule.add(rule.add(None, good), {"sums": np.ones((1, 4)), "mass": np.ones(3)})


@pytest.mark.parametrize("command", ["node", "relay"])
def test_a_name_that_is_not_the_keys_is_refused_before_anything_starts(tmp_path, command):
    keys = tmp_path / "keys"
    fedbus("keygen", "broker", "--dir", str(keys))
    fedbus("keygen", "site-a", "--dir", str(keys), "--clients", "0-2")
    where = ["--clients", "0-2", "--broker"] if command == "node" else \
        ["--bind", "tcp://127.0.0.1:1", "--upstream"]
    proc = fedbus(command, *where, "tcp://127.0.0.1:1", "--keys-dir", str(keys),
                  "--key", "site-a", "--name", "other", check=False, timeout=60)
    assert proc.returncode == 2
    assert "--name other differs from the key's name site-a" in proc.stderr

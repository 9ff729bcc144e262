"""Ten thousand clients, without training: the partition, the registration of four nodes
with a real broker, the engine's first round at fraction 0.1 and the routing of its tasks;
and the engine's per-message bookkeeping that keeps a round linear in its clients."""
from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from fedbus.broker.peer import Peer
from fedbus.node.config import build_config
from fedbus.node.engine import Engine, client_address, task_seed
from fedbus.node.server import build_engine
from fedbus.node.setup import federated_data

CLIENTS, NODES = 10_000, 4


def test_task_seed_is_numpys_seed_sequence():
    rng = random.Random(0)
    cases = [(0, 0, 0), (0, 9_999, 4), (2**32 - 1, 1, 2**32 - 1), (2**32, 5, 6), (3, 2**40, 1)]
    cases += [(rng.getrandbits(32), rng.getrandbits(14), rng.getrandbits(10)) for _ in range(2000)]
    for seed, client, version in cases:
        want = int(np.random.SeedSequence([seed, client, version]).generate_state(1)[0])
        assert task_seed(seed, client, version) == want, (seed, client, version)


@pytest.fixture(scope="module")
def ten_thousand(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "blobs.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(4 * CLIENTS, 16)).astype(np.float32),
             y=np.arange(4 * CLIENTS) % 10)
    return build_config({
        "federation": {"clients": CLIENTS, "rounds": 5, "fraction": 0.1, "seed": 1},
        "data": {"dataset": f"npz:{path}", "partition": "iid"},
        "model": {"arch": "mlp"},
        "algorithm": {"name": "noop"},
        "launch": {"nodes": NODES},
    })


def test_ten_thousand_clients_are_partitioned_disjointly(ten_thousand):
    data = federated_data(ten_thousand)
    assert len(data.parts) == CLIENTS
    train = np.concatenate([p.train for p in data.parts])
    test = np.concatenate([p.test for p in data.parts])
    assert min(len(p.train) for p in data.parts) >= 1
    assert len(np.unique(np.concatenate([train, test]))) == len(train) + len(test) == 4 * CLIENTS


def test_ten_thousand_clients_register_and_get_their_first_round(ten_thousand, tcp_endpoint,
                                                                broker_proc):
    broker_proc(tcp_endpoint)
    engine = build_engine(ten_thousand, "run-10k")
    server = Peer(tcp_endpoint, "srv", role="server", run="run-10k")
    server.start()
    share = CLIENTS // NODES
    nodes = [Peer(tcp_endpoint, f"n{i}", role="client",
                  addresses=[client_address(c) for c in range(i * share, (i + 1) * share)])
             for i in range(NODES)]
    try:
        for node in nodes:
            node.start()
        # the broker tells the server of each node and the clients it hosts
        joined, outs = {}, []
        deadline = time.monotonic() + 60
        while len(joined) < NODES and time.monotonic() < deadline:
            msg = server.recv(timeout=1.0)
            if msg is not None and msg.kind == "join":
                joined[msg.body["node"]] = msg.body["clients"]
                outs += engine.on_join(msg.body["node"], msg.body["clients"], 0.0)
        assert sorted(joined) == [f"n{i}" for i in range(NODES)]
        assert all(len(c) == share for c in joined.values())
        assert [o.kind for o in outs] == ["config"] * NODES
        for i in range(NODES - 1):
            assert engine.on_configured(f"n{i}", "run-10k", 1.0) == []  # not everyone yet
        tasks = engine.on_configured(f"n{NODES - 1}", "run-10k", 2.0)
        assert len(engine.live) == CLIENTS
        assert len(tasks) == math.ceil(0.1 * CLIENTS) and {o.kind for o in tasks} == {"task"}
        sampled = [int(o.dst[1:]) for o in tasks]
        assert sampled == sorted(set(sampled)) and len(engine.busy) == len(sampled)
        assert {c // share for c in sampled} == set(range(NODES))  # every node has work
        # the tasks reach the node hosting each client, over the real broker
        for out in tasks:
            server.send(out.kind, out.dst, {"task": out.body["task"]}, round=out.round)
        got: dict[str, list[int]] = {n.name: [] for n in nodes}
        deadline = time.monotonic() + 60
        while sum(map(len, got.values())) < len(tasks) and time.monotonic() < deadline:
            for node in nodes:
                while (msg := node.recv(timeout=0.01)) is not None:
                    got[node.name].append(int(msg.dst[1:]))
        for i, node in enumerate(nodes):
            assert sorted(got[node.name]) == [c for c in sampled if c // share == i]
    finally:
        for peer in (*nodes, server):
            peer.close(0)


def _round_engine(clients: int, **federation) -> Engine:
    cfg = build_config({"federation": {"clients": clients, "rounds": 3, **federation},
                        "data": {"dataset": "digits", "partition": "iid"},
                        "model": {"arch": "mlp"}, "algorithm": {"name": "noop"}})
    engine = build_engine(cfg, "r")
    engine.on_join("n", [client_address(c) for c in range(clients)], 0.0)
    return engine


def _answer(engine: Engine, out, now: float):
    body = {"task": out.body["task"], "version": out.body["version"], "num_samples": 1,
            "work": {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1},
            "payload": {"state": np.asarray(out.body["payload"]["state"])}}
    return engine.on_update(out.dst, body, 100, now)


def test_the_task_indexes_follow_every_way_a_task_ends():
    # sync with a deadline: answers, a failure, a dead node and the deadline
    engine = _round_engine(6, deadline_s=5.0, late="fold")
    tasks = engine.on_configured("n", "r", 0.0)
    assert engine.next_deadline() == 5.0 and sorted(engine.busy) == list(range(6))
    _answer(engine, tasks[0], 1.0)
    engine.on_task_failed(tasks[1].dst, tasks[1].body["task"], 1.5)
    assert sorted(engine.busy) == [2, 3, 4, 5] and len(engine.tasks) == 4
    outs = engine.on_tick(5.0)  # closes the round: the rest are late, their tasks kept
    assert engine.version == 1 and engine.round is None
    assert sorted(engine.busy) == [2, 3, 4, 5]
    assert all(t.deadline == 0.0 for t in engine.tasks.values())
    # its evaluation waits for the clients that answered; the lifted task deadlines no
    # longer count
    assert {o.kind for o in outs} == {"eval"} and engine.next_deadline() == 5.0 + 2 * 5.0
    engine.on_leave("n", [], 6.0)
    assert not engine.busy and not engine.tasks and not engine.live
    # async: each task's own deadline ends it
    engine = _round_engine(4, mode="async", concurrency=2, deadline_s=3.0)
    first = engine.on_configured("n", "r", 0.0)
    assert len(first) == 2 and len(engine.busy) == 2 and engine.next_deadline() == 3.0
    _answer(engine, first[0], 1.0)  # buffered; a new client takes its slot at t=1
    assert len(engine.busy) == 2 and engine.next_deadline() == 3.0
    engine.on_tick(3.0)  # the other first task expired; its slot is refilled
    expired = int(first[1].dst[1:])
    assert engine.window.failures == {expired: "timed_out"}
    assert engine.next_deadline() == 4.0 and len(engine.busy) == 2


def test_a_final_evaluation_asks_few_clients_for_embeddings():
    from fedbus.node.engine import embedding_clients

    assert embedding_clients(list(range(30)), 50) == list(range(30))
    assert embedding_clients(list(range(30)), 0) == list(range(30))
    picked = embedding_clients(list(range(10_000)), 50)
    assert len(picked) == 50 and picked[:3] == [0, 200, 400] and picked[-1] == 9_800
    engine = _round_engine(120, rounds=1)
    engine.cfg.log["embedding_clients"] = 4
    tasks = engine.on_configured("n", "r", 0.0)
    outs = []
    for out in tasks:
        outs += _answer(engine, out, 1.0)
    asked = [int(o.dst[1:]) for o in outs if o.kind == "eval" and o.body["embed"]]
    assert asked == [0, 30, 60, 90]
    assert all(o.body["embed"] == engine.cfg.log.embeddings for o in outs if o.body["embed"])

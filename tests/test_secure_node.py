"""A client node's side of a securely aggregated round (issue 43: the key and share steps
off the critical path). A node handed a round's tasks sends every one's keys before it
trains any, and answers the secure steps that came meanwhile between two trainings, so the
shares no longer wait for its last training.

Driven by events, not by time: a real ClientNode (real handlers training on digits, the
real X25519/AES-GCM/Shamir) wired in process to a real server engine, every message body
encoded and decoded as msgpack frames on the way, the engine's answers queued for the
node's next receive. The order of what the node did (each message it sent, each training
it began) is the verdict."""
from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest

from fedbus.broker import wire
from fedbus.broker.wire import Message
from fedbus.node import client_host
from fedbus.node.client_host import ClientNode
from fedbus.node.config import build_config
from fedbus.node.engine import client_address
from fedbus.node.server import build_engine, dispatch

RUN = "r"
CLIENTS = 4


def _config(secure: bool = True):
    return build_config({
        "federation": {"clients": CLIENTS, "rounds": 2, "seed": 5},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": "fedproto"},
        "train": {"epochs": 1, "cohort": "off"},
        "privacy": {"secure_aggregation": secure, "secagg_timeout_s": 10.0}})


def _framed(body):
    return wire.decode_body(wire.encode_body(body))


class Loopback:
    """The node's peer, in process: what the node sends is taken by the engine (the live
    server's dispatch), and the engine's messages to the node's clients wait in `inbox`
    for the node's next receive. `events` records, in order, each message the node sent
    (kind, secagg step, client) and, through the training hook, each training it began."""

    def __init__(self, engine):
        self.engine = engine
        self.run = RUN
        self.inbox: collections.deque = collections.deque()
        self.events: list[tuple[str, str | None, str]] = []

    def deliver(self, outs) -> None:
        self.inbox.extend(Message(o.kind, "server", o.dst, _framed(o.body), run=RUN,
                                  round=o.round) for o in outs)

    def send(self, kind, dst, body, *, src, round=0, **_):
        self.events.append((kind, body.get("step") if kind == "secagg" else None, src))
        msg = Message(kind, src, dst, _framed(body), run=RUN, round=round)
        self.deliver(dispatch(self.engine, msg, 1.0))
        return SimpleNamespace(frames=[])

    def recv(self, timeout=None):
        return self.inbox.popleft() if self.inbox else None


def _wired(cfg):
    """A real engine and a real node of all CLIENTS, joined and configured, wired in
    process by a Loopback: (engine, node, loop)."""
    engine = build_engine(cfg, RUN)
    engine.on_join("n", [client_address(c) for c in range(CLIENTS)], 0.0)
    loop = Loopback(engine)
    node = ClientNode("inproc://none", list(range(CLIENTS)), name="n", threads=1)
    node._build(RUN, cfg)
    node.peer = loop
    loop.deliver(engine.on_configured("n", RUN, 0.0))
    return engine, node, loop


@pytest.fixture
def federation(monkeypatch):
    engine, node, loop = _wired(_config())
    real = client_host.run_task

    def observed(handler, body):  # the training itself is the real one
        loop.events.append(("train", None, str(body["task"])))
        return real(handler, body)

    monkeypatch.setattr(client_host, "run_task", observed)
    return engine, node, loop


def _one_round(node, loop) -> list[tuple[str, str | None, str]]:
    """The round's tasks handed to the node together (as serve gathers a burst), then
    every message that follows handled in turn; the events of this round."""
    start = len(loop.events)
    tasks = [m for m in loop.inbox if m.kind == "task"]
    loop.inbox = collections.deque(m for m in loop.inbox if m.kind != "task")
    assert len(tasks) == CLIENTS
    node._safely_tasks(tasks)
    while loop.inbox or node._pending:
        msg = node._pending.popleft() if node._pending else loop.inbox.popleft()
        if msg.kind == "task":  # the next round: not this one's
            loop.inbox.appendleft(msg)
            break
        node.handle(msg)
    return loop.events[start:]


def test_every_key_leaves_before_the_first_training_and_shares_before_the_last(federation):
    engine, node, loop = federation
    events = _one_round(node, loop)
    kinds = [(k, step) for k, step, _ in events]
    trains = [i for i, (k, _) in enumerate(kinds) if k == "train"]
    keys = [i for i, ks in enumerate(kinds) if ks == ("secagg", "keys")]
    shares = [i for i, ks in enumerate(kinds) if ks == ("secagg", "shares")]
    updates = [i for i, (k, _) in enumerate(kinds) if k == "update"]
    assert len(trains) == len(keys) == len(shares) == len(updates) == CLIENTS, kinds
    # before: a task's keys left only when the tasks before it had trained, so the peers
    # (and every share) waited for the node's last training
    assert max(keys) < min(trains), kinds
    assert max(shares) < max(trains), kinds
    # a client trained after the masking came sends its masked update as soon as it is done
    assert updates[-1] == trains[-1] + 1, kinds
    record = engine.records[-1]
    assert record["round"] == 0
    assert record["secagg"]["survivors"] == CLIENTS
    assert "failed" not in record["secagg"]


def test_the_secure_rounds_equal_the_plain_ones_within_the_quantisation_bound(federation):
    """The reordering changes nothing the server computes: two rounds through the node,
    secure, against the same two rounds plain (the same seeds, the same trainings)."""
    engine, node, loop = federation
    for _ in range(2):
        _one_round(node, loop)
    secure = np.asarray(engine.handler.state_dict()["protos"], dtype=np.float64)
    bound = engine.records[-1]["secagg"]["quant_bound"]

    plain, pnode, ploop = _wired(_config(secure=False))
    for _ in range(2):
        _one_round(pnode, ploop)
    expected = np.asarray(plain.handler.state_dict()["protos"], dtype=np.float64)
    assert [r["round"] for r in engine.records] == [r["round"] for r in plain.records] == [0, 1]
    assert np.abs(secure - expected).max() <= bound + 1e-6

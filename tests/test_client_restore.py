"""A restarted client node restores each client's saved state (fedbus.node.client_state)
from the first message the resumed server sends it: which saved round that message builds
on. Driven by events: real handlers on digits, a real state store on disk, the message
handed to the node; no process, no clock."""
from __future__ import annotations

import pytest
import torch

from fedbus.broker.wire import Message
from fedbus.node.client_host import ClientNode
from fedbus.node.config import build_config

RUN = "r"


@pytest.mark.parametrize("kind, restored", [("task", 0), ("eval", 1)])
def test_a_restarted_node_restores_what_its_first_message_builds_on(tmp_path, kind, restored):
    """After a restart the node restores each client from its newest state before the
    first round the server sends. A task of round 1 redoes round 1 (the state after round
    0); an evaluation of round 1, which a resumed server re-sends when that record was
    pending at the kill, scores the state after round 1. It used to count as round 1 and
    restored round 0's state, losing the client's round-1 training."""
    cfg = build_config({
        "federation": {"clients": 4, "rounds": 2, "seed": 5},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": "fedproto"}})
    node = ClientNode("inproc://none", list(range(4)), name="n", threads=1,
                      state_dir=tmp_path / "states")
    node.threaded_writer = False
    node._build(RUN, cfg)
    handler = node.pool.get(0)
    weights = {}
    for rnd in (0, 1):  # two saved states, told apart by their first weight
        with torch.no_grad():
            first = next(iter(handler.ctx.model.parameters()))
            first.fill_(float(rnd + 1))
        weights[rnd] = first.detach().clone()
        assert node.states.save_client(0, rnd, handler)
    with torch.no_grad():
        first.fill_(-1.0)
    node._unrestored = {0}
    body = {"task": 1} if kind == "task" else {"eval": 1}
    got = node._handler(Message(kind, "server", "c0", body, run=RUN, round=1))
    assert node._resume_cutoff == (1 if kind == "task" else 2)
    assert torch.equal(next(iter(got.ctx.model.parameters())), weights[restored])

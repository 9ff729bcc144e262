"""fedtgp: the adaptive margin delta(t) on hand-made prototypes, one server
step's loss against a hand computation with fixed generator weights, staleness
weights, presence without counts, determinism and resume of the server's
seeded training, empty rounds, the prototypes-only client update from a real
LocalRun, and a short in-process federation on scikit-learn's digits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, C, D, check_spec, client_ctx, digits_parts, freeze, make_model,
                          server_ctx, simulate, update)

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.base import Failure, LocalRun, RoundInfo, ServerContext
from fedbus.algorithms.fedtgp import adaptive_margin, presence

torch.set_num_threads(1)


# --- the adaptive margin delta(t) ----------------------------------------------------------

def test_adaptive_margin_by_hand():
    centres = np.array([[0, 0], [3, 0], [3, 4], [9, 9]], np.float64)
    present = np.array([True, True, True, False])
    # pairwise: |c0-c1| = 3, |c0-c2| = 5, |c1-c2| = 4; class-wise minimum: 3, 3, 4;
    # delta = min(max(3, 3, 4), tau) = 4 (not the largest pairwise distance, 5)
    assert adaptive_margin(centres, present, 100.0) == pytest.approx(4.0)
    assert adaptive_margin(centres, present, 3.5) == pytest.approx(3.5)
    # fewer than two classes: the code's gaps stay at 1e9, so delta = tau
    assert adaptive_margin(centres, np.array([True, False, False, False]), 7.0) == 7.0


def tgp_server(**params):
    params = {"server_epochs": 0, **params}
    return get_algorithm("fedtgp").server(server_ctx(params, num_classes=3, feature_dim=2))


def test_server_margin_from_client_prototypes():
    # class centres (means over the clients that sent the class): (0,0), (3,0), (3,4)
    a = {"protos": np.array([[-1, 0], [3, 1], [3, 4]], np.float32)}
    b = {"protos": np.array([[1, 0], [3, -1], [0, 0]], np.float32)}  # class 2 absent: zero row
    s = tgp_server()
    metrics = s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))
    assert metrics["margin"] == pytest.approx(4.0) and metrics["classes_received"] == 3
    s = tgp_server(margin_threshold=2.0)
    assert s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))["margin"] == 2.0


def test_presence_by_counts_or_nonzero_rows():
    p = np.array([[1, 0], [0, 0], [0, 2]], np.float32)
    assert presence(p).tolist() == [True, False, True]
    assert presence(p, np.array([3, 1, 0])).tolist() == [True, True, False]
    assert presence(p, np.zeros(3, np.int64)).tolist() == [True, False, True]


# --- one server step's loss by hand -----------------------------------------------------------

def fix_generator(server, emb):
    """Identity layers, zero biases: with non-negative embeddings the generated
    prototypes are the embeddings themselves."""
    net = server.net
    with torch.no_grad():
        net.embeddings.weight.copy_(torch.tensor(emb, dtype=torch.float32))
        for lin in (net.middle[0], net.fc):
            lin.weight.copy_(torch.eye(2))
            lin.bias.zero_()


def test_one_server_step_loss_by_hand():
    # generated prototypes G = [[1,0], [0,1], [2,2]]; client prototypes
    # p1 = (1,0) of class 0 (client A), p2 = (0,4) of class 1 (client B);
    # centres (1,0), (0,4): gap sqrt(17) > tau = 1, so delta = 1.
    # d(p1, G) = (0, sqrt 2, sqrt 5); d(p2, G) = (sqrt 17, 3, sqrt 8)
    # CE1 = log(1 + e^(0+1-sqrt 2) + e^(0+1-sqrt 5))  = 0.668538928...
    # CE2 = log(1 + e^(3+1-sqrt 17) + e^(3+1-sqrt 8)) = 1.631440996...
    ce1 = math.log(1 + math.exp(1 - math.sqrt(2)) + math.exp(1 - math.sqrt(5)))
    ce2 = math.log(1 + math.exp(4 - math.sqrt(17)) + math.exp(4 - math.sqrt(8)))
    assert ce1 == pytest.approx(0.6685389, abs=1e-6) and ce2 == pytest.approx(1.6314410, abs=1e-6)
    a = {"protos": np.array([[1, 0], [0, 0], [0, 0]], np.float32)}
    b = {"protos": np.array([[0, 0], [0, 4], [0, 0]], np.float32)}
    for stale, want in ((0, (ce1 + ce2) / 2), (3, (ce1 + 0.5 * ce2) / 1.5)):
        s = tgp_server(server_epochs=1, server_batch_size=10, margin_threshold=1.0,
                       server_lr=0.1)
        fix_generator(s, [[1, 0], [0, 1], [2, 2]])
        metrics = s.aggregate([update(0, a), update(1, b, staleness=stale)], [],
                              RoundInfo(0, 3))
        assert metrics["margin"] == 1.0
        assert metrics["server_loss"] == pytest.approx(want, abs=1e-6)
        # one SGD step moved the generator; the task carries its output for all classes
        task = s.make_task(0, RoundInfo(1, 3))
        assert task["has"].tolist() == [True, True, True]
        with torch.no_grad():
            np.testing.assert_allclose(task["protos"], s.net().numpy(), atol=1e-7)
        assert not np.allclose(task["protos"], [[1, 0], [0, 1], [2, 2]])


def test_server_training_lowers_the_loss():
    a = {"protos": np.array([[1, 0], [0, 3], [3, 3]], np.float32)}
    b = {"protos": np.array([[2, 0], [0, 4], [0, 0]], np.float32)}
    s = tgp_server(server_epochs=1, server_hidden=8)
    first = s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))["server_loss"]
    s = tgp_server(server_epochs=200, server_hidden=8)
    last = s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))["server_loss"]
    assert last < first


# --- determinism, resume, empty rounds ---------------------------------------------------------

def rounds_of(server, inputs):
    out = []
    for r, ups in enumerate(inputs):
        server.aggregate(ups, [], RoundInfo(r, len(inputs)))
        out.append(server.make_task(0, RoundInfo(r + 1, len(inputs)))["protos"].copy())
    return out


def test_server_is_deterministic_and_resumable():
    rng = np.random.default_rng(0)
    inputs = [[update(i, {"protos": rng.normal(size=(C, D)).astype(np.float32)})
               for i in range(3)] for _ in range(3)]
    params = {"server_epochs": 5}
    state = torch.get_rng_state()
    one = rounds_of(get_algorithm("fedtgp").server(server_ctx(params)), inputs)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    two = rounds_of(get_algorithm("fedtgp").server(server_ctx(params)), inputs)
    for x, y in zip(one, two):
        np.testing.assert_array_equal(x, y)
    # resume from a checkpoint after round 0: the same outputs, bit for bit
    s = get_algorithm("fedtgp").server(server_ctx(params))
    rounds_of(s, inputs[:1])
    resumed = get_algorithm("fedtgp").server(server_ctx(params))
    resumed.load_state_dict(freeze(s.state_dict()))
    for x, y in zip(rounds_of(resumed, inputs[1:]), one[1:]):
        np.testing.assert_array_equal(x, y)
    other = rounds_of(get_algorithm("fedtgp").server(
        ServerContext(params=params, train=TRAIN, num_classes=C, feature_dim=D, clients=4,
                      rounds=3, seed=1, homogeneous=True, make_model=make_model)), inputs)
    assert not np.array_equal(other[0], one[0])


def test_empty_aggregation_keeps_state():
    s = tgp_server(server_epochs=3)
    s.aggregate([update(0, {"protos": np.array([[1, 0], [0, 1], [0, 0]], np.float32)})], [],
                RoundInfo(0, 3))
    before = s.state_dict()
    metrics = s.aggregate([], [Failure(0, "dead"), Failure(1, "late")], RoundInfo(1, 3))
    assert metrics["updates"] == 0
    # all-zero prototypes carry no class: nothing to train on either
    s.aggregate([update(0, {"protos": np.zeros((3, 2), np.float32)})], [], RoundInfo(2, 3))
    after = s.state_dict()
    for k in ("protos", "has", "generator"):
        np.testing.assert_array_equal(after[k], before[k])
    for k in before["net"]:
        np.testing.assert_array_equal(after["net"][k], before["net"][k])


# --- client and a short federation -------------------------------------------------------------

def test_client_uploads_prototypes_only():
    part = digits_parts(4, ways=5)[0]
    algo = get_algorithm("fedtgp")
    server = algo.server(server_ctx({}))
    assert server.update_spec() == {"protos": ("float32", (C, D))}
    h = algo.client(client_ctx(0, part, {}))
    run = LocalRun(h.ctx, epochs=1, seed=0)
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))), run)
    assert set(payload) == {"protos"} and run.work.steps == run.steps_per_epoch()
    check_spec(payload, server.update_spec())
    held = np.bincount(part[1].numpy(), minlength=C) > 0
    assert presence(payload["protos"]).tolist() == held.tolist()
    assert h.lam == 10.0 and h.proto_source == "after"


def test_fedtgp_short_federation_learns():
    server, _, history = simulate("fedtgp", {}, rounds=4, clients=4, epochs=3, ways=5)
    assert server.has.all() and server.margin > 0
    last = history[-1]
    # chance: 0.1 over all classes, 0.2 within a client's five
    assert last["proto_acc"] > 0.6 and last["acc"] > 0.5, history

"""local, fedavg, fedprox: aggregation by hand, staleness, empty rounds, real
local training through LocalRun, sync/async equivalence, and a short
in-process federation on scikit-learn's digits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import (check_spec, client_ctx, freeze, iid_digits_parts, make_model,
                          server_ctx, simulate, update)
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import Failure, LocalRun, RoundInfo, model_weights

torch.set_num_threads(1)


# --- registry and config ----------------------------------------------------------------

def test_registry_and_param_validation():
    from fedbus.node.config import ConfigError, build_config

    for name in ("local", "fedavg", "fedprox"):
        assert get_algorithm(name).name == name
    assert get_algorithm("fedavg").server.needs_same_model
    assert build_config({"algorithm": {"name": "fedprox"}}).algorithm["mu"] == 0.01
    with pytest.raises(ConfigError):
        build_config({"algorithm": {"name": "fedprox", "mu": -1.0}})


# --- FedAvg aggregation by hand ----------------------------------------------------------

def linear_model(i):
    lin = nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0]]))
        lin.bias.copy_(torch.tensor([0.5]))
    return lin


def test_fedavg_aggregate_by_hand():
    server = get_algorithm("fedavg").server(server_ctx({}, make=linear_model))
    assert server.update_spec() == {"delta": {"weight": ("float32", (1, 2)),
                                              "bias": ("float32", (1,))}}
    a = update(0, {"delta": {"weight": np.array([[1.0, 0.0]], np.float32),
                             "bias": np.array([1.0], np.float32)}}, n=1)
    b = update(1, {"delta": {"weight": np.array([[0.0, 4.0]], np.float32),
                             "bias": np.array([-1.0], np.float32)}}, n=3)
    server.aggregate([a, b], [], RoundInfo(0, 3))
    # w = [1, 2] + (1 * [1, 0] + 3 * [0, 4]) / 4 = [1.25, 5.0]; b = 0.5 + (1 - 3) / 4 = 0.0
    np.testing.assert_allclose(server.weights["weight"], [[1.25, 5.0]], atol=1e-7)
    np.testing.assert_allclose(server.weights["bias"], [0.0], atol=1e-7)
    assert server.weights["weight"].dtype == np.float32


def test_fedavg_staleness_weights_by_hand():
    server = get_algorithm("fedavg").server(server_ctx({}, make=linear_model))
    fresh = update(0, {"delta": {"weight": np.array([[2.0, 0.0]], np.float32),
                                 "bias": np.array([0.0], np.float32)}}, n=1)
    stale = update(1, {"delta": {"weight": np.array([[0.0, 2.0]], np.float32),
                                 "bias": np.array([3.0], np.float32)}}, n=1, version=0,
                   staleness=3)
    assert stale.weight == 0.5
    server.aggregate([fresh, stale], [], RoundInfo(3, 5))
    # step = (1 * [2, 0] + 0.5 * [0, 2]) / 1.5 = [4/3, 2/3]; bias step = 0.5 * 3 / 1.5 = 1
    np.testing.assert_allclose(server.weights["weight"], [[1 + 4 / 3, 2 + 2 / 3]], atol=1e-6)
    np.testing.assert_allclose(server.weights["bias"], [1.5], atol=1e-6)


@pytest.mark.parametrize("name", ["fedavg", "fedatt"])
def test_partial_drop_counts_partial_updates_as_failures(name):
    """partial = "drop": Michieli & Ozay's FedAvg without toleration (Table 3)."""
    from fedbus.algorithms.core.handlers import Work
    from fedbus.node.config import ConfigError, build_config

    full = {"weight": np.array([[1.0, 0.0]], np.float32), "bias": np.array([1.0], np.float32)}
    half = {"weight": np.array([[0.0, 4.0]], np.float32), "bias": np.array([-1.0], np.float32)}
    done = update(0, {"delta": full}, n=1, work=Work(2, 2.0, 2, 1))
    part = update(1, {"delta": half}, n=3, work=Work(2, 0.5, 1, 3))
    dropping = get_algorithm(name).server(server_ctx({"partial": "drop"}, make=linear_model))
    m = dropping.aggregate([done, part], [Failure(2, "late")], RoundInfo(0, 3))
    assert m["updates"] == 1 and m["failures"] == 2
    # one update left: w + delta for both rules (FedAtt's softmax over one client is 1)
    np.testing.assert_allclose(dropping.weights["weight"], [[2.0, 2.0]], atol=1e-6)
    np.testing.assert_allclose(dropping.weights["bias"], [1.5], atol=1e-6)
    tolerating = get_algorithm(name).server(server_ctx({}, make=linear_model))
    m = tolerating.aggregate([done, part], [], RoundInfo(0, 3))
    assert m["updates"] == 2 and m["failures"] == 0
    assert not np.allclose(tolerating.weights["weight"], [[2.0, 2.0]])
    with pytest.raises(ConfigError, match="partial"):
        build_config({"algorithm": {"name": name, "partial": "skip"}})
    with pytest.raises(ConfigError, match="partial"):   # FedProx tolerates by design
        build_config({"algorithm": {"name": "fedprox", "partial": "drop"}})


@pytest.mark.parametrize("name", ["local", "fedavg", "fedprox"])
def test_empty_aggregation_keeps_state(name):
    server = get_algorithm(name).server(server_ctx({}))
    before = server.state_dict()
    metrics = server.aggregate([], [Failure(0, "dead"), Failure(1, "late")], RoundInfo(0, 3))
    assert metrics["updates"] == 0 and metrics["failures"] == 2
    after = server.state_dict()
    for k in before.get("weights", {}):
        np.testing.assert_array_equal(before["weights"][k], after["weights"][k])


def test_fedavg_sync_async_equivalence():
    """Two fresh updates in one aggregate == plain FedAvg of the full weights."""
    algo = get_algorithm("fedavg")
    parts = iid_digits_parts(2)
    server = algo.server(server_ctx({}, clients=2))
    g = {k: v.copy() for k, v in server.weights.items()}
    full, ups = [], []
    for i, part in enumerate(parts[:2]):
        h = algo.client(client_ctx(i, part, {}))
        payload = h.train(freeze(server.make_task(i, RoundInfo(0, 3))),
                          LocalRun(h.ctx, epochs=1, seed=i))
        full.append(model_weights(h.ctx.model))
        # the delta is exactly the client's weights minus the global it was sent
        for k, gk in g.items():
            np.testing.assert_allclose(gk + payload["delta"][k], full[-1][k], atol=1e-6)
        ups.append(update(i, payload, len(part[1])))
    n1, n2 = ups[0].num_samples, ups[1].num_samples
    server.aggregate(ups, [], RoundInfo(0, 3))
    # async order: the same two updates, other order, in a fresh server
    other = algo.server(server_ctx({}, clients=2))
    other.aggregate(ups[::-1], [], RoundInfo(0, 3))
    for k in g:
        plain = (n1 * full[0][k].astype(np.float64) + n2 * full[1][k]) / (n1 + n2)
        np.testing.assert_allclose(server.weights[k], plain, atol=1e-6, rtol=0)
        np.testing.assert_allclose(other.weights[k], server.weights[k], atol=1e-7, rtol=0)


# --- clients through a real LocalRun ----------------------------------------------------------

@pytest.mark.parametrize("name", ["local", "fedavg", "fedprox"])
def test_client_trains_and_update_has_spec(name):
    algo = get_algorithm(name)
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    before = model_weights(h.ctx.model)
    run = LocalRun(h.ctx, epochs=2, seed=3)
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))), run)
    check_spec(payload, server.update_spec())
    assert run.work.steps == 2 * run.steps_per_epoch() and run.work.stopped == "done"
    assert not math.isnan(h.last_loss)
    after = model_weights(h.ctx.model)
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    if name == "local":
        assert payload == {}
    metrics = h.evaluate(freeze(server.make_eval(0, RoundInfo(0, 3))))
    assert {"acc", "loss", "num_test"} <= set(metrics) and metrics["num_test"] == len(part[3])


def test_fedavg_partial_work_still_updates():
    algo = get_algorithm("fedavg")
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    run = LocalRun(h.ctx, epochs=2, seed=0, epochs_to_run=0.25)
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))), run)
    assert run.work.stopped == "partial" and 1 <= run.work.steps < run.steps_per_epoch()
    assert any(np.abs(v).sum() > 0 for v in payload["delta"].values())


def test_fedavg_evaluates_global_model_and_keeps_local():
    algo = get_algorithm("fedavg")
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    h.train(freeze(server.make_task(0, RoundInfo(0, 3))), LocalRun(h.ctx, epochs=1, seed=0))
    local = model_weights(h.ctx.model)
    got = h.evaluate(freeze(server.make_eval(0, RoundInfo(0, 3))))
    # the untrained global model: scored exactly as a fresh copy of it scores
    ref = make_model(0)
    with torch.no_grad():
        logits = ref(part[2])
    assert got["acc"] == pytest.approx((logits.argmax(1) == part[3]).float().mean().item())
    after = model_weights(h.ctx.model)
    assert all(np.array_equal(local[k], after[k]) for k in local)


# --- FedProx's proximal term -------------------------------------------------------------------

def test_fedprox_proximal_term_by_hand():
    algo = get_algorithm("fedprox")
    part = iid_digits_parts(4)[0]
    h = algo.client(client_ctx(0, part, {"mu": 0.5}))
    h.begin_local({})
    with torch.no_grad():
        h.ctx.model.fc.bias[0] += 3.0
        h.ctx.model.fc.weight[1, 2] -= 4.0
    x, y = part[0][:16], part[1][:16]
    ce = nn.functional.cross_entropy(h.ctx.model(x), y)
    # mu / 2 * ||w - w_t||^2 = 0.25 * (3^2 + 4^2) = 6.25
    assert h.batch_loss(x, y).item() == pytest.approx(ce.item() + 6.25, abs=1e-5)


def test_fedprox_stays_closer_to_global():
    part = iid_digits_parts(4)[0]
    norms = {}
    for mu in (0.0, 5.0):
        algo = get_algorithm("fedprox")
        server = algo.server(server_ctx({"mu": mu}))
        h = algo.client(client_ctx(0, part, {"mu": mu}))
        payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))),
                          LocalRun(h.ctx, epochs=3, seed=0))
        norms[mu] = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum())
                                  for v in payload["delta"].values()))
    assert norms[5.0] < 0.8 * norms[0.0]


def test_fedavg_state_roundtrip():
    algo = get_algorithm("fedavg")
    server = algo.server(server_ctx({}, make=linear_model))
    server.aggregate([update(0, {"delta": {"weight": np.ones((1, 2), np.float32),
                                           "bias": np.ones(1, np.float32)}}, n=2)],
                     [], RoundInfo(0, 3))
    state = freeze(server.state_dict())
    fresh = algo.server(server_ctx({}, make=linear_model))
    fresh.load_state_dict(state)
    for k in server.weights:
        np.testing.assert_array_equal(fresh.weights[k], server.weights[k])
        assert fresh.weights[k].flags.writeable


# --- short federations learn ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["local", "fedavg", "fedprox"])
def test_short_federation_learns(name):
    _, _, history = simulate(name, {}, rounds=4, clients=4, epochs=3, ways=None,
                              metrics="acc")
    assert history[-1] > 0.6 and history[-1] > history[0], history  # chance is 0.1

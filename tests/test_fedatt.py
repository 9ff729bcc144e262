"""FedAtt (fedbus.algorithms.fedatt): the server's layer-wise attention step against a
hand computation, its staleness and noise options, and a real small federation."""
from __future__ import annotations

import math

import numpy as np
import pytest
from algo_support import server_ctx
from algo_support import update as make_update
from helpers import SMALL, fedbus, merged, metrics, run_federation

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import Failure, RoundInfo
from fedbus.algorithms.fedatt import attentive_step


def upd(client, delta, weight=1.0):
    """A fresh update carrying `delta` (weight: the engine's staleness weight)."""
    return make_update(client, {"delta": delta}, weight=weight)


def two_layer_server(params):
    server = get_algorithm("fedatt").server(server_ctx(params, clients=2))
    # a tiny global model of two "layers" (the handler treats every entry alike)
    server.weights = {"a": np.array([1.0, 2.0], np.float32),
                      "b": np.array([[0.5]], np.float32)}
    return server


def test_server_step_matches_a_hand_computation():
    server = two_layer_server({"epsilon": 0.5})
    d1 = {"a": np.array([3.0, 4.0], np.float32), "b": np.array([[0.0]], np.float32)}
    d2 = {"a": np.array([0.0, 1.0], np.float32), "b": np.array([[-2.0]], np.float32)}
    out = server.aggregate([upd(0, d1), upd(1, d2)], [],
                           RoundInfo(0, 3))
    # layer a: s = (||(3,4)||, ||(0,1)||) = (5, 1); alpha = softmax(5, 1)
    aa = np.exp([5.0, 1.0]) / np.exp([5.0, 1.0]).sum()
    # layer b: s = (0, 2); alpha = softmax(0, 2)
    ab = np.exp([0.0, 2.0]) / np.exp([0.0, 2.0]).sum()
    # w - eps * sum_k alpha_k (w - w_k), with w - w_k = -delta_k
    want_a = np.array([1.0, 2.0]) + 0.5 * (aa[0] * np.array([3.0, 4.0])
                                           + aa[1] * np.array([0.0, 1.0]))
    want_b = 0.5 + 0.5 * (ab[0] * 0.0 + ab[1] * -2.0)
    assert server.weights["a"] == pytest.approx(want_a, rel=1e-6)
    assert server.weights["b"][0, 0] == pytest.approx(want_b, rel=1e-6)
    assert server.weights["a"].dtype == np.float32
    att = out["attention"]
    assert att["0"] == pytest.approx((aa[0] + ab[0]) / 2)
    assert att["1"] == pytest.approx((aa[1] + ab[1]) / 2)
    assert att["0"] + att["1"] == pytest.approx(1.0)
    assert out["attn_max"] == pytest.approx(max(att.values()))


def test_epsilon_one_with_equal_distances_is_the_plain_mean_and_staleness_shrinks_a_step():
    d1 = {"a": np.array([2.0, 0.0], np.float32), "b": np.array([[1.0]], np.float32)}
    d2 = {"a": np.array([0.0, 2.0], np.float32), "b": np.array([[-1.0]], np.float32)}
    server = two_layer_server({"epsilon": 1.0})
    server.aggregate([upd(0, d1), upd(1, d2)], [], RoundInfo(0, 3))
    assert server.weights["a"] == pytest.approx([2.0, 3.0])  # w + (d1 + d2) / 2
    assert server.weights["b"][0, 0] == pytest.approx(0.5)
    step, att = attentive_step([d1, d2], [1.0, 0.5], 1.0)  # client 1 is stale (s = 0.5)
    assert step["a"] == pytest.approx([1.0, 0.5]) and att == pytest.approx([0.5, 0.5])


def test_no_update_keeps_the_weights_and_noise_is_seeded():
    server = two_layer_server({"dp": 0.1})
    before = {k: v.copy() for k, v in server.weights.items()}
    server.aggregate([], [Failure(0, "late")], RoundInfo(0, 3))
    assert all((server.weights[k] == before[k]).all() for k in before)
    d = {"a": np.zeros(2, np.float32), "b": np.zeros((1, 1), np.float32)}
    outs = []
    for _ in range(2):
        s = two_layer_server({"dp": 0.1})
        s.aggregate([upd(0, d)], [], RoundInfo(1, 3))
        outs.append(s.weights["a"])
    assert (outs[0] == outs[1]).all() and not (outs[0] == before["a"]).all()


def test_fedatt_federation(tmp_path):
    run_dir, summary = run_federation(tmp_path, merged(SMALL, algorithm={"name": "fedatt"}),
                                      name="fedatt")
    recs = metrics(run_dir)
    assert summary["rounds_completed"] == SMALL["federation"]["rounds"]
    for r in recs:
        att = r["agg_extra"]["attention"]
        assert sorted(int(c) for c in att) == r["participants"]
        assert sum(att.values()) == pytest.approx(1.0)
        assert math.isfinite(r["acc_mean"])
    assert summary["final"]["acc_weighted"] > 0.2  # 10 classes: chance is 0.1
    assert "replay identical" in fedbus("replay", str(run_dir)).stdout

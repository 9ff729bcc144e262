"""fedproto and fedavg-proto: prototype aggregation by hand (weighted and
unweighted, staleness, the "has" mask, keep_missing), the client regularisers
by hand, prototypes and update spec from a real LocalRun, nearest-prototype
inference, heterogeneous models, Qiao's final-round prototype upload, and short
in-process federations on scikit-learn's digits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import (C, D, check_spec, client_ctx, digits_parts, freeze, server_ctx,
                          simulate, update)
from sklearn.datasets import load_digits
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.base import Failure, LocalRun, RoundInfo

torch.set_num_threads(1)


# --- FedProto server: aggregation by hand ------------------------------------------------

A = {"protos": np.array([[1, 0], [0, 2], [0, 0]], np.float32),
     "counts": np.array([2, 1, 0], np.int64)}  # class 2 missing at client A
B = {"protos": np.array([[4, 3], [2, 2], [5, 5]], np.float32),
     "counts": np.array([1, 3, 4], np.int64)}


def proto_server(**params):
    return get_algorithm("fedproto").server(server_ctx(params, num_classes=3, feature_dim=2))


def test_fedproto_spec_and_initial_task():
    s = proto_server()
    assert s.update_spec() == {"protos": ("float32", (3, 2)), "counts": ("int64", (3,))}
    task = s.make_task(0, RoundInfo(0, 3))
    assert task["protos"].dtype == np.float32 and task["protos"].shape == (3, 2)
    assert task["has"].dtype == bool and not task["has"].any()


def test_fedproto_unweighted_mean_by_hand():
    s = proto_server()  # aggregate = "mean" is the default (the reference code)
    s.aggregate([update(0, A), update(1, B)], [], RoundInfo(0, 3))
    # class 0: ([1,0] + [4,3]) / 2; class 1: ([0,2] + [2,2]) / 2; class 2: B alone
    np.testing.assert_allclose(s.protos, [[2.5, 1.5], [1.0, 2.0], [5.0, 5.0]], atol=1e-6)
    assert s.make_task(0, RoundInfo(1, 3))["has"].tolist() == [True, True, True]


def test_fedproto_count_weighted_mean_by_hand():
    s = proto_server(aggregate="weighted")
    s.aggregate([update(0, A), update(1, B)], [], RoundInfo(0, 3))
    # class 0: (2*[1,0] + 1*[4,3]) / 3 = [2, 1]; class 1: (1*[0,2] + 3*[2,2]) / 4 = [1.5, 2]
    np.testing.assert_allclose(s.protos, [[2.0, 1.0], [1.5, 2.0], [5.0, 5.0]], atol=1e-6)


def test_fedproto_staleness_weights_by_hand():
    stale = update(1, B, staleness=3)  # weight 1/sqrt(4) = 0.5
    s = proto_server()
    s.aggregate([update(0, A), stale], [], RoundInfo(3, 5))
    # class 0: (1*[1,0] + 0.5*[4,3]) / 1.5 = [2, 1]; class 1: (1*[0,2] + 0.5*[2,2]) / 1.5
    np.testing.assert_allclose(s.protos, [[2.0, 1.0], [2 / 3, 2.0], [5.0, 5.0]], atol=1e-6)
    s = proto_server(aggregate="weighted")
    s.aggregate([update(0, A), stale], [], RoundInfo(3, 5))
    # class 0: a = (2*1, 1*0.5): (2*[1,0] + 0.5*[4,3]) / 2.5 = [1.6, 0.6]
    # class 1: a = (1*1, 3*0.5): (1*[0,2] + 1.5*[2,2]) / 2.5 = [1.2, 2]
    np.testing.assert_allclose(s.protos, [[1.6, 0.6], [1.2, 2.0], [5.0, 5.0]], atol=1e-6)


def test_fedproto_has_mask_and_keep_missing():
    for keep in (True, False):
        s = proto_server(keep_missing=keep)
        s.aggregate([update(1, B)], [], RoundInfo(0, 3))
        s.aggregate([update(0, A)], [], RoundInfo(1, 3))  # A lacks class 2
        task = s.make_task(0, RoundInfo(2, 3))
        np.testing.assert_allclose(task["protos"][:2], [[1, 0], [0, 2]], atol=1e-6)
        if keep:  # class 2 keeps B's prototype from the round before
            assert task["has"].tolist() == [True, True, True]
            np.testing.assert_allclose(task["protos"][2], [5, 5])
        else:  # the reference code: the set is replaced by what arrived
            assert task["has"].tolist() == [True, True, False]
            np.testing.assert_allclose(task["protos"][2], [0, 0])


def test_fedproto_empty_aggregation_keeps_state():
    s = proto_server()
    s.aggregate([update(0, A), update(1, B)], [], RoundInfo(0, 3))
    before = s.state_dict()
    metrics = s.aggregate([], [Failure(0, "dead"), Failure(1, "late")], RoundInfo(1, 3))
    assert metrics["updates"] == 0 and metrics["classes"] == 3
    np.testing.assert_array_equal(s.state_dict()["protos"], before["protos"])
    np.testing.assert_array_equal(s.state_dict()["has"], before["has"])


def test_fedproto_state_roundtrip():
    s = proto_server()
    s.aggregate([update(0, A)], [], RoundInfo(0, 3))
    fresh = proto_server()
    fresh.load_state_dict(freeze(s.state_dict()))
    np.testing.assert_array_equal(fresh.protos, s.protos)
    np.testing.assert_array_equal(fresh.has, s.has)


# --- FedProto client ---------------------------------------------------------------------

def task_with(protos, has):
    return freeze({"protos": np.asarray(protos, np.float32), "has": np.asarray(has, bool)})


def test_fedproto_client_update_is_eq5_prototypes():
    part = digits_parts(4, ways=5)[0]  # classes 0..4 only
    algo = get_algorithm("fedproto")
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    run = LocalRun(h.ctx, epochs=1, seed=0)
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))), run)
    check_spec(payload, server.update_spec())
    assert run.work.steps == run.steps_per_epoch()
    counts = np.bincount(part[1].numpy(), minlength=C)
    np.testing.assert_array_equal(payload["counts"], counts)
    model = h.ctx.model.eval()
    with torch.no_grad():
        for k in range(C):
            if counts[k]:
                want = model.features(part[0][part[1] == k]).mean(0).numpy()
                np.testing.assert_allclose(payload["protos"][k], want, atol=1e-5)
            else:
                assert not payload["protos"][k].any()


def test_fedproto_mse_regulariser_by_hand():
    part = digits_parts(4)[0]
    h = get_algorithm("fedproto").client(client_ctx(0, part, {"lam": 2.0}))
    g = np.random.default_rng(0).normal(size=(C, D)).astype(np.float32)
    has = np.arange(C) % 2 == 0  # only even classes have a global prototype
    h._global, h._has = h.global_protos(task_with(g, has))
    h._reg = True
    x, y = part[0][:20], part[1][:20]
    with torch.no_grad():
        feats = h.ctx.model.features(x).numpy()
        ce = nn.functional.cross_entropy(h.ctx.model(x), y).item()
        loss = h.batch_loss(x, y).item()
    sq = 0.0
    for row, label in zip(feats, y.tolist()):
        if has[label]:
            sq += float(((row - g[label]) ** 2).sum())
    # nn.MSELoss: mean over all B x D elements, rows without a prototype add 0
    assert loss == pytest.approx(ce + 2.0 * sq / (len(y) * D), rel=1e-5)


def test_fedproto_paper_regulariser_by_hand():
    part = digits_parts(4)[0]
    h = get_algorithm("fedproto").client(client_ctx(0, part, {"lam": 0.5,
                                                              "proto_loss": "paper"}))
    g = np.random.default_rng(1).normal(size=(C, D)).astype(np.float32)
    has = np.arange(C) < 7
    h._global, h._has = h.global_protos(task_with(g, has))
    h._reg = True
    x, y = part[0][:40], part[1][:40]
    with torch.no_grad():
        feats = h.ctx.model.features(x).numpy()
        ce = nn.functional.cross_entropy(h.ctx.model(x), y).item()
        loss = h.batch_loss(x, y).item()
    reg = 0.0
    for k in set(y.tolist()):
        if has[k]:
            reg += float(np.linalg.norm(feats[y.numpy() == k].mean(0) - g[k]))
    assert loss == pytest.approx(ce + 0.5 * reg, rel=1e-5)


def test_fedproto_during_source_averages_training_features():
    part = digits_parts(4, ways=5)[1]
    params = {"proto_source": "during", "lam": 0.0}
    h = get_algorithm("fedproto").client(client_ctx(0, part, params))
    h.optimizer.param_groups[0]["lr"] = 0.0  # features stay fixed, so the mean is checkable
    h.optimizer.param_groups[0]["momentum"] = 0.0
    payload = h.train(task_with(np.zeros((C, D)), np.zeros(C, bool)),
                      LocalRun(h.ctx, epochs=2, seed=0))
    counts = np.bincount(part[1].numpy(), minlength=C)
    np.testing.assert_array_equal(payload["counts"], counts)
    with torch.no_grad():  # train mode equals eval mode for this network
        for k in np.nonzero(counts)[0]:
            want = h.ctx.model.features(part[0][part[1] == k]).mean(0).numpy()
            np.testing.assert_allclose(payload["protos"][k], want, atol=1e-5)


def test_fedproto_inference_all_vs_own_classes():
    x = torch.tensor(load_digits().data[:200] / 16.0, dtype=torch.float32)
    y = torch.tensor(load_digits().target[:200], dtype=torch.int64)
    three = (x[y == 3], y[y == 3], x[y == 3], y[y == 3])  # a client holding class 3 only
    out = {}
    for mode in ("all", "own"):
        h = get_algorithm("fedproto").client(client_ctx(0, three, {"infer_classes": mode}))
        with torch.no_grad():
            centre = h.ctx.model.features(three[2]).mean(0).numpy()
        g = np.tile(centre, (C, 1))
        g[3] += 100.0  # the own class is far away, every other class sits on the data
        out[mode] = h.evaluate(task_with(g, np.ones(C, bool)))
    assert out["all"]["proto_acc"] == 0.0
    assert out["own"]["proto_acc"] == 1.0
    assert {"acc", "loss", "num_test", "proto_acc"} <= set(out["all"])


def test_fedproto_proto_acc_nan_without_prototypes():
    part = digits_parts(4)[0]
    h = get_algorithm("fedproto").client(client_ctx(0, part, {}))
    metrics = h.evaluate(task_with(np.zeros((C, D)), np.zeros(C, bool)))
    assert math.isnan(metrics["proto_acc"]) and not math.isnan(metrics["acc"])


# --- short federations -----------------------------------------------------------------------

@pytest.mark.parametrize("params", [{}, {"aggregate": "weighted", "proto_loss": "paper",
                                         "proto_source": "during", "keep_missing": False}])
def test_fedproto_short_federation_learns(params):
    _, _, history = simulate("fedproto", params, rounds=4, clients=4, epochs=3, ways=5)
    last = history[-1]
    # chance: 0.1 over all classes, 0.2 within a client's five
    assert last["acc"] > 0.5 and last["proto_acc"] > 0.6, history


def test_fedproto_heterogeneous_models_learn():
    _, handlers, history = simulate("fedproto", {}, rounds=4, clients=4, epochs=3,
                                    ways=5, hetero=True)
    kinds = {sum(p.numel() for p in h.ctx.model.parameters()) for h in handlers}
    assert len(kinds) == 2  # two architectures, one feature dimension
    assert history[-1]["proto_acc"] > 0.6, history


# --- fedavg-proto (Qiao et al.) -----------------------------------------------------------------

def linear3(i):
    return nn.Linear(2, 1)


def test_fedavg_proto_asks_for_prototypes_in_the_last_round_only():
    algo = get_algorithm("fedavg-proto")
    s = algo.server(server_ctx({}, rounds=3))
    assert [s.make_task(0, RoundInfo(r, 3))["send_protos"] for r in range(3)] == [False,
                                                                                  False, True]
    s = algo.server(server_ctx({"every_round": True}, rounds=3))
    assert all(s.make_task(0, RoundInfo(r, 3))["send_protos"] for r in range(3))


def test_fedavg_proto_aggregates_count_and_staleness_weighted():
    algo = get_algorithm("fedavg-proto")
    s = algo.server(server_ctx({}, make=linear3, num_classes=3, feature_dim=2))
    zero = {"weight": np.zeros((1, 2), np.float32), "bias": np.zeros(1, np.float32)}
    s.aggregate([update(0, {"delta": zero})], [], RoundInfo(0, 3))  # no prototypes yet
    assert not s.make_eval(0, RoundInfo(0, 3))["has"].any()
    s.aggregate([update(0, {"delta": zero, **A}), update(1, {"delta": zero, **B}, staleness=3)],
                [], RoundInfo(2, 3))
    ev = s.make_eval(0, RoundInfo(2, 3))
    # count x staleness weights, as test_fedproto_staleness_weights_by_hand
    np.testing.assert_allclose(ev["protos"], [[1.6, 0.6], [1.2, 2.0], [5.0, 5.0]], atol=1e-6)
    assert ev["has"].tolist() == [True, True, True] and "weights" in ev
    before = s.state_dict()
    s.aggregate([], [Failure(0, "dead")], RoundInfo(3, 4))
    np.testing.assert_array_equal(s.state_dict()["protos"], before["protos"])
    fresh = algo.server(server_ctx({}, make=linear3, num_classes=3, feature_dim=2))
    fresh.load_state_dict(freeze(s.state_dict()))
    np.testing.assert_array_equal(fresh.protos, s.protos)


def test_fedavg_proto_final_round_upload_and_proto_acc():
    server, handlers, history = simulate("fedavg-proto", {}, rounds=3, clients=4, epochs=3,
                                         ways=5)
    assert math.isnan(history[0]["proto_acc"]) and math.isnan(history[1]["proto_acc"])
    assert history[-1]["proto_acc"] > 0.6 and history[-1]["acc"] > 0.3, history
    # clients 0..3 hold classes j..j+4: classes 0..7 have a prototype, 8 and 9 none
    assert server.has.tolist() == [True] * 8 + [False] * 2
    # an update made in the final round carries the prototypes (spec: delta + optional protos)
    h = handlers[0]
    payload = h.train(freeze(server.make_task(0, RoundInfo(2, 3))),
                      LocalRun(h.ctx, epochs=1, seed=0))
    check_spec(payload, {**server.update_spec(), "protos": ("float32", (C, D)),
                         "counts": ("int64", (C,))})
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))),
                      LocalRun(h.ctx, epochs=1, seed=0))
    assert set(payload) == {"delta"}

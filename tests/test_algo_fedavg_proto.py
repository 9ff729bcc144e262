"""fedavg-proto (Qiao et al., "Prototype helps federated learning"; audit:
docs/FIDELITY.md (fedavg-proto)): the defaults are the paper's; prototypes are asked for in the
last round only (Algorithm 1 lines 5-9) or every round (the curves); eq. 2 (class means of the
received global model's features by default, or the option's post-training local model's),
eq. 3 (plain per-class mean over the clients that have
the class; the count-weighted option; staleness) and eq. 4 (nearest prototype with the latest
global model, or the option's local model) checked against plain numpy on tiny inputs; and a
short in-process federation on scikit-learn's digits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, BodyHead, C, D, check_spec, client_ctx, digits_parts, freeze,
                          make_model, server_ctx, simulate, update)
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import (ClientContext, Failure, LocalRun, RoundInfo,
                                             model_weights)
from fedbus.algorithms.core.params import default_of

torch.set_num_threads(1)

A = {"protos": np.array([[1, 0], [0, 2], [0, 0]], np.float32),
     "counts": np.array([2, 1, 0], np.int64)}  # class 2 missing at client A
B = {"protos": np.array([[4, 3], [2, 2], [5, 5]], np.float32),
     "counts": np.array([1, 3, 4], np.int64)}


class Tiny(BodyHead):
    """features(x) = x @ F.T + f, head(h) = h @ W.T + b on 2-d inputs, 3 classes."""

    def __init__(self, F=((1.0, 0.0), (0.0, 1.0)), f=(0.0, 0.0),
                 W=((1.0, -1.0), (0.5, 2.0), (-1.0, 0.0)), b=(0.1, 0.0, -0.2)):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.fc = nn.Linear(2, 3)
        with torch.no_grad():
            for p, v in ((self.body.weight, F), (self.body.bias, f), (self.fc.weight, W),
                         (self.fc.bias, b)):
                p.copy_(torch.tensor(v, dtype=torch.float32))


def tiny_client(model, x, y, params, test=None):
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    tx, ty = (x, y) if test is None else (torch.tensor(test[0], dtype=torch.float32),
                                          torch.tensor(test[1], dtype=torch.int64))
    ctx = ClientContext(client=0, model=model, device=torch.device("cpu"), train_x=x, train_y=y,
                        test_x=tx, test_y=ty, num_classes=3, feature_dim=2, params=params,
                        train=TRAIN, seed=0)
    return get_algorithm("fedavg-proto").client(ctx)


def tiny_server(**params):
    return get_algorithm("fedavg-proto").server(
        server_ctx(params, make=lambda i: Tiny(), num_classes=3, feature_dim=2))


def zero_delta():
    return {k: np.zeros_like(v) for k, v in model_weights(Tiny()).items()}


def test_fedavg_proto_defaults_follow_the_paper():
    from fedbus.algorithms.fedavg_proto import FedAvgProtoServer
    defaults = {k: default_of(v) for k, v in FedAvgProtoServer.PARAMS.items()}
    assert defaults == {"every_round": False,  # Algorithm 1: prototypes in round T only
                        "aggregate": "mean",  # eq. 3
                        "proto_model": "global",  # eq. 2's f_e(w_e; x), Sec. II-A's global w
                        "infer_model": "global",  # Sec. II-B: the latest model parameters
                        # a defence, off by default (fedbus.algorithms.core.robust)
                        "robust": "none", "robust_trim": 0.1, "robust_f": 1, "robust_m": 1}


def test_fedavg_proto_asks_for_prototypes_in_the_last_round_only():
    algo = get_algorithm("fedavg-proto")
    s = algo.server(server_ctx({}, rounds=3))
    assert [s.make_task(0, RoundInfo(r, 3))["send_protos"] for r in range(3)] == [False,
                                                                                  False, True]
    s = algo.server(server_ctx({"every_round": True}, rounds=3))
    assert all(s.make_task(0, RoundInfo(r, 3))["send_protos"] for r in range(3))


def test_fedavg_proto_eq3_plain_mean_over_clients_with_the_class():
    s = tiny_server()
    s.aggregate([update(0, {"delta": zero_delta()})], [], RoundInfo(0, 3))  # no prototypes yet
    assert not s.make_eval(0, RoundInfo(0, 3))["has"].any()
    s.aggregate([update(0, {"delta": zero_delta(), **A}), update(1, {"delta": zero_delta(), **B})],
                [], RoundInfo(2, 3))
    ev = s.make_eval(0, RoundInfo(2, 3))
    # eq. 3 by hand: y-bar_j = mean of y~_i,j over the clients i that have class j
    want = np.zeros((3, 2))
    for j in range(3):
        have = [p["protos"][j].astype(float) for p in (A, B) if p["counts"][j] > 0]
        want[j] = sum(have) / len(have)
    np.testing.assert_allclose(want, [[2.5, 1.5], [1.0, 2.0], [5.0, 5.0]])
    np.testing.assert_allclose(ev["protos"], want, atol=1e-6)
    assert ev["has"].tolist() == [True, True, True] and "weights" in ev


def test_fedavg_proto_weighted_option_and_staleness_by_hand():
    stale = update(1, {"delta": zero_delta(), **B}, staleness=3)  # weight 1/sqrt(4) = 0.5
    s = tiny_server()
    s.aggregate([update(0, {"delta": zero_delta(), **A}), stale], [], RoundInfo(2, 3))
    # class 0: (1*[1,0] + 0.5*[4,3]) / 1.5 = [2, 1]; class 1: (1*[0,2] + 0.5*[2,2]) / 1.5
    np.testing.assert_allclose(s.protos, [[2.0, 1.0], [2 / 3, 2.0], [5.0, 5.0]], atol=1e-6)
    s = tiny_server(aggregate="weighted")
    s.aggregate([update(0, {"delta": zero_delta(), **A}), stale], [], RoundInfo(2, 3))
    # count x staleness: class 0 a = (2, 0.5): (2*[1,0] + 0.5*[4,3]) / 2.5 = [1.6, 0.6]
    # class 1 a = (1, 1.5): (1*[0,2] + 1.5*[2,2]) / 2.5 = [1.2, 2]
    np.testing.assert_allclose(s.protos, [[1.6, 0.6], [1.2, 2.0], [5.0, 5.0]], atol=1e-6)
    before = s.state_dict()
    s.aggregate([], [Failure(0, "dead")], RoundInfo(3, 4))
    np.testing.assert_array_equal(s.state_dict()["protos"], before["protos"])
    fresh = tiny_server(aggregate="weighted")
    fresh.load_state_dict(freeze(s.state_dict()))
    np.testing.assert_array_equal(fresh.protos, s.protos)
    np.testing.assert_array_equal(fresh.has, s.has)


def test_fedavg_proto_eq2_prototypes_of_the_received_global_model():
    """proto_model = "global" (default): eq. 2 with the weights the task carries, the model
    that (aggregated one step on) classifies with them, not the client's trained model."""
    x = np.array([[1, 2], [3, 0], [0, 1], [2, 2], [5, 5], [1, 1]], float)
    y = np.array([0, 0, 1, 1, 0, 1])  # class 2 absent: zero row, count 0
    own_F, global_F, global_f = np.eye(2), np.array([[0.5, 1.0], [1.0, -0.5]]), (0.3, -0.1)
    h = tiny_client(Tiny(F=own_F), x, y, {})
    received = model_weights(Tiny(F=global_F, f=global_f))
    payload = h.train(freeze({"weights": received, "send_protos": True}),
                      LocalRun(h.ctx, epochs=2, seed=0))
    trained = model_weights(h.ctx.model)
    assert not np.allclose(trained["body.weight"], global_F)  # it trained from the received
    feats = x @ global_F.T + np.array(global_f)
    want = np.array([feats[y == 0].mean(0), feats[y == 1].mean(0), [0.0, 0.0]])
    np.testing.assert_allclose(payload["protos"], want, atol=1e-5)
    np.testing.assert_array_equal(payload["counts"], [3, 3, 0])
    check_spec(payload, {"protos": ("float32", (3, 2)), "counts": ("int64", (3,))})
    # the trained model's class means are another thing (what "local" sends)
    trained_feats = x @ trained["body.weight"].astype(float).T + trained["body.bias"]
    assert not np.allclose(payload["protos"][0], trained_feats[y == 0].mean(0), atol=1e-3)


def test_fedavg_proto_global_prototypes_on_digits_are_the_received_models_class_means():
    """On real data: every round (every_round), each client's uploaded prototypes are the
    class means of the received global model's features over its training split."""
    server, handlers, _ = simulate("fedavg-proto", {"every_round": True}, rounds=2, clients=3,
                                   ways=4)
    for i, h in enumerate(handlers):
        task = freeze(server.make_task(i, RoundInfo(2, 3)))
        model = make_model(0)  # the same network, the received global weights loaded
        model.load_state_dict({k: torch.tensor(np.array(v)) for k, v in task["weights"].items()})
        model.eval()
        with torch.no_grad():
            feats = model.features(h.ctx.train_x).double().numpy()
        labels = h.ctx.train_y.numpy()
        payload = h.train(task, LocalRun(h.ctx, epochs=1, seed=7))
        for c in range(C):
            if (labels == c).any():
                np.testing.assert_allclose(payload["protos"][c], feats[labels == c].mean(0),
                                           rtol=1e-5, atol=1e-5)
                assert payload["counts"][c] == (labels == c).sum()
            else:
                assert payload["counts"][c] == 0 and not payload["protos"][c].any()


def test_fedavg_proto_proto_model_leaves_the_training_alone():
    """The prototype pass (eval mode, no gradient, no random draw) changes no weight: the
    same task gives the same delta under either proto_model, so the FedAvg rows of the
    recipes read the same training whichever prototypes a run computes."""
    part = digits_parts(1, ways=4)[0]
    server = get_algorithm("fedavg-proto").server(server_ctx({}, clients=1, rounds=1))
    task = freeze(server.make_task(0, RoundInfo(0, 1)))
    out = {}
    for proto_model in ("global", "local"):
        h = get_algorithm("fedavg-proto").client(
            client_ctx(0, part, {"proto_model": proto_model}))
        out[proto_model] = h.train(task, LocalRun(h.ctx, epochs=1, seed=3))
    assert all((out["global"]["delta"][k] == out["local"]["delta"][k]).all()
               for k in out["global"]["delta"])
    assert not np.allclose(out["global"]["protos"], out["local"]["protos"])


def test_fedavg_proto_eq2_prototypes_of_the_post_training_local_model():
    x = np.array([[1, 2], [3, 0], [0, 1], [2, 2], [5, 5], [1, 1]], float)
    y = np.array([0, 0, 1, 1, 0, 1])  # class 2 absent: zero row, count 0
    h = tiny_client(Tiny(), x, y, {"proto_model": "local"})
    start = model_weights(h.ctx.model)
    payload = h.train(freeze({"weights": start, "send_protos": True}),
                      LocalRun(h.ctx, epochs=2, seed=0))
    trained = model_weights(h.ctx.model)
    assert not np.allclose(trained["body.weight"], start["body.weight"])  # it did train
    feats = x @ trained["body.weight"].astype(float).T + trained["body.bias"]
    want = np.array([feats[y == 0].mean(0), feats[y == 1].mean(0), [0.0, 0.0]])
    np.testing.assert_allclose(payload["protos"], want, atol=1e-5)
    np.testing.assert_array_equal(payload["counts"], [3, 3, 0])
    check_spec(payload, {"protos": ("float32", (3, 2)), "counts": ("int64", (3,))})


@pytest.mark.parametrize("infer_model", ["global", "local"])
def test_fedavg_proto_eq4_nearest_prototype_with_the_global_or_local_model(infer_model):
    test_x = np.array([[1.0, 0.2], [0.1, 1.0], [-1.0, 0.3], [0.8, -0.9], [0.2, 0.1]])
    test_y = np.array([0, 1, 2, 0, 1])
    protos = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], np.float32)
    has = np.array([True, True, False])  # class 2 has no prototype: never predicted
    local_F, global_F = np.eye(2), np.array([[0.0, 1.0], [1.0, 0.0]])  # global swaps the axes
    h = tiny_client(Tiny(F=local_F), test_x, test_y, {"infer_model": infer_model},
                    test=(test_x, test_y))
    global_w = model_weights(Tiny(F=global_F))
    out = h.evaluate(freeze({"weights": global_w, "protos": protos, "has": has}))

    def eq4_accuracy(F):
        feats = test_x @ F.T
        dist = np.linalg.norm(feats[:, None, :] - protos[None, :, :], axis=2)
        dist[:, ~has] = np.inf
        return float((dist.argmin(1) == test_y).mean())

    by_hand = {"global": eq4_accuracy(global_F), "local": eq4_accuracy(local_F)}
    assert by_hand == {"global": 0.2, "local": 0.6}  # the two models disagree here
    assert out["proto_acc"] == pytest.approx(by_hand[infer_model])
    # "acc" is the global model's head either way, and the local weights come back
    logits = (test_x @ global_F.T) @ global_w["fc.weight"].T + global_w["fc.bias"]
    assert out["acc"] == pytest.approx(float((logits.argmax(1) == test_y).mean()))
    np.testing.assert_array_equal(h.ctx.model.body.weight.detach().numpy(), local_F)


@pytest.mark.parametrize("params", [{}, {"infer_model": "local", "aggregate": "weighted"}])
def test_fedavg_proto_final_round_upload_and_proto_acc(params):
    server, handlers, history = simulate("fedavg-proto", params, rounds=3, clients=4, epochs=3,
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

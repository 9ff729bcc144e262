"""fedproto (Tan et al., AAAI 2022; audit: docs/FIDELITY.md (fedproto)): the defaults are
the paper's; prototype aggregation by hand (eq. 6 count-weighted, the code's unweighted
mean, staleness, the "has" mask, keep_missing), the client regularisers by hand (eqs. 7-8
on a hand-made two-dimensional network, the code's MSE), local prototypes (eq. 3, and the
code's last-epoch training features), nearest-prototype inference (eq. 4, all vs own
classes), heterogeneous models, and short in-process federations on scikit-learn's digits.
fedavg-proto (Qiao et al.) is tested in test_algo_fedavg_proto.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, BodyHead, C, D, check_spec, client_ctx, digits_parts, freeze,
                          server_ctx, simulate, update)
from sklearn.datasets import load_digits
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, Failure, LocalRun, RoundInfo

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


def test_fedproto_defaults_follow_the_paper():
    from fedbus.algorithms.core.params import default_of
    from fedbus.algorithms.fedproto import INFER_CLASSES, PROTO_LOSS, FedProtoServer
    defaults = {k: default_of(v) for k, v in FedProtoServer.PARAMS.items()}
    assert defaults == {"lam": 1.0,  # the paper's best lambda on MNIST and FEMNIST
                        "proto_loss": "mse",  # App. B eq. 1 (eq. 8 leaves d open), the code
                        "aggregate": "weighted",  # eq. 6
                        "keep_missing": True,  # = the code's set replacement at full participation
                        "infer_classes": "all",  # eq. 4
                        "proto_source": "after",  # eq. 3
                        # a defence, off by default (fedbus.algorithms.core.robust)
                        "robust": "none", "robust_trim": 0.1, "robust_f": 1, "robust_m": 1}
    assert default_of(PROTO_LOSS) == "mse" and default_of(INFER_CLASSES) == "all"


def test_fedproto_unweighted_mean_by_hand():
    s = proto_server(aggregate="mean")  # the reference code's proto_aggregation
    s.aggregate([update(0, A), update(1, B)], [], RoundInfo(0, 3))
    # class 0: ([1,0] + [4,3]) / 2; class 1: ([0,2] + [2,2]) / 2; class 2: B alone
    np.testing.assert_allclose(s.protos, [[2.5, 1.5], [1.0, 2.0], [5.0, 5.0]], atol=1e-6)
    assert s.make_task(0, RoundInfo(1, 3))["has"].tolist() == [True, True, True]


def test_fedproto_eq6_count_weighted_mean_by_hand():
    s = proto_server()  # aggregate = "weighted" (eq. 6) is the default
    s.aggregate([update(0, A), update(1, B)], [], RoundInfo(0, 3))
    # class 0: (2*[1,0] + 1*[4,3]) / 3 = [2, 1]; class 1: (1*[0,2] + 3*[2,2]) / 4 = [1.5, 2]
    np.testing.assert_allclose(s.protos, [[2.0, 1.0], [1.5, 2.0], [5.0, 5.0]], atol=1e-6)
    # the same, written as eq. 6's sum over N_j of |D_i,j| / N_j * C_i^(j), in plain numpy
    pa, pb = A["protos"].astype(float), B["protos"].astype(float)
    na, nb = A["counts"].astype(float), B["counts"].astype(float)
    want = np.zeros((3, 2))
    for j in range(3):
        n_j = na[j] + nb[j]
        want[j] = na[j] / n_j * pa[j] + nb[j] / n_j * pb[j]
    np.testing.assert_allclose(s.protos, want, atol=1e-6)
    assert s.make_task(0, RoundInfo(1, 3))["has"].tolist() == [True, True, True]


def test_fedproto_staleness_weights_by_hand():
    stale = update(1, B, staleness=3)  # weight 1/sqrt(4) = 0.5
    s = proto_server(aggregate="mean")
    s.aggregate([update(0, A), stale], [], RoundInfo(3, 5))
    # class 0: (1*[1,0] + 0.5*[4,3]) / 1.5 = [2, 1]; class 1: (1*[0,2] + 0.5*[2,2]) / 1.5
    np.testing.assert_allclose(s.protos, [[2.0, 1.0], [2 / 3, 2.0], [5.0, 5.0]], atol=1e-6)
    s = proto_server()  # eq. 6
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
    h = get_algorithm("fedproto").client(client_ctx(0, part, {"lam": 2.0, "proto_loss": "mse"}))
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


def test_fedproto_eq8_regulariser_by_hand():
    part = digits_parts(4)[0]
    h = get_algorithm("fedproto").client(client_ctx(0, part, {"lam": 0.5,
                                                              "proto_loss": "eq8"}))
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


def test_fedproto_eq8_mean_is_fedtgps_eq4_and_its_eq11_regulariser():
    """proto_loss = "eq8_mean": FedTGP's eq. 4 statement of FedProto's loss, lam E_{c ~ C_i}
    phi(P_i^c, P-bar^c): eq. 8's distances averaged over the batch's classes, by hand, and
    the very function FedTGP's eq. 11 (fedtgp proto_loss = "paper") computes on the same
    batch and prototypes: one form for the fedtgp-hetero recipe's like-for-like rows."""
    from fedbus.algorithms.fedtgp import prototype_regulariser

    part = digits_parts(4)[0]
    h = get_algorithm("fedproto").client(client_ctx(0, part, {"lam": 0.1,
                                                              "proto_loss": "eq8_mean"}))
    g = np.random.default_rng(2).normal(size=(C, D)).astype(np.float32)
    has = np.arange(C) < 7
    h._global, h._has = h.global_protos(task_with(g, has))
    h._reg = True
    x, y = part[0][:40], part[1][:40]
    with torch.no_grad():
        feats = h.ctx.model.features(x)
        ce = nn.functional.cross_entropy(h.ctx.model(x), y).item()
        loss = h.batch_loss(x, y).item()
        fedtgp_eq11 = prototype_regulariser(feats, y, torch.from_numpy(g),
                                            torch.from_numpy(has), "paper").item()
    distances = [float(np.linalg.norm(feats.numpy()[y.numpy() == k].mean(0) - g[k]))
                 for k in sorted(set(y.tolist())) if has[k]]
    assert len(distances) > 1  # a mean differs from eq. 8's sum here
    assert loss == pytest.approx(ce + 0.1 * np.mean(distances), rel=1e-5)
    assert loss == pytest.approx(ce + 0.1 * fedtgp_eq11, rel=1e-5)


class Tiny(BodyHead):
    """A hand-made network on 2-d inputs: features(x) = x @ F.T + f (identity by default),
    head(h) = h @ W.T + b with the given 3 x 2 W. Everything it computes is a few lines
    of numpy."""

    def __init__(self, W, b):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.fc = nn.Linear(2, 3)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.body.bias.zero_()
            self.fc.weight.copy_(torch.tensor(W, dtype=torch.float32))
            self.fc.bias.copy_(torch.tensor(b, dtype=torch.float32))


def tiny_ctx(model, x, y, params, train=None):
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    return ClientContext(client=0, model=model, device=torch.device("cpu"), train_x=x,
                         train_y=y, test_x=x, test_y=y, num_classes=3, feature_dim=2,
                         params=params, train=train or TRAIN, seed=0)


def np_cross_entropy(logits, y):
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return -logp[np.arange(len(y)), y].mean(), np.exp(logp)


def test_fedproto_eq7_eq8_paper_loss_and_gradient_on_tiny_inputs():
    # eq. 7: CE + lam * L_R; eq. 8 with the L2 distance and Algorithm 1's batch
    # prototypes: L_R = sum over the batch's classes k with a global prototype of
    # || mean_{y=k} f(x) - C-bar_k ||_2 (proto_loss = "eq8").
    W, b = [[1.0, -1.0], [0.5, 2.0], [-1.0, 0.0]], [0.1, 0.0, -0.2]
    x = np.array([[1, 2], [3, 0], [0, 1], [2, 2], [5, 5]], dtype=np.float64)
    y = np.array([0, 0, 1, 1, 2])
    g = np.array([[0, 0], [1, 1], [9, 9]], dtype=np.float64)
    has = np.array([True, True, False])  # class 2 has no global prototype: no term
    lam = 0.5
    h = get_algorithm("fedproto").client(tiny_ctx(Tiny(W, b), x, y,
                                                  {"lam": lam, "proto_loss": "eq8"}))
    assert h.proto_loss == "eq8"
    h._global, h._has = h.global_protos(task_with(g, has))
    h._reg = True
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    loss = h.batch_loss(xt, torch.tensor(y))
    loss.backward()
    # by hand: features are x itself; batch means m_0 = [2, 1], m_1 = [1, 1.5]
    logits = x @ np.array(W).T + np.array(b)
    ce, prob = np_cross_entropy(logits, y)
    m0, m1 = x[y == 0].mean(0), x[y == 1].mean(0)
    np.testing.assert_allclose([m0, m1], [[2, 1], [1, 1.5]])
    reg = np.linalg.norm(m0 - g[0]) + np.linalg.norm(m1 - g[1])  # sqrt(5) + 0.5
    assert loss.item() == pytest.approx(ce + lam * reg, rel=1e-6)
    # the gradient flows through the batch means: d||m_k - g_k|| / dx_i = u_k / n_k
    onehot = np.eye(3)[y]
    grad = (prob - onehot) @ np.array(W) / len(y)
    for k, m in ((0, m0), (1, m1)):
        u = (m - g[k]) / np.linalg.norm(m - g[k])
        grad[y == k] += lam * u / (y == k).sum()
    np.testing.assert_allclose(xt.grad.numpy(), grad, rtol=1e-5, atol=1e-6)


def test_fedproto_mse_option_on_tiny_inputs():
    # the reference code: loss2 = nn.MSELoss()(proto_new, protos), proto_new = the
    # features with each row whose class has a global prototype replaced by it
    W, b = [[1.0, -1.0], [0.5, 2.0], [-1.0, 0.0]], [0.1, 0.0, -0.2]
    x = np.array([[1, 2], [3, 0], [0, 1], [2, 2], [5, 5]], dtype=np.float64)
    y = np.array([0, 0, 1, 1, 2])
    g = np.array([[0, 0], [1, 1], [9, 9]], dtype=np.float64)
    has = np.array([True, True, False])
    h = get_algorithm("fedproto").client(tiny_ctx(Tiny(W, b), x, y,
                                                  {"lam": 3.0, "proto_loss": "mse"}))
    h._global, h._has = h.global_protos(task_with(g, has))
    h._reg = True
    with torch.no_grad():
        loss = h.batch_loss(torch.tensor(x, dtype=torch.float32), torch.tensor(y)).item()
    ce, _ = np_cross_entropy(x @ np.array(W).T + np.array(b), y)
    proto_new = x.copy()
    for i, k in enumerate(y):
        if has[k]:
            proto_new[i] = g[k]
    mse = ((proto_new - x) ** 2).mean()  # over all 5 x 2 entries: (5 + 9 + 1 + 2 + 0) / 10
    assert mse == pytest.approx(1.7)
    assert loss == pytest.approx(ce + 3.0 * mse, rel=1e-6)


class EpochShift(nn.Module):
    """features(x) = x + (index of the local epoch the call falls in): the class
    means of any one epoch are known by hand whatever order the batches come in."""

    def __init__(self, steps_per_epoch):
        super().__init__()
        self.fc = nn.Linear(2, 3)
        self.calls, self.per_epoch = 0, steps_per_epoch

    def features(self, x):
        epoch = self.calls // self.per_epoch
        if self.training:
            self.calls += 1
        return x + float(epoch)

    def head(self, h):
        return self.fc(h)

    def forward(self, x):
        return self.head(self.features(x))


@pytest.mark.parametrize("epochs,to_run,shift", [(2, None, 1.0), (3, None, 2.0),
                                                 (2, 1.5, 0.0), (3, 2.5, 1.0)])
def test_fedproto_during_source_is_the_last_complete_epoch(epochs, to_run, shift):
    # the code empties agg_protos_label at each local epoch: the update is the mean of the
    # last epoch's training features (here x + epoch index), not of all epochs
    # (x + 0.5 for two epochs). A run cut mid-epoch uses its last complete epoch.
    x = np.array([[1, 2], [3, 0], [0, 1], [2, 2], [5, 5], [1, 1], [4, 0], [0, 4]], float)
    y = np.array([0, 0, 1, 1, 2, 2, 2, 0])
    train = {**TRAIN, "lr": 0.0, "momentum": 0.0, "batch_size": 4}  # 2 steps per epoch
    h = get_algorithm("fedproto").client(
        tiny_ctx(EpochShift(2), x, y, {"proto_source": "during"}, train=train))
    run = LocalRun(h.ctx, epochs=epochs, seed=0, epochs_to_run=to_run)
    payload = h.train(task_with(np.zeros((3, 2)), np.zeros(3, bool)), run)
    steps = 2 * epochs if to_run is None else round(2 * to_run)
    assert run.work.steps == steps
    want = np.array([x[y == k].mean(0) + shift for k in range(3)])
    np.testing.assert_allclose(payload["protos"], want, atol=1e-6)
    np.testing.assert_array_equal(payload["counts"], [3, 2, 3])


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

# the defaults, eq. 8 read literally, and the reference code's choices (but all-class
# inference)
@pytest.mark.parametrize("params", [{}, {"proto_loss": "eq8"},
                                    {"aggregate": "mean", "proto_loss": "mse",
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

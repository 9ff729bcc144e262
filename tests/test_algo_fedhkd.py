"""fedhkd (Chen, Wang, Vikalo, ICLR 2023; algorithms/fedhkd.py): the defaults are the paper's
(App. A.1, Sec. 4.3); the server step by hand on three clients of three classes (eq. 1's
weights, eq. 9's count-weighted hyper-knowledge, the staleness weights, K^j empty when nobody
shares j) and its sums merged as a relay does; the client's local hyper-knowledge by hand on
a network whose features are its inputs (eq. 4, the threshold nu withholding a class, the
Gaussian mechanism of eq. 7 with Lemma 1's sensitivity, drawn from the task's seed); eq. 11's
two terms by hand; one real task on digits; the reference code's choices, each pinned (the
last client's values, no threshold, one unscaled noise vector, KL and MSE terms, gradient
clipping, unweighted weights, persistent knowledge); and real federations of processes on
digits (sync with a folded straggler, async), learning and replaying identically."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, BodyHead, check_spec, client_ctx, digits_parts, freeze,
                          server_ctx, update)
from helpers import (SMALL, TINY, assert_update_replays, fedbus, merged, metrics,
                     run_async_with_slow_client, run_federation, run_with_folded_straggler)
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, ClientUpdate, LocalRun, RoundInfo, Work
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import default_of

torch.set_num_threads(1)
ALGO = get_algorithm("fedhkd")


# --- a network whose features are its inputs: every mean and soft prediction by hand --------

class Identity2(BodyHead):
    """features(x) = x (D = 2), head = a fixed Linear(2, 3)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Identity()
        self.fc = nn.Linear(2, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
            self.fc.bias.copy_(torch.tensor([0.0, 0.5, 0.0]))


def tiny_server(**params):
    return ALGO.server(server_ctx(params, clients=3, make=lambda i: Identity2(), num_classes=3,
                                  feature_dim=2))


def tiny_client(x, y, **params):
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)
    ctx = ClientContext(client=0, model=Identity2(), device=torch.device("cpu"), train_x=x,
                        train_y=y, test_x=x, test_y=y, num_classes=3, feature_dim=2,
                        params=params, train=TRAIN, seed=0)
    return ALGO.client(ctx)


def no_training(handler, task, seed=5):
    """A task of zero epochs: the upload is the hyper-knowledge of the model as sent."""
    return handler.train(freeze(task), LocalRun(handler.ctx, epochs=0, seed=seed))


def softmax(z, t):
    e = np.exp(np.asarray(z, np.float64) / t)
    return e / e.sum(axis=1, keepdims=True)


# class 0: 6 samples, class 1: 3, class 2: 1 (a fraction 0.1 < nu = 0.25)
X = [[1, 2], [3, 0], [2, 2], [0, 1], [1, 1], [5, 0], [0, 3], [1, 4], [2, 2], [4, 4]]
Y = [0, 0, 0, 0, 0, 0, 1, 1, 1, 2]


def by_hand(x, y, t=0.5):
    """Eq. 4 in numpy: per class the mean input (= representation) and mean of
    softmax(fc(x) / T), with Identity2's head."""
    x, y = np.asarray(x, np.float64), np.asarray(y)
    w, b = np.array([[1, 0], [0, 1], [-1, -1]], np.float64), np.array([0, 0.5, 0])
    q = softmax(x @ w.T + b, t)
    h = np.stack([x[y == j].mean(0) if (y == j).any() else np.zeros(2) for j in range(3)])
    qm = np.stack([q[y == j].mean(0) if (y == j).any() else np.zeros(3) for j in range(3)])
    return h, qm, np.bincount(y, minlength=3)


# --- defaults ---------------------------------------------------------------------------------

def test_fedhkd_defaults_follow_the_paper():
    defaults = {k: default_of(v) for k, v in ALGO.server.PARAMS.items()}
    assert defaults == {"lam": 0.05, "gamma": 0.05,  # App. A.1 (FedHKD; FedHKD* has gamma 0)
                        "temperature": 0.5, "sigma": 7.0, "nu": 0.25,  # App. A.1
                        "zeta": 3.0,  # Sec. 4.3: |h(l)| <= 3 after the final BatchNorm
                        "clip_features": False,  # the paper clips nothing
                        "noise": "paper",  # eq. 7: per class, scaled by Lemma 1
                        "aggregate": "weighted",  # eq. 9
                        "keep_missing": False,  # Sec. 3.2: K^j empty when nobody shares j
                        "kd_loss": "paper", "feature_loss": "paper",  # eq. 11, Euclidean
                        "clip_grad": 0.0,  # not in the paper (the code: 1.1)
                        "weights_aggregate": "weighted"}  # eq. 1
    assert ALGO.client.PARAMS is ALGO.server.PARAMS
    assert ALGO.server.needs_same_model and ALGO.server.DP_LEVELS == ()


# --- server: eq. 1 and eq. 9 by hand -------------------------------------------------------------

def delta(value):
    """The same step on every weight of Identity2's head."""
    return {"fc.weight": np.full((3, 2), value, np.float32), "fc.bias": np.full(3, value,
                                                                                np.float32)}


def payload(d, counts, protos, soft):
    return {"delta": delta(d), "counts": np.array(counts, np.int64),
            "protos": np.array(protos, np.float32), "soft": np.array(soft, np.float32)}


Z2, Z3 = [0, 0], [0, 0, 0]
PA = payload(1.0, [4, 6, 0], [[1, 0], [0, 2], Z2], [[.8, .1, .1], [.2, .7, .1], Z3])  # n 10
PB = payload(2.0, [12, 0, 8], [[4, 3], Z2, [2, 2]], [[.6, .2, .2], Z3, [.1, .1, .8]])  # n 20
PC = payload(-1.0, [0, 10, 20], [Z2, [3, 1], [5, 5]], [Z3, [.3, .6, .1], [.2, .2, .6]])  # n 30
SIZES = (10, 20, 30)


def three(staleness=(0, 0, 0)):
    return [update(i, p, n, staleness=s) for i, (p, n, s) in
            enumerate(zip((PA, PB, PC), SIZES, staleness))]


def test_server_spec_and_first_task():
    s = tiny_server()
    spec = s.update_spec()
    assert spec["protos"] == ("float32", (3, 2)) and spec["soft"] == ("float32", (3, 3))
    assert spec["counts"] == ("int64", (3,)) and set(spec["delta"]) == {"fc.weight", "fc.bias"}
    task = s.make_task(0, RoundInfo(0, 3))
    assert set(task) == {"weights", "protos", "soft", "has"} and not task["has"].any()
    assert set(s.make_eval(0, RoundInfo(0, 3))) == {"weights"}


def test_server_eq1_weights_and_eq9_hyper_knowledge_by_hand():
    s = tiny_server()
    w0 = {k: v.copy() for k, v in s.weights.items()}
    metrics = s.aggregate(three(), [], RoundInfo(0, 3))
    # eq. 1: w0 + (10 * 1 + 20 * 2 + 30 * (-1)) / 60 = w0 + 1/3 on every entry
    for k in w0:
        np.testing.assert_allclose(s.weights[k], w0[k] + 1 / 3, atol=1e-6)
    # eq. 9, p_i = N^j_i / N^j over the clients that shared j:
    # H^0 = (4 [1,0] + 12 [4,3]) / 16, H^1 = (6 [0,2] + 10 [3,1]) / 16,
    # H^2 = (8 [2,2] + 20 [5,5]) / 28
    np.testing.assert_allclose(s.protos, [[3.25, 2.25], [1.875, 1.375], [116 / 28, 116 / 28]],
                               atol=1e-6)
    # Q^0 = (4 [.8,.1,.1] + 12 [.6,.2,.2]) / 16, Q^1 = (6 [.2,.7,.1] + 10 [.3,.6,.1]) / 16, ...
    np.testing.assert_allclose(s.soft, [[0.65, 0.175, 0.175], [0.2625, 0.6375, 0.1],
                                        [4.8 / 28, 4.8 / 28, 18.4 / 28]], atol=1e-6)
    # the same, eq. 9 written out as its sum in plain numpy
    for key, got in (("protos", s.protos), ("soft", s.soft)):
        for j in range(3):
            n = [p["counts"][j] for p in (PA, PB, PC)]
            want = sum(nj / sum(n) * p[key][j].astype(float) for nj, p in zip(n, (PA, PB, PC)))
            np.testing.assert_allclose(got[j], want, atol=1e-6)
    assert s.has.tolist() == [True, True, True]
    assert metrics["updates"] == 3 and metrics["classes_received"] == 3
    task = s.make_task(1, RoundInfo(1, 3))
    np.testing.assert_array_equal(task["protos"], s.protos)
    np.testing.assert_array_equal(task["soft"], s.soft)


def test_server_staleness_weights_by_hand():
    s = tiny_server()
    w0 = {k: v.copy() for k, v in s.weights.items()}
    s.aggregate(three(staleness=(0, 3, 0)), [], RoundInfo(3, 5))  # B's weight 1/sqrt(4)
    # eq. 1 with c_i = s_i n_i: (10 * 1 + 10 * 2 - 30) / 50 = 0
    for k in w0:
        np.testing.assert_allclose(s.weights[k], w0[k], atol=1e-6)
    # class 0: a = (4, 12 * 0.5): (4 [1,0] + 6 [4,3]) / 10 = [2.8, 1.8]
    np.testing.assert_allclose(s.protos[0], [2.8, 1.8], atol=1e-6)
    # class 2: a = (8 * 0.5, 20): (4 [2,2] + 20 [5,5]) / 24 = 4.5
    np.testing.assert_allclose(s.protos[2], [4.5, 4.5], atol=1e-6)
    np.testing.assert_allclose(s.soft[1], [0.2625, 0.6375, 0.1], atol=1e-6)  # B lacks class 1


def test_a_class_nobody_shares_is_empty_and_empty_rounds_keep_the_state():
    s = tiny_server()
    s.aggregate(three(), [], RoundInfo(0, 3))
    s.aggregate([update(0, PA, 10)], [], RoundInfo(1, 3))  # A withheld class 2
    # Sec. 3.2: "If there is no participating client sharing hyper-knowledge for class j,
    # the server sets K^j = empty"
    assert s.has.tolist() == [True, True, False]
    np.testing.assert_array_equal(s.protos[2], [0, 0])
    np.testing.assert_array_equal(s.soft[2], [0, 0, 0])
    np.testing.assert_allclose(s.protos[:2], PA["protos"][:2], atol=1e-6)
    before = s.state_dict()
    metrics = s.aggregate([], [], RoundInfo(2, 3))
    assert metrics["updates"] == 0 and metrics["classes"] == 2
    after = s.state_dict()
    for k in ("protos", "soft", "has"):
        np.testing.assert_array_equal(after[k], before[k])
    fresh = tiny_server()
    fresh.load_state_dict(after)  # a resumed server
    for k, v in fresh.state_dict().items():
        if k != "weights":
            np.testing.assert_array_equal(v, after[k])


def test_relay_sums_give_the_flat_aggregation():
    rule = ALGO.server.merge_rule({})
    assert rule is ALGO.server.MERGE and rule.name == "delta-sums+hyper-knowledge-sums"
    flat, merged = tiny_server(), tiny_server()
    flat.aggregate(three(), [], RoundInfo(0, 3))
    params = merged.resolved_params()
    singles = three()
    form = None
    for u in singles[:2]:  # a relay adds A's and B's sum forms
        form = rule.add(form, rule.lift(u.payload, u.num_samples, u.work, params, u.client))
    assert rule.check(form, [["c0", 0, 10, {}], ["c1", 0, 20, {}]]) is None
    members = tuple(ClientUpdate(u.client, {}, u.num_samples, u.work, 0) for u in singles[:2])
    sums = ClientUpdate(0, freeze(form), 30, Work(1, 1.0, 1, 30), 0, members=members)
    metrics = merged.aggregate([sums, singles[2]], [], RoundInfo(0, 3))
    assert metrics["updates"] == 3
    for k in flat.weights:
        np.testing.assert_allclose(merged.weights[k], flat.weights[k], atol=1e-6)
    np.testing.assert_allclose(merged.protos, flat.protos, atol=1e-6)
    np.testing.assert_allclose(merged.soft, flat.soft, atol=1e-6)
    np.testing.assert_array_equal(merged.has, flat.has)


# --- the reference code's server choices --------------------------------------------------------

def test_code_option_last_client_overwrites_each_class():
    s = tiny_server(aggregate="last")
    s.aggregate(three(staleness=(0, 0, 2)), [], RoundInfo(2, 3))
    # the code's global_features.update(local_features), in the aggregation's order: class 0
    # last held by B, classes 1 and 2 by C (its staleness weight plays no part)
    np.testing.assert_array_equal(s.protos, [[4, 3], [3, 1], [5, 5]])
    np.testing.assert_array_equal(s.soft, np.array([[.6, .2, .2], [.3, .6, .1], [.2, .2, .6]],
                                                   np.float32))
    # no sum: relays forward, secure aggregation is refused
    assert ALGO.server.merge_rule({"aggregate": "last"}) is None
    assert not ALGO.server.merges({"aggregate": "last"})
    assert ALGO.server.merges({}) and ALGO.server.merges({"aggregate": "mean"})


def test_code_options_unweighted_means_and_persistent_knowledge():
    s = tiny_server(aggregate="mean", weights_aggregate="mean", keep_missing=True)
    w0 = {k: v.copy() for k, v in s.weights.items()}
    s.aggregate(three(), [], RoundInfo(0, 3))
    # the code's average_weights: (1 + 2 - 1) / 3; its global_knowledge_aggregation: plain means
    for k in w0:
        np.testing.assert_allclose(s.weights[k], w0[k] + 2 / 3, atol=1e-6)
    np.testing.assert_allclose(s.protos, [[2.5, 1.5], [1.5, 1.5], [3.5, 3.5]], atol=1e-6)
    np.testing.assert_allclose(s.soft[2], [0.15, 0.15, 0.7], atol=1e-6)
    s.aggregate([update(0, PA, 10)], [], RoundInfo(1, 3))
    # the code's dictionaries persist: class 2 keeps its value from the round before
    assert s.has.tolist() == [True, True, True]
    np.testing.assert_allclose(s.protos[2], [3.5, 3.5], atol=1e-6)
    # the relay's sums follow the "mean" options too
    flat, merged = (tiny_server(aggregate="mean", weights_aggregate="mean") for _ in range(2))
    flat.aggregate(three(), [], RoundInfo(0, 3))
    rule, params = merged.MERGE, merged.resolved_params()
    ups = three()
    form = rule.add(None, rule.lift(ups[0].payload, 10, ups[0].work, params, 0))
    form = rule.add(form, rule.lift(ups[1].payload, 20, ups[1].work, params, 1))
    members = tuple(ClientUpdate(u.client, {}, u.num_samples, u.work, 0) for u in ups[:2])
    merged.aggregate([ClientUpdate(0, freeze(form), 30, Work(1, 1.0, 1, 30), 0,
                                   members=members), ups[2]], [], RoundInfo(0, 3))
    for k in flat.weights:
        np.testing.assert_allclose(merged.weights[k], flat.weights[k], atol=1e-6)
    np.testing.assert_allclose(merged.protos, flat.protos, atol=1e-6)


# --- client: eq. 4, the threshold nu, eq. 7 by hand -----------------------------------------------

def test_client_hyper_knowledge_and_threshold_nu_by_hand():
    server = tiny_server()
    task = server.make_task(0, RoundInfo(0, 3))
    up = no_training(tiny_client(X, Y, sigma=0.0), task)
    h, q, n = by_hand(X, Y)
    # nu = 0.25: class 2 is 1 of 10 samples (0.1 < nu), so it is withheld: count 0, zero rows
    assert up["counts"].tolist() == [6, 3, 0]
    np.testing.assert_allclose(up["protos"], [h[0], h[1], [0, 0]], atol=1e-6)
    np.testing.assert_allclose(up["soft"], [q[0], q[1], [0, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(up["soft"][:2].sum(1), 1.0, atol=1e-6)
    assert all(np.abs(v).max() == 0 for v in up["delta"].values())  # no step taken
    # the class at exactly nu is shared (the rule withholds a fraction *below* nu)
    at = no_training(tiny_client(X, Y, sigma=0.0, nu=0.3), task)
    assert at["counts"].tolist() == [6, 3, 0]
    above = no_training(tiny_client(X, Y, sigma=0.0, nu=0.31), task)
    assert above["counts"].tolist() == [6, 0, 0]
    # what the server then holds for class 2 comes from the other client alone
    other = payload(0.0, [0, 0, 5], [Z2, Z2, [7, 7]], [Z3, Z3, [.1, .1, .8]])
    server.aggregate([update(0, up, 10), update(1, other, 5)], [], RoundInfo(0, 3))
    np.testing.assert_allclose(server.protos, [h[0], h[1], [7, 7]], atol=1e-6)


def test_code_option_no_threshold_shares_every_class():
    task = tiny_server().make_task(0, RoundInfo(0, 3))
    up = no_training(tiny_client(X, Y, sigma=0.0, nu=0.0), task)  # the code: no nu
    h, q, n = by_hand(X, Y)
    assert up["counts"].tolist() == [6, 3, 1]
    np.testing.assert_allclose(up["protos"], h, atol=1e-6)
    np.testing.assert_allclose(up["soft"], q, atol=1e-6)


def test_gaussian_mechanism_eq7_with_lemma1_sensitivity_seeded():
    from fedbus.algorithms.fedhkd import _noise_seed
    task = tiny_server().make_task(0, RoundInfo(0, 3))
    clean = no_training(tiny_client(X, Y, sigma=0.0, nu=0.0), task, seed=11)
    noisy = no_training(tiny_client(X, Y, nu=0.0), task, seed=11)  # sigma 7, zeta 3
    again = no_training(tiny_client(X, Y, nu=0.0), task, seed=11)
    other = no_training(tiny_client(X, Y, nu=0.0), task, seed=12)
    for k in ("protos", "soft", "counts"):
        np.testing.assert_array_equal(noisy[k], again[k])  # same task seed, same upload
    assert not np.array_equal(noisy["protos"], other["protos"])
    np.testing.assert_array_equal(noisy["soft"], clean["soft"])  # only h-bar is noised
    # chi^j(l) ~ N(0, (2 zeta / N^j)^2 sigma^2), independent per class and coordinate,
    # drawn from the generator seeded by the task's seed
    z = torch.randn(3, 2, generator=torch.Generator().manual_seed(_noise_seed(11)),
                    dtype=torch.float64).numpy()
    std = 7.0 * 2 * 3.0 / np.array([6.0, 3.0, 1.0])
    np.testing.assert_allclose(noisy["protos"] - clean["protos"], z * std[:, None], atol=1e-4)
    # a class below nu carries no noise either: its row stays zero
    withheld = no_training(tiny_client(X, Y), task, seed=11)
    np.testing.assert_array_equal(withheld["protos"][2], [0, 0])


def test_code_option_one_unscaled_noise_vector():
    from fedbus.algorithms.fedhkd import _noise_seed
    task = tiny_server().make_task(0, RoundInfo(0, 3))
    clean = no_training(tiny_client(X, Y, sigma=0.0, nu=0.0), task, seed=4)
    code = no_training(tiny_client(X, Y, sigma=2.0, nu=0.0, noise="code"), task, seed=4)
    noise = code["protos"] - clean["protos"]
    # the code's local_knowledge_aggregation: std * randn(code_len), added to every class
    z = torch.randn(2, generator=torch.Generator().manual_seed(_noise_seed(4)),
                    dtype=torch.float64).numpy()
    np.testing.assert_allclose(noise, np.tile(2.0 * z, (3, 1)), atol=1e-5)


def test_clip_features_bounds_the_means():
    task = tiny_server().make_task(0, RoundInfo(0, 3))
    up = no_training(tiny_client(X, Y, sigma=0.0, nu=0.0, zeta=2.0, clip_features=True), task)
    h, _, _ = by_hand(np.clip(X, -2, 2), Y)
    np.testing.assert_allclose(up["protos"], h, atol=1e-6)
    # the soft predictions come from the representations as they are
    np.testing.assert_allclose(up["soft"], by_hand(X, Y)[1], atol=1e-6)


# --- eq. 11 by hand ---------------------------------------------------------------------------

def test_eq11_terms_by_hand_and_the_codes_forms():
    from fedbus.algorithms.fedhkd import classifier_term, feature_term
    head = Identity2().fc
    H = torch.tensor([[1.0, 0.0], [0.0, 2.0], [9.0, 9.0]])
    Q = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.0, 0.0, 0.0]])
    has = torch.tensor([True, True, False])
    z = np.array([[1, 0.5, -1], [0, 2.5, -2]], np.float64)  # head(H[has]) by hand
    q = softmax(z, 0.5)
    # 1/n sum_j ||Q(G(H^j), T) - Q^j||_2, n = 3 classes (class 2 has no knowledge: adds 0)
    want = (np.linalg.norm(q[0] - Q[0].numpy()) + np.linalg.norm(q[1] - Q[1].numpy())) / 3
    got = classifier_term(head, H, Q, has, 0.5, "paper")
    assert got.item() == pytest.approx(want, rel=1e-5)
    # the code: nn.KLDivLoss()(log Q(G(H), T), Q): mean over the 2 x 3 entries
    p = Q[:2].numpy().astype(np.float64)
    kl = (p * (np.log(p) - np.log(q))).sum() / 6
    assert classifier_term(head, H, Q, has, 0.5, "kl").item() == pytest.approx(kl, rel=1e-5)
    # 1/B sum_k ||R(x_k) - H^{y_k}||_2 (a sample of class 2 adds 0, still counts in B)
    h = torch.tensor([[1.0, 1.0], [3.0, 4.0], [0.0, 0.0]])
    y = torch.tensor([0, 1, 2])
    want = (1.0 + np.sqrt(9 + 4)) / 3
    assert feature_term(h, y, H, has, "paper").item() == pytest.approx(want, rel=1e-6)
    # the code: MSELoss over B x D entries, a class without H keeping its own feature
    mse = (0 + 1 + 9 + 4 + 0 + 0) / 6
    assert feature_term(h, y, H, has, "mse").item() == pytest.approx(mse, rel=1e-6)


def test_round0_trains_on_cross_entropy_alone_and_the_terms_move_the_model():
    """K empty (App. A.4): the first task's loss is CE alone, the same whatever lam and gamma;
    with knowledge the two terms change the update."""
    part = digits_parts(4, ways=3)[0]
    s = ALGO.server(server_ctx({}))
    first = s.make_task(0, RoundInfo(0, 3))

    def one(params, task, seed=3):
        h = ALGO.client(client_ctx(0, part, params))
        return h.train(freeze(task), LocalRun(h.ctx, epochs=1, seed=seed))

    a, b = one({}, first), one({"lam": 5.0, "gamma": 5.0}, first)
    for k in a["delta"]:
        np.testing.assert_array_equal(a["delta"][k], b["delta"][k])
    s.aggregate([update(0, a, len(part[1]))], [], RoundInfo(0, 3))
    second = s.make_task(0, RoundInfo(1, 3))
    assert second["has"].any()
    c, d = one({}, second), one({"lam": 0.0, "gamma": 0.0}, second)
    assert any(not np.array_equal(c["delta"][k], d["delta"][k]) for k in c["delta"])


def test_code_option_gradient_clipping_in_knowledge_aided_steps():
    part = digits_parts(4, ways=3)[0]
    s = ALGO.server(server_ctx({}))
    steps = math.ceil(len(part[1]) / TRAIN["batch_size"])

    def norm(params, task):
        h = ALGO.client(client_ctx(0, part, params))
        up = h.train(freeze(task), LocalRun(h.ctx, epochs=1, seed=3))
        return math.sqrt(sum(float((v.astype(np.float64) ** 2).sum())
                             for v in up["delta"].values())), up

    first = s.make_task(0, RoundInfo(0, 3))
    free, up = norm({}, first)
    clipped_first, _ = norm({"clip_grad": 1e-4}, first)
    assert clipped_first == pytest.approx(free)  # the code's first round does not clip
    s.aggregate([update(0, up, len(part[1]))], [], RoundInfo(0, 3))
    second = s.make_task(0, RoundInfo(1, 3))
    clipped, _ = norm({"clip_grad": 1e-4}, second)
    # every step moves the weights by at most lr x (sum of the momentum factors) x 1e-4
    assert clipped <= TRAIN["lr"] * 1e-4 * steps / (1 - TRAIN["momentum"]) * 1.001
    assert norm({}, second)[0] > 100 * clipped


# --- client: one real task on digits ---------------------------------------------------------

def test_one_task_on_digits_uploads_and_is_seeded():
    part = digits_parts(4, ways=3)[0]  # client 0: classes 0, 1, 2 in shares ~1/2, ~1/4, ~1/6
    s = ALGO.server(server_ctx({}))
    task = freeze(s.make_task(0, RoundInfo(0, 3)))

    def run(seed, **params):
        h = ALGO.client(client_ctx(0, part, params))
        return h, h.train(task, LocalRun(h.ctx, epochs=1, seed=seed))

    h, up = run(7)
    check_spec(up, s.update_spec())
    train_y = part[1].numpy()
    sizes = np.bincount(train_y, minlength=10)
    shared = sizes / len(train_y) >= 0.25
    assert shared.sum() >= 1 and (~shared & (sizes > 0)).any()  # nu withholds a held class
    np.testing.assert_array_equal(up["counts"], np.where(shared, sizes, 0))
    assert not up["protos"][~shared].any() and not up["soft"][~shared].any()
    np.testing.assert_allclose(up["soft"][shared].sum(1), 1.0, atol=1e-5)
    assert any(np.abs(v).max() > 0 for v in up["delta"].values())
    _, same = run(7)
    _, other = run(8)
    for k in ("protos", "soft", "counts"):
        np.testing.assert_array_equal(up[k], same[k])
    for k in up["delta"]:
        np.testing.assert_array_equal(up["delta"][k], same["delta"][k])
    assert not np.array_equal(up["protos"], other["protos"])
    # the noise is eq. 7's: with the same batches, only h-bar moves, by 2 zeta sigma / N^j
    _, clean = run(7, sigma=0.0)
    for k in up["delta"]:
        np.testing.assert_array_equal(up["delta"][k], clean["delta"][k])
    np.testing.assert_array_equal(up["soft"], clean["soft"])
    noise = (up["protos"] - clean["protos"])[shared]
    want = 2 * 3.0 * 7.0 / sizes[shared]
    assert noise.std(axis=1) == pytest.approx(want, rel=0.4)  # 32 draws per class
    # evaluate: the personalised model ("acc") and the global model ("global_acc")
    out = h.evaluate(freeze(s.make_eval(0, RoundInfo(0, 3))))
    fresh = client_ctx(0, part, {}).model
    glob = head_metrics(fresh, part[2], part[3])
    own = head_metrics(h.ctx.model, part[2], part[3])
    assert out["global_acc"] == glob["acc"] and out["global_loss"] == pytest.approx(glob["loss"])
    assert out["acc"] == own["acc"] and out["num_test"] == len(part[3])


# --- real federations --------------------------------------------------------------------------

TINY_FEDHKD = merged(TINY, algorithm={"name": "fedhkd"})


def _eval_results(run) -> dict[int, list[dict]]:
    """Every client's eval metrics per version, from `fedbus log RUN --json` (what each
    client reported, before the server's summary over clients)."""
    out = fedbus("log", str(run), "--kind", "eval_result", "--json").stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    by_version: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("kind") == "eval_result":
            by_version.setdefault(r["summary"]["version"], []).append(r["summary"]["metrics"])
    return by_version


def _weighted(results: list[dict], key: str) -> float:
    n = sum(m["num_test"] for m in results)
    return sum(m[key] * m["num_test"] for m in results) / n


def test_sync_federation_with_a_folded_straggler_learns_and_replays(tmp_path):
    from test_replay import assert_identical

    run, summary, recs = run_with_folded_straggler(
        tmp_path, merged(TINY_FEDHKD, federation={"rounds": 3, "eval_every": 3},
                         train={"epochs": 2, "lr": 0.1}))
    assert all(r["agg"]["classes"] >= 1 for r in recs)  # hyper-knowledge was shared
    # learning above chance (0.1): the personalised models and the global model
    assert summary["final"]["acc_mean"] > 0.3, summary["final"]
    evals = _eval_results(run)
    final = evals[max(evals)]
    assert all("global_acc" in m for m in final)
    assert _weighted(final, "global_acc") > 0.2, final
    # and the server summarises it over clients like acc (metrics.jsonl, summary.json)
    last = [r for r in recs if "acc_mean" in r][-1]
    assert last["global_acc_weighted"] == pytest.approx(_weighted(final, "global_acc"))
    # the server replays bit for bit, and a client's update (its noise included)
    assert_identical(run, rounds=3)
    assert_update_replays(run, client=1, rnd=2)


def test_async_federation_with_a_slow_client(tmp_path):
    from test_replay import assert_identical

    run, summary, recs = run_async_with_slow_client(
        tmp_path, merged(TINY_FEDHKD, federation={"rounds": 4, "eval_every": 1}), held=True)
    assert any(r["stale"] for r in recs)  # updates made from older versions were aggregated
    final = summary["final"]
    assert 0.0 <= final["acc_mean"] <= 1.0, final
    evals = _eval_results(run)
    assert all(0.0 <= m["global_acc"] <= 1.0 for m in evals[max(evals)])
    assert_identical(run, rounds=4)


def test_merge_declaration_serves_secure_aggregation(tmp_path):
    """Eq. 1 and eq. 9 are sums: under secure aggregation the server sees only the round's
    masked total of HyperKnowledgeSums' forms, and still builds its knowledge from it."""
    cfg = merged(SMALL, federation={"clients": 4, "rounds": 2, "eval_every": 2},
                 algorithm={"name": "fedhkd"}, privacy={"secure_aggregation": True})
    run, summary = run_federation(tmp_path, cfg, timeout=240)
    recs = metrics(run)
    assert summary["rounds_completed"] == 2
    assert all(r["secagg"]["survivors"] == 4 and "failed" not in r["secagg"] for r in recs)
    assert all(r["participants"] == [0, 1, 2, 3] and r["agg"]["classes"] >= 1 for r in recs)
    assert "replay identical: " in fedbus("replay", str(run)).stdout

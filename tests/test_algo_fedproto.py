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
from sklearn.datasets import load_digits
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.base import (ClientContext, ClientUpdate, Failure, LocalRun, RoundInfo,
                                    ServerContext, Work)

torch.set_num_threads(1)

C, D = 10, 32
TRAIN = {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.0, "batch_size": 32}


# --- a tiny harness: real data, real networks, handlers called directly -------------

class Net(nn.Module):
    def __init__(self, deep: bool = False):
        super().__init__()
        pre = [nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, D)] if deep else [nn.Linear(64, D)]
        self.body = nn.Sequential(*pre, nn.ReLU())
        self.fc = nn.Linear(D, C)

    def features(self, x):
        return self.body(x)

    def head(self, h):
        return self.fc(h)

    def forward(self, x):
        return self.head(self.features(x))


def make_model(i: int, seed: int = 0, deep: bool = False) -> Net:
    with torch.random.fork_rng():
        torch.manual_seed(seed + (1000 if deep else 0))
        return Net(deep)


def digits_parts(k: int, ways: int = 10, seed: int = 0):
    """k clients; client j holds classes j, j+1, ..., j+ways-1 (mod 10), split
    75/25 into train and test; the class pools are shared out without overlap."""
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = np.asarray(data.target)
    rng = np.random.default_rng(seed)
    owners = {c: [j for j in range(k) if (c - j) % 10 < ways] for c in range(10)}
    idx = {j: [] for j in range(k)}
    for c in range(10):
        pool = rng.permutation(np.nonzero(y == c)[0])
        for j, chunk in zip(owners[c], np.array_split(pool, max(1, len(owners[c])))):
            idx[j].extend(chunk.tolist())
    parts = []
    yt = torch.as_tensor(y, dtype=torch.int64)
    for j in range(k):
        order = rng.permutation(np.array(idx[j]))
        cut = int(0.75 * len(order))
        tr, te = torch.as_tensor(order[:cut]), torch.as_tensor(order[cut:])
        parts.append((x[tr], yt[tr], x[te], yt[te]))
    return parts


def client_ctx(i, part, params, model=None, seed=0):
    model = make_model(i, seed) if model is None else model
    return ClientContext(client=i, model=model, device=torch.device("cpu"),
                         train_x=part[0], train_y=part[1], test_x=part[2], test_y=part[3],
                         num_classes=C, feature_dim=D, params=params, train=TRAIN, seed=seed + i)


def server_ctx(params, clients=4, rounds=3, make=make_model, num_classes=C, feature_dim=D,
               homogeneous=True):
    return ServerContext(params=params, train=TRAIN, num_classes=num_classes,
                         feature_dim=feature_dim, clients=clients, rounds=rounds, seed=0,
                         homogeneous=homogeneous, make_model=make)


def freeze(value):
    """What the wire hands over: fresh read-only arrays."""
    if isinstance(value, dict):
        return {k: freeze(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        out = value.copy()
        out.flags.writeable = False
        return out
    return value


def check_spec(payload, spec):
    for key, want in spec.items():
        assert key in payload, key
        if isinstance(want, dict):
            check_spec(payload[key], want)
            continue
        dtype, shape = want
        arr = payload[key]
        assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype(dtype), (key, arr.dtype)
        assert len(arr.shape) == len(shape), key
        assert all(s is None or s == a for s, a in zip(shape, arr.shape)), (key, arr.shape)


def update(i, payload, n=10, version=0, staleness=0):
    return ClientUpdate(client=i, payload=freeze(payload), num_samples=n,
                        work=Work(1, 1.0, 1, n), version=version, staleness=staleness,
                        weight=1.0 / math.sqrt(1 + staleness))


def simulate(name, params, rounds=3, clients=4, epochs=1, ways=5, hetero=False):
    algo = get_algorithm(name)
    parts = digits_parts(clients, ways)
    server = algo.server(server_ctx(params, clients, rounds, homogeneous=not hetero))
    handlers = [algo.client(client_ctx(i, p, params, model=make_model(i, deep=hetero and i % 2)))
                for i, p in enumerate(parts)]
    history = []
    for r in range(rounds):
        info = RoundInfo(r, rounds)
        ups = []
        for i, h in enumerate(handlers):
            run = LocalRun(h.ctx, epochs=epochs, seed=1000 * r + i)
            payload = h.train(freeze(server.make_task(i, info)), run)
            check_spec(payload, server.update_spec())
            ups.append(update(i, payload, len(h.ctx.train_y), version=r))
        server.aggregate(ups, [], info)
        evals = [h.evaluate(freeze(server.make_eval(i, info))) for i, h in enumerate(handlers)]
        history.append({k: float(np.mean([e[k] for e in evals])) for k in ("acc", "proto_acc")})
    return server, handlers, history


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

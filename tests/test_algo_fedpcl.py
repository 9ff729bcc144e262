"""fedpcl (Tan et al., NeurIPS 2022; audit: docs/FIDELITY.md (fedpcl)): the defaults are the
authors' code's (only the abstract is here); the server step (every client's latest set, the
unweighted class average, the fill of missing classes, the wait for every client) by hand;
the code's ConLoss and PFLlib's reading by hand on tiny tensors; one seeded client task on
digits over a frozen backbone pre-trained on MNIST; and real federations (sync with a folded
straggler, async) that learn and replay identically."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import check_spec, freeze, update
from helpers import (MNIST_NPZ, TINY, merged, needs_mnist, run_async_with_slow_client,
                     run_with_folded_straggler)

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, LocalRun, RoundInfo, ServerContext
from fedbus.algorithms.core.params import default_of
from fedbus.algorithms.fedpcl import (FedPCLServer, average_sets, filled_sets,
                                      prototype_contrast, prototype_softmax)
from fedbus.models import build_model
from fedbus.node.data.datasets import load_dataset

torch.set_num_threads(1)
ARCH = f"frozen:cnn@{MNIST_NPZ}"  # a digits federation, its backbone pre-trained on MNIST
TRAIN = {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.0, "batch_size": 32}


def test_fedpcl_defaults_are_the_codes():
    defaults = {k: default_of(v) for k, v in FedPCLServer.PARAMS.items()}
    assert defaults == {
        "loss": "code",  # lib/losses.py ConLoss summed over every client's set
        "temperature": 0.07,  # ConLoss(temperature=0.07)
        "ce_weight": 0.0,  # the code back-propagates loss2 only
        "wait_for_all": True,  # len(global_protos) == args.num_users
        "optimizer": "adam",  # update.py, Adam(lr, weight_decay=1e-4)
        "adam_weight_decay": 1e-4,
        "infer": "local"}  # test_inference_twoway: the client's own local prototypes
    assert get_algorithm("fedpcl").server is FedPCLServer
    assert not FedPCLServer.needs_same_model  # personal projections, prototypes only
    assert FedPCLServer.merge_rule() is None and FedPCLServer.DP_LEVELS == ()


# --- the server step by hand ------------------------------------------------------------------

def server(params=None, clients=3, c=3, d=2):
    ctx = ServerContext(params=params or {}, train=TRAIN, num_classes=c, feature_dim=d,
                        clients=clients, rounds=5, seed=0, homogeneous=True,
                        make_model=lambda i: None)
    return FedPCLServer(ctx)


def upd(client, protos, counts, version=0):
    return update(client, {"protos": np.array(protos, np.float32),
                           "counts": np.array(counts, np.int64)}, version=version)


def test_fedpcl_server_step_by_hand():
    s = server()
    empty = s.make_task(0, RoundInfo(0, 5))
    assert empty["sets"].shape == (0, 3, 2) and not empty["avg_has"].any()
    m = s.aggregate([upd(0, [[1, 0], [0, 1], [0, 0]], [4, 2, 0]),
                     upd(1, [[3, 0], [0, 0], [0, 5]], [1, 0, 9])], [], RoundInfo(0, 5))
    # proto_aggregation: each class's unweighted mean over the clients holding it
    np.testing.assert_allclose(s.avg, [[2, 0], [0, 1], [0, 5]])
    assert s.avg_has.tolist() == [True, True, True]
    assert m["clients_with_prototypes"] == 2 and m["sets_replaced"] == 2
    # client 2 has not reported: the code's regulariser waits for every client
    assert s.make_task(0, RoundInfo(1, 5))["sets"].shape == (0, 3, 2)
    assert server({"wait_for_all": False}).active() is False
    eager = server({"wait_for_all": False})
    eager.aggregate([upd(0, [[1, 0], [0, 1], [0, 0]], [4, 2, 0])], [], RoundInfo(0, 5))
    assert eager.make_task(1, RoundInfo(1, 5))["sets"].shape == (1, 3, 2)

    s.aggregate([upd(2, [[0, 0], [0, 3], [0, 0]], [0, 7, 0], version=1)], [], RoundInfo(1, 5))
    np.testing.assert_allclose(s.avg, [[2, 0], [0, 2], [0, 5]])
    task = s.make_task(1, RoundInfo(2, 5))
    # every client's set, the classes it lacks filled with the average
    np.testing.assert_allclose(task["sets"], [[[1, 0], [0, 1], [0, 5]],
                                              [[3, 0], [0, 2], [0, 5]],
                                              [[2, 0], [0, 3], [0, 5]]])
    assert task["sets_has"].all()
    # a later set replaces its client's; an older one (a late fold) does not
    s.aggregate([upd(0, [[5, 0], [0, 0], [0, 0]], [3, 0, 0], version=2),
                 upd(2, [[9, 9], [9, 9], [9, 9]], [1, 1, 1], version=0)], [], RoundInfo(2, 5))
    np.testing.assert_allclose(s.avg, [[4, 0], [0, 3], [0, 5]])
    assert s.version.tolist() == [2, 0, 1]
    # checkpoint round trip
    t = server()
    t.load_state_dict(freeze(s.state_dict()))
    for k, v in s.state_dict().items():
        np.testing.assert_array_equal(t.state_dict()[k], v)


def test_average_and_fill_helpers():
    sets = np.array([[[1.0, 1.0], [0, 0]], [[3.0, -1.0], [2, 2]]], np.float32)
    has = np.array([[True, False], [True, True]])
    avg, avg_has = average_sets(sets, has)
    np.testing.assert_allclose(avg, [[2, 0], [2, 2]])
    filled, filled_has = filled_sets(sets, has, avg, avg_has)
    np.testing.assert_allclose(filled[0], [[1, 1], [2, 2]])
    assert filled_has.all()
    none_avg, none_has = average_sets(np.zeros((2, 2, 2), np.float32), np.zeros((2, 2), bool))
    assert not none_has.any() and not none_avg.any()


# --- the losses by hand -------------------------------------------------------------------------

def unit(*v):
    a = np.array(v, np.float64)
    return a / np.linalg.norm(a)


Z = np.stack([unit(1, 0), unit(1, 1), unit(0, 1)])  # three samples, labels 0, 0, 1
Y = [0, 0, 1]
P = np.array([[0.8, 0.1], [0.1, 0.7], [0.5, 0.5]])  # class 2 absent from the batch


def conloss_by_hand(z, y, p, tau, views=2, has=None):
    """ConLoss from its definition: rows r over views x batch, anchor p[y_r], contrast the
    other rows; mean over rows of -1/|Pos| sum_pos (l_rp - log sum_{k != r} exp l_rk)."""
    feats = [z[i] for _ in range(views) for i in range(len(y))]
    labels = [y[i] for _ in range(views) for i in range(len(y))]
    per_row = []
    for r, yr in enumerate(labels):
        if has is not None and not has[yr]:
            continue
        logit = [float(p[yr] @ f) / tau for f in feats]
        log_den = math.log(sum(math.exp(logit[k]) for k in range(len(feats)) if k != r))
        pos = [k for k in range(len(feats)) if k != r and labels[k] == yr]
        if not pos:
            continue
        per_row.append(-sum(logit[k] - log_den for k in pos) / len(pos))
    return sum(per_row) / len(per_row)


@pytest.mark.parametrize("tau", [0.07, 0.5])
def test_code_contrastive_loss_by_hand(tau):
    z, y = torch.tensor(Z, dtype=torch.float64), torch.tensor(Y)
    p, has = torch.tensor(P), torch.ones(3, dtype=torch.bool)
    got = prototype_contrast(z, y, p, has, tau, base_temperature=tau)
    assert float(got) == pytest.approx(conloss_by_hand(Z, Y, P, tau), rel=1e-10)
    # base temperature 0.07 scales by tau / 0.07 (ConLoss's factor)
    scaled = prototype_contrast(z, y, p, has, tau)
    assert float(scaled) == pytest.approx(tau / 0.07 * conloss_by_hand(Z, Y, P, tau), rel=1e-10)
    # one view: sample 2 (class 1) is alone and has no positive: left out
    one = prototype_contrast(z, y, p, has, tau, base_temperature=tau, views=1)
    assert float(one) == pytest.approx(conloss_by_hand(Z, Y, P, tau, views=1), rel=1e-10)
    # a class without a prototype has no anchor: its rows are left out, its features stay
    part = torch.tensor([True, False, True])
    got = prototype_contrast(z, y, p, part, tau, base_temperature=tau)
    assert float(got) == pytest.approx(conloss_by_hand(Z, Y, P, tau, has=[1, 0, 1]), rel=1e-10)


def test_global_local_loss_by_hand():
    z, y, tau = torch.tensor(Z), torch.tensor(Y), 0.5
    has = torch.tensor([True, True, False])
    got = prototype_softmax(z, y, torch.tensor(P), has, tau)
    want = 0.0
    for i, yi in enumerate(Y):
        logits = [float(P[k] @ Z[i]) / tau for k in range(2)]  # class 2 has no prototype
        want += -(logits[yi] - math.log(sum(math.exp(v) for v in logits)))
    assert float(got) == pytest.approx(want / 3, rel=1e-10)


# --- a client task on digits ------------------------------------------------------------------

@pytest.fixture(scope="module")
def backbones(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FEDBUS_BACKBONE_DIR", str(tmp_path_factory.mktemp("backbones")))
    yield
    mp.undo()


def digits_clients(k=3, per_class=30):
    ds = load_dataset("digits")
    x, y = torch.from_numpy(ds.x), torch.from_numpy(ds.y)
    rng = np.random.default_rng(0)
    parts = []
    for j in range(k):
        idx = np.concatenate([rng.permutation(np.flatnonzero(ds.y == c))[:per_class]
                              for c in ((3 * j + i) % 10 for i in range(4))])
        idx = rng.permutation(idx)
        cut = int(0.75 * len(idx))
        parts.append((x[idx[:cut]], y[idx[:cut]], x[idx[cut:]], y[idx[cut:]]))
    return parts


def client(i, part, params=None, seed=0):
    model = build_model(ARCH, in_shape=(1, 8, 8), num_classes=10, seed=seed)
    ctx = ClientContext(client=i, model=model, device=torch.device("cpu"), train_x=part[0],
                        train_y=part[1], test_x=part[2], test_y=part[3], num_classes=10,
                        feature_dim=model.feature_dim, params=params or {}, train=TRAIN, seed=i)
    return get_algorithm("fedpcl").client(ctx)


def payload_of(h, task, seed=0):
    return h.train(freeze(task), LocalRun(h.ctx, epochs=1, seed=seed))


@needs_mnist
def test_fedpcl_client_task_on_digits(backbones):
    parts = digits_clients()
    srv = server(clients=3, c=10, d=256)
    first = [client(i, p) for i, p in enumerate(parts)]
    proj0 = first[0].ctx.model.proj.weight.detach().clone()
    ups = []
    for i, h in enumerate(first):  # round 0: no sets yet, so no step: prototypes only
        pay = payload_of(h, srv.make_task(i, RoundInfo(0, 5)))
        check_spec(pay, srv.update_spec())
        ups.append(update(i, pay))
    assert torch.equal(first[0].ctx.model.proj.weight, proj0)
    assert math.isnan(first[0].last_loss)
    srv.aggregate(ups, [], RoundInfo(0, 5))
    task = srv.make_task(0, RoundInfo(1, 5))
    assert task["sets"].shape == (3, 10, 256)

    h = first[0]
    backbone = [p.detach().clone() for p in h.ctx.model.backbones[0].parameters()]
    assert isinstance(h.optimizer, torch.optim.Adam) and h.ctx.optimizers == [h.optimizer]
    pay = payload_of(h, task)
    assert not torch.equal(h.ctx.model.proj.weight, proj0)  # the projection trained
    for a, b in zip(h.ctx.model.backbones[0].parameters(), backbone):
        assert torch.equal(a, b)  # the backbone did not
    assert np.isfinite(h.last_loss) and h.last_loss > 0
    counts = np.bincount(parts[0][1].numpy(), minlength=10)
    np.testing.assert_array_equal(pay["counts"], counts)
    with torch.no_grad():  # the mean normalised feature per class, by hand
        z = h.ctx.model.eval().features(parts[0][0])
        z = (z / z.norm(dim=1, keepdim=True)).numpy()
    for k in range(10):
        if counts[k]:
            np.testing.assert_allclose(pay["protos"][k], z[parts[0][1].numpy() == k].mean(0),
                                       atol=1e-6)
        else:
            assert not pay["protos"][k].any()
    # the same task, seed and start give the same update to the bit
    twin = client(0, parts[0])
    payload_of(twin, server(clients=3, c=10, d=256).make_task(0, RoundInfo(0, 5)))
    again = payload_of(twin, task)
    np.testing.assert_array_equal(again["protos"], pay["protos"])
    # evaluation: the nearest of its own prototypes among its own classes
    ev = h.evaluate(freeze(srv.make_eval(0, RoundInfo(1, 5))))
    assert set(ev) == {"acc", "proto_acc", "num_test"} and ev["acc"] == ev["proto_acc"]
    with torch.no_grad():
        zt = h.ctx.model.features(parts[0][2])
        dist = torch.cdist(zt, torch.from_numpy(pay["protos"]))
        dist[:, torch.from_numpy(counts == 0)] = float("inf")
        assert ev["acc"] == pytest.approx(float((dist.argmin(1) == parts[0][3]).float().mean()))
    state = h.state_dict()
    fresh = client(0, parts[0], seed=9)
    fresh.load_state_dict(state)
    assert fresh.evaluate(freeze(srv.make_eval(0, RoundInfo(1, 5)))) == ev


@needs_mnist
@pytest.mark.parametrize("params", [{}, {"loss": "global_local"}, {"ce_weight": 1.0},
                                    {"optimizer": "sgd", "infer": "global"}])
def test_fedpcl_short_federation_learns(backbones, params):
    # three clients of four classes each, six rounds in process (deterministic): the prototype
    # accuracy rises from what the untrained projection gives
    parts = digits_clients()
    srv = server(params, clients=3, c=10, d=256)
    hs = [client(i, p, params) for i, p in enumerate(parts)]
    accs = []
    for r in range(6):
        ups = [update(i, payload_of(h, srv.make_task(i, RoundInfo(r, 6)), seed=r))
               for i, h in enumerate(hs)]
        srv.aggregate(ups, [], RoundInfo(r, 6))
        evs = [h.evaluate(freeze(srv.make_eval(i, RoundInfo(r, 6)))) for i, h in enumerate(hs)]
        accs.append(np.mean([e["acc"] for e in evs]))
        if params.get("ce_weight"):
            assert all(np.isfinite(e["loss"]) for e in evs)
    # among its own 4 classes (chance 0.25), or all 10 with infer = global (0.69 measured)
    assert accs[-1] > accs[0] and accs[-1] > (0.6 if params.get("infer") else 0.8), accs


# --- real federations ---------------------------------------------------------------------------

TINY_FEDPCL = merged(TINY, algorithm={"name": "fedpcl"}, model={"arch": ARCH},
                     train={"lr": 0.01})


@pytest.fixture
def backbone_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDBUS_BACKBONE_DIR", str(tmp_path / "backbones"))


@needs_mnist
def test_fedpcl_sync_with_a_folded_straggler_learns_and_replays(tmp_path, backbone_dir):
    from test_replay import assert_identical

    # wait_for_all = false: with the code's wait the contrastive term would start only once
    # the straggler's first set arrived
    run, summary, recs = run_with_folded_straggler(
        tmp_path, merged(TINY_FEDPCL, federation={"rounds": 5, "eval_every": 5},
                         algorithm={"wait_for_all": False}, train={"epochs": 2}),
        timeout=300)
    assert recs[-1]["agg"]["clients_with_prototypes"] == 4
    final = summary["final"]
    # own-prototype prediction among each client's ~3 classes: 0.87 measured
    assert final["acc_mean"] > 0.6 and final["proto_acc_mean"] == final["acc_mean"], final
    assert_identical(run, rounds=5)


@needs_mnist
def test_fedpcl_async_with_a_slow_client_learns_and_replays(tmp_path, backbone_dir):
    from test_replay import assert_identical

    run, summary, recs = run_async_with_slow_client(
        tmp_path, merged(TINY_FEDPCL, federation={"rounds": 6, "eval_every": 6}), timeout=300)
    assert summary["final"]["acc_mean"] > 0.6, summary["final"]  # 0.82 measured
    assert_identical(run, rounds=6)

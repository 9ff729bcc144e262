"""proto-attention handlers: margins, attention and aggregation by hand; real training."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import check_spec, make_model_fn, seven_class_digits, tiny_harness

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.base import Failure, LocalRun, RoundInfo
from fedbus.algorithms.proto_attention import (ProtoAttentionClient, ProtoAttentionServer,
                                               attention_weights, client_score,
                                               normalise_scores, prototype_margins)

torch.set_num_threads(1)

TRAIN = {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.0, "batch_size": 32, "epochs": 1}
RAW = {"minmax": False}  # hand computations on raw 2-d prototypes
server_ctx, client_ctx, update = tiny_harness(TRAIN)


@pytest.fixture(scope="module")
def digits_clients():
    return seven_class_digits(seed=1)


# --- margins by hand -----------------------------------------------------------------

def test_margin_by_hand():
    b = np.array([[0, 0], [4, 0], [0, 3]], float)
    a = np.array([[1, 0], [4, 1], [0, 3]], float)
    v = np.array([True, True, True])
    mu = prototype_margins(a, b, v, v)
    # class 0: d+ = 1, d- = min(3, sqrt 10) = 3 -> (3-1)/(3+1) = 0.5
    # class 1: d+ = 1, d- = min(sqrt 17, sqrt 20) = sqrt 17
    # class 2: d+ = 0, d- = min(3, 5) = 3 -> 1
    want = [0.5, (math.sqrt(17) - 1) / (math.sqrt(17) + 1), 1.0]
    np.testing.assert_allclose(mu, want, rtol=1e-12)
    # class 2 missing in b: undefined for class 2, and class 0's d- is now 3 (b1) still
    mu = prototype_margins(a, b, v, np.array([True, True, False]))
    np.testing.assert_allclose(mu[:2], [0.5, (math.sqrt(17) - 1) / (math.sqrt(17) + 1)])
    assert math.isnan(mu[2])
    # a one-class reference: no d-, undefined -> counts as 0 in the client score
    mu = prototype_margins(a, b, v, np.array([True, False, False]))
    assert np.isnan(mu).all()
    assert client_score(mu, np.array([True, False, False])) == 0.0
    # scores: sum / mean, and the "sum" norm's (1+mu)/2 mapping
    mu = np.array([0.5, -0.5, np.nan])
    present = np.array([True, True, True])
    assert client_score(mu, present, "softmax", "sum") == pytest.approx(0.0)
    assert client_score(mu, present, "sum", "sum") == pytest.approx(0.75 + 0.25 + 0.5)
    assert client_score(mu, present, "sum", "mean") == pytest.approx(1.5 / 3)


def test_minmax_makes_margins_scale_and_shift_invariant():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    v = np.ones(4, bool)
    p = {"minmax": True, "norm": "softmax", "reduce": "sum", "temp": 1.0, "round0": "counts"}
    u1 = {"protos": a, "protos_before": b, "counts": np.ones(4, np.int64)}
    # each prototype scaled and shifted on its own: same normalised prototypes
    u2 = {"protos": a * 3 + 7, "protos_before": b * 0.5 - 2, "counts": np.ones(4, np.int64)}
    _, l1, _ = attention_weights([u1], [1], None, None, p)
    _, l2, _ = attention_weights([u2], [1], None, None, p)
    assert l1[0] == pytest.approx(l2[0], rel=1e-9)
    from fedbus.algorithms.protos import minmax_channels
    mu = prototype_margins(minmax_channels(a), minmax_channels(b), v, v)
    assert l1[0] == pytest.approx(np.sum(mu), rel=1e-9)


# --- attention and aggregation by hand ---------------------------------------------------

def three_clients():
    # 2 classes, 2-d. Previous aggregate G: g0 = (0,0), g1 = (2,0).
    c0 = {"protos": np.array([[0, 0], [2, 0]], np.float32),
          "protos_before": np.array([[0, 0], [2, 0]], np.float32),
          "counts": np.array([5, 5], np.int64)}
    c1 = {"protos": np.array([[1, 0], [4, 0]], np.float32),
          "protos_before": np.array([[0, 0], [4, 0]], np.float32),
          "counts": np.array([10, 10], np.int64)}
    c2 = {"protos": np.array([[0.5, 0], [0, 0]], np.float32),  # class 1 absent
          "protos_before": np.array([[0, 0], [0, 0]], np.float32),
          "counts": np.array([30, 0], np.int64)}
    return [c0, c1, c2], [10, 20, 30]


# LPM scores (sum of margins, after vs before):
#   client 0: both classes d+ = 0 -> mu = 1, 1        -> 2
#   client 1: c0 d+ = 1, d- = 3 -> 0.5; c1 d+ = 0 -> 1 -> 1.5
#   client 2: one class only, no d- -> 0               -> 0
# APM scores (after vs G = (0,0), (2,0)):
#   client 0: 1 + 1                                    -> 2
#   client 1: c0 d+ = 1, d- = 1 -> 0; c1 d+ = 2, d- = 4 -> 1/3 -> 1/3
#   client 2: c0 d+ = 0.5, d- = 1.5 -> 0.5             -> 0.5
E = math.exp
L_HAND = np.array([E(2), E(1.5), E(0)]) / (E(2) + E(1.5) + E(0))
A_HAND = np.array([E(2), E(1 / 3), E(0.5)]) / (E(2) + E(1 / 3) + E(0.5))
ATT_HAND = (L_HAND + A_HAND) / 2


def test_attention_weights_by_hand():
    ups, n = three_clients()
    g = np.array([[0, 0], [2, 0]], float)
    p = {"minmax": False, "norm": "softmax", "reduce": "sum", "temp": 1.0, "round0": "counts"}
    att, lpm, apm = attention_weights(ups, n, g, np.array([True, True]), p)
    np.testing.assert_allclose(lpm, [2, 1.5, 0], rtol=1e-7)
    np.testing.assert_allclose(apm, [2, 1 / 3, 0.5], rtol=1e-7)
    np.testing.assert_allclose(att, ATT_HAND, rtol=1e-7)
    # the same numbers written out: L = (.574097, .348207, .077696), A = (.708212, .133764, .158024)
    np.testing.assert_allclose(L_HAND, [0.574097, 0.348207, 0.077696], atol=2e-6)
    np.testing.assert_allclose(A_HAND, [0.708212, 0.133764, 0.158024], atol=2e-6)
    np.testing.assert_allclose(att, [0.641155, 0.240986, 0.117860], atol=2e-6)
    # the "sum" norm: per-class (1+mu)/2 summed, divided by the total
    p2 = dict(p, norm="sum")
    att2, lpm2, apm2 = attention_weights(ups, n, g, np.array([True, True]), p2)
    np.testing.assert_allclose(lpm2, [2, 0.75 + 1, 0.5])
    np.testing.assert_allclose(apm2, [2, 0.5 + 2 / 3, 0.75])
    want = (np.array([2, 1.75, 0.5]) / 4.25 + np.array([2, 7 / 6, 0.75]) / (2 + 7 / 6 + 0.75)) / 2
    np.testing.assert_allclose(att2, want, rtol=1e-7)
    assert normalise_scores([0.0, 0.0], "sum").tolist() == [0.5, 0.5]


def test_server_aggregation_by_hand_with_staleness_and_aggregate_protos():
    make = make_model_fn(d_in=2, feat=2, classes=2)
    srv = ProtoAttentionServer(server_ctx(RAW, make, classes=2, feat=2))
    srv.agg_protos = np.array([[0, 0], [2, 0]], np.float32)
    srv.agg_mask = np.array([True, True])
    w0 = {k: v.copy() for k, v in srv.weights.items()}
    ups, n = three_clients()
    for i, u in enumerate(ups):
        u["delta"] = {k: np.full_like(v, float(i + 1)) for k, v in w0.items()}  # 1, 2, 3
    # client 2 is stale: w = 0.5 -> c = (att0, att1, 0.5 att2)
    arrivals = [update(2, ups[2], n[2], weight=0.5, staleness=3), update(0, ups[0], n[0]),
                update(1, ups[1], n[1])]
    srv.aggregate(arrivals, [], RoundInfo(3, 5))
    c = ATT_HAND * np.array([1, 1, 0.5])
    step = (c[0] * 1 + c[1] * 2 + c[2] * 3) / c.sum()
    # (.641155 + 2 * .240986 + 3 * .058930) / .941070
    assert step == pytest.approx(1.381316, abs=2e-6)
    for k in w0:
        np.testing.assert_allclose(srv.weights[k], w0[k] + step, rtol=1e-6)
    # aggregate prototypes, weights w * n_c: class 0: 5*(0,0) + 10*(1,0) + 0.5*30*(.5,0) over 30
    #                                       class 1: 5*(2,0) + 10*(4,0) over 15
    np.testing.assert_allclose(srv.agg_protos, [[17.5 / 30, 0], [50 / 15, 0]], rtol=1e-6)
    assert srv.agg_mask.all()


def test_round0_sample_count_weights_equal_fedavg():
    make = make_model_fn(d_in=2, feat=2, classes=2)
    srv = ProtoAttentionServer(server_ctx(RAW, make, classes=2, feat=2))
    w0 = {k: v.copy() for k, v in srv.weights.items()}
    ups, n = three_clients()
    for i, u in enumerate(ups):
        u["delta"] = {k: np.full_like(v, float(i + 1)) for k, v in w0.items()}
    att, _, _ = attention_weights(ups, n, None, None, dict(srv.p))
    np.testing.assert_allclose(att, [10 / 60, 20 / 60, 30 / 60])
    srv.aggregate([update(i, u, n[i]) for i, u in enumerate(ups)], [], RoundInfo(0, 5))
    # FedAvg: (10*1 + 20*2 + 30*3) / 60 = 140/60
    for k in w0:
        np.testing.assert_allclose(srv.weights[k], w0[k] + 140 / 60, rtol=1e-6)
    # the aggregate exists now (count-weighted): class 0 (0*5 + 1*10 + .5*30)/45, class 1 50/15
    np.testing.assert_allclose(srv.agg_protos, [[25 / 45, 0], [50 / 15, 0]], rtol=1e-6)
    # round0 = "mix": (sigma(LPM) + share) / 2
    att, _, _ = attention_weights(ups, n, None, None, dict(srv.p, round0="mix"))
    np.testing.assert_allclose(att, (L_HAND + np.array([1, 2, 3]) / 6) / 2, rtol=1e-7)


def test_partial_work_client_still_weighted(digits_clients):
    params = {}
    srv = ProtoAttentionServer(server_ctx(params))
    clients = [ProtoAttentionClient(client_ctx(i, p, params)) for i, p in enumerate(digits_clients)]
    for r in range(2):
        ups = []
        for cl in clients:
            # client 2 does 10 % of its epoch, every round
            part = 0.1 if cl.ctx.client == 2 else None
            run = LocalRun(cl.ctx, epochs=1, seed=r, epochs_to_run=part)
            payload = cl.train(srv.make_task(cl.ctx.client, RoundInfo(r, 5)), run)
            ups.append(update(cl.ctx.client, payload, len(cl.ctx.train_y), work=run.work))
        assert ups[2].work.stopped == "partial" and ups[2].work.fraction < 0.2
        agg = srv.agg_protos.astype(float) if srv.agg_mask.any() else None
        att, _, apm = attention_weights([u.payload for u in ups], [u.num_samples for u in ups],
                                        agg, srv.agg_mask, srv.p)
        assert (att > 0).all() and att.sum() == pytest.approx(1.0)
        assert (apm is None) == (r == 0)
        before = {k: v.copy() for k, v in srv.weights.items()}
        # only the partial client arrives: it alone moves the model
        if r == 1:
            probe = ProtoAttentionServer(server_ctx(params))
            probe.load_state_dict(srv.state_dict())
            probe.aggregate([ups[2]], [], RoundInfo(r, 5))
            moved = sum(float(np.abs(probe.weights[k] - before[k]).sum()) for k in before)
            assert moved > 0
        srv.aggregate(ups, [], RoundInfo(r, 5))


def test_empty_updates_and_state_roundtrip():
    srv = ProtoAttentionServer(server_ctx({}))
    snap = {k: v.copy() for k, v in srv.weights.items()}
    out = srv.aggregate([], [Failure(0, "dead"), Failure(1, "late")], RoundInfo(0, 5))
    assert out["updates"] == 0
    for k in snap:
        np.testing.assert_array_equal(srv.weights[k], snap[k])
    assert not srv.agg_mask.any() and srv.aggregations == 0
    srv.agg_protos[:] = 1.5
    srv.agg_mask[3] = True
    fresh = ProtoAttentionServer(server_ctx({}))
    from fedbus.broker.wire import decode_body, encode_body  # checkpoints use the wire codec
    fresh.load_state_dict(decode_body(encode_body(srv.state_dict())))
    np.testing.assert_array_equal(fresh.agg_protos, srv.agg_protos)
    np.testing.assert_array_equal(fresh.agg_mask, srv.agg_mask)


def test_registry_and_spec():
    algo = get_algorithm("proto-attention")
    assert algo.server is ProtoAttentionServer and algo.client is ProtoAttentionClient
    spec = ProtoAttentionServer(server_ctx({})).update_spec()
    assert spec["protos"] == ("float32", (10, 16))
    assert spec["protos_before"] == ("float32", (10, 16))
    assert spec["counts"] == ("int64", (10,)) and spec["delta"]["fc.bias"] == ("float32", (10,))


# --- real training ------------------------------------------------------------------------

def test_client_trains_on_digits_and_update_has_spec(digits_clients):
    srv = ProtoAttentionServer(server_ctx({}))
    cli = ProtoAttentionClient(client_ctx(0, digits_clients[0], {}))
    run = LocalRun(cli.ctx, epochs=1, seed=0)
    upd = cli.train(srv.make_task(0, RoundInfo(0, 5)), run)
    check_spec(upd, srv.update_spec(), by_name=True)
    # and the engine's own validation accepts it
    from fedbus.node.validate import check_update
    body = {"task": 1, "version": 0, "num_samples": len(cli.ctx.train_y),
            "work": run.work.to_dict(), "payload": upd}
    check_update(body, srv.update_spec(), num_classes=10,
                 max_samples=len(cli.ctx.train_y))
    assert run.work.steps > 0 and np.isfinite(upd["train_loss"])
    assert (upd["counts"] > 0).sum() == 7
    assert not np.allclose(upd["protos"], upd["protos_before"])  # training moved them
    ev = cli.evaluate(srv.make_eval(0, RoundInfo(1, 5)))
    assert {"acc", "loss", "num_test", "proto_acc"} <= set(ev)


def test_simulation_learns_on_digits(digits_clients):
    srv = ProtoAttentionServer(server_ctx({}))
    clients = [ProtoAttentionClient(client_ctx(i, p, {})) for i, p in enumerate(digits_clients)]
    for r in range(5):
        ups = []
        for cl in clients:
            run = LocalRun(cl.ctx, epochs=2, seed=100 * r + cl.ctx.client)
            payload = cl.train(srv.make_task(cl.ctx.client, RoundInfo(r, 5)), run)
            ups.append(update(cl.ctx.client, payload, len(cl.ctx.train_y), version=r))
        metrics = srv.aggregate(ups, [], RoundInfo(r, 5))
        assert ("apm_mean" in metrics) == (r > 0)
    evs = [cl.evaluate(srv.make_eval(cl.ctx.client, RoundInfo(5, 5))) for cl in clients]
    acc = np.mean([e["acc"] for e in evs])
    proto_acc = np.mean([e["proto_acc"] for e in evs])
    print("acc", acc, "proto_acc", proto_acc)
    assert acc > 0.6, evs
    assert proto_acc > 0.6, evs

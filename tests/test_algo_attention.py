"""proto-attention handlers: the paper's equations by hand (Michieli & Ozay, eq. 5-15),
the non-paper options, real training, and a real federation writing AMM and attention
into metrics.jsonl."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import check_spec, make_model_fn, seven_class_digits, tiny_harness
from helpers import SMALL, merged, metrics, run_federation

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import Failure, LocalRun, RoundInfo
from fedbus.algorithms.proto_attention import (ProtoAttentionClient, ProtoAttentionServer,
                                               aggregate_mean_margin, attention_weights,
                                               client_score, normalise_scores,
                                               prototype_margins)

torch.set_num_threads(1)

TRAIN = {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.0, "batch_size": 32, "epochs": 1}
RAW = {"minmax": False}  # hand computations on raw 2-d prototypes
PAPER = {"minmax": False, "norm": "sigmoid", "reduce": "sum", "dminus": "mean",
         "clues": "both", "round0": "counts", "temp": 1.0}
server_ctx, client_ctx, update = tiny_harness(TRAIN)
sqrt, E = math.sqrt, math.exp


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.fixture(scope="module")
def digits_clients():
    return seven_class_digits(seed=1)


def test_defaults_are_the_papers():
    srv = ProtoAttentionServer(server_ctx({}))
    assert srv.p == {"norm": "sigmoid", "temp": 1.0, "reduce": "sum", "dminus": "mean",
                     "minmax": True, "clues": "both", "round0": "counts", "carry": False}


# --- eq. 5-7: the semantic prototype margin by hand ---------------------------------------

def test_margin_eq5_to_7_by_hand():
    b = np.array([[0, 0], [4, 0], [0, 3]], float)
    a = np.array([[1, 0], [4, 1], [0, 3]], float)
    v = np.array([True, True, True])
    mu = prototype_margins(a, b, v, v)
    # eq. 6: d- = the MEAN distance to the other classes' prototypes of b
    # class 0: d+ = 1, d- = (3 + sqrt 10) / 2
    # class 1: d+ = 1, d- = (sqrt 17 + sqrt 20) / 2
    # class 2: d+ = 0, d- = (3 + 5) / 2 = 4      -> mu = 1
    dm0, dm1 = (3 + sqrt(10)) / 2, (sqrt(17) + sqrt(20)) / 2
    want = [(dm0 - 1) / (dm0 + 1), (dm1 - 1) / (dm1 + 1), 1.0]
    np.testing.assert_allclose(mu, want, rtol=1e-12)
    # C' = classes of BOTH sets: a lacks class 2, so b's class 2 is no d- reference either:
    # class 0: d- = 3 -> (3 - 1) / (3 + 1); class 1: d- = sqrt 17; class 2 undefined
    mu = prototype_margins(a, b, np.array([True, True, False]), v)
    np.testing.assert_allclose(mu[:2], [0.5, (sqrt(17) - 1) / (sqrt(17) + 1)], rtol=1e-12)
    assert math.isnan(mu[2])
    # a one-class C': no d-, undefined -> counts as 0 in the client's sum
    mu = prototype_margins(a, b, v, np.array([True, False, False]))
    assert np.isnan(mu).all()
    assert client_score(mu, np.array([True, False, False])) == 0.0
    # the non-paper dminus = "min": the nearest other class
    mu = prototype_margins(a, b, v, v, dminus="min")
    np.testing.assert_allclose(mu, [0.5, (sqrt(17) - 1) / (sqrt(17) + 1), 1.0], rtol=1e-12)


def test_client_score_sum_mean_and_the_sum_norms_mapping():
    mu = np.array([0.5, -0.25, np.nan])
    present = np.array([True, True, True])
    assert client_score(mu, present) == pytest.approx(0.25)  # eq. 11's argument
    assert client_score(mu, present, "sigmoid", "mean") == pytest.approx(0.25 / 3)
    assert client_score(mu, present, "sum", "sum") == pytest.approx(0.75 + 0.375 + 0.5)


def test_minmax_makes_margins_scale_and_shift_invariant():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    v = np.ones(4, bool)
    p = dict(PAPER, minmax=True)
    u1 = {"protos": a, "protos_before": b, "counts": np.ones(4, np.int64)}
    # each prototype scaled and shifted on its own: same normalised prototypes
    u2 = {"protos": a * 3 + 7, "protos_before": b * 0.5 - 2, "counts": np.ones(4, np.int64)}
    _, l1, _ = attention_weights([u1], [1], None, None, p, first=True)
    _, l2, _ = attention_weights([u2], [1], None, None, p, first=True)
    assert l1[0] == pytest.approx(l2[0], rel=1e-9)
    # min-max by hand: (x - min) / (max - min) per prototype, over its channels
    def mm(rows):
        return np.array([[(x - min(r)) / (max(r) - min(r)) for x in r] for r in rows])
    # eq. 8: LPM = mu(p_before[c], p_after)
    mu = prototype_margins(mm(b.tolist()), mm(a.tolist()), v, v)
    assert l1[0] == pytest.approx(np.sum(mu), rel=1e-9)


# --- eq. 8-14: attention and aggregation by hand -------------------------------------------

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


# LPM (eq. 8: before[c] against the after set; 2 classes, so d- is the other class):
#   client 0: before = after: d+ = 0 for both classes     -> 1 + 1 = 2
#   client 1: c0: d+ = |(0,0)-(1,0)| = 1, d- = |(0,0)-(4,0)| = 4 -> 3/5
#             c1: d+ = 0, d- = |(4,0)-(1,0)| = 3 -> 1      -> 1.6
#   client 2: one class, C' = {0}: no d-                   -> 0
# APM (eq. 9: after[c] against G, on C' = the classes both have):
#   client 0: 1 + 1                                        -> 2
#   client 1: c0 d+ = 1, d- = 1 -> 0; c1 d+ = 2, d- = 4 -> 1/3 -> 1/3
#   client 2: C' = {0}: no d-                              -> 0
LPM_HAND = [2, 1.6, 0]
APM_HAND = [2, 1 / 3, 0]
# eq. 11: v = sigmoid(sum of margins); eq. 12: a = v / sum v; eq. 13: (a_agg + a_loc) / 2
V_LOC = [sigmoid(s) for s in LPM_HAND]
V_AGG = [sigmoid(s) for s in APM_HAND]
A_LOC = [v / sum(V_LOC) for v in V_LOC]
A_AGG = [v / sum(V_AGG) for v in V_AGG]
ATT_HAND = [(x + y) / 2 for x, y in zip(A_AGG, A_LOC)]


def test_sigmoid_then_divide_by_the_sum_eq11_12_by_hand():
    s = [2.0, -1.0, 0.5]
    v = [1 / (1 + E(-2.0)), 1 / (1 + E(1.0)), 1 / (1 + E(-0.5))]
    want = [x / sum(v) for x in v]
    np.testing.assert_allclose(normalise_scores(s), want, rtol=1e-12)
    # written out: v = (.880797, .268941, .622459), sum 1.772197
    np.testing.assert_allclose(want, [0.497008, 0.151756, 0.351236], atol=2e-6)
    assert normalise_scores(s).sum() == pytest.approx(1.0)
    # not a softmax: exp(2) / (exp(2) + exp(-1) + exp(.5)) = .785597
    assert normalise_scores(s, "softmax")[0] == pytest.approx(E(2) / (E(2) + E(-1) + E(0.5)))
    assert abs(normalise_scores(s)[0] - 0.785597) > 0.2
    # no underflow far into the sigmoid's tail: sigmoid(-800) / (sigmoid(-800) + sigmoid(-801))
    np.testing.assert_allclose(normalise_scores([-800.0, -801.0]),
                               [1 / (1 + E(-1)), E(-1) / (1 + E(-1))], rtol=1e-9)


def test_attention_weights_by_hand():
    ups, n = three_clients()
    g = np.array([[0, 0], [2, 0]], float)
    both = np.array([True, True])
    att, lpm, apm = attention_weights(ups, n, g, both, PAPER)
    np.testing.assert_allclose(lpm, LPM_HAND, rtol=1e-7)
    np.testing.assert_allclose(apm, APM_HAND, rtol=1e-7)
    np.testing.assert_allclose(att, ATT_HAND, rtol=1e-7)
    assert att.sum() == pytest.approx(1.0)
    # the same numbers written out: v_loc = (.880797, .832018, .5), v_agg = (.880797, .582570, .5)
    np.testing.assert_allclose(A_LOC, [0.398044, 0.376000, 0.225956], atol=2e-6)
    np.testing.assert_allclose(A_AGG, [0.448616, 0.296720, 0.254665], atol=2e-6)
    np.testing.assert_allclose(att, [0.423330, 0.336360, 0.240311], atol=2e-6)
    # Table 3's ablations: one clue alone
    att_l, _, _ = attention_weights(ups, n, g, both, dict(PAPER, clues="lpm"))
    att_a, _, _ = attention_weights(ups, n, g, both, dict(PAPER, clues="apm"))
    np.testing.assert_allclose(att_l, A_LOC, rtol=1e-7)
    np.testing.assert_allclose(att_a, A_AGG, rtol=1e-7)


def test_non_paper_norms_softmax_and_sum_by_hand():
    ups, n = three_clients()
    g = np.array([[0, 0], [2, 0]], float)
    both = np.array([True, True])
    att, _, _ = attention_weights(ups, n, g, both, dict(PAPER, norm="softmax"))
    soft_l = [E(s) / sum(E(x) for x in LPM_HAND) for s in LPM_HAND]
    soft_a = [E(s) / sum(E(x) for x in APM_HAND) for s in APM_HAND]
    np.testing.assert_allclose(att, [(x + y) / 2 for x, y in zip(soft_l, soft_a)], rtol=1e-7)
    # "sum": each mu mapped to (1 + mu) / 2 (undefined: 0 -> 1/2), summed, divided by the total
    att, lpm, apm = attention_weights(ups, n, g, both, dict(PAPER, norm="sum"))
    np.testing.assert_allclose(lpm, [2, 0.8 + 1, 0.5], rtol=1e-7)
    np.testing.assert_allclose(apm, [2, 0.5 + 2 / 3, 0.5], rtol=1e-7)
    want = (np.array([2, 1.8, 0.5]) / 4.3 + np.array([2, 7 / 6, 0.5]) / (2 + 7 / 6 + 0.5)) / 2
    np.testing.assert_allclose(att, want, rtol=1e-7)
    assert normalise_scores([0.0, 0.0], "sum").tolist() == [0.5, 0.5]


def test_round0_counts_and_later_rounds_without_an_aggregate():
    ups, n = three_clients()
    # eq. 13, t = 0: n_k / sum n_j
    att, _, apm = attention_weights(ups, n, None, None, PAPER, first=True)
    np.testing.assert_allclose(att, [10 / 60, 20 / 60, 30 / 60])
    assert apm is None
    # non-paper round0 = "mix": (a_loc + n-share) / 2
    att, _, _ = attention_weights(ups, n, None, None, dict(PAPER, round0="mix"), first=True)
    np.testing.assert_allclose(att, [(a + s) / 2 for a, s in zip(A_LOC, [1 / 6, 2 / 6, 3 / 6])])
    # t > 0 with no aggregate yet (p_agg = 0, no classes): every APM margin counts 0, so
    # v_agg = sigmoid(0) = 1/2 for all and a_agg is uniform
    att, _, apm = attention_weights(ups, n, None, None, PAPER, first=False)
    np.testing.assert_allclose(apm, [0, 0, 0])
    np.testing.assert_allclose(att, [(a + 1 / 3) / 2 for a in A_LOC], rtol=1e-7)


def test_server_aggregation_by_hand_with_staleness_and_aggregate_protos():
    make = make_model_fn(d_in=2, feat=2, classes=2)
    srv = ProtoAttentionServer(server_ctx(RAW, make, classes=2, feat=2))
    srv.agg_protos = np.array([[0, 0], [2, 0]], np.float32)
    srv.agg_mask = np.array([True, True])
    w0 = {k: v.copy() for k, v in srv.weights.items()}
    ups, n = three_clients()
    for i, u in enumerate(ups):
        u["delta"] = {k: np.full_like(v, float(i + 1)) for k, v in w0.items()}  # 1, 2, 3
    # client 2 is stale: s = 0.5 -> c = (a0, a1, 0.5 a2)
    arrivals = [update(2, ups[2], n[2], weight=0.5, staleness=3), update(0, ups[0], n[0]),
                update(1, ups[1], n[1])]
    out = srv.aggregate(arrivals, [], RoundInfo(3, 5))
    c = [ATT_HAND[0], ATT_HAND[1], 0.5 * ATT_HAND[2]]
    step = (c[0] * 1 + c[1] * 2 + c[2] * 3) / sum(c)
    # (.423330 + 2 * .336360 + 3 * .120155) / .879845
    assert step == pytest.approx(1.655423, abs=2e-6)
    for k in w0:
        np.testing.assert_allclose(srv.weights[k], w0[k] + step, rtol=1e-6)
    # the attention of each client lands in the metrics (before staleness), summing to 1
    assert out["attention"] == pytest.approx({"0": ATT_HAND[0], "1": ATT_HAND[1],
                                              "2": ATT_HAND[2]}, rel=1e-7)
    # eq. 10, weights s * n_c: class 0: 5*(0,0) + 10*(1,0) + 0.5*30*(.5,0) over 30
    #                          class 1: 5*(2,0) + 10*(4,0) over 15
    np.testing.assert_allclose(srv.agg_protos, [[17.5 / 30, 0], [50 / 15, 0]], rtol=1e-6)
    assert srv.agg_mask.all()


def test_eq14_fresh_updates_give_the_attention_weighted_mean_of_models():
    make = make_model_fn(d_in=2, feat=2, classes=2)
    srv = ProtoAttentionServer(server_ctx(RAW, make, classes=2, feat=2))
    srv.agg_protos = np.array([[0, 0], [2, 0]], np.float32)
    srv.agg_mask = np.array([True, True])
    w0 = {k: v.copy() for k, v in srv.weights.items()}
    ups, n = three_clients()
    models = []  # W_k = W + delta_k with delta_k = k + 1 everywhere
    for i, u in enumerate(ups):
        u["delta"] = {k: np.full_like(v, float(i + 1)) for k, v in w0.items()}
        models.append({k: w0[k] + (i + 1) for k in w0})
    srv.aggregate([update(i, u, n[i]) for i, u in enumerate(ups)], [], RoundInfo(1, 5))
    for k in w0:
        want = sum(a * m[k] for a, m in zip(ATT_HAND, models))  # W = sum_k a[k] W_k
        np.testing.assert_allclose(srv.weights[k], want, rtol=1e-6, atol=1e-6)


def test_round0_sample_count_weights_equal_fedavg():
    make = make_model_fn(d_in=2, feat=2, classes=2)
    srv = ProtoAttentionServer(server_ctx(RAW, make, classes=2, feat=2))
    w0 = {k: v.copy() for k, v in srv.weights.items()}
    ups, n = three_clients()
    for i, u in enumerate(ups):
        u["delta"] = {k: np.full_like(v, float(i + 1)) for k, v in w0.items()}
    out = srv.aggregate([update(i, u, n[i]) for i, u in enumerate(ups)], [], RoundInfo(0, 5))
    # FedAvg: (10*1 + 20*2 + 30*3) / 60 = 140/60
    for k in w0:
        np.testing.assert_allclose(srv.weights[k], w0[k] + 140 / 60, rtol=1e-6)
    assert out["attention"] == pytest.approx({"0": 1 / 6, "1": 2 / 6, "2": 3 / 6})
    assert "apm_mean" not in out
    # the aggregate exists now (count-weighted): class 0 (0*5 + 1*10 + .5*30)/45, class 1 50/15
    np.testing.assert_allclose(srv.agg_protos, [[25 / 45, 0], [50 / 15, 0]], rtol=1e-6)


def test_eq10_drops_classes_absent_from_an_aggregation_unless_carry():
    make = make_model_fn(d_in=2, feat=2, classes=2)
    ups, n = three_clients()
    for carry in (False, True):
        srv = ProtoAttentionServer(server_ctx(dict(RAW, carry=carry), make, classes=2, feat=2))
        srv.agg_protos = np.array([[0, 0], [2, 0]], np.float32)
        srv.agg_mask = np.array([True, True])
        ups[2]["delta"] = {k: np.zeros_like(v) for k, v in srv.weights.items()}
        srv.aggregate([update(2, ups[2], n[2])], [], RoundInfo(2, 5))  # has class 0 only
        assert srv.agg_mask.tolist() == [True, carry]
        np.testing.assert_allclose(srv.agg_protos, [[0.5, 0], [2 if carry else 0, 0]])


# --- eq. 15: the aggregate mean margin --------------------------------------------------------

def test_amm_eq15_by_hand():
    p = np.array([[0, 0], [3, 0], [0, 4], [9, 9]], float)
    mask = np.array([True, True, True, False])  # class 3 was not aggregated
    amm, amm_dist = aggregate_mean_margin(p, mask)
    # eq. 15 as printed: mu(p[c], p) has d+ = |p[c] - p[c]| = 0, so mu = d-/d- = 1 for each
    # aggregated class; class 3 is undefined (0); / |C| = 4
    assert amm == pytest.approx((1 + 1 + 1 + 0) / 4)
    # un-normalised: (d- - d+) = the mean distance to the other aggregated prototypes
    # class 0: (3 + 4)/2, class 1: (3 + 5)/2, class 2: (4 + 5)/2; / |C| = 4
    assert amm_dist == pytest.approx((3.5 + 4 + 4.5) / 4)
    assert aggregate_mean_margin(p, np.array([True, False, False, False])) == (0.0, 0.0)


def test_server_reports_amm_on_the_raw_count_weighted_aggregate():
    make = make_model_fn(d_in=2, feat=2, classes=3)
    srv = ProtoAttentionServer(server_ctx({}, make, classes=3, feat=2))  # minmax on (paper)
    zero = {k: np.zeros_like(v) for k, v in srv.weights.items()}
    a = {"protos": np.array([[0, 0], [2, 0], [0, 0]], np.float32),
         "protos_before": np.array([[0, 0], [2, 0], [0, 0]], np.float32),
         "counts": np.array([1, 1, 0], np.int64), "delta": zero}
    b = {"protos": np.array([[0, 0], [4, 0], [0, 4]], np.float32),
         "protos_before": np.array([[0, 0], [4, 0], [0, 4]], np.float32),
         "counts": np.array([1, 1, 2], np.int64), "delta": zero}
    out = srv.aggregate([update(0, a, 2), update(1, b, 4)], [], RoundInfo(0, 5))
    # raw aggregate: class 0 (0,0), class 1 ((2 + 4) / 2, 0) = (3,0), class 2 (0,4)
    np.testing.assert_allclose(srv.agg_raw, [[0, 0], [3, 0], [0, 4]])
    assert out["amm"] == pytest.approx(1.0)  # 3 classes, each mu = 1, / 3
    assert out["amm_dist"] == pytest.approx((3.5 + 4 + 4.5) / 3)
    # the normalised aggregate (eq. 10 on min-max prototypes): (0,0) stays 0, (3,0) -> (1,0)
    np.testing.assert_allclose(srv.agg_protos, [[0, 0], [1, 0], [0, 1]])


# --- partial work, state, registry ----------------------------------------------------------

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
                                        agg, srv.agg_mask, srv.p, first=r == 0)
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
    assert out["updates"] == 0 and "attention" not in out
    for k in snap:
        np.testing.assert_array_equal(srv.weights[k], snap[k])
    assert not srv.agg_mask.any() and srv.aggregations == 0
    srv.agg_protos[:] = 1.5
    srv.agg_raw[:] = 7.0
    srv.agg_mask[3] = True
    fresh = ProtoAttentionServer(server_ctx({}))
    from fedbus.broker.wire import decode_body, encode_body  # checkpoints use the wire codec
    fresh.load_state_dict(decode_body(encode_body(srv.state_dict())))
    np.testing.assert_array_equal(fresh.agg_protos, srv.agg_protos)
    np.testing.assert_array_equal(fresh.agg_raw, srv.agg_raw)
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


# --- a real federation: AMM and attention in metrics.jsonl ------------------------------------

def test_federation_writes_amm_and_attention_to_metrics(tmp_path):
    """Broker, server and two client nodes on digits; 5 of 6 clients sampled per round,
    each running F' ~ U[0, F] epochs (the paper's partial workload)."""
    cfg = merged(SMALL, federation={"rounds": 3, "fraction": 0.75, "eval_every": 3},
                 algorithm={"name": "proto-attention"}, train={"epochs": 2},
                 system={"partial_work": True})
    run, summary = run_federation(tmp_path, cfg, timeout=240)
    recs = metrics(run)
    assert summary["rounds_completed"] == 3 and [r["round"] for r in recs] == [0, 1, 2]
    for r in recs:
        att = r["agg_extra"]["attention"]
        assert sorted(int(c) for c in att) == r["participants"] and len(att) == r["updates"]
        assert sum(att.values()) == pytest.approx(1.0, abs=1e-9)
        assert all(a > 0 for a in att.values())
        assert r["agg"]["attn_max"] == pytest.approx(max(att.values()))
        # eq. 15 as printed is |C'| / |C|: here every aggregated class has another one
        assert 0.0 < r["agg"]["amm"] <= 1.0 and r["agg"]["amm_dist"] > 0.0
        assert ("apm_mean" in r["agg"]) == (r["round"] > 0)
    assert any(r["partial"] > 0 for r in recs)  # partial work was aggregated, not dropped
    # t = 0 is FedAvg's sample-count share; later rounds are the margins' attention
    assert recs[0]["agg"]["attn_max"] != pytest.approx(recs[0]["agg"]["attn_min"])

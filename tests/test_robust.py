"""Robust aggregation (fedbus.algorithms.core.robust, issue 30 item 2): each rule on hand-made
vectors against a hand computation; an attacker below the breakdown point moves the median,
the trimmed mean and Krum no further than each rule's stated bound while the plain mean
goes wherever the attacker wants; the default "none" is today's aggregation bit for bit;
real FedProto / FedAvg / FedAvg-proto / FedTGP servers with one poisoned client; no merge
rule (relay, engine) under a robust option; and one short federation run with it."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import client_ctx, digits_parts, iid_digits_parts, server_ctx, update

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core import robust as R
from fedbus.algorithms.core.handlers import ClientUpdate, LocalRun, RoundInfo, Work
from fedbus.algorithms.core.params import resolved_params
from fedbus.algorithms.core.protos import aggregate_prototypes, merge_prototypes
from fedbus.algorithms.core.weights import average_deltas, fedavg_coefs
from fedbus.node.config import ConfigError, build_config

torch.set_num_threads(1)

ROBUST_FAMILIES = ("fedavg", "fedprox", "fedavg-proto", "fedproto", "fedtgp")


# --- the rules by hand -------------------------------------------------------------------

X4 = np.array([[1.0, 10.0], [3.0, -2.0], [2.0, 5.0], [100.0, 4.0]])
X5 = np.vstack([X4, [[0.0, 0.0]]])


def test_median_by_hand():
    # odd n: the middle value; even n: the mean of the two middle ones
    np.testing.assert_array_equal(R.median(X5), [2.0, 4.0])  # (0,1,2,3,100), (-2,0,4,5,10)
    np.testing.assert_array_equal(R.median(X4), [2.5, 4.5])  # (2+3)/2, (4+5)/2
    np.testing.assert_array_equal(R.median(X5[[4, 2, 0, 3, 1]]), R.median(X5))  # any order


def test_trimmed_mean_by_hand():
    # n = 5, beta = 0.2: t = 1 from each end: (1+2+3)/3 = 2, (0+4+5)/3 = 3
    np.testing.assert_allclose(R.trimmed_mean(X5, 0.2), [2.0, 3.0], rtol=0, atol=1e-15)
    # beta = 0.19: t = floor(0.95) = 0, the plain mean
    np.testing.assert_allclose(R.trimmed_mean(X5, 0.19), X5.mean(axis=0), rtol=1e-15)
    assert R.trim_count(100, 0.29) == 29 and R.trim_count(10, 0.1) == 1
    assert R.trim_count(9, 0.1) == 0
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        R.trimmed_mean(X5, 0.5)
    # the sorted values are summed in order: the client order changes no bit
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, 50))
    assert np.array_equal(R.trimmed_mean(x, 0.25), R.trimmed_mean(x[::-1], 0.25))


def test_krum_scores_and_choice_by_hand():
    # five points on a line, f = 1: each score sums the n - f - 2 = 2 smallest squared
    # distances to the others.
    x = np.array([[0.0], [1.0], [3.0], [7.0], [50.0]])
    sq = R.pairwise_sq_distances(x)
    np.testing.assert_array_equal(sq[0], [0, 1, 9, 49, 2500])
    # 0: 1+9; 1: 1+4; 3: 4+9; 7: 16+36; 50: 43^2 + 47^2
    np.testing.assert_array_equal(R.krum_scores(sq, 1), [10, 5, 13, 52, 1849 + 2209])
    value, chosen = R.krum(x, 1)
    assert chosen.tolist() == [1] and value.tolist() == [1.0]
    value, chosen = R.krum(x, 1, m=3)  # multi-Krum: the 3 lowest scores, averaged
    assert chosen.tolist() == [1, 0, 2] and value.tolist() == [4 / 3]
    value, chosen = R.krum(x, 1, m=10)  # m is capped at n - f = 4
    assert chosen.tolist() == [1, 0, 2, 3] and value.tolist() == [11 / 4]


def test_krum_ties_go_to_the_first_client():
    square = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [10.0, 10.0], [1.0, 1.0]])
    # every corner of the unit square scores 1 + 1 = 2: the first client's wins
    assert R.krum_scores(R.pairwise_sq_distances(square), 1).tolist()[:3] == [2, 2, 2]
    assert R.krum(square, 1)[1].tolist() == [0]
    assert R.krum(square[[4, 3, 2, 1, 0]], 1)[1].tolist() == [0]  # now (1, 1) is first


def test_impossible_settings_are_refused_and_krum_falls_back_to_the_median():
    with pytest.raises(ValueError, match=r"n >= 2f \+ 3 = 5"):
        R.krum(X4, 1)
    with pytest.raises(ValueError, match="robust rule 'mean'"):
        R.RobustRule("mean")
    with pytest.raises(ValueError):
        R.RobustRule("trimmed_mean", trim=0.5)
    with pytest.raises(ValueError):
        R.RobustRule("krum", m=0)
    with pytest.raises(ValueError, match="at least one"):
        R.median(np.zeros((0, 3)))
    # four vectors cannot hold Krum's bound with f = 1: the median, counted
    out = R.Outcome()
    np.testing.assert_array_equal(R.RobustRule("krum", f=1).vectors(X4, out), R.median(X4))
    assert out.fallbacks == 1 and not out.chosen
    out = R.Outcome()
    R.RobustRule("krum", f=1).vectors(X5, out)
    # scores (2 nearest): (1,10) 26+101, (3,-2) 13+50, (2,5) 26+29, (100,4) huge, (0,0) 13+29
    assert out.fallbacks == 0 and out.chosen == {-1: [4]}


def test_per_class_uses_the_holders_only_and_reports_fallbacks():
    protos = np.array([[[1, 1], [5, 5], [0, 0]],
                       [[3, 3], [0, 0], [0, 0]],
                       [[2, 8], [7, 7], [0, 0]]], np.float32)
    present = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 0]], bool)
    out = R.Outcome()
    mean, has = R.RobustRule("median").per_class(protos, present, out)
    # class 0: median of (1,1), (3,3), (2,8) = (2, 3); class 1: (5,5) and (7,7) -> (6, 6)
    np.testing.assert_array_equal(mean, [[2, 3], [6, 6], [0, 0]])
    assert has.tolist() == [True, True, False] and mean.dtype == np.float32
    out = R.Outcome()
    R.RobustRule("krum", f=0).per_class(protos, present, out)
    # f = 0 needs 3 holders: class 0 has them (Krum), class 1 falls back
    assert out.fallbacks == 1 and list(out.chosen) == [0]


def test_trees_apply_the_rule_name_by_name_and_krum_over_the_float_entries():
    trees = [{"w": np.array([[1.0, 2.0]], np.float32), "n": np.array(3, np.int64)},
             {"w": np.array([[2.0, 0.0]], np.float32), "n": np.array(100, np.int64)},
             {"w": np.array([[9.0, 1.0]], np.float32), "n": np.array(4, np.int64)}]
    med = R.RobustRule("median").trees(trees)
    np.testing.assert_array_equal(med["w"], [[2.0, 1.0]])
    assert med["n"] == 4.0 and med["n"].shape == ()
    # Krum with f = 0 over w only (n counts steps): w scores 1 nearest: 5, 5, 50
    out = R.Outcome()
    k = R.RobustRule("krum", f=0).trees(trees, out)
    assert out.chosen == {-1: [0]} and k["w"].tolist() == [[1.0, 2.0]] and k["n"] == 3
    big = [{"w": np.arange(R.CHUNK + 5, dtype=np.float32) * i} for i in (1.0, 3.0, 2.0)]
    np.testing.assert_array_equal(R.RobustRule("median").trees(big)["w"],
                                  np.arange(R.CHUNK + 5) * 2.0)  # across chunks


def test_trees_in_blocks_that_span_names_give_the_rule_name_by_name(monkeypatch):
    rng = np.random.default_rng(4)
    shapes = {"a": (3, 4), "b": (5,), "c": (), "d": (2, 2, 3), "n": ()}
    trees = [{k: (rng.integers(0, 9, size=s) if k == "n" else rng.normal(size=s))
              .astype(np.int64 if k == "n" else np.float32) for k, s in shapes.items()}
             for _ in range(7)]
    want = {k: np.median(np.stack([t[k] for t in trees]).astype(np.float64), axis=0)
            for k in shapes}
    for chunk in (1, 7, 10, 1 << 16):  # blocks of 1 column, across names, one block
        monkeypatch.setattr(R, "CHUNK", chunk)
        got = R.RobustRule("median").trees(trees)
        assert all(np.array_equal(got[k], want[k]) and got[k].shape == shapes[k] for k in shapes)
        out = R.Outcome()
        got = R.RobustRule("krum", f=2).trees(trees, out)
        flat = np.stack([np.concatenate([t[k].reshape(-1) for k in "abcd"]) for t in trees])
        assert out.chosen[-1] == R.krum(flat, 2)[1].tolist()


# --- an attacker below the breakdown point --------------------------------------------------

def _honest_and_attack(rng, n_honest, d, scale):
    honest = rng.normal(size=(n_honest, d))
    direction = rng.normal(size=d)
    return honest, honest.mean(0) + scale * direction / np.linalg.norm(direction)


def _diameter(x):
    return math.sqrt(R.pairwise_sq_distances(x).max())


@pytest.mark.parametrize("scale", [1e6, 10.0, 2.0, 0.5])
def test_one_attacker_of_five_is_bounded(scale):
    """The bound asserted: the median and the trimmed mean (beta = 0.2, t = 1 >= f) lie,
    coordinate by coordinate, between the smallest and largest honest value; Krum (f = 1)
    returns a vector within sqrt(n - f - 2) D of an honest one and multi-Krum (m = n - f)
    an average within (sqrt(n - f - 2) + 1) D of the honest mean, D the honest diameter.
    The plain mean moves by (attack - honest mean) / 5, as far as the attacker likes."""
    rng = np.random.default_rng(7)
    honest, bad = _honest_and_attack(rng, 4, 64, scale)
    for pos in range(5):  # the attacker anywhere in the client order
        x = np.insert(honest, pos, bad, axis=0)
        lo, hi = honest.min(0), honest.max(0)
        for value in (R.median(x), R.trimmed_mean(x, 0.2)):
            assert np.all(value >= lo) and np.all(value <= hi)
        d, n, f = _diameter(honest), 5, 1
        value, _ = R.krum(x, f)
        assert np.linalg.norm(honest - value, axis=1).min() <= math.sqrt(n - f - 2) * d + 1e-9
        value, _ = R.krum(x, f, m=n - f)
        assert np.linalg.norm(value - honest.mean(0)) <= (math.sqrt(n - f - 2) + 1) * d
        shift = np.linalg.norm(x.mean(0) - honest.mean(0))
        np.testing.assert_allclose(shift, scale / 5, rtol=1e-9)


def test_two_colluding_attackers_of_seven_are_bounded():
    rng = np.random.default_rng(11)
    honest, bad = _honest_and_attack(rng, 5, 32, 1e4)
    x = np.vstack([honest[:2], bad, honest[2:], bad + 1.0])  # f = 2, n = 7 >= 2f + 3
    lo, hi = honest.min(0), honest.max(0)
    for value in (R.median(x), R.trimmed_mean(x, 2 / 7)):
        assert np.all(value >= lo) and np.all(value <= hi)
    value, chosen = R.krum(x, 2)
    assert chosen[0] not in (2, 6)  # far away, the colluders score worst
    assert np.linalg.norm(honest - value, axis=1).min() <= math.sqrt(3) * _diameter(honest)


# --- the default: today's aggregation, bit for bit ------------------------------------------

def _proto_payloads(rng, n, c=4, d=3):
    out = []
    for _ in range(n):
        counts = rng.integers(0, 5, size=c)
        protos = rng.normal(size=(c, d)).astype(np.float32) * (counts > 0)[:, None]
        out.append({"protos": protos.astype(np.float32), "counts": counts.astype(np.int64)})
    return out


@pytest.mark.parametrize("params", [{}, {"robust": "none", "robust_f": 3}])
def test_fedproto_default_is_eq6_bit_for_bit(params):
    rng = np.random.default_rng(0)
    payloads = _proto_payloads(rng, 6)
    ups = [update(i, p, staleness=i % 3) for i, p in enumerate(payloads)]
    s = get_algorithm("fedproto").server(server_ctx(params, num_classes=4, feature_dim=3))
    s.aggregate(ups, [], RoundInfo(0, 3))
    # what FedProtoServer.aggregate computed before the option existed
    mean, mass = aggregate_prototypes(np.stack([p["protos"] for p in payloads]),
                                      np.stack([p["counts"] for p in payloads]),
                                      np.array([u.weight for u in ups]), by_count=True)
    want, has = merge_prototypes(np.zeros((4, 3), np.float32), np.zeros(4, bool), mean,
                                 mass > 0, True)
    assert np.array_equal(s.protos, want) and np.array_equal(s.has, has)
    assert type(s).merge_rule(resolved_params(type(s), params)) is type(s).MERGE
    assert s.merge_rule() is type(s).MERGE


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedavg-proto"])
def test_weight_family_default_is_the_weighted_mean_bit_for_bit(name):
    algo = get_algorithm(name)
    s = algo.server(server_ctx({}))
    start = {k: v.copy() for k, v in s.weights.items()}
    rng = np.random.default_rng(1)
    deltas = [{k: rng.normal(size=v.shape).astype(v.dtype) if v.dtype.kind == "f"
               else np.zeros_like(v) for k, v in start.items()} for _ in range(5)]
    ups = [update(i, {"delta": dl}, n=10 + 7 * i, staleness=i % 2)
           for i, dl in enumerate(deltas)]
    s.aggregate(ups, [], RoundInfo(0, 3))
    want = average_deltas(start, deltas, fedavg_coefs(ups))
    assert all(np.array_equal(s.weights[k], want[k]) for k in want)


def test_fedtgp_default_trains_on_the_prototypes_as_they_came():
    rng = np.random.default_rng(2)
    payloads = [{"protos": p["protos"]} for p in _proto_payloads(rng, 5)]
    out = []
    for params in ({}, {"robust": "none"}):
        s = get_algorithm("fedtgp").server(server_ctx({"server_epochs": 3, **params},
                                                      num_classes=4, feature_dim=3))
        s.aggregate([update(i, p) for i, p in enumerate(payloads)], [], RoundInfo(0, 3))
        out.append((s.protos.copy(), s.margin))
    assert np.array_equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]


# --- real handlers with one poisoned client ---------------------------------------------------

def _trained_payloads(name, params, parts):
    """One round of real local training on digits: the clients' payloads and sample counts."""
    algo = get_algorithm(name)
    server = algo.server(server_ctx(params, clients=len(parts)))
    info = RoundInfo(0, 1)  # the last round: fedavg-proto sends prototypes too
    out = []
    for i, part in enumerate(parts):
        h = algo.client(client_ctx(i, part, params))
        payload = h.train(server.make_task(i, info), LocalRun(h.ctx, epochs=1, seed=i))
        out.append((payload, len(part[1])))
    return out


def _poisoned_protos(payload):
    return {**payload, "protos": np.full_like(payload["protos"], 1e6)
            * (np.asarray(payload["counts"]) > 0)[:, None]}


@pytest.fixture(scope="module")
def fedproto_payloads():
    # client j holds classes j..j+7 (mod 10): every class has 3 to 5 holders
    return _trained_payloads("fedproto", {}, digits_parts(5, ways=8))


def test_fedproto_median_keeps_a_poisoned_client_out(fedproto_payloads):
    """Client 0 sends prototypes of 1e6 (its own shape and counts): the median's global
    prototypes stay within the honest clients' range per coordinate; eq. 6 moves by ~1e5."""
    honest = fedproto_payloads[1:]
    ups = [update(0, _poisoned_protos(fedproto_payloads[0][0]), n=fedproto_payloads[0][1])]
    ups += [update(i + 1, p, n=n) for i, (p, n) in enumerate(honest)]
    info = RoundInfo(0, 3)
    robust = get_algorithm("fedproto").server(server_ctx({"robust": "median"}))
    metrics = robust.aggregate(ups, [], info)
    plain = get_algorithm("fedproto").server(server_ctx({}))
    plain.aggregate(ups, [], info)
    clean = get_algorithm("fedproto").server(server_ctx({}))
    clean.aggregate(ups[1:], [], info)
    assert metrics["robust_fallbacks"] == 0.0 and robust.has.all()
    protos = np.stack([p["protos"] for p, _ in honest]).astype(np.float64)
    held = np.stack([p["counts"] for p, _ in honest]) > 0
    for k in range(10):
        rows = protos[held[:, k], k]
        assert len(rows) >= 2  # the attacker is one of 3 or more holders: f < n/2
        assert np.all(robust.protos[k] >= rows.min(0) - 1e-6)
        assert np.all(robust.protos[k] <= rows.max(0) + 1e-6)
    spread = np.abs(protos[held]).max()
    assert np.abs(robust.protos - clean.protos).max() <= 2 * spread
    assert np.abs(plain.protos - clean.protos).max() > 1e4


def test_fedproto_krum_reports_whom_it_chose(fedproto_payloads):
    ups = [update(0, _poisoned_protos(fedproto_payloads[0][0]))]
    ups += [update(i, p, n=n) for i, (p, n) in enumerate(fedproto_payloads[1:], start=1)]
    s = get_algorithm("fedproto").server(server_ctx({"robust": "krum", "robust_f": 1}))
    metrics = s.aggregate(ups, [], RoundInfo(0, 3))
    # f = 1 needs 5 holders: only classes 4-7 have them, the other six fall back
    assert metrics["robust_fallbacks"] == 6.0 and list(metrics["krum_chosen"]) == \
        ["4", "5", "6", "7"]
    s = get_algorithm("fedproto").server(server_ctx({"robust": "krum", "robust_f": 0}))
    metrics = s.aggregate(ups, [], RoundInfo(0, 3))
    chosen = metrics["krum_chosen"]
    assert metrics["robust_fallbacks"] == 0.0 and len(chosen) == 10
    assert all(len(v) == 1 and v[0] != 0 for v in chosen.values())  # never the attacker
    assert np.abs(s.protos).max() < 1e3


@pytest.fixture(scope="module")
def fedavg_payloads():
    return _trained_payloads("fedavg", {}, iid_digits_parts(5))


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum"])
def test_fedavg_robust_rules_keep_a_poisoned_delta_out(fedavg_payloads, rule):
    """Client 0's delta is 1e3 everywhere: each rule's step stays within the honest deltas'
    range per weight (median, trimmed mean with t = 1) or is an honest delta (Krum, f = 1);
    the weighted mean steps by ~200."""
    params = {"robust": rule, "robust_trim": 0.2}
    poison = {k: np.full_like(v, 1e3) if v.dtype.kind == "f" else v
              for k, v in fedavg_payloads[0][0]["delta"].items()}
    ups = [update(0, {"delta": poison}, n=10_000)]  # it claims many samples, too
    ups += [update(i, p, n=n) for i, (p, n) in enumerate(fedavg_payloads[1:], start=1)]
    s = get_algorithm("fedavg").server(server_ctx(params))
    start = {k: v.copy() for k, v in s.weights.items()}
    metrics = s.aggregate(ups, [], RoundInfo(0, 3))
    honest = [p["delta"] for p, _ in fedavg_payloads[1:]]
    for k, w in s.weights.items():
        stack = np.stack([h[k] for h in honest]).astype(np.float64)
        step = w.astype(np.float64) - start[k]
        assert np.all(step >= stack.min(0) - 1e-5) and np.all(step <= stack.max(0) + 1e-5), k
    if rule == "krum":
        assert metrics["krum_chosen"] != [0] and len(metrics["krum_chosen"]) == 1
    plain = get_algorithm("fedavg").server(server_ctx({}))
    plain.aggregate(ups, [], RoundInfo(0, 3))
    assert max(np.abs(plain.weights[k] - start[k]).max() for k in start) > 100


def test_fedavg_proto_robust_covers_weights_and_prototypes():
    payloads = _trained_payloads("fedavg-proto", {}, digits_parts(5, ways=10))
    bad = dict(payloads[0][0])
    bad["delta"] = {k: np.full_like(v, 1e3) for k, v in bad["delta"].items()}
    bad = _poisoned_protos(bad)
    ups = [update(0, bad)] + [update(i, p, n=n) for i, (p, n) in enumerate(payloads[1:], 1)]
    s = get_algorithm("fedavg-proto").server(server_ctx({"robust": "median"}))
    start = {k: v.copy() for k, v in s.weights.items()}
    metrics = s.aggregate(ups, [], RoundInfo(0, 1))
    assert metrics["proto_updates"] == 5.0 and metrics["proto_robust_fallbacks"] == 0.0
    assert max(np.abs(s.weights[k] - start[k]).max() for k in start) < 10
    assert s.has.all() and np.abs(s.protos).max() < 1e3


def test_fedtgp_trains_on_the_robust_prototypes():
    """A poisoned client's 1e6 rows drive eq. 9's margin to its cap tau; under the median
    the centres Q^c are the per-class medians, and the margin is theirs."""
    from fedbus.algorithms.fedtgp import adaptive_margin
    rng = np.random.default_rng(5)
    honest = [{"protos": rng.normal(size=(4, 3)).astype(np.float32)} for _ in range(4)]
    bad = rng.normal(size=(4, 3)).astype(np.float32)
    bad[0] = 1e6  # class 0 pulled far from the others
    ups = [update(0, {"protos": bad})] + [update(i, p) for i, p in enumerate(honest, start=1)]
    params = {"server_epochs": 2}
    plain = get_algorithm("fedtgp").server(server_ctx(params, num_classes=4, feature_dim=3))
    plain.aggregate(ups, [], RoundInfo(0, 3))
    assert plain.margin == 100.0  # tau
    s = get_algorithm("fedtgp").server(server_ctx({**params, "robust": "median"},
                                                  num_classes=4, feature_dim=3))
    metrics = s.aggregate(ups, [], RoundInfo(0, 3))
    med = np.median(np.stack([bad] + [h["protos"] for h in honest]), axis=0)
    assert s.margin == pytest.approx(adaptive_margin(med, np.ones(4, bool), 100.0))
    assert s.margin < 10 and math.isfinite(metrics["server_loss"])
    assert np.isfinite(s.protos).all() and np.abs(s.protos).max() < 100


# --- no merge rule under a robust option -------------------------------------------------------

@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedproto"])
def test_a_robust_run_declares_no_merge_rule(name):
    cls = get_algorithm(name).server
    assert cls.merge_rule() is not None  # the class's declaration stands
    assert cls.merge_rule(resolved_params(cls, {})) is cls.MERGE
    for rule in ("median", "trimmed_mean", "krum"):
        assert cls.merge_rule(resolved_params(cls, {"robust": rule})) is None
        handler = cls(server_ctx({"robust": rule}))
        assert handler.merge_rule() is None  # what the server's engine asks
    assert cls(server_ctx({})).merge_rule() is cls.MERGE
    # a subclass that does not declare the option keeps its sums (MP-FedCL under FedAvg)
    mp = get_algorithm("mpfedcl").server
    assert mp.merge_rule(resolved_params(mp, {})) is mp.MERGE


def test_a_merged_update_reaching_a_robust_aggregation_is_refused():
    s = get_algorithm("fedproto").server(server_ctx({"robust": "median"}, num_classes=2,
                                                    feature_dim=2))
    member = ClientUpdate(1, {}, 1, Work(1, 1.0, 1, 1), 0)
    merged = ClientUpdate(1, {"sums": np.zeros((2, 2)), "mass": np.zeros(2)}, 1,
                          Work(1, 1.0, 1, 1), 0, members=(member,))
    with pytest.raises(ValueError, match="pre-aggregated"):
        s.aggregate([merged], [], RoundInfo(0, 3))


def test_the_relay_forwards_and_the_server_refuses_merged_updates_under_a_robust_option():
    from fedbus.broker.wire import Message
    from fedbus.node.engine import client_address
    from fedbus.node.relay import Relay
    from fedbus.node.server import build_engine, dispatch

    raw = {"federation": {"clients": 4, "rounds": 2},
           "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": "mlp"},
           "algorithm": {"name": "fedproto", "robust": "median"}}
    relay = Relay("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "relay-0")
    relay._choose_rule(raw)
    assert relay.rule is None  # forwards every update as it is
    relay._choose_rule({**raw, "algorithm": {"name": "fedproto"}})
    assert relay.rule is not None
    engine = build_engine(build_config(raw), "r")
    engine.on_join("relay", [client_address(c) for c in range(4)], 0.0)
    tasks = engine.on_configured("relay", "r", 0.0)
    c, d = engine.handler.ctx.num_classes, engine.handler.ctx.feature_dim
    work = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1}
    body = {"version": tasks[0].body["version"], "rule": "prototype-sums",
            "members": [[t.dst, t.body["task"], 1, work] for t in tasks[:2]],
            "payload": {"sums": np.zeros((c, d)), "mass": np.zeros(c)}}
    outs = dispatch(engine, Message("merged", "relay", "server", body, run="r",
                                    round=tasks[0].round), 1.0)
    assert outs[0].kind == "error" and "no merge rule" in outs[0].body["reason"]


# --- configuration -------------------------------------------------------------------------------

def test_the_option_is_validated_and_only_the_robust_families_take_it():
    base = {"data": {"dataset": "digits"}}
    for name in ROBUST_FAMILIES:
        cfg = build_config({**base, "algorithm": {"name": name, "robust": "trimmed_mean",
                                                  "robust_trim": 0.25}})
        assert cfg.algorithm["robust"] == "trimmed_mean"
        assert build_config({**base, "algorithm": {"name": name}}).algorithm["robust"] == "none"
    with pytest.raises(ConfigError, match="allowed values are none, median, trimmed_mean"):
        build_config({**base, "algorithm": {"name": "fedavg", "robust": "mean"}})
    with pytest.raises(ConfigError, match="robust_trim"):
        build_config({**base, "algorithm": {"name": "fedavg", "robust_trim": 0.5}})
    for name in ("fd", "fedatt", "mpfedcl", "fedgh"):
        with pytest.raises(ConfigError, match="unknown key algorithm.robust"):
            build_config({**base, "algorithm": {"name": name, "robust": "median"}})
    assert "fedavg, fedprox, fedavg-proto, fedproto, fedtgp" in \
        R.unsupported_hint("algorithm", "robust")
    assert {n for n in ROBUST_FAMILIES
            if "robust" in get_algorithm(n).server.PARAMS} == set(R.ALGORITHMS)


# --- a short federation ---------------------------------------------------------------------------

def test_a_federation_with_a_robust_rule_completes(tmp_path):
    """fedbus run with --set algorithm.robust=krum (f = 0: a class with 3 holders is
    Krum's): the rounds complete, and whom Krum chose per class is in the records."""
    from tests.helpers import SMALL, metrics, run_federation

    sections = {**SMALL, "algorithm": {"name": "fedproto"}}
    run, summary = run_federation(tmp_path, sections, "--set", "algorithm.robust=krum",
                                  "--set", "algorithm.robust_f=0")
    assert summary["rounds_completed"] == 3 and summary["final"]["proto_acc_mean"] > 0.2
    recs = metrics(run)
    assert [r["merged"] for r in recs] == [0, 0, 0]
    for r in recs:
        chosen = r["agg_extra"].get("krum_chosen", {})
        assert len(chosen) + r["agg"]["robust_fallbacks"] == r["agg"]["classes_received"]
        assert all(len(v) == 1 and 0 <= v[0] < 6 for v in chosen.values())

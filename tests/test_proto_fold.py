"""fedbus.algorithms.core.protos.fold_prototypes: the one fold of received per-class vectors
into the global ones (FedProto's eq. 6, FD's logits, FedAvg-proto's eq. 3), from single
updates or from a merge rule's sums, under the algorithms' options."""
from __future__ import annotations

import numpy as np
import pytest
from algo_support import update

from fedbus.algorithms.core import robust as R
from fedbus.algorithms.core.handlers import ClientUpdate, Work
from fedbus.algorithms.core.merge import LogitSums, PrototypeSums
from fedbus.algorithms.core.protos import aggregate_prototypes, fold_prototypes, merge_prototypes

C, D = 3, 2
# client 0 holds classes 0 (2 samples) and 2 (1); client 1 classes 0 (1) and 1 (3)
P0 = np.array([[1.0, 2.0], [0.0, 0.0], [5.0, 6.0]], np.float32)
P1 = np.array([[4.0, 8.0], [7.0, 1.0], [0.0, 0.0]], np.float32)
N0 = np.array([2, 0, 1], np.int64)
N1 = np.array([1, 3, 0], np.int64)
EMPTY = (np.zeros((C, D), np.float32), np.zeros(C, bool))


def _singles(weights=(1.0, 1.0)):
    return [update(0, {"protos": P0, "counts": N0}, weight=weights[0]),
            update(1, {"protos": P1, "counts": N1}, weight=weights[1])]


def _merged(rule, params, ups):
    """What a relay sends up for `ups` (one global version): their lifted forms added."""
    total = None
    for u in ups:
        total = rule.add(total, rule.lift(u.payload, u.num_samples, u.work, params, u.client))
    return ClientUpdate(client=ups[0].client, payload=total,
                        num_samples=sum(u.num_samples for u in ups), work=Work(1, 1.0, 1, 1),
                        version=0, weight=ups[0].weight,
                        members=tuple(ClientUpdate(u.client, {}, u.num_samples, u.work, 0)
                                      for u in ups))


@pytest.mark.parametrize("aggregate", ["weighted", "mean"])
def test_weighted_and_mean_by_hand(aggregate):
    protos, has, received = fold_prototypes(*EMPTY, _singles((1.0, 0.5)), PrototypeSums(),
                                            {"aggregate": aggregate})
    # class 0: client 1 weighs its staleness weight 0.5 times its count 1 (weighted) or 1
    a0, a1 = (2.0, 0.5) if aggregate == "weighted" else (1.0, 0.5)
    want0 = (a0 * P0[0].astype(np.float64) + a1 * P1[0]) / (a0 + a1)
    np.testing.assert_array_equal(protos[0], want0.astype(np.float32))
    np.testing.assert_array_equal(protos[1], P1[1])  # one holder: its prototype
    np.testing.assert_array_equal(protos[2], P0[2])
    assert protos.dtype == np.float32 and has.tolist() == received.tolist() == [True] * 3


def test_single_updates_are_aggregate_then_merge_bit_for_bit():
    rng = np.random.default_rng(0)
    ups = [update(i, {"protos": rng.normal(size=(C, D)).astype(np.float32),
                      "counts": rng.integers(0, 3, size=C)}, staleness=i % 3) for i in range(5)]
    old = rng.normal(size=(C, D)).astype(np.float32), np.array([True, False, True])
    for aggregate in ("weighted", "mean"):
        for keep in (True, False):
            got = fold_prototypes(*old, ups, PrototypeSums(), {"aggregate": aggregate},
                                  keep_missing=keep)
            mean, mass = aggregate_prototypes(
                np.stack([u.payload["protos"] for u in ups]),
                np.stack([u.payload["counts"] for u in ups]),
                np.array([u.weight for u in ups]), by_count=aggregate == "weighted")
            want = merge_prototypes(*old, mean, mass > 0, keep)
            assert got[0].tobytes() == want[0].tobytes()
            assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], mass > 0)


@pytest.mark.parametrize("keep", [True, False])
def test_keep_missing(keep):
    old = np.full((C, D), 9.0, np.float32), np.array([False, False, True])
    ups = [update(1, {"protos": P1, "counts": N1})]  # classes 0 and 1 only
    protos, has, received = fold_prototypes(*old, ups, PrototypeSums(), {"aggregate": "mean"},
                                            keep_missing=keep)
    assert received.tolist() == [True, True, False]
    np.testing.assert_array_equal(protos[:2], P1[:2])
    if keep:  # class 2 keeps its previous global row
        assert has.tolist() == [True, True, True] and protos[2].tolist() == [9.0, 9.0]
    else:  # dropped: zero row, absent
        assert has.tolist() == [True, True, False] and protos[2].tolist() == [0.0, 0.0]
    assert old[0][2].tolist() == [9.0, 9.0] and old[1].tolist() == [False, False, True]


@pytest.mark.parametrize("aggregate", ["weighted", "mean"])
def test_merged_sums_equal_the_per_client_fold(aggregate):
    rng = np.random.default_rng(1)
    params = {"aggregate": aggregate}
    rule = PrototypeSums()
    for weights in ([1.0] * 5, [1.0, 1.0, 0.5, 1.0, 0.25]):
        ups = [update(i, {"protos": rng.normal(size=(C, D)).astype(np.float32),
                          "counts": rng.integers(0, 3, size=C)}, weight=w)
               for i, w in enumerate(weights)]
        flat = fold_prototypes(*EMPTY, ups, rule, params)
        # a relay's sums of clients 0 and 1 (one global version: one weight) beside the rest
        got = fold_prototypes(*EMPTY, [_merged(rule, params, ups[:2])] + ups[2:], rule, params)
        assert np.array_equal(got[1], flat[1]) and np.array_equal(got[2], flat[2])
        if weights == [1.0] * 5:  # the same sums in the same order
            assert got[0].tobytes() == flat[0].tobytes()
        else:  # (a p) w against (a w) p: float64 rounding
            np.testing.assert_allclose(got[0], flat[0], rtol=1e-6)


def test_fd_logits_fold_like_prototypes():
    ups = [update(0, {"logits": P0, "counts": N0}), update(1, {"logits": P1, "counts": N1})]
    want = fold_prototypes(*EMPTY, _singles(), PrototypeSums(), {"aggregate": "weighted"})
    for updates in (ups, [_merged(LogitSums(), {"aggregate": "weighted"}, ups)]):
        got = fold_prototypes(*EMPTY, updates, LogitSums(), {"aggregate": "weighted"},
                              key="logits")
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_robust_rule_per_class_then_merge():
    old = np.full((C, D), 9.0, np.float32), np.array([False, False, True])
    ups = _singles() + [update(2, {"protos": P0 + 1, "counts": N0})]
    rule = R.RobustRule("median")
    out = R.Outcome()
    got = fold_prototypes(*old, ups, PrototypeSums(), {"aggregate": "weighted"}, robust=rule,
                          outcome=out)
    mean, present = rule.per_class(np.stack([P0, P1, P0 + 1]), np.stack([N0, N1, N0]) > 0)
    want = merge_prototypes(*old, mean, present, True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0][1], P1[1])  # unweighted, one holder
    merged = _merged(PrototypeSums(), {"aggregate": "weighted"}, _singles())
    with pytest.raises(ValueError, match="pre-aggregated"):
        fold_prototypes(*old, [merged], PrototypeSums(), {}, robust=rule)
    with pytest.raises(ValueError, match="no update"):
        fold_prototypes(*old, [], PrototypeSums(), {})


def test_server_training_params_keep_each_algorithms_defaults():
    from fedbus.algorithms import get_algorithm
    from fedbus.algorithms.core.params import default_of

    want = {"fedgh": (1, 1, 0.01), "fedtgp": (100, 0, 0.0), "fedgen": (100, 0, None)}
    for name, values in want.items():
        params = get_algorithm(name).server.PARAMS
        got = tuple(default_of(params[k]) if k in params else None
                    for k in ("server_epochs", "server_batch_size", "server_lr"))
        assert got == values, name

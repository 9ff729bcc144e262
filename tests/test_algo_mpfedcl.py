"""MP-FedCL handlers: hand-computed pool, loss and aggregation; real training on digits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import check_spec, make_model_fn, seven_class_digits, tiny_harness

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, Failure, LocalRun, RoundInfo
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.protos import embeddings
from fedbus.algorithms.mpfedcl import (MPFedCLClient, MPFedCLServer, client_prototypes,
                                       merge_pool, pool_contrastive_loss, pool_distances)

torch.set_num_threads(1)

TRAIN = {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.0, "batch_size": 32, "epochs": 1}
server_ctx, client_ctx, update = tiny_harness(TRAIN)


@pytest.fixture(scope="module")
def digits_clients():
    return seven_class_digits(seed=0)


# --- the pool, by hand ------------------------------------------------------------

def two_clients_k2():
    # client A (0): counts [4, 1, 2]; class 1 has one prototype (one slot missing)
    pa = np.array([[[0, 0], [10, 0]], [[1, 1], [9, 9]], [[5, 5], [9, 5]]], np.float32)
    ma = np.array([[1, 1], [1, 0], [1, 1]], bool)
    ca = np.array([4, 1, 2], np.int64)
    # client B (1): counts [2, 0, 3]; class 1 missing (garbage rows must be ignored)
    pb = np.array([[[0, 2], [10, 2]], [[7, 7], [7, 7]], [[5, 6], [9, 6]]], np.float32)
    mb = np.array([[1, 1], [0, 0], [1, 1]], bool)
    cb = np.array([2, 0, 3], np.int64)
    return [pa, pb], [ma, mb], [ca, cb]


def test_pool_default_is_eq10_client_padding_by_hand():
    # Eq. 8-10 with the defaults (pool "all", avg "mean", padding "client"), k = 2.
    p, m, c = two_clients_k2()
    pool, mask = merge_pool(p, m, c, [1.0, 1.0], 2)
    # eq. 9 averages, by hand: class 0 over its four entries (0,0),(10,0),(0,2),(10,2);
    # class 1 over A's single entry (1,1); class 2 over (5,5),(9,5),(5,6),(9,6)
    avg0, avg1 = np.array([5.0, 1.0]), np.array([1.0, 1.0])
    assert np.allclose(np.mean([[0, 0], [10, 0], [0, 2], [10, 2]], 0), avg0)
    # eq. 10, client by client: A has K=2 of class 0 and 2 (kept), K=1 < k of class 1
    # (both slots -> avg1); B keeps its classes 0 and 2 and lacks class 1 (2 x avg1).
    want = np.array([[[0, 0], [10, 0], [0, 2], [10, 2]],
                     [avg1, avg1, avg1, avg1],
                     [[5, 5], [9, 5], [5, 6], [9, 6]]], np.float32)
    assert pool.dtype == np.float32 and mask.dtype == bool
    assert mask.all() and pool.shape == (3, 4, 2)  # n_updates x k entries for every class
    np.testing.assert_allclose(pool, want)


def three_clients_class1():
    """k = 2, one class, three clients: A one prototype (1,1) (K=1), B two (3,3), (5,7),
    C lacks the class."""
    pa = np.array([[[1, 1], [0, 0]]], np.float32)
    pb = np.array([[[3, 3], [5, 7]]], np.float32)
    pc = np.zeros((1, 2, 2), np.float32)
    masks = [np.array([[1, 0]], bool), np.array([[1, 1]], bool), np.zeros((1, 2), bool)]
    counts = [np.array([1]), np.array([6]), np.array([0])]
    return [pa, pb, pc], masks, counts


def test_pool_padding_modes_by_hand():
    p, m, c = three_clients_class1()
    avg = (np.array([1, 1]) + np.array([3, 3]) + np.array([5, 7])) / 3  # eq. 9: (3, 11/3)
    pool, mask = merge_pool(p, m, c, [1.0] * 3, 2, padding="client")
    np.testing.assert_allclose(pool[0], [avg, avg, [3, 3], [5, 7], avg, avg], rtol=1e-6)
    assert mask.all()
    pool, mask = merge_pool(p, m, c, [1.0] * 3, 2, padding="fill")
    np.testing.assert_allclose(pool[0], [[1, 1], avg, [3, 3], [5, 7], avg, avg], rtol=1e-6)
    pool, mask = merge_pool(p, m, c, [1.0] * 3, 2, padding="pool")  # union has 3 >= k
    np.testing.assert_allclose(pool[0], [[1, 1], [3, 3], [5, 7]])
    assert mask[0].tolist() == [True, True, True]
    # avg "count": entry weights w * n / K: A 1*1/1 = 1, B 1*6/2 = 3 each
    cnt = (1 * np.array([1, 1]) + 3 * np.array([3, 3]) + 3 * np.array([5, 7])) / 7
    pool, _ = merge_pool(p, m, c, [1.0] * 3, 2, avg="count")
    np.testing.assert_allclose(pool[0, 0], cnt, rtol=1e-6)
    # DBSCAN (variable cluster counts): a client's clusters are kept, a missing class is
    # filled with k copies
    pool, mask = merge_pool(p, m, c, [1.0] * 3, 2, cluster="dbscan")
    np.testing.assert_allclose(pool[0][mask[0]], [[1, 1], [3, 3], [5, 7], avg, avg], rtol=1e-6)


def test_pool_kmeans_k2_by_hand():
    p, m, c = two_clients_k2()
    # avg "count": entry weights omega = w * n / slots: A 1*4/2 = 2, B 1*2/2 = 1.
    # clusters {(0,0),(0,2)} and {(10,0),(10,2)}: y = (2*0 + 1*2)/3 = 2/3
    pool, mask = merge_pool(p, m, c, [1.0, 1.0], 2, mode="kmeans", avg="count", seed=3,
                            init="k-means++", n_init=5)
    assert pool.shape == (3, 2, 2) and mask.all()
    c0 = pool[0][np.argsort(pool[0][:, 0])]
    np.testing.assert_allclose(c0, [[0, 2 / 3], [10, 2 / 3]], rtol=1e-6)
    # class 1: one entry (1,1), padded with itself
    np.testing.assert_allclose(pool[1], [[1, 1], [1, 1]])
    # class 2: omega A 1*2/2 = 1, B 1*3/2 = 1.5: y = (1*5 + 1.5*6)/2.5 = 5.6
    c2 = pool[2][np.argsort(pool[2][:, 0])]
    np.testing.assert_allclose(c2, [[5, 5.6], [9, 5.6]], rtol=1e-6)
    # avg "mean" (default): every entry weighs its client's w = 1: y = (0 + 2)/2 = 1
    pool, _ = merge_pool(p, m, c, [1.0, 1.0], 2, mode="kmeans", seed=3, init="k-means++",
                         n_init=5)
    c0 = pool[0][np.argsort(pool[0][:, 0])]
    np.testing.assert_allclose(c0, [[0, 1], [10, 1]], rtol=1e-6)


def test_pool_average_with_staleness_k3():
    # A (fresh, w=1): class 0 one prototype (1,1) from 1 sample; class 1 three.
    pa = np.array([[[1, 1], [0, 0], [0, 0]], [[0, 0], [2, 0], [4, 0]]], np.float32)
    ma = np.array([[1, 0, 0], [1, 1, 1]], bool)
    ca = np.array([1, 3], np.int64)
    # B: class 0 one prototype (4,4) from 3 samples; class 1 missing.
    pb = np.array([[[4, 4], [0, 0], [0, 0]], [[0, 0], [0, 0], [0, 0]]], np.float32)
    mb = np.array([[1, 0, 0], [0, 0, 0]], bool)
    cb = np.array([3, 0], np.int64)
    # B stale, w = 0.5. Eq. 9 (avg "mean") weighs entries by w: ((1,1) + 0.5 (4,4)) / 1.5
    # = (2,2); padding "client": both have K=1 < 3 of class 0 -> 3 x (2,2) each; class 1:
    # A keeps its three, B lacks it -> 3 x mean((0,0),(2,0),(4,0)) = (2,0).
    pool, mask = merge_pool([pa, pb], [ma, mb], [ca, cb], [1.0, 0.5], 3)
    np.testing.assert_allclose(pool[0], [[2, 2]] * 6, rtol=1e-6)
    np.testing.assert_allclose(pool[1], [[0, 0], [2, 0], [4, 0]] + [[2, 0]] * 3)
    assert mask.all()
    # avg "count", padding "pool" (fedbus's former defaults): omega_A = 1*1 = 1,
    # omega_B = 0.5*3 = 1.5; pad = (1*(1,1) + 1.5*(4,4)) / 2.5 = (2.8, 2.8)
    pool, mask = merge_pool([pa, pb], [ma, mb], [ca, cb], [1.0, 0.5], 3, avg="count",
                            padding="pool")
    np.testing.assert_allclose(pool[0], [[1, 1], [4, 4], [2.8, 2.8]], rtol=1e-6)
    np.testing.assert_allclose(pool[1], [[0, 0], [2, 0], [4, 0]])
    # B fresh: omega_B = 3, pad = ((1,1) + 3*(4,4)) / 4 = (3.25, 3.25)
    pool, _ = merge_pool([pa, pb], [ma, mb], [ca, cb], [1.0, 1.0], 3, avg="count",
                         padding="pool")
    np.testing.assert_allclose(pool[0, 2], [3.25, 3.25], rtol=1e-6)


def test_pool_missing_class_and_carry():
    p, m, c = two_clients_k2()
    prev, prev_mask = merge_pool(p, m, c, [1.0, 1.0], 2)
    # a later aggregation with only B, which lacks class 1
    pool, mask = merge_pool([p[1]], [m[1]], [c[1]], [1.0], 2, prev_pool=prev,
                            prev_mask=prev_mask, carry=True)
    np.testing.assert_allclose(pool[1][mask[1]], [[1, 1]] * 4)  # carried over
    np.testing.assert_allclose(pool[0][mask[0]], [[0, 2], [10, 2]])
    pool, mask = merge_pool([p[1]], [m[1]], [c[1]], [1.0], 2, prev_pool=prev,
                            prev_mask=prev_mask, carry=False)
    assert not mask[1].any()  # no client has class 1: missing
    # no class at all anywhere: all missing
    pool, mask = merge_pool([], [], [], [], 2, prev_pool=np.zeros((3, 2, 2), np.float32),
                            prev_mask=np.zeros((3, 2), bool))
    assert not mask.any() and pool.shape == (3, 2, 2)


# --- the loss, by hand ------------------------------------------------------------

def test_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    y = torch.tensor([0, 1, 2])  # class 2 has no pool entry: sample 2 is skipped
    pool = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[-1.0, 0.0], [9.0, 9.0]],
                         [[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    tau = 0.5
    got = pool_contrastive_loss(z, y, pool, mask, tau, "cosine").item()
    # numpy, by the formula: valid anchors (1,0),(0,1) of class 0 and (-1,0) of class 1
    anchors = np.array([[1, 0], [0, 1], [-1, 0]], float)
    owner = np.array([0, 0, 1])
    losses = []
    for zi, yi in zip(np.array([[1, 0], [0.6, 0.8]]), [0, 1]):
        s = anchors @ (zi / np.linalg.norm(zi)) / tau
        lse = np.log(np.exp(s).sum())
        pos = owner == yi
        losses.append(-np.mean(s[pos] - lse))
    want = np.mean(losses)
    # and the same written out: sample 0: lse0 - 1; sample 1: lse1 + 1.2
    lse0 = math.log(math.exp(2) + 1 + math.exp(-2))
    lse1 = math.log(math.exp(1.2) + math.exp(1.6) + math.exp(-1.2))
    assert want == pytest.approx(((lse0 - 1) + (lse1 + 1.2)) / 2, rel=1e-12)
    assert got == pytest.approx(want, rel=1e-5)
    assert pool_contrastive_loss(z, y, pool, mask, tau).item() == pytest.approx(want, rel=1e-5)
    # the raw inner product (sim "dot"): s = z . p
    losses = []
    for zi, yi in zip(np.array([[1, 0], [0.6, 0.8]]), [0, 1]):
        s = anchors @ zi / tau
        losses.append(-np.mean(s[owner == yi] - np.log(np.exp(s).sum())))
    got_dot = pool_contrastive_loss(z * 3, y, pool, mask, tau, "dot").item()
    losses3 = []
    for zi, yi in zip(np.array([[3, 0], [1.8, 2.4]]), [0, 1]):
        s = anchors @ zi / tau
        losses3.append(-np.mean(s[owner == yi] - np.log(np.exp(s).sum())))
    assert got_dot == pytest.approx(np.mean(losses3), rel=1e-5)
    assert pool_contrastive_loss(z, y, pool, mask, tau, "dot").item() == pytest.approx(
        np.mean(losses), rel=1e-5)
    # l2 similarity: s = -|z - p|^2
    got_l2 = pool_contrastive_loss(z, y, pool, mask, tau, "l2").item()
    losses = []
    for zi, yi in zip(np.array([[1, 0], [0.6, 0.8]]), [0, 1]):
        s = -((anchors - zi) ** 2).sum(1) / tau
        lse = np.log(np.exp(s).sum())
        losses.append(-np.mean(s[owner == yi] - lse))
    assert got_l2 == pytest.approx(np.mean(losses), rel=1e-5)


def test_contrastive_loss_empty_pool_is_zero_with_grad():
    z = torch.randn(4, 3, requires_grad=True)
    loss = pool_contrastive_loss(z, torch.tensor([0, 1, 0, 1]), torch.zeros(2, 2, 3),
                                 torch.zeros(2, 2, dtype=torch.bool), 0.07)
    assert loss.item() == 0.0
    loss.backward()


def test_pool_distances_min_and_mean():
    z = torch.tensor([[0.0, 0.0]])
    pool = torch.tensor([[[1.0, 0.0], [3.0, 0.0]], [[0.0, 2.0], [0.0, 2.0]],
                         [[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    d_min = pool_distances(z, pool, mask, "l2", "min")
    d_mean = pool_distances(z, pool, mask, "l2", "mean")
    np.testing.assert_allclose(d_min[0, :2].numpy(), [1.0, 2.0])
    np.testing.assert_allclose(d_mean[0, :2].numpy(), [2.0, 2.0])
    assert math.isinf(d_min[0, 2]) and math.isinf(d_mean[0, 2])
    assert d_min.argmin(1).item() == 0


def test_eq13_inference_is_l2_min_by_default():
    # eq. 13: argmin_c min_{p in P_c} ||r - p||_2. r = (2, 1); class 0 entries (10, 5)
    # (same direction: cosine distance 0, L2 sqrt(80)) and (0, 9); class 1 entry (3, -1)
    # (L2 sqrt(5), cosine distance 1 - 5/(sqrt 5 sqrt 10)).
    r = torch.tensor([[2.0, 1.0]])
    pool = torch.tensor([[[10.0, 5.0], [0.0, 9.0]], [[3.0, -1.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True], [True, False]])
    d = pool_distances(r, pool, mask)
    want = [min(math.hypot(8, 4), math.hypot(2, 8)), math.hypot(1, 2)]
    np.testing.assert_allclose(d[0].numpy(), want, rtol=1e-6)
    assert d.argmin(1).item() == 1
    d_cos = pool_distances(r, pool, mask, "cosine")
    np.testing.assert_allclose(d_cos[0].numpy(),
                               [0.0, 1 - 5 / (math.sqrt(5) * math.sqrt(10))], atol=1e-6)
    assert d_cos.argmin(1).item() == 0


# --- client prototypes -------------------------------------------------------------

def test_sp_fedcl_k1_is_class_means():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(50, 4, generator=g)
    labels = torch.randint(0, 3, (50,), generator=g)
    labels[labels == 2] = 0  # class 2 absent
    protos, mask, counts = client_prototypes(feats, labels, 3, 1)
    f, lab = feats.numpy(), labels.numpy()
    for c in range(2):
        np.testing.assert_allclose(protos[c, 0], f[lab == c].mean(0), rtol=1e-5, atol=1e-6)
    assert mask[:, 0].tolist() == [True, True, False]
    assert counts.tolist() == [int((lab == 0).sum()), int((lab == 1).sum()), 0]
    assert protos.dtype == np.float32 and protos.shape == (3, 1, 4)


def test_kmeans_prototypes_and_fewer_samples_than_k():
    # class 0: two tight blobs around (0,0) and (10,10); class 1: two samples only, k = 3
    blob = torch.tensor([[0.0, 0.0], [0.2, 0.0], [0.0, 0.2], [10.0, 10.0], [10.2, 10.0],
                         [10.0, 10.2], [5.0, 5.0], [7.0, 7.0]])
    labels = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    protos, mask, _ = client_prototypes(blob, labels, 2, 3, seed=1)
    assert mask[0].all() and mask[1].tolist() == [True, True, False]
    np.testing.assert_allclose(protos[1, :2], [[5, 5], [7, 7]])
    np.testing.assert_allclose(protos[1, 2], [0, 0])
    # 3 centroids of 6 points: the two blobs' points split, all inside their blob
    c0 = protos[0]
    assert ((np.abs(c0 - 0.1) < 0.2).all(1) | (np.abs(c0 - 10.1) < 0.2).all(1)).all()
    # determinism
    again = client_prototypes(blob, labels, 2, 3, seed=1)[0]
    np.testing.assert_array_equal(protos, again)


def test_dbscan_prototypes_cap_and_noise():
    rng = np.random.default_rng(0)
    a = rng.normal([0, 0], 0.05, (20, 2))
    b = rng.normal([5, 5], 0.05, (12, 2))
    c = rng.normal([9, 0], 0.05, (6, 2))
    noise = np.array([[20.0, 20.0], [-20.0, 20.0]])
    feats = torch.tensor(np.concatenate([a, b, c, noise]), dtype=torch.float32)
    labels = torch.zeros(len(feats), dtype=torch.int64)
    protos, mask, _ = client_prototypes(feats, labels, 1, 2, cluster="dbscan", eps=0.5,
                                        min_samples=3)
    assert mask[0].tolist() == [True, True]
    np.testing.assert_allclose(protos[0, 0], a.mean(0), rtol=1e-5, atol=1e-6)  # largest first
    np.testing.assert_allclose(protos[0, 1], b.mean(0), rtol=1e-5, atol=1e-6)  # c dropped (cap k)
    # all noise -> the class mean as the single prototype
    protos, mask, _ = client_prototypes(torch.tensor(noise, dtype=torch.float32),
                                        torch.zeros(2, dtype=torch.int64), 1, 2, cluster="dbscan",
                                        eps=0.5, min_samples=3)
    assert mask[0].tolist() == [True, False]
    np.testing.assert_allclose(protos[0, 0], noise.mean(0))


# --- server ------------------------------------------------------------------------

def small_server(params=None):
    make = make_model_fn(d_in=2, feat=2, classes=3)
    return MPFedCLServer(server_ctx({"k": 2, **(params or {})}, make, classes=3, feat=2)), make


def const_delta(weights, value):
    return {k: np.full_like(v, value) for k, v in weights.items()}


def test_server_fedavg_and_pool_by_hand_with_staleness():
    srv, _ = small_server()
    w0 = {k: v.copy() for k, v in srv.weights.items()}
    p, m, c = two_clients_k2()
    ua = update(0, {"protos": p[0], "mask": m[0], "counts": c[0],
                    "delta": const_delta(w0, 1.0)}, 10)
    # B is stale (weight 0.5): coefficients 1*10 = 10 and 0.5*30 = 15 ->
    # step = (10*1 + 15*4) / 25 = 2.8
    ub = update(1, {"protos": p[1], "mask": m[1], "counts": c[1],
                    "delta": const_delta(w0, 4.0)}, 30, weight=0.5, staleness=3)
    metrics = srv.aggregate([ub, ua], [], RoundInfo(0, 5))  # arrival order does not matter
    for k in w0:
        np.testing.assert_allclose(srv.weights[k], w0[k] + 2.8, rtol=1e-6)
        assert srv.weights[k].dtype == w0[k].dtype
    np.testing.assert_allclose(srv.pool[0], [[0, 0], [10, 0], [0, 2], [10, 2]])
    assert metrics["updates"] == 2 and metrics["pool_classes"] == 3
    task = srv.make_task(0, RoundInfo(1, 5))
    assert task["pool"].dtype == np.float32 and task["pool_mask"].dtype == bool
    assert set(task) == {"weights", "round", "pool", "pool_mask"} and task["round"] == 1
    # eval_model "local" (default): the eval task needs no weights; "global" carries them
    assert set(srv.make_eval(0, RoundInfo(1, 5))) == {"pool", "pool_mask"}
    srv_g, _ = small_server({"eval_model": "global"})
    assert set(srv_g.make_eval(0, RoundInfo(1, 5))) == {"weights", "pool", "pool_mask"}
    # staleness enters the padding average (eq. 9 weights by w): B stale, w = 0.5
    srv3, _ = small_server({"k": 3, "pool": "kmeans"})
    wz = const_delta(srv3.weights, 0.0)
    pa = np.array([[[1, 1], [0, 0], [0, 0]], [[0, 0], [2, 0], [4, 0]], [[0, 0]] * 3], np.float32)
    pb = np.array([[[4, 4], [0, 0], [0, 0]], [[0, 0]] * 3, [[0, 0]] * 3], np.float32)
    ma = np.array([[1, 0, 0], [1, 1, 1], [0, 0, 0]], bool)
    mb = np.array([[1, 0, 0], [0, 0, 0], [0, 0, 0]], bool)
    ua = update(0, {"protos": pa, "mask": ma, "counts": np.array([1, 3, 0]), "delta": wz}, 4)
    ub = update(1, {"protos": pb, "mask": mb, "counts": np.array([3, 0, 0]), "delta": wz}, 3,
                weight=0.5, staleness=2)
    srv3.aggregate([ua, ub], [], RoundInfo(0, 5))
    # two entries < k = 3: padded with ((1,1) + 0.5 (4,4)) / 1.5 = (2,2)
    np.testing.assert_allclose(srv3.pool[0], [[1, 1], [4, 4], [2, 2]], rtol=1e-6)
    assert not srv3.pool_mask[2].any()


def test_server_empty_updates_change_nothing_and_state_roundtrip():
    srv, _ = small_server()
    before = srv.state_dict()
    before = {"weights": {k: v.copy() for k, v in before["weights"].items()},
              "pool": before["pool"].copy(), "pool_mask": before["pool_mask"].copy()}
    out = srv.aggregate([], [Failure(0, "dead"), Failure(1, "late")], RoundInfo(0, 5))
    assert out["updates"] == 0
    for k, v in before["weights"].items():
        np.testing.assert_array_equal(srv.weights[k], v)
    np.testing.assert_array_equal(srv.pool, before["pool"])
    np.testing.assert_array_equal(srv.pool_mask, before["pool_mask"])
    # state round trip after a real aggregation
    p, m, c = two_clients_k2()
    srv.aggregate([update(0, {"protos": p[0], "mask": m[0], "counts": c[0],
                              "delta": const_delta(srv.weights, 0.5)}, 5)], [], RoundInfo(0, 5))
    fresh, _ = small_server()
    from fedbus.broker.wire import decode_body, encode_body  # checkpoints use the wire codec
    fresh.load_state_dict(decode_body(encode_body(srv.state_dict())))
    np.testing.assert_array_equal(fresh.pool, srv.pool)
    np.testing.assert_array_equal(fresh.pool_mask, srv.pool_mask)
    assert fresh.aggregations == 1
    for k in srv.weights:
        np.testing.assert_array_equal(fresh.weights[k], srv.weights[k])


def test_registry_and_spec():
    algo = get_algorithm("mpfedcl")
    assert algo.server is MPFedCLServer and algo.client is MPFedCLClient
    srv = MPFedCLServer(server_ctx({}))
    spec = srv.update_spec()
    assert spec["protos"] == ("float32", (10, 2, 16)) and spec["mask"] == ("bool", (10, 2))
    assert spec["counts"] == ("int64", (10,))
    assert spec["delta"]["fc.weight"] == ("float32", (10, 16))


# --- client: learning-rate decay, evaluation model -------------------------------------

def test_client_lr_decays_per_round(digits_clients):
    # Table IV: eta = 0.01 decayed by 0.95 per global round -> lr_t = train.lr * 0.95^t
    srv = MPFedCLServer(server_ctx({}))
    cli = MPFedCLClient(client_ctx(0, digits_clients[0], {}))
    for r in (0, 3):
        cli.train(srv.make_task(0, RoundInfo(r, 5)), LocalRun(cli.ctx, epochs=1, seed=r))
        want = TRAIN["lr"] * 0.95 ** r
        assert [g["lr"] for g in cli.optimizer.param_groups] == [pytest.approx(want, rel=1e-12)]
    cli = MPFedCLClient(client_ctx(0, digits_clients[0], {"lr_decay": 1.0}))
    cli.train(srv.make_task(0, RoundInfo(4, 5)), LocalRun(cli.ctx, epochs=1, seed=0))
    assert cli.optimizer.param_groups[0]["lr"] == TRAIN["lr"]


def test_client_one_sgd_step_uses_the_decayed_lr():
    # one sample, one step, plain SGD: w' = w - lr_t * grad; check against lr_t = 0.05 * 0.9^2
    x = torch.ones(1, 64) * 0.1
    y = torch.tensor([3])
    train = {**TRAIN, "momentum": 0.0, "batch_size": 1}
    ctx = ClientContext(client=0, model=make_model_fn()(0), device=torch.device("cpu"),
                        train_x=x, train_y=y, test_x=x, test_y=y, num_classes=10,
                        feature_dim=16, params={"lr_decay": 0.9}, train=train, seed=0)
    cli = MPFedCLClient(ctx)
    srv = MPFedCLServer(server_ctx({"lr_decay": 0.9}))
    w0 = {k: v.detach().clone() for k, v in srv_model_state(srv).items()}
    model = make_model_fn()(0)
    model.load_state_dict(w0)
    loss = torch.nn.functional.cross_entropy(model(x), y)  # empty pool: CE only
    grads = torch.autograd.grad(loss, list(model.parameters()))
    out = cli.train(srv.make_task(0, RoundInfo(2, 5)), LocalRun(ctx, epochs=1, seed=0))
    lr = 0.05 * 0.9 ** 2
    for (name, _), g in zip(model.named_parameters(), grads):
        np.testing.assert_allclose(out["delta"][name], (-lr * g).numpy(), rtol=1e-4, atol=1e-7)


def srv_model_state(srv):
    return {k: torch.from_numpy(np.array(v)) for k, v in srv.weights.items()}


def test_evaluate_local_vs_global_model(digits_clients):
    srv = MPFedCLServer(server_ctx({}))
    cli = MPFedCLClient(client_ctx(0, digits_clients[0], {}))
    cli.train(srv.make_task(0, RoundInfo(0, 5)), LocalRun(cli.ctx, epochs=2, seed=0))
    srv.aggregate([update(0, cli.train(srv.make_task(0, RoundInfo(1, 5)),
                                       LocalRun(cli.ctx, epochs=1, seed=1)), 10)],
                  [], RoundInfo(1, 5))
    # push the global weights away from the client's so the two evaluations differ
    srv.weights = {k: (v * 0.0 if k.endswith("weight") else v) for k, v in srv.weights.items()}
    ctx = cli.ctx
    local_state = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    ev_local = cli.evaluate(srv.make_eval(0, RoundInfo(2, 5)))
    want = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
    assert ev_local["acc"] == want["acc"] and ev_local["loss"] == pytest.approx(want["loss"])
    # proto_acc by hand: nearest pool entry by L2 (eq. 13)
    z = embeddings(ctx.model, ctx.test_x).numpy()
    pool, pmask = srv.pool, srv.pool_mask
    best = np.full((len(z), pool.shape[0]), np.inf)
    for c in range(pool.shape[0]):
        for j in np.flatnonzero(pmask[c]):
            best[:, c] = np.minimum(best[:, c], np.sqrt(((z - pool[c, j]) ** 2).sum(1)))
    want_pa = float((best.argmin(1) == ctx.test_y.numpy()).mean())
    assert ev_local["proto_acc"] == pytest.approx(want_pa, abs=1e-6)  # float32 mean
    # "global": the global weights are scored and the local ones put back
    cli_g = MPFedCLClient(client_ctx(0, digits_clients[0], {"eval_model": "global"}))
    cli_g.ctx.model.load_state_dict(local_state)
    srv.p["eval_model"] = "global"
    ev_global = cli_g.evaluate(srv.make_eval(0, RoundInfo(2, 5)))
    assert ev_global["acc"] != ev_local["acc"] or ev_global["loss"] != ev_local["loss"]
    for k, v in cli_g.ctx.model.state_dict().items():
        assert torch.equal(v, local_state[k])


# --- real training -----------------------------------------------------------------

@pytest.mark.parametrize("params", [{}, {"cluster": "dbscan", "eps": 2.0, "min_samples": 3},
                                    {"k": 1}])
def test_client_trains_on_digits_and_update_has_spec(digits_clients, params):
    srv = MPFedCLServer(server_ctx(params))
    cli = MPFedCLClient(client_ctx(0, digits_clients[0], params))
    # one round with an empty pool, one with the pool so the contrastive term runs
    for r in range(2):
        task = srv.make_task(0, RoundInfo(r, 5))
        run = LocalRun(cli.ctx, epochs=1, seed=r)
        upd = cli.train(task, run)
        check_spec(upd, srv.update_spec(), by_name=True)
        # and the engine's own validation accepts it
        from fedbus.node.validate import check_update
        body = {"task": 1, "version": 0, "num_samples": len(cli.ctx.train_y),
                "work": run.work.to_dict(), "payload": upd}
        check_update(body, srv.update_spec(), num_classes=10,
                     max_samples=len(cli.ctx.train_y))
        assert run.work.steps > 0 and np.isfinite(upd["train_loss"])
        assert upd["mask"].any() and (upd["counts"] > 0).sum() == 7
        srv.aggregate([update(0, upd, len(cli.ctx.train_y))], [], RoundInfo(r, 5))
    assert srv.pool_mask.any(1).sum() == 7
    ev = cli.evaluate(srv.make_eval(0, RoundInfo(2, 5)))
    assert {"acc", "loss", "num_test", "proto_acc"} <= set(ev)


def test_simulation_learns_on_digits(digits_clients):
    params = {"k": 3}
    srv = MPFedCLServer(server_ctx(params))
    clients = [MPFedCLClient(client_ctx(i, part, params)) for i, part in enumerate(digits_clients)]
    for r in range(5):
        ups = []
        for cl in clients:
            run = LocalRun(cl.ctx, epochs=2, seed=100 * r + cl.ctx.client)
            payload = cl.train(srv.make_task(cl.ctx.client, RoundInfo(r, 5)), run)
            ups.append(update(cl.ctx.client, payload, len(cl.ctx.train_y), version=r))
        srv.aggregate(ups, [], RoundInfo(r, 5))
    evs = [cl.evaluate(srv.make_eval(cl.ctx.client, RoundInfo(5, 5))) for cl in clients]
    acc = np.mean([e["acc"] for e in evs])
    proto_acc = np.mean([e["proto_acc"] for e in evs])
    print("acc", acc, "proto_acc", proto_acc)
    assert acc > 0.6, evs
    assert proto_acc > 0.6, evs

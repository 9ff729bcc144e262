"""fedpac (Xu et al., ICLR 2023; only the abstract is here, so the authors' code is the
specification; audit: docs/FIDELITY.md (fedpac)): the defaults are the code's; the head QP by
hand (two clients in closed form, three with an interior and a boundary optimum, the 1e-3
floor, the non-PSD repair and the own-head fallback); the server step by hand (body average,
count-weighted prototypes, mixed heads, staleness, partial work, a client twice, checkpoint);
the client's statistics and loss by hand on a network whose features are its inputs; one
seeded task on digits; and real federations (sync with a folded straggler, async, through
two relays that forward) that learn and replay identically."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, BodyHead, C, check_spec, client_ctx, digits_parts, freeze,
                          server_ctx, simulate, update)
from helpers import (SLOW, SMALL, TINY, assert_update_replays, late_rounds, merged, metrics,
                     run_async_with_slow_client, run_with_folded_straggler)
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, LocalRun, RoundInfo, Work
from fedbus.algorithms.core.params import default_of
from fedbus.algorithms.fedpac import (FedPACServer, head_weights, psd_or_repaired, qp_matrix,
                                      solve_simplex_qp)

torch.set_num_threads(1)
ALGO = get_algorithm("fedpac")


def test_fedpac_defaults_are_the_codes():
    defaults = {k: default_of(v) for k, v in FedPACServer.PARAMS.items()}
    assert defaults == {
        "partial": "tolerate",  # fedbus's treatment of partial work (the code has none)
        "lam": 1.0,  # options.py --lam
        "head_epochs": 1,  # local_training's epoch_classifier
        "head_lr": 0.1,  # local_training's lr_g
        "combine_heads": True,  # options.py --agg_g 1
        "weight_floor": 1e-3,  # get_head_agg_weight's eps
        "psd_floor": 0.01,  # get_head_agg_weight's eigenvalue cut
        "keep_missing": False,  # protos_aggregation rebuilds the dict each round
        "eval_model": "personal"}  # the model the next round starts from
    assert ALGO.server is FedPACServer and FedPACServer.needs_same_model
    assert FedPACServer.merge_rule() is None  # the QP needs every participant: forwarded
    assert vars(FedPACServer).get("DP_LEVELS", ()) == ()


def test_fedpac_refuses_a_model_group():
    from fedbus.node.config import ConfigError, build_config
    from fedbus.node.setup import check_models

    cfg = build_config(merged(SMALL, algorithm={"name": "fedpac"},
                              model={"group": ["cnn", "cnn4"]}))
    with pytest.raises(ConfigError, match="'fedpac' averages model weights, so every client "
                                          "needs one architecture"):
        check_models(cfg, ALGO.server.needs_same_model, ALGO.server.needs_same_head)


# --- the head QP by hand ----------------------------------------------------------------------

def test_qp_matrix_is_diag_v_plus_the_gram_of_reference_differences():
    # 3 clients, 2 classes, 1-d features: h_ref[j] = [[a_j], [b_j]]
    h = np.array([[[1.0], [0.0]], [[0.0], [2.0]], [[3.0], [1.0]]])
    p = qp_matrix([0.5, 1.0, 2.0], h, 0)
    # r_j = h_0 - h_j: r_0 = (0, 0), r_1 = (1, -2), r_2 = (-2, -1); D = [r_j . r_l]
    np.testing.assert_allclose(p, [[0.5, 0, 0], [0, 1 + 5, -2 + 2], [0, 0, 2 + 5]])
    np.testing.assert_allclose(qp_matrix([0.5, 1.0, 2.0], h, 2)[0],
                               [0.5 + 5, 2 * 3 + 1 * -1, 0])  # r_0 = (2, 1), r_1 = (3, -1)


def test_two_clients_in_closed_form():
    # P = diag(v_0, v_1 + d) for client 0, d = ||h_0 - h_1||^2: alpha_0 = (v_1 + d) / (v_0 +
    # v_1 + d) (the minimum of v_0 a^2 + (v_1 + d)(1 - a)^2)
    h = np.array([[[0.0, 0.0]], [[0.6, 0.8]]])  # d = 1
    np.testing.assert_allclose(head_weights([1.0, 2.0], h, 0), [0.75, 0.25], atol=1e-8)
    np.testing.assert_allclose(head_weights([1.0, 2.0], h, 1), [0.5, 0.5], atol=1e-8)
    # same statistics everywhere: weights by inverse variance, 1/v_j / sum 1/v
    same = np.zeros((2, 1, 2))
    np.testing.assert_allclose(head_weights([1.0, 3.0], same, 0), [0.75, 0.25], atol=1e-8)


def test_three_clients_interior_and_boundary_optima():
    v = [1.0, 1.0, 1.0]
    # neighbours on opposite sides (h = 0, 1, -1): P = [[1,0,0],[0,2,-1],[0,-1,2]], P^-1 1 is
    # proportional to (1, 1, 1): their biases cancel, equal thirds
    opposite = np.array([[[0.0]], [[1.0]], [[-1.0]]])
    np.testing.assert_allclose(head_weights(v, opposite, 0), [1 / 3] * 3, atol=1e-7)
    # one side (h = 0, 1, 2): P = [[1,0,0],[0,2,2],[0,2,5]]; on the support {0, 1}
    # P a = lambda 1 gives (2/3, 1/3), and (P a)_2 = 2/3 >= lambda: the far one gets nothing
    same_side = np.array([[[0.0]], [[1.0]], [[2.0]]])
    alpha = head_weights(v, same_side, 0)
    np.testing.assert_allclose(alpha, [2 / 3, 1 / 3, 0.0], atol=1e-6)
    # KKT of a general case: every weight with alpha_j > 0 has the smallest gradient
    p = qp_matrix([0.3, 0.7, 0.2], np.array([[[0.0, 1.0]], [[0.5, 0.2]], [[-0.4, 0.9]]]), 0)
    a = solve_simplex_qp(p)
    grad = p @ a
    assert a.sum() == pytest.approx(1.0) and (a >= 0).all()
    assert grad[a > 1e-6].max() == pytest.approx(grad.min(), abs=1e-8)


def test_small_weights_are_zeroed_and_the_rest_renormalised():
    # same h, v = (5e-4, 1): the QP gives (1/1.0005, 5e-4/1.0005); 4.998e-4 <= 1e-3 is zeroed
    same = np.zeros((2, 1, 1))
    np.testing.assert_array_equal(head_weights([5e-4, 1.0], same, 1), [1.0, 0.0])
    np.testing.assert_allclose(head_weights([5e-4, 1.0], same, 1, weight_floor=1e-4),
                               [1 / 1.0005, 5e-4 / 1.0005], atol=1e-8)


def test_a_matrix_that_is_not_psd_is_repaired_or_the_own_head_kept():
    # eigenvalues 3 and -1: rebuilt from the eigenpair of 3, 3 x (1,1)(1,1)^T / 2
    np.testing.assert_allclose(psd_or_repaired(np.array([[1.0, 2.0], [2.0, 1.0]]), 0.01),
                               [[1.5, 1.5], [1.5, 1.5]], atol=1e-12)
    psd = np.array([[2.0, 1.0], [1.0, 2.0]])
    assert psd_or_repaired(psd, 0.01) is not None
    np.testing.assert_array_equal(psd_or_repaired(psd, 0.01), psd)
    # v_0 = -0.5 (no client sends that; rounding could), d = 1: for client 0 P = diag(-0.5, 2)
    # keeps diag(0, 2) and puts all weight on itself; for client 1 P = diag(0.5, 1), PSD
    h = np.array([[[0.0]], [[1.0]]])
    np.testing.assert_allclose(head_weights([-0.5, 1.0], h, 0), [1.0, 0.0], atol=1e-8)
    np.testing.assert_allclose(head_weights([-0.5, 1.0], h, 1), [2 / 3, 1 / 3], atol=1e-7)
    # nothing left at or above psd_floor: None, the client keeps its own head
    assert head_weights([-1.0, 0.005], np.zeros((2, 1, 1)), 0) is None
    assert head_weights([-1.0, 0.005], np.zeros((2, 1, 1)), 0, psd_floor=0.001) is not None


# --- the server step by hand: 2 classes, 2-d features -----------------------------------------

class Tiny(BodyHead):
    """features = Linear(2, 2) (identity at start), head = Linear(2, 2)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.fc = nn.Linear(2, 2)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.body.bias.zero_()
            self.fc.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
            self.fc.bias.zero_()


def tiny_server(**params):
    return ALGO.server(server_ctx(params, clients=4, make=lambda i: Tiny(), num_classes=2,
                                  feature_dim=2))


def tiny_update(i, bias, head_w, protos, counts, h_ref, v, **kw):
    payload = {"delta": {"body.weight": np.zeros((2, 2), np.float32),
                         "body.bias": np.asarray(bias, np.float32)},
               "head": {"weight": np.asarray(head_w, np.float32),
                        "bias": np.zeros(2, np.float32)},
               "protos": np.asarray(protos, np.float32), "counts": np.asarray(counts, np.int64),
               "h_ref": np.asarray(h_ref, np.float32), "v": np.array([v], np.float64)}
    return update(i, payload, **kw)


HA, HB = np.eye(2), np.array([[0.0, 2.0], [2.0, 0.0]])
# client A: classes 0 and 1; client B: class 0 only; h_ref differ by d = 0.6^2 + 0.8^2 = 1
A = dict(protos=[[1, 0], [0, 1]], counts=[3, 1], h_ref=[[0.6, 0], [0, 0.25]], v=1.0)
B = dict(protos=[[3, 0], [0, 0]], counts=[6, 0], h_ref=[[0, 0], [0, 1.05]], v=2.0)


def test_fedpac_server_step_by_hand():
    s = tiny_server()
    first = s.make_task(0, RoundInfo(0, 3))
    assert set(first) == {"weights", "protos", "has", "round"}  # no personal head yet
    assert not first["has"].any() and set(first["weights"]) == {"body.weight", "body.bias"}
    m = s.aggregate([tiny_update(0, [1, 0], HA, **A, n=10),
                     tiny_update(1, [0, 2], HB, **B, n=30)], [], RoundInfo(0, 3))
    # body: sum n_k delta_k / sum n_k (average_weights_weighted)
    np.testing.assert_allclose(s.weights["body.bias"], [0.25, 1.5], atol=1e-7)
    np.testing.assert_array_equal(s.weights["body.weight"], np.eye(2))
    # prototypes by class counts (protos_aggregation): class 0 (3 [1,0] + 6 [3,0]) / 9
    np.testing.assert_allclose(s.protos, [[7 / 3, 0], [0, 1]], atol=1e-6)
    assert s.has.tolist() == [True, True] and m["classes_received"] == 2
    # heads: d = 1, alpha_A = (v_B + d) / (v_A + v_B + d) = 3/4; alpha_B = (1/2, 1/2)
    np.testing.assert_allclose(s.heads[0]["weight"], 0.75 * HA + 0.25 * HB, atol=1e-6)
    np.testing.assert_allclose(s.heads[1]["weight"], 0.5 * HA + 0.5 * HB, atol=1e-6)
    assert m["head_fallbacks"] == 0 and m["head_own_weight"] == pytest.approx(0.625, abs=1e-6)
    assert m["head_weights"] == {"0": {"0": 0.75, "1": 0.25}, "1": {"0": 0.5, "1": 0.5}}
    task = s.make_task(0, RoundInfo(1, 3))
    assert task["head_from"] == 0 and task["round"] == 1
    np.testing.assert_array_equal(task["head"]["weight"], s.heads[0]["weight"])
    assert "head" not in s.make_task(2, RoundInfo(1, 3))  # never seen: keeps its own
    assert "head" in s.make_eval(1, RoundInfo(1, 3)) and "head" not in s.make_eval(3,
                                                                               RoundInfo(1, 3))


def test_fedpac_server_staleness_partial_work_and_repeats():
    s = tiny_server()
    stale = tiny_update(1, [0, 2], HB, **B, n=30, version=0, staleness=3)  # weight 1/2
    s.aggregate([tiny_update(0, [1, 0], HA, **A, n=10, version=3), stale], [], RoundInfo(3, 5))
    # body and prototypes: c_k = w_k n_k and w_k n_kc; the QP is the fresh one's (unweighted)
    np.testing.assert_allclose(s.weights["body.bias"], [10 / 25, 30 / 25], atol=1e-7)
    np.testing.assert_allclose(s.protos[0], [(3 + 0.5 * 18) / 6, 0], atol=1e-6)
    np.testing.assert_allclose(s.heads[0]["weight"], 0.75 * HA + 0.25 * HB, atol=1e-6)
    assert s.head_from == {0: 3, 1: 0}
    # partial = drop: the partial update is a failure, and client 0 alone keeps its own head
    s = tiny_server(partial="drop")
    part = tiny_update(1, [0, 2], HB, **B, n=30, work=Work(2, 0.5, 1, 15))
    m = s.aggregate([tiny_update(0, [1, 0], HA, **A, n=10), part], [], RoundInfo(0, 3))
    assert m["failures"] == 1 and 1 not in s.heads
    np.testing.assert_allclose(s.heads[0]["weight"], HA, atol=1e-7)
    np.testing.assert_allclose(s.weights["body.bias"], [1, 0], atol=1e-7)
    # a client twice in one aggregation (async): both steps count, its latest update is its
    # place in the QP
    s = tiny_server()
    old = tiny_update(0, [1, 0], HB, **A, n=10, version=0, staleness=1)
    new = tiny_update(0, [1, 0], HA, **A, n=10, version=1)
    s.aggregate([new, old, tiny_update(1, [0, 2], HB, **B, n=30, version=1)], [], RoundInfo(1, 3))
    assert s.head_from[0] == 1
    np.testing.assert_allclose(s.heads[0]["weight"], 0.75 * HA + 0.25 * HB, atol=1e-6)


def test_fedpac_server_options_and_checkpoint():
    ups = [tiny_update(0, [1, 0], HA, **A, n=10), tiny_update(1, [0, 2], HB, **B, n=30)]
    s = tiny_server(combine_heads=False)  # the code's --agg_g 0
    m = s.aggregate(ups, [], RoundInfo(0, 3))
    assert s.heads == {} and "head_weights" not in m and "head" not in s.make_task(0,
                                                                               RoundInfo(1, 3))
    # classes no update holds: dropped (the code) or kept (keep_missing)
    only_b = [tiny_update(1, [0, 0], HB, **B, n=30, version=1)]
    for keep, has in ((False, [True, False]), (True, [True, True])):
        s = tiny_server(keep_missing=keep)
        s.aggregate(ups, [], RoundInfo(0, 3))
        s.aggregate(only_b, [], RoundInfo(1, 3))
        assert s.has.tolist() == has
        np.testing.assert_allclose(s.protos[0], [3, 0], atol=1e-6)
    before = s.state_dict()
    m = s.aggregate([], [], RoundInfo(2, 3))  # nothing arrived: nothing moves
    assert m["updates"] == 0
    fresh = tiny_server(keep_missing=True)
    fresh.load_state_dict(freeze(before))
    assert fresh.head_from == s.head_from == {0: 0, 1: 1}
    for c in (0, 1):
        for k in ("weight", "bias"):
            np.testing.assert_array_equal(fresh.heads[c][k], s.heads[c][k])
    np.testing.assert_array_equal(fresh.protos, s.protos)
    assert fresh.make_task(1, RoundInfo(3, 5))["head_from"] == 1
    assert before["head_from"].tolist() == [0, 1, -1, -1]


def test_fedpac_non_psd_statistics_fall_back_to_the_own_head():
    # v < 0 everywhere and equal h_ref: no eigenvalue >= 0.01, each keeps its own head
    bad = [tiny_update(i, [0, 0], h, protos=[[1, 0], [0, 0]], counts=[2, 0], h_ref=np.zeros((2, 2)),
                       v=-1.0) for i, h in ((0, HA), (1, HB))]
    s = tiny_server()
    m = s.aggregate(bad, [], RoundInfo(0, 3))
    assert m["head_fallbacks"] == 2 and m["head_own_weight"] == 1.0
    np.testing.assert_array_equal(s.heads[0]["weight"], HA)
    np.testing.assert_array_equal(s.heads[1]["weight"], HB)


# --- the client by hand: features are the inputs ----------------------------------------------

X = [[1, 2], [3, 0], [0, 1], [2, 2], [1, 0]]
Y = [0, 0, 1, 1, 1]


def tiny_client(**params):
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y, dtype=torch.int64)
    ctx = ClientContext(client=0, model=Tiny(), device=torch.device("cpu"), train_x=x,
                        train_y=y, test_x=x, test_y=y, num_classes=2, feature_dim=2,
                        params=params, train=TRAIN, seed=0)
    return ALGO.client(ctx)


def test_client_statistics_by_hand():
    h = tiny_client()
    s = tiny_server()
    up = h.train(freeze(s.make_task(0, RoundInfo(0, 3))), LocalRun(h.ctx, epochs=0, seed=0))
    # class 0: (1,2), (3,0): mu_0 = (2, 1), mean ||f||^2 = 7; class 1: (0,1), (2,2), (1,0):
    # mu_1 = (1, 1), mean ||f||^2 = 10/3; p = (2/5, 3/5)
    # v = (0.4 * 7 - 0.16 * 5 + 0.6 * 10/3 - 0.36 * 2) / 5 = 3.28 / 5
    assert up["v"].tolist() == [pytest.approx(0.656, rel=1e-12)]
    np.testing.assert_allclose(up["h_ref"], [[0.8, 0.4], [0.6, 0.6]], atol=1e-7)
    np.testing.assert_allclose(up["protos"], [[2, 1], [1, 1]], atol=1e-7)
    assert up["counts"].tolist() == [2, 3]
    np.testing.assert_array_equal(up["head"]["weight"], np.eye(2))  # no epoch: unchanged
    assert not up["delta"]["body.bias"].any()
    check_spec(up, s.update_spec())


def test_client_loss_is_ce_plus_lam_mse_to_global_or_local_prototypes():
    h = tiny_client(lam=0.5)
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(Y, dtype=torch.int64)
    mu = torch.tensor([[2.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    # the server has class 0 only: class 1 aligns to the client's own pre-training mean
    task = {"protos": np.array([[4.0, 0.0], [9.0, 9.0]], np.float32),
            "has": np.array([True, False])}
    targets = h.alignment_targets(task, mu)
    np.testing.assert_array_equal(targets.numpy(), [[4, 0], [1, 1]])
    assert h.alignment_targets({"protos": task["protos"], "has": np.zeros(2, bool)}, mu) is None
    h._targets, h._aligning = targets, True
    with torch.no_grad():
        got = h.batch_loss(x, y).item()
    logits = np.asarray(X, np.float64)  # identity body, identity head
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ce = -logp[np.arange(5), Y].mean()
    t = np.array([[4, 0], [4, 0], [1, 1], [1, 1], [1, 1]], np.float64)
    mse = ((np.asarray(X) - t) ** 2).mean()  # over 5 x 2 entries (nn.MSELoss)
    assert got == pytest.approx(ce + 0.5 * mse, rel=1e-6)
    h._aligning = False  # the head phase: cross-entropy alone
    with torch.no_grad():
        assert h.batch_loss(x, y).item() == pytest.approx(ce, rel=1e-6)


# --- one task on digits -----------------------------------------------------------------------

def test_one_task_on_digits_is_seeded_and_trains_each_part_in_its_phase():
    part = digits_parts(4, ways=5)[0]
    s = ALGO.server(server_ctx({}))
    init_head = {k: v.copy() for k, v in s._initial.items() if k.startswith("fc.")}
    task = freeze(s.make_task(0, RoundInfo(0, 3)))

    def run(seed, **params):
        h = ALGO.client(client_ctx(0, part, params))
        return h, h.train(task, LocalRun(h.ctx, epochs=1, seed=seed))

    h, up = run(7)
    check_spec(up, s.update_spec())
    assert [g["lr"] for g in h.head_optimizer.param_groups] == [0.1]  # the code's lr_g
    assert [g["lr"] for g in h.optimizer.param_groups] == [TRAIN["lr"]]  # the body's
    assert h.head_version == 0
    counts = np.bincount(part[1].numpy(), minlength=C)
    np.testing.assert_array_equal(up["counts"], counts)
    # the statistics of the model as sent (eval mode), by hand in float64
    with torch.no_grad():
        f = client_ctx(0, part, {}).model.eval().features(part[0]).double().numpy()
    y, n = part[1].numpy(), len(part[1])
    p = counts / n
    mu = np.array([f[y == k].mean(0) if counts[k] else np.zeros(f.shape[1]) for k in range(C)])
    sq = np.array([(f[y == k] ** 2).sum(1).mean() if counts[k] else 0.0 for k in range(C)])
    np.testing.assert_allclose(up["h_ref"], p[:, None] * mu, rtol=1e-5, atol=1e-7)
    assert up["v"][0] == pytest.approx(((p * sq - p * p * (mu * mu).sum(1)).sum()) / n, rel=1e-9)
    assert not np.array_equal(up["head"]["weight"], init_head["fc.weight"])  # head phase
    assert max(np.abs(d).max() for d in up["delta"].values()) > 0  # body phase
    _, same = run(7)
    _, other = run(8)
    for k in ("protos", "h_ref", "v", "counts"):
        np.testing.assert_array_equal(up[k], same[k])
    for k in up["delta"]:
        np.testing.assert_array_equal(up["delta"][k], same["delta"][k])
    np.testing.assert_array_equal(up["head"]["weight"], same["head"]["weight"])
    assert not np.array_equal(up["protos"], other["protos"])
    # head_epochs = 0: the body phase never moves the head
    _, frozen_head = run(7, head_epochs=0)
    np.testing.assert_array_equal(frozen_head["head"]["weight"], init_head["fc.weight"])
    # statistics come before training: the same whatever the training does
    np.testing.assert_array_equal(frozen_head["h_ref"], up["h_ref"])


def test_digits_client_aligns_adopts_its_personal_head_and_evaluates_it():
    parts = digits_parts(4, ways=5)
    s = ALGO.server(server_ctx({}))
    hs = [ALGO.client(client_ctx(i, p, {})) for i, p in enumerate(parts[:2])]
    ups = [update(i, h.train(freeze(s.make_task(i, RoundInfo(0, 3))),
                             LocalRun(h.ctx, epochs=1, seed=i)), len(h.ctx.train_y))
           for i, h in enumerate(hs)]
    s.aggregate(ups, [], RoundInfo(0, 3))
    h = hs[0]
    task = freeze(s.make_task(0, RoundInfo(1, 3)))
    assert task["has"].any() and task["head_from"] == 0
    # personal evaluation: the global body with the mixed head, the client's model untouched
    own = {k: v.clone() for k, v in h.ctx.model.state_dict().items()}
    ev = h.evaluate(freeze(s.make_eval(0, RoundInfo(0, 3))))
    model = client_ctx(0, parts[0], {}).model
    model.load_state_dict({**{k: torch.from_numpy(np.array(v)) for k, v in s.weights.items()},
                           **{"fc." + k: torch.from_numpy(np.array(v))
                              for k, v in s.heads[0].items()}})
    from fedbus.algorithms.core.metrics import head_metrics
    assert ev["acc"] == head_metrics(model, parts[0][2], parts[0][3])["acc"]
    assert all(torch.equal(v, h.ctx.model.state_dict()[k]) for k, v in own.items())
    h.params = {"eval_model": "local"}
    assert h.evaluate(task)["acc"] == head_metrics(h.ctx.model, parts[0][2], parts[0][3])["acc"]
    h.params = {}
    # the alignment term changes the body's update (lam 0 = FedRep's phases, head lr 0.1)
    g = ALGO.client(client_ctx(0, parts[0], {"lam": 0.0}))
    g.load_state_dict(h.state_dict())
    with_align = h.train(task, LocalRun(h.ctx, epochs=1, seed=5))
    without = g.train(task, LocalRun(g.ctx, epochs=1, seed=5))
    np.testing.assert_array_equal(with_align["h_ref"], without["h_ref"])
    assert not np.array_equal(with_align["delta"]["body.0.weight"],
                              without["delta"]["body.0.weight"])
    # a head made from an older upload than the client's latest training is not adopted
    assert h.head_version == 1 and h.offered_head(task) is None
    assert g.state_dict()["extra"]["head_version"] == 1


def test_fedpac_short_federation_learns():
    _, _, hist = simulate("fedpac", {}, rounds=4, clients=4, ways=5, metrics="acc")
    assert hist[-1] > 0.45 and hist[-1] > hist[0]  # chance 0.1; 5 classes a client


# --- real federations -------------------------------------------------------------------------

TINY_FEDPAC = merged(TINY, algorithm={"name": "fedpac"})


def test_fedpac_sync_with_a_folded_straggler_learns_and_replays(tmp_path):
    from test_replay import assert_identical

    # 5 rounds, as test_algo_fednh's
    run, summary, recs = run_with_folded_straggler(
        tmp_path, merged(TINY_FEDPAC, federation={"rounds": 5, "eval_every": 5},
                         train={"epochs": 2}))
    combined = [r for r in recs if r["updates"]]
    assert all(r["agg"]["classes_received"] > 0 for r in combined), recs
    # every participant got a head; a folded straggler's in the aggregation it came in
    first_late = late_rounds(recs)[0]
    assert any(str(SLOW) in r["agg_extra"]["head_weights"] for r in recs
               if r["round"] > first_late and "agg_extra" in r), recs
    assert summary["final"]["acc_mean"] > 0.3, summary["final"]  # chance 0.1
    assert_identical(run, rounds=5)
    # a client's update replays bit for bit: statistics, both phases, head and prototypes
    assert_update_replays(run, client=1, rnd=2)


def test_fedpac_async_with_a_slow_client_learns_and_replays(tmp_path):
    from test_replay import assert_identical

    run, summary, recs = run_async_with_slow_client(
        tmp_path, merged(TINY_FEDPAC, federation={"rounds": 6, "eval_every": 6},
                         data={"ways_std": 0.0}))
    assert summary["final"]["acc_mean"] > 0.3, summary["final"]  # chance 0.1
    assert_identical(run, rounds=6)


def test_fedpac_through_two_relays_forwards_and_gives_the_flat_federation(tmp_path):
    from tests.test_relay import EQUIV, _arrays, _final_state, run_to_end

    sections = merged(EQUIV, algorithm={"name": "fedpac"})
    runs = {name: run_to_end(tmp_path, sections, relays=relays, name=name)
            for name, relays in (("flat", False), ("relays", True))}
    flat, tree = (_arrays(_final_state(runs[k])) for k in ("flat", "relays"))
    assert sorted(flat) == sorted(tree) and any(k.startswith("heads/") for k in flat)
    for key in flat:  # the same updates reach the server, one by one
        np.testing.assert_allclose(np.asarray(tree[key], np.float64),
                                   np.asarray(flat[key], np.float64), rtol=0, atol=1e-6,
                                   err_msg=key)
    flat_recs, tree_recs = metrics(runs["flat"]), metrics(runs["relays"])
    assert len(tree_recs) == len(flat_recs) == 3
    for f, t in zip(flat_recs, tree_recs):
        assert t["participants"] == f["participants"] == list(range(6))
        assert t["merged"] == f["merged"] == 0 and t["messages_up"] == f["messages_up"] == 6
        assert t["acc_mean"] == pytest.approx(f["acc_mean"], abs=1e-6)

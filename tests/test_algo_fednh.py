"""fednh (Dai et al., AAAI 2023; audit: docs/FIDELITY.md (fednh)): the defaults are the authors'
code's where the poster is silent; eq. 1's initial prototypes (circle, simplex, the numerical
maximiser) and the code's orthogonal ones; the server step (Algorithm 1 lines 8 and 10) by hand
on 3 classes in 2-d, with staleness weights and every option; the client (cosine loss by hand,
the upload, clipping, the lr schedule) on digits; relays and secure aggregation against the
flat step; and real federations (sync with a folded straggler, async, through two relays)
that learn and replay identically."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, BodyHead, C, D, check_spec, client_ctx, digits_parts, freeze,
                          server_ctx, simulate, update)
from helpers import TINY, merged, run_async_with_slow_client, run_with_folded_straggler
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientUpdate, LocalRun, RoundInfo, Work
from fedbus.algorithms.core.params import default_of, resolved_params
from fedbus.algorithms.fednh import (SCALE, FedNHServer, FedNHSums, client_lr,
                                     initial_prototypes, uniform_prototypes)

torch.set_num_threads(1)
S3 = math.sqrt(3.0)


def test_fednh_defaults_are_the_codes_where_the_poster_is_silent():
    defaults = {k: default_of(v) for k, v in FedNHServer.PARAMS.items()}
    assert defaults == {
        "rho": 0.9,  # FedNH_smoothing
        "init": "uniform",  # eq. 1 (the code's FedNH_head_init = orthogonal is the option)
        "aggregate": "weighted",  # FedNHServer.aggregate: count-weighted class means
        "body_aggregate": "mean",  # poster line 10 and FedAvgServer.aggregate: 1/|S_t|
        "server_lr": 1.0,  # server_config learning_rate
        "scale_init": 1.0,  # Conv2CifarNH's scaling
        "learn_scale": True,  # FedNH_fix_scaling = False
        "clip_norm": 10.0,  # clip_grad_norm_(max_norm=10)
        "lr_schedule": "diminishing",  # the paper runs' --client_lr_scheduler
        "lr_decay": 0.99,  # client lr_decay_per_round
        "eval_model": "global"}
    assert get_algorithm("fednh").server is FedNHServer
    assert FedNHServer.needs_same_model and isinstance(FedNHServer.merge_rule(), FedNHSums)
    assert vars(FedNHServer).get("DP_LEVELS", ()) == ()  # a delta and prototypes at once


# --- eq. 1: the initial prototypes ------------------------------------------------------------

def pairwise_cos(w):
    g = np.asarray(w, np.float64) @ np.asarray(w, np.float64).T
    return g[~np.eye(len(g), dtype=bool)]


def test_uniform_init_on_the_circle_is_the_codes_2d_uniform_head():
    # d = 2: angles 2 pi c / |C| (FedUHClient._initialize_model, FedNH_head_init = uniform)
    np.testing.assert_allclose(uniform_prototypes(3, 2),
                               [[1, 0], [-0.5, S3 / 2], [-0.5, -S3 / 2]], atol=1e-7)
    np.testing.assert_allclose(uniform_prototypes(4, 2), [[1, 0], [0, 1], [-1, 0], [0, -1]],
                               atol=1e-7)


@pytest.mark.parametrize("c,d", [(10, 32), (4, 4), (4, 3), (11, 10)])
def test_uniform_init_is_the_regular_simplex_where_it_fits(c, d):
    # |C| <= d + 1: eq. 1's maximiser, every pairwise cosine -1/(|C| - 1)
    w = uniform_prototypes(c, d)
    assert w.shape == (c, d) and w.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(pairwise_cos(w), -1.0 / (c - 1), atol=1e-6)
    if c <= d:  # each class scores highest on its own (non-negative) axis
        assert (np.argmax(w[:, :c], axis=0) == np.arange(c)).all()


@pytest.mark.parametrize("c,d,best", [(6, 3, 0.0),  # the octahedron
                                      (12, 3, 1 / math.sqrt(5))])  # the icosahedron
def test_uniform_init_beyond_the_simplex_nears_the_known_optimum(c, d, best):
    w = uniform_prototypes(c, d, seed=4)
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0, atol=1e-6)
    assert best - 1e-9 <= pairwise_cos(w).max() < best + 0.01
    np.testing.assert_array_equal(w, uniform_prototypes(c, d, seed=4))  # seeded


def test_orthogonal_init_is_the_codes_orthonormal_rows():
    w = initial_prototypes(C, D, "orthogonal", seed=3)
    np.testing.assert_allclose(w @ w.T, np.eye(C), atol=1e-6)
    np.testing.assert_array_equal(w, initial_prototypes(C, D, "orthogonal", seed=3))
    assert np.abs(w - initial_prototypes(C, D, "orthogonal", seed=4)).max() > 0.1
    wide = initial_prototypes(7, 3, "orthogonal", seed=0)  # |C| > d: rows normalised
    np.testing.assert_allclose(np.linalg.norm(wide, axis=1), 1.0, atol=1e-6)


# --- the server step by hand: 3 classes, 2-d features ------------------------------------------

class Tiny(BodyHead):
    """features = Linear(2, 2) (the body), head = Linear(2, 3) (unused by FedNH)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.fc = nn.Linear(2, 3)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.body.bias.zero_()


def tiny_server(**params):
    return get_algorithm("fednh").server(
        server_ctx(params, make=lambda i: Tiny(), num_classes=3, feature_dim=2))


def unit(v):
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def tiny_update(i, protos, counts, scale, bias, **kw):
    delta = {"body.weight": np.zeros((2, 2), np.float32),
             "body.bias": np.asarray(bias, np.float32), SCALE: np.array([scale], np.float32)}
    return update(i, {"delta": delta, "protos": np.asarray(protos, np.float32),
                      "counts": np.asarray(counts, np.int64)}, **kw)


# client A holds classes 0 and 1, client B all three; their normalised class means
PA, NA = [[1, 0], [0, 1], [0, 0]], [2, 1, 0]
PB, NB = [[0, 1], [0.6, 0.8], [-1, 0]], [1, 3, 4]
W0 = np.array([[1, 0], [-0.5, S3 / 2], [-0.5, -S3 / 2]])


def test_fednh_server_step_by_hand():
    s = tiny_server()  # rho 0.9, count-weighted class means, unweighted body mean
    task = s.make_task(0, RoundInfo(0, 3))
    np.testing.assert_allclose(task["protos"], W0, atol=1e-7)  # eq. 1 on the circle
    assert task["weights"][SCALE].tolist() == [1.0] and (task["round"], task["rounds"]) == (0, 3)
    assert set(task["weights"]) == {"body.weight", "body.bias", SCALE}  # the head is not sent
    m = s.aggregate([tiny_update(0, PA, NA, 0.5, [1, 0], n=10),
                     tiny_update(1, PB, NB, -0.1, [0, 2], n=30)], [], RoundInfo(0, 3))
    # line 8: mu_c = normalize(sum_k n_kc mu_kc / sum_k n_kc); W_c = normalize(.9 W_c + .1 mu_c)
    mu = [unit((2 * np.array([1, 0]) + 1 * np.array([0, 1])) / 3),  # [2, 1] / sqrt 5
          unit((1 * np.array([0, 1]) + 3 * np.array([0.6, 0.8])) / 4),  # [1.8, 3.4] / 4
          unit([-1, 0])]  # B alone
    want = np.array([unit(0.9 * W0[c] + 0.1 * mu[c]) for c in range(3)])
    np.testing.assert_allclose(s.protos, want, atol=1e-6)
    np.testing.assert_allclose(s.protos[0], unit([0.9 + 0.2 / math.sqrt(5), 0.1 / math.sqrt(5)]),
                               atol=1e-6)
    # line 10: theta += (1/|S|) sum_k delta_k, the scale too
    assert s.weights[SCALE][0] == pytest.approx(1.2)
    np.testing.assert_allclose(s.weights["body.bias"], [0.5, 1.0], atol=1e-7)
    np.testing.assert_array_equal(s.weights["body.weight"], np.eye(2))
    assert m["classes_received"] == 3 and m["scale"] == pytest.approx(1.2)
    assert m["proto_cos_moved"] == pytest.approx(np.mean(np.sum(W0 * want, axis=1)))
    np.testing.assert_allclose(np.linalg.norm(s.make_task(0, RoundInfo(1, 3))["protos"],
                                              axis=1), 1.0, atol=1e-6)


def test_fednh_server_options_by_hand():
    ups = [tiny_update(0, PA, NA, 0.5, [1, 0], n=10), tiny_update(1, PB, NB, -0.1, [0, 2], n=30)]
    s = tiny_server(rho=0.0, aggregate="mean", body_aggregate="weighted", server_lr=0.5)
    s.aggregate(ups, [], RoundInfo(0, 3))
    # rho 0: W_c = the normalised plain mean over the holders of c
    want = [unit(unit(np.add([1, 0], [0, 1]) / 2)), unit(np.add([0, 1], [0.6, 0.8]) / 2),
            unit([-1, 0])]
    np.testing.assert_allclose(s.protos, want, atol=1e-6)
    # body by sample counts, times the server lr: 0.5 * (10 * 0.5 + 30 * -0.1) / 40
    assert s.weights[SCALE][0] == pytest.approx(1.0 + 0.5 * (5 - 3) / 40)
    np.testing.assert_allclose(s.weights["body.bias"], [0.5 * 10 / 40, 0.5 * 60 / 40], atol=1e-7)
    s = tiny_server(rho=1.0)  # rho 1: the prototypes never move
    s.aggregate(ups, [], RoundInfo(0, 3))
    np.testing.assert_allclose(s.protos, W0, atol=1e-7)


def test_fednh_server_staleness_and_missing_classes_by_hand():
    s = tiny_server()
    stale = tiny_update(1, PB, NB, -0.1, [0, 2], n=30, staleness=3)  # weight 1/2
    s.aggregate([tiny_update(0, PA, NA, 0.5, [1, 0], n=10), stale], [], RoundInfo(3, 5))
    # a_kc = w_k n_kc: class 0 (2 [1,0] + 0.5 [0,1]) / 2.5; class 1 (1 [0,1] + 1.5 [.6,.8]) / 2.5
    mu0, mu1 = unit([2, 0.5]), unit([0.9, 2.2])
    np.testing.assert_allclose(s.protos[0], unit(0.9 * W0[0] + 0.1 * mu0), atol=1e-6)
    np.testing.assert_allclose(s.protos[1], unit(0.9 * W0[1] + 0.1 * mu1), atol=1e-6)
    # the body: (1 * 0.5 + 0.5 * -0.1) / 1.5
    assert s.weights[SCALE][0] == pytest.approx(1.0 + 0.45 / 1.5)
    s = tiny_server()  # only A: class 2 has no holder and keeps its prototype (the code's)
    m = s.aggregate([tiny_update(0, PA, NA, 0.0, [0, 0])], [], RoundInfo(0, 3))
    np.testing.assert_array_equal(s.protos[2], W0[2].astype(np.float32))
    assert m["classes_received"] == 2
    before = s.state_dict()
    m = s.aggregate([], [], RoundInfo(1, 3))  # nothing arrived: nothing moves
    assert m["updates"] == 0
    np.testing.assert_array_equal(s.protos, before["protos"])
    fresh = tiny_server()
    fresh.load_state_dict(freeze(before))
    np.testing.assert_array_equal(fresh.protos, s.protos)
    np.testing.assert_array_equal(fresh.weights[SCALE], s.weights[SCALE])
    assert before["has"].all()


def test_fednh_merged_updates_give_the_flat_step():
    """A relay's sum form (FedNHSums: lifted and added) folds to the flat server's state."""
    ups = [tiny_update(0, PA, NA, 0.5, [1, 0], n=10), tiny_update(1, PB, NB, -0.1, [0, 2], n=30),
           tiny_update(2, PB[::-1], [4, 0, 2], 0.2, [3, -1], n=7)]
    for params in ({}, {"aggregate": "mean", "body_aggregate": "weighted", "server_lr": 0.7}):
        flat = tiny_server(**params)
        flat.aggregate(ups, [], RoundInfo(0, 3))
        tree = tiny_server(**params)
        rule = tree.merge_rule()
        p = resolved_params(FedNHServer, params)
        form = None
        for u in ups[:2]:
            form = rule.add(form, rule.lift(u.payload, u.num_samples, u.work, p, u.client))
        members = tuple(ClientUpdate(u.client, {}, u.num_samples, u.work, 0) for u in ups[:2])
        tree.aggregate([ClientUpdate(0, freeze(form), 40, Work(1, 1.0, 2, 40), 0,
                                     members=members), ups[2]], [], RoundInfo(0, 3))
        np.testing.assert_allclose(tree.protos, flat.protos, atol=1e-6)
        for k in flat.weights:
            np.testing.assert_allclose(tree.weights[k], flat.weights[k], atol=1e-6)


# --- the client on digits ------------------------------------------------------------------------

def test_fednh_client_task_on_digits():
    part = digits_parts(4, ways=5)[0]  # classes 0..4 only
    algo = get_algorithm("fednh")
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    head_before = h.ctx.model.fc.weight.detach().clone()
    task = freeze(server.make_task(0, RoundInfo(2, 5)))
    run = LocalRun(h.ctx, epochs=1, seed=0)
    payload = h.train(task, run)
    check_spec(payload, server.update_spec())
    assert run.work.steps == run.steps_per_epoch()
    # the lr of a round-2 task: train.lr * 0.99^2 (the code's diminishing schedule)
    assert [g["lr"] for g in h.optimizer.param_groups] == [pytest.approx(0.05 * 0.99 ** 2)] * 2
    counts = np.bincount(part[1].numpy(), minlength=C)
    np.testing.assert_array_equal(payload["counts"], counts)
    norms = np.linalg.norm(payload["protos"], axis=1)
    np.testing.assert_allclose(norms[counts > 0], 1.0, atol=1e-5)
    assert not payload["protos"][counts == 0].any()
    with torch.no_grad():  # normalize(mean of normalize(f(x))) per class, by hand
        z = h.ctx.model.eval().features(part[0]).numpy()
        z /= np.linalg.norm(z, axis=1, keepdims=True)
        for k in np.nonzero(counts)[0]:
            np.testing.assert_allclose(payload["protos"][k], unit(z[part[1].numpy() == k]
                                                                  .mean(0)), atol=1e-5)
    # the body and the scale moved; the network's own head never trains
    assert payload["delta"][SCALE].shape == (1,) and payload["delta"][SCALE][0] != 0
    assert max(np.abs(v).max() for k, v in payload["delta"].items() if k != SCALE) > 0
    assert torch.equal(h.ctx.model.fc.weight, head_before)
    assert set(payload["delta"]) == {"body.0.weight", "body.0.bias", SCALE}
    # the global model's evaluation: the cosine classifier and the nearest prototype agree
    ev = h.evaluate(freeze(server.make_eval(0, RoundInfo(2, 5))))
    assert set(ev) == {"acc", "loss", "num_test", "proto_acc"}
    assert ev["acc"] == pytest.approx(ev["proto_acc"], abs=0.02)


def test_fednh_cosine_loss_by_hand():
    part = digits_parts(4)[0]
    h = get_algorithm("fednh").client(client_ctx(0, part, {"scale_init": 3.0}))
    g = initial_prototypes(C, D, "uniform", 0)
    h._protos = torch.from_numpy(g)
    x, y = part[0][:20], part[1][:20]
    with torch.no_grad():
        loss = h.batch_loss(x, y).item()
        f = h.ctx.model.features(x).numpy().astype(np.float64)
    z = f / np.linalg.norm(f, axis=1, keepdims=True)
    logits = 3.0 * z @ g.T
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(20), y.numpy()].mean(), rel=1e-5)


def test_fednh_clipping_bounds_a_step_and_a_fixed_scale_stays():
    # one step, momentum's first step is the gradient: ||step|| = lr x min(||grad||, clip)
    part = digits_parts(4)[0]
    params = {"clip_norm": 1e-3, "lr_schedule": "constant"}
    server = get_algorithm("fednh").server(server_ctx(params))
    h = get_algorithm("fednh").client(client_ctx(0, part, params))
    run = LocalRun(h.ctx, epochs=1, seed=0, epochs_to_run=0.01)
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))), run)
    assert run.work.steps == 1
    norm = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum())
                         for v in payload["delta"].values()))
    assert norm == pytest.approx(TRAIN["lr"] * 1e-3, rel=1e-3)
    params = {"learn_scale": False, "scale_init": 30.0}  # the code's FedNH_fix_scaling
    server = get_algorithm("fednh").server(server_ctx(params))
    h = get_algorithm("fednh").client(client_ctx(0, part, params))
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))),
                      LocalRun(h.ctx, epochs=1, seed=0))
    assert payload["delta"][SCALE].tolist() == [0.0] and h.scale.item() == 30.0


def test_fednh_lr_schedules():
    assert client_lr(0.1, "diminishing", 0.99, 0, 10) == pytest.approx(0.1)
    assert client_lr(0.1, "diminishing", 0.99, 3, 10) == pytest.approx(0.1 * 0.99 ** 3)
    # the code's stepwise: lr while its round (rnd + 1) < rounds // 2, then lr / 10
    assert [client_lr(0.1, "stepwise", 0.99, r, 10) for r in (0, 3, 4, 9)] == \
        [pytest.approx(v) for v in (0.1, 0.1, 0.01, 0.01)]
    assert client_lr(0.1, "constant", 0.5, 7, 10) == 0.1


def test_fednh_local_evaluation_and_state_roundtrip():
    part = digits_parts(4, ways=5)[1]
    algo = get_algorithm("fednh")
    server = algo.server(server_ctx({"eval_model": "local"}))
    h = algo.client(client_ctx(0, part, {"eval_model": "local"}))
    h.train(freeze(server.make_task(0, RoundInfo(0, 3))), LocalRun(h.ctx, epochs=2, seed=0))
    server.protos = np.roll(server.protos, 1, axis=0)  # the global W moved on
    eval_task = freeze(server.make_eval(0, RoundInfo(1, 3)))
    local = h.evaluate(eval_task)
    # a rebuilt handler (eviction, resume) with the saved state scores the same
    state = h.state_dict()
    g = algo.client(client_ctx(0, part, {"eval_model": "local"}))
    g.load_state_dict(state)
    assert g.evaluate(eval_task) == local and g.scale.item() == h.scale.item()
    # "global" scores the task's W (here rolled: wrong classes) and the client's model is
    # untouched by it
    h.params = {"eval_model": "global"}
    before = {k: v.clone() for k, v in h.ctx.model.state_dict().items()}
    glob = h.evaluate(eval_task)
    assert glob["acc"] < local["acc"]
    assert all(torch.equal(v, h.ctx.model.state_dict()[k]) for k, v in before.items())


def test_fednh_short_federation_learns():
    _, _, hist = simulate("fednh", {"scale_init": 10.0}, rounds=4, clients=4, ways=5)
    assert hist[-1]["acc"] > 0.6 and hist[-1]["proto_acc"] > 0.6  # chance 0.1


# --- relays and secure aggregation through the server's engine -----------------------------------

def _fednh_payload(engine, task, client: int) -> dict:
    """A random FedNH update shaped by the update spec: small deltas, unit class means for the
    classes the client holds (one of them left out), counts within its class sizes."""
    rng = np.random.default_rng([client, task.body["version"], 11])
    spec = engine.handler.update_spec()
    c, d = engine.handler.ctx.num_classes, engine.handler.ctx.feature_dim
    counts = np.array([rng.integers(1, n + 1) if n else 0
                       for n in engine.class_samples[client]], np.int64)
    counts[rng.integers(c)] = 0
    protos = rng.normal(size=(c, d))
    protos = protos / np.linalg.norm(protos, axis=1, keepdims=True) * (counts > 0)[:, None]
    delta = {k: (rng.normal(0, 0.01, size=shape) if np.dtype(dt).kind == "f" else
                 np.zeros(shape)).astype(dt) for k, (dt, shape) in spec["delta"].items()}
    return {"delta": delta, "protos": protos.astype(np.float32), "counts": counts}


def _fednh_body(engine, task) -> dict:
    from tests.test_merge_rules import DONE
    c = int(task.dst[1:])
    return {"task": task.body["task"], "version": task.body["version"],
            "num_samples": int(engine.train_sizes[c]), "work": DONE,
            "payload": _fednh_payload(engine, task, c)}


@pytest.mark.parametrize("params", [{}, {"aggregate": "mean", "body_aggregate": "weighted"}])
def test_fednh_relay_sums_through_the_engine_give_the_flat_step(params):
    from fedbus.broker.wire import Message
    from fedbus.node.server import dispatch
    from tests.test_merge_rules import SITES, _cfg, _engine, _equal, _global, _record

    cfg = _cfg("fednh", **params)
    flat, f_tasks = _engine(cfg, {"n": range(6)})
    tree, t_tasks = _engine(cfg, {f"relay-{i}": s for i, s in enumerate(SITES)})
    before = _global(flat)
    for t in f_tasks:
        outs = dispatch(flat, Message("update", t.dst, "server", _fednh_body(flat, t), run="r",
                                      round=t.round), 1.0)
        assert not [o for o in outs if o.kind == "error"], outs
    rule, p = tree.handler.merge_rule(), resolved_params(FedNHServer, dict(cfg.algorithm))
    for i, site in enumerate(SITES):
        total, members = None, []
        for t in (t for t in t_tasks if int(t.dst[1:]) in site):
            body = _fednh_body(tree, t)
            total = rule.add(total, rule.lift(body["payload"], body["num_samples"],
                                              Work.from_dict(body["work"]), p, int(t.dst[1:])))
            members.append([t.dst, t.body["task"], body["num_samples"], body["work"]])
        msg = Message("merged", f"relay-{i}", "server", {"version": 0, "rule": rule.name,
                                                         "members": members, "payload": total},
                      run="r", round=0)
        outs = dispatch(tree, msg, 1.0)
        assert not [o for o in outs if o.kind == "error"], outs
    assert flat.version == tree.version == 1 and _record(tree)["merged"] == 2
    _equal(_global(tree), _global(flat), before)


def test_fednh_under_secure_aggregation_gives_the_plain_step():
    from fedbus.broker.wire import Message
    from fedbus.node.privacy.secure_round import privacy_refusal
    from fedbus.node.server import dispatch
    from tests.test_merge_rules import _cfg, _engine_sampled, _global, _record
    from tests.test_secure_aggregation import secure_round

    fed = {"fraction": 0.6, "deadline_s": 5.0}
    secure_cfg, plain_cfg = (_cfg("fednh", secure=s, fed=fed) for s in (True, False))
    assert privacy_refusal(secure_cfg) is None
    (secure, s_tasks), (plain, p_tasks) = (_engine_sampled(c) for c in (secure_cfg, plain_cfg))
    assert [t.dst for t in s_tasks] == [t.dst for t in p_tasks] and len(s_tasks) == 4
    before = _global(plain)
    secure_round(secure, secure_cfg, s_tasks, update=lambda e, t, c: _fednh_body(e, t))
    for t in p_tasks:
        dispatch(plain, Message("update", t.dst, "server", _fednh_body(plain, t), run="r",
                                round=t.round), 1.0)
    assert secure.version == plain.version == 1
    rec = _record(secure)
    assert rec["secagg"].get("failed") is None and rec["secagg"]["survivors"] == 4
    tol = rec["secagg"]["quant_bound"]
    got, want = _global(secure), _global(plain)
    assert sorted(got) == sorted(want) and "protos" in want
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=10 * tol, err_msg=k)
    assert max(np.abs(want[k] - before[k]).max() for k in want) > 100 * tol


# --- real federations -----------------------------------------------------------------------------

TINY_FEDNH = merged(TINY, algorithm={"name": "fednh"})


def test_fednh_sync_with_a_folded_straggler_learns_and_replays(tmp_path):
    from test_replay import assert_identical

    # 5 rounds: the straggler's update of each of the first four is folded into the next
    run, summary, recs = run_with_folded_straggler(
        tmp_path, merged(TINY_FEDNH, federation={"rounds": 5, "eval_every": 5},
                         train={"epochs": 2}))
    assert all(r["agg"].get("classes_received", 0) > 0 for r in recs if r["updates"]), recs
    final = summary["final"]
    assert final["acc_mean"] > 0.25 and final["proto_acc_mean"] > 0.25, final  # chance 0.1
    assert_identical(run, rounds=5)


def test_fednh_async_with_a_slow_client_learns_and_replays(tmp_path):
    from test_replay import assert_identical

    # 6 aggregations of 2 one-epoch updates. Every client holds 3 classes (ways_std 0): with
    # SMALL's spread, client 0 holds one class, trains 2 steps a task, so it is in nearly every
    # buffer of 2 and pulls the averaged body to its class (acc_mean 0.13-0.41 over runs);
    # with 3 classes each, 0.48-0.68 in three runs (timing decides which updates are stale)
    run, summary, recs = run_async_with_slow_client(
        tmp_path, merged(TINY_FEDNH, federation={"rounds": 6, "eval_every": 6},
                         data={"ways_std": 0.0}))
    assert summary["final"]["acc_mean"] > 0.3, summary["final"]  # chance 0.1
    assert_identical(run, rounds=6)  # replay follows the log, whatever the timing was


def test_fednh_through_two_relays_gives_the_flat_federation(tmp_path):
    from tests.test_relay import (EQUIV, _arrays, _final_state, assert_relays_give_the_flat_run,
                                  run_to_end)

    sections = merged(EQUIV, algorithm={"name": "fednh"})
    runs = {name: run_to_end(tmp_path, sections, relays=relays, name=name)
            for name, relays in (("flat", False), ("relays", True))}
    flat, tree = (_arrays(_final_state(runs[k])) for k in ("flat", "relays"))
    assert "protos" in flat and any(k.startswith("weights/") for k in flat)
    assert sorted(flat) == sorted(tree)
    assert_relays_give_the_flat_run(runs, flat, tree, "fednh")
    summary = json.loads((runs["relays"] / "summary.json").read_text())
    assert summary["rounds_completed"] == 3

"""fedtgp: the adaptive margin delta(t) (eq. 9, the code's rule, the Tab. 6
ablations) on hand-made prototypes, one server step's loss against a hand
computation with fixed generator weights, one SGD step of the trainable vectors
without F by hand, the client loss R (eq. 11 and the code's MSE) by hand,
staleness weights, presence without counts, determinism and resume of the
server's seeded training, empty rounds, the prototypes-only client update (eq. 2)
from a real LocalRun, and a short in-process federation on scikit-learn's digits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, C, D, check_spec, client_ctx, digits_parts, freeze, make_model,
                          server_ctx, simulate, update)

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import Failure, LocalRun, RoundInfo, ServerContext
from fedbus.algorithms.fedtgp import adaptive_margin, presence, prototype_regulariser

torch.set_num_threads(1)


# --- the adaptive margin delta(t) ----------------------------------------------------------

def test_adaptive_margin_by_hand():
    centres = np.array([[0, 0], [3, 0], [3, 4], [9, 9]], np.float64)
    present = np.array([True, True, True, False])
    # pairwise: |c0-c1| = 3, |c0-c2| = 5, |c1-c2| = 4; class-wise minimum: 3, 3, 4.
    # eq. 9 ("max", default): delta = min(max pairwise distance, tau) = 5
    assert adaptive_margin(centres, present, 100.0) == pytest.approx(5.0)
    assert adaptive_margin(centres, present, 4.5) == pytest.approx(4.5)
    # the reference code ("max_min"): min(max of the class-wise minima, tau) = 4
    assert adaptive_margin(centres, present, 100.0, "max_min") == pytest.approx(4.0)
    assert adaptive_margin(centres, present, 3.5, "max_min") == pytest.approx(3.5)
    # Tab. 6 ablations: FM (eq. 7) a fixed delta = tau, SCL (eq. 6) no margin
    assert adaptive_margin(centres, present, 7.0, "fixed") == 7.0
    assert adaptive_margin(centres, present, 7.0, "none") == 0.0
    # fewer than two classes: the code's gaps stay at 1e9, so delta = tau
    for rule in ("max", "max_min"):
        assert adaptive_margin(centres, np.array([True, False, False, False]), 7.0, rule) == 7.0


def tgp_server(**params):
    params = {"server_epochs": 0, **params}
    return get_algorithm("fedtgp").server(server_ctx(params, num_classes=3, feature_dim=2))


def test_server_margin_from_client_prototypes():
    # class centres (means over the clients that sent the class): (0,0), (3,0), (3,4)
    a = {"protos": np.array([[-1, 0], [3, 1], [3, 4]], np.float32)}
    b = {"protos": np.array([[1, 0], [3, -1], [0, 0]], np.float32)}  # class 2 absent: zero row
    s = tgp_server()
    metrics = s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))
    assert metrics["margin"] == pytest.approx(5.0) and metrics["classes_received"] == 3
    s = tgp_server(margin="max_min")
    assert s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))["margin"] == \
        pytest.approx(4.0)
    s = tgp_server(margin_threshold=2.0)
    assert s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))["margin"] == 2.0


def test_presence_by_counts_or_nonzero_rows():
    p = np.array([[1, 0], [0, 0], [0, 2]], np.float32)
    assert presence(p).tolist() == [True, False, True]
    assert presence(p, np.array([3, 1, 0])).tolist() == [True, True, False]
    assert presence(p, np.zeros(3, np.int64)).tolist() == [True, False, True]


# --- one server step's loss by hand -----------------------------------------------------------

def fix_generator(server, emb):
    """Identity layers, zero biases: with non-negative embeddings the generated
    prototypes are the embeddings themselves."""
    net = server.net
    with torch.no_grad():
        net.embeddings.weight.copy_(torch.tensor(emb, dtype=torch.float32))
        for lin in (net.middle[0], net.fc):
            lin.weight.copy_(torch.eye(2))
            lin.bias.zero_()


def test_one_server_step_loss_by_hand():
    # generated prototypes G = [[1,0], [0,1], [2,2]]; client prototypes
    # p1 = (1,0) of class 0 (client A), p2 = (0,4) of class 1 (client B);
    # centres (1,0), (0,4): gap sqrt(17) > tau = 1, so delta = 1.
    # d(p1, G) = (0, sqrt 2, sqrt 5); d(p2, G) = (sqrt 17, 3, sqrt 8)
    # CE1 = log(1 + e^(0+1-sqrt 2) + e^(0+1-sqrt 5))  = 0.668538928...
    # CE2 = log(1 + e^(3+1-sqrt 17) + e^(3+1-sqrt 8)) = 1.631440996...
    ce1 = math.log(1 + math.exp(1 - math.sqrt(2)) + math.exp(1 - math.sqrt(5)))
    ce2 = math.log(1 + math.exp(4 - math.sqrt(17)) + math.exp(4 - math.sqrt(8)))
    assert ce1 == pytest.approx(0.6685389, abs=1e-6) and ce2 == pytest.approx(1.6314410, abs=1e-6)
    a = {"protos": np.array([[1, 0], [0, 0], [0, 0]], np.float32)}
    b = {"protos": np.array([[0, 0], [0, 4], [0, 0]], np.float32)}
    for stale, want in ((0, (ce1 + ce2) / 2), (3, (ce1 + 0.5 * ce2) / 1.5)):
        s = tgp_server(server_epochs=1, server_batch_size=10, margin_threshold=1.0,
                       server_lr=0.1)
        fix_generator(s, [[1, 0], [0, 1], [2, 2]])
        metrics = s.aggregate([update(0, a), update(1, b, staleness=stale)], [],
                              RoundInfo(0, 3))
        assert metrics["margin"] == 1.0
        assert metrics["server_loss"] == pytest.approx(want, abs=1e-6)
        # one SGD step moved the generator; the task carries its output for all classes
        task = s.make_task(0, RoundInfo(1, 3))
        assert task["has"].tolist() == [True, True, True]
        with torch.no_grad():
            np.testing.assert_allclose(task["protos"], s.net().numpy(), atol=1e-7)
        assert not np.allclose(task["protos"], [[1, 0], [0, 1], [2, 2]])


def test_one_server_sgd_step_by_hand_without_f():
    # generator "none" (Tab. 6 "w/o F"): the prototypes are the trainable vectors g_c.
    # One prototype p = (1, 0) of class 0, g = [(0, 0), (0, 2)], margin none (eq. 6).
    # logits l_c = -(||p - g_c|| + delta [c = 0]); d = (1, sqrt 5); CE = -l_0 + lse(l);
    # dCE/dg_c = (softmax_c - [c = 0]) (p - g_c) / d_c. One SGD step at the default server
    # lr, the clients' train.lr (0.05): g_c - 0.05 dCE/dg_c.
    p = np.array([1.0, 0.0])
    g = np.array([[0.0, 0.0], [0.0, 2.0]])
    for rule, delta in (("none", 0.0), ("fixed", 0.5)):
        d = np.sqrt(((p - g) ** 2).sum(1))
        logits = -(d + delta * np.array([1.0, 0.0]))
        sm = np.exp(logits - logits.max())
        sm /= sm.sum()
        grad = (sm - np.array([1.0, 0.0]))[:, None] * (p - g) / d[:, None]
        want = g - TRAIN["lr"] * grad
        s = get_algorithm("fedtgp").server(server_ctx(
            {"server_epochs": 1, "generator": "none", "margin": rule, "margin_threshold": delta},
            num_classes=2, feature_dim=2))
        with torch.no_grad():
            s.net.embeddings.weight.copy_(torch.tensor(g, dtype=torch.float32))
        a = {"protos": np.array([[1, 0], [0, 0]], np.float32)}
        metrics = s.aggregate([update(0, a)], [], RoundInfo(0, 3))
        assert metrics["margin"] == delta
        assert metrics["server_loss"] == pytest.approx(-logits[0] + np.log(np.exp(logits).sum()),
                                                       abs=1e-6)
        np.testing.assert_allclose(s.make_task(0, RoundInfo(1, 3))["protos"], want, atol=1e-6)


def test_client_regulariser_by_hand():
    # eq. 11 ("paper"): mean over the batch's classes of ||batch class mean - P-hat^c||_2;
    # the code ("mse"): nn.MSELoss(h, target), target = P-hat^{y_b} (or h_b if none)
    h = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 5.0], [4.0, 4.0]])
    y = torch.tensor([0, 0, 1, 2])
    g = torch.tensor([[2.0, 2.0], [0.0, 1.0], [9.0, 9.0]])
    has = torch.tensor([True, True, False])  # class 2 has no global prototype
    # class 0: mean (2, 1) vs (2, 2): 1; class 1: (0, 5) vs (0, 1): 4 -> (1 + 4) / 2
    got = prototype_regulariser(h, y, g, has)
    assert got.item() == pytest.approx(2.5)
    # mse: rows 0,1 vs (2,2): (1+4) + (1+0); row 2 vs (0,1): 0 + 16; row 3 vs itself: 0
    # over B x D = 8 entries: 22 / 8
    assert prototype_regulariser(h, y, g, has, "mse").item() == pytest.approx(22 / 8)
    # the client adds lam * R to CE: default lam 0.1 and the paper form
    part = digits_parts(4, ways=5)[0]
    cli = get_algorithm("fedtgp").client(client_ctx(0, part, {}))
    assert cli.lam == 0.1 and cli.proto_loss == "paper"
    x, yy = part[0][:6], part[1][:6]
    protos = torch.randn(C, D, generator=torch.Generator().manual_seed(0))
    cli._global, cli._has, cli._reg = protos, torch.ones(C, dtype=torch.bool), True
    with torch.no_grad():
        hh = cli.ctx.model.features(x)
        ce = torch.nn.functional.cross_entropy(cli.ctx.model.head(hh), yy).item()
        hn, yn, gn = hh.numpy(), yy.numpy(), protos.numpy()
        r = np.mean([np.linalg.norm(hn[yn == c].mean(0) - gn[c]) for c in np.unique(yn)])
        assert cli.batch_loss(x, yy).item() == pytest.approx(ce + 0.1 * r, rel=1e-5)


def test_server_training_lowers_the_loss():
    a = {"protos": np.array([[1, 0], [0, 3], [3, 3]], np.float32)}
    b = {"protos": np.array([[2, 0], [0, 4], [0, 0]], np.float32)}
    s = tgp_server(server_epochs=1, server_hidden=8)
    first = s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))["server_loss"]
    s = tgp_server(server_epochs=200, server_hidden=8)
    last = s.aggregate([update(0, a), update(1, b)], [], RoundInfo(0, 3))["server_loss"]
    assert last < first


# --- determinism, resume, empty rounds ---------------------------------------------------------

def rounds_of(server, inputs):
    out = []
    for r, ups in enumerate(inputs):
        server.aggregate(ups, [], RoundInfo(r, len(inputs)))
        out.append(server.make_task(0, RoundInfo(r + 1, len(inputs)))["protos"].copy())
    return out


def test_server_is_deterministic_and_resumable():
    rng = np.random.default_rng(0)
    inputs = [[update(i, {"protos": rng.normal(size=(C, D)).astype(np.float32)})
               for i in range(3)] for _ in range(3)]
    params = {"server_epochs": 5}
    state = torch.get_rng_state()
    one = rounds_of(get_algorithm("fedtgp").server(server_ctx(params)), inputs)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    two = rounds_of(get_algorithm("fedtgp").server(server_ctx(params)), inputs)
    for x, y in zip(one, two):
        np.testing.assert_array_equal(x, y)
    # resume from a checkpoint after round 0: the same outputs, bit for bit
    s = get_algorithm("fedtgp").server(server_ctx(params))
    rounds_of(s, inputs[:1])
    resumed = get_algorithm("fedtgp").server(server_ctx(params))
    resumed.load_state_dict(freeze(s.state_dict()))
    for x, y in zip(rounds_of(resumed, inputs[1:]), one[1:]):
        np.testing.assert_array_equal(x, y)
    other = rounds_of(get_algorithm("fedtgp").server(
        ServerContext(params=params, train=TRAIN, num_classes=C, feature_dim=D, clients=4,
                      rounds=3, seed=1, homogeneous=True, make_model=make_model)), inputs)
    assert not np.array_equal(other[0], one[0])


def test_empty_aggregation_keeps_state():
    s = tgp_server(server_epochs=3)
    s.aggregate([update(0, {"protos": np.array([[1, 0], [0, 1], [0, 0]], np.float32)})], [],
                RoundInfo(0, 3))
    before = s.state_dict()
    metrics = s.aggregate([], [Failure(0, "dead"), Failure(1, "late")], RoundInfo(1, 3))
    assert metrics["updates"] == 0
    # all-zero prototypes carry no class: nothing to train on either
    s.aggregate([update(0, {"protos": np.zeros((3, 2), np.float32)})], [], RoundInfo(2, 3))
    after = s.state_dict()
    for k in ("protos", "has", "generator"):
        np.testing.assert_array_equal(after[k], before[k])
    for k in before["net"]:
        np.testing.assert_array_equal(after["net"][k], before["net"][k])


# --- client and a short federation -------------------------------------------------------------

def test_client_uploads_prototypes_only():
    part = digits_parts(4, ways=5)[0]
    algo = get_algorithm("fedtgp")
    server = algo.server(server_ctx({}))
    assert server.update_spec() == {"protos": ("float32", (C, D))}
    h = algo.client(client_ctx(0, part, {}))
    run = LocalRun(h.ctx, epochs=1, seed=0)
    payload = h.train(freeze(server.make_task(0, RoundInfo(0, 3))), run)
    assert set(payload) == {"protos"} and run.work.steps == run.steps_per_epoch()
    check_spec(payload, server.update_spec())
    held = np.bincount(part[1].numpy(), minlength=C) > 0
    assert presence(payload["protos"]).tolist() == held.tolist()
    assert h.lam == 0.1 and h.proto_loss == "paper"
    # eq. 2: the upload is the class mean of f(x) over the training set, eval mode
    with torch.no_grad():
        h.ctx.model.eval()
        feats = h.ctx.model.features(part[0]).numpy()
    labels = part[1].numpy()
    for c in np.flatnonzero(held):
        np.testing.assert_allclose(payload["protos"][c], feats[labels == c].mean(0),
                                   rtol=1e-5, atol=1e-6)


def test_fedtgp_short_federation_learns():
    server, _, history = simulate("fedtgp", {}, rounds=4, clients=4, epochs=3, ways=5)
    assert server.has.all() and server.margin > 0
    last = history[-1]
    # chance: 0.1 over all classes, 0.2 within a client's five
    assert last["proto_acc"] > 0.6 and last["acc"] > 0.5, history


# --- the fedtgp-hetero recipe's like-for-like regulariser pairs ----------------------------

def recipe_client(label, part, model, protos, has):
    """A client of the fedtgp-hetero row `label`, with the row's resolved [algorithm] and
    [train] settings (the recipe's lambda, form, lr 0.01, momentum 0, batch 10), trained one
    epoch from `model`'s weights against the global prototypes (protos, has)."""
    from fedbus.bench import reproduce as rp
    from fedbus.node.config import build_config

    recipe = rp.RECIPES["fedtgp-hetero"]
    row = next(r for r in recipe.rows if r.label == label)
    built = build_config(rp.sections(recipe, row, 0))
    ctx = client_ctx(0, part, dict(built.algorithm), model=model)
    ctx.train = dict(built.train)
    h = get_algorithm(row.algorithm).client(ctx)
    h.train(freeze({"protos": protos, "has": has}), LocalRun(ctx, epochs=1, seed=5))
    return {k: v.detach().clone() for k, v in h.ctx.model.state_dict().items()}


@pytest.mark.parametrize("fedtgp_row, fedproto_row, same", [
    ("FedTGP, MSE regulariser", "FedProto", True),
    ("FedTGP", "FedProto, FedTGP's eq. 4 regulariser", True),
    ("FedTGP", "FedProto", False),  # the recipe's paper rows: different regularisers
])
def test_recipe_pairs_train_a_client_alike_on_the_same_prototypes(fedtgp_row, fedproto_row,
                                                                  same):
    """Within a like-for-like pair of the fedtgp-hetero recipe the two algorithms' clients
    are the same learner: from the same weights, on the same batches and global prototypes,
    they end bit for bit equal (so the rows differ only by how the server makes the
    prototypes); the recipe's FedProto and FedTGP rows do not."""
    part = digits_parts(4, ways=5)[0]
    protos = np.random.default_rng(3).normal(size=(C, D)).astype(np.float32)
    has = np.arange(C) < 8
    weights = [recipe_client(label, part, make_model(0), protos, has)
               for label in (fedtgp_row, fedproto_row)]
    equal = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert equal is same

"""fedgh: one server SGD step of the global header on two client LARs by hand (with a
staleness weight), the staleness weight's scaling of a single-LAR step, empty
aggregations, the state round trip and the untouched global RNG, the header
replacement on the client (across networks that name their head differently), the
LARs of a real LocalRun (after training, and during the last epoch), partial work,
evaluation with the local and the global header, config validation, and a short
heterogeneous in-process federation on scikit-learn's digits.

fedgen: the diversity loss and the per-label ensemble weights by hand, one generator step's
loss (both teacher forms, with and without the diversity term, with a staleness weight) and
the averaged header by hand on a constant generator, empty aggregations, the state round
trip, the client's CE + generated-feature CE by hand, real LocalRuns (full and partial),
config validation and a heterogeneous in-process federation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, C, D, Net, check_spec, client_ctx, digits_parts, make_model,
                          server_ctx, simulate, update)

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, LocalRun, RoundInfo, Work
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.protos import local_prototypes
from fedbus.algorithms.fedgen import Generator, diversity_loss, label_weights
from fedbus.algorithms.fedgh import header_weights, load_header
from fedbus.models.registry import build_model

torch.set_num_threads(1)

FEDGH = get_algorithm("fedgh")
R0 = RoundInfo(0, 3)


def tiny_server(w, b, **params):
    """A server for 2 classes, 2 features, its header set to (w, b)."""
    def make(i):  # the header's weights are replaced below
        return Net(d_in=3, feat=2, classes=2)

    s = FEDGH.server(server_ctx(params, make=make, num_classes=2, feature_dim=2))
    s.load_state_dict({"header": {"weight": np.array(w, np.float32),
                                  "bias": np.array(b, np.float32)},
                       "generator": s.gen.get_state().numpy()})
    return s


def lar(rows, counts):
    return {"protos": np.array(rows, np.float32), "counts": np.array(counts, np.int64)}


# --- the server step by hand -----------------------------------------------------------------

def test_one_server_step_by_hand():
    # header W = I, b = 0. Client A sends p1 = (1, 0) of class 0 (class 1 absent: count 0),
    # client B (staleness 3, w = 1/2) sends p2 = (0, 2) of class 1.
    # logits: z1 = (1, 0), z2 = (0, 2); with s1 = sigmoid(1) = 0.7310586, s2 = sigmoid(2) =
    # 0.8807971: CE1 = log(1 + e^-1) = 0.3132617, CE2 = log(1 + e^-2) = 0.1269280;
    # dCE/dz = softmax - onehot: g1 = (s1 - 1, 1 - s1), g2 = (1 - s2, s2 - 1).
    # One minibatch of both: loss = (w1 CE1 + w2 CE2) / 2; dW = (w1 g1 p1^T + w2 g2 p2^T) / 2,
    # db = (w1 g1 + w2 g2) / 2; one SGD step at lr 0.1.
    s1, s2 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))
    ce1, ce2 = math.log(1 + math.exp(-1)), math.log(1 + math.exp(-2))
    assert (s1, s2, ce1, ce2) == pytest.approx((0.7310586, 0.8807971, 0.3132617, 0.1269280),
                                               abs=1e-7)
    g1, g2 = np.array([s1 - 1, 1 - s1]), np.array([1 - s2, s2 - 1])
    p1, p2 = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    a = update(0, lar([[1, 0], [0, 0]], [3, 0]))
    for stale in (0, 3):
        w2 = 1 / math.sqrt(1 + stale)
        s = tiny_server(np.eye(2), [0, 0], server_lr=0.1, server_batch_size=2)
        b = update(1, lar([[0, 0], [0, 2]], [0, 5]), staleness=stale)
        metrics = s.aggregate([a, b], [], R0)
        assert metrics["lars"] == 2 and metrics["classes_received"] == 2
        assert metrics["server_loss"] == pytest.approx((ce1 + w2 * ce2) / 2, abs=1e-6)
        dw = (np.outer(g1, p1) + w2 * np.outer(g2, p2)) / 2
        db = (g1 + w2 * g2) / 2
        task = s.make_task(0, RoundInfo(1, 3))
        np.testing.assert_allclose(task["head"]["weight"], np.eye(2) - 0.1 * dw, atol=1e-7)
        np.testing.assert_allclose(task["head"]["bias"], -0.1 * db, atol=1e-7)


def test_staleness_scales_a_single_lar_step():
    # default batching: one LAR per step (the authors' code). W = 0, b = 0, p = (2, 1) of
    # class 1: softmax (1/2, 1/2), dCE/dz = (1/2, -1/2); the step is lr * w * that, so a
    # LAR of staleness 3 (w = 1/2) moves the header half as far as a fresh one.
    steps = []
    for stale in (0, 3):
        s = tiny_server(np.zeros((2, 2)), [0, 0])
        assert s.param("server_epochs") == 1 and s.param("server_batch_size") == 1
        s.aggregate([update(0, lar([[0, 0], [2, 1]], [0, 4]), staleness=stale)], [], R0)
        steps.append(s.make_task(0, R0)["head"]["bias"].astype(np.float64))
    np.testing.assert_allclose(steps[0], [-0.01 * 0.5, 0.01 * 0.5], atol=1e-8)
    np.testing.assert_allclose(steps[1], 0.5 * steps[0], atol=1e-8)


def test_more_server_epochs_lower_the_loss():
    ups = [update(0, lar([[1, 0], [0, 1]], [1, 1])), update(1, lar([[2, 0], [0, 3]], [1, 1]))]
    first = tiny_server(np.zeros((2, 2)), [0, 0], server_epochs=1).aggregate(ups, [], R0)
    last = tiny_server(np.zeros((2, 2)), [0, 0], server_epochs=50).aggregate(ups, [], R0)
    assert last["server_loss"] < first["server_loss"] - 0.1


# --- empty rounds, state, determinism --------------------------------------------------------

def test_empty_aggregation_keeps_the_header():
    s = FEDGH.server(server_ctx({}))
    before = {k: v.copy() for k, v in s.make_task(0, R0)["head"].items()}
    gen = s.gen.get_state().clone()
    m = s.aggregate([], [], R0)
    assert m["updates"] == 0 and m["lars"] == 0
    # an update without any present class is no training data either
    s.aggregate([update(0, lar(np.zeros((C, D)), np.zeros(C)))], [], R0)
    for k, v in s.make_task(0, R0)["head"].items():
        np.testing.assert_array_equal(v, before[k])
    assert torch.equal(s.gen.get_state(), gen)


def test_header_starts_from_the_seeded_model():
    s = FEDGH.server(server_ctx({}))
    ref = make_model(0)
    head = s.make_task(0, R0)["head"]
    assert sorted(head) == ["bias", "weight"]
    np.testing.assert_array_equal(head["weight"], ref.fc.weight.detach().numpy())
    np.testing.assert_array_equal(head["bias"], ref.fc.bias.detach().numpy())


def rounds_of(server, inputs, start=0):
    out = []
    for r, ups in enumerate(inputs, start):
        server.aggregate(ups, [], RoundInfo(r, 3))
        out.append({k: v.copy() for k, v in server.make_task(0, RoundInfo(r + 1, 3))["head"]
                    .items()})
    return out


def test_state_round_trip_and_determinism():
    rng = np.random.default_rng(0)
    inputs = [[update(i, lar(rng.normal(size=(C, D)), rng.integers(0, 3, size=C)))
               for i in range(3)] for _ in range(3)]
    params = {"server_epochs": 3, "server_batch_size": 4}
    state = torch.get_rng_state()
    one = rounds_of(FEDGH.server(server_ctx(params)), inputs)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    s = FEDGH.server(server_ctx(params))
    rounds_of(s, inputs[:1])
    saved = s.state_dict()
    resumed = FEDGH.server(server_ctx(params))
    resumed.load_state_dict(saved)
    two = rounds_of(resumed, inputs[1:], start=1)
    for x, y in zip(one[1:], two):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert not np.array_equal(one[0]["weight"], one[2]["weight"])


# --- the client ------------------------------------------------------------------------------

def test_client_replaces_its_header_then_trains():
    part = digits_parts(4, ways=5)[0]
    s = FEDGH.server(server_ctx({}))
    header = {"weight": np.full((C, D), 0.01, np.float32), "bias": np.arange(C, dtype=np.float32)}
    cli = FEDGH.client(client_ctx(0, part, {}, model=make_model(0, seed=7)))
    body = cli.ctx.model.body[0].weight.detach().clone()
    # zero epochs: no step, so the head is the received header exactly, the body untouched
    out = cli.train({"head": header}, LocalRun(cli.ctx, epochs=0, seed=0))
    np.testing.assert_array_equal(cli.ctx.model.fc.weight.detach().numpy(), header["weight"])
    np.testing.assert_array_equal(cli.ctx.model.fc.bias.detach().numpy(), header["bias"])
    assert torch.equal(cli.ctx.model.body[0].weight, body)
    check_spec(out, s.update_spec())
    # one epoch from the header: the whole model moves, the head away from the header
    cli.train({"head": header}, LocalRun(cli.ctx, epochs=1, seed=0))
    assert not torch.equal(cli.ctx.model.body[0].weight, body)
    assert not np.allclose(cli.ctx.model.fc.bias.detach().numpy(), header["bias"])


def test_header_travels_between_differently_named_heads():
    # FedProto's CNN names its head fc2, the MLP fc: the header travels without the prefix
    cnn = build_model("cnn", in_shape=(1, 8, 8), num_classes=C, feature_dim=D, seed=0)
    mlp = build_model("mlp", in_shape=(1, 8, 8), num_classes=C, feature_dim=D, seed=1)
    h = header_weights(cnn.fc2)
    assert sorted(h) == ["bias", "weight"]
    load_header(mlp.fc, h)
    np.testing.assert_array_equal(mlp.fc.weight.detach().numpy(), h["weight"])
    other = build_model("mlp-fedcl", in_shape=(1, 8, 8), num_classes=C, feature_dim=D, seed=0)
    with pytest.raises(ValueError, match="same header"):
        load_header(other.classifier, h)


def test_client_update_is_its_class_means_after_training():
    part = digits_parts(4, ways=5)[1]
    s = FEDGH.server(server_ctx({}))
    cli = FEDGH.client(client_ctx(1, part, {}))
    before = [p.detach().clone() for p in cli.ctx.model.parameters()]
    out = cli.train(s.make_task(1, R0), LocalRun(cli.ctx, epochs=2, seed=3))
    check_spec(out, s.update_spec())
    assert any(not torch.equal(a, b) for a, b in zip(before, cli.ctx.model.parameters()))
    want_p, _ = local_prototypes(cli.ctx.model, part[0], part[1], C)
    np.testing.assert_array_equal(out["protos"], want_p)
    np.testing.assert_array_equal(out["counts"], np.bincount(part[1].numpy(), minlength=C))
    assert (out["counts"] > 0).sum() == 5  # the client's five classes
    assert np.all(out["protos"][out["counts"] == 0] == 0)


def lr0_ctx(part, params):
    train = {**TRAIN, "lr": 0.0, "momentum": 0.0}
    return ClientContext(client=0, model=make_model(0), device=torch.device("cpu"),
                         train_x=part[0], train_y=part[1], test_x=part[2], test_y=part[3],
                         num_classes=C, feature_dim=D, params=params, train=train, seed=0)


def test_last_epoch_lars():
    part = digits_parts(4, ways=5)[2]
    s = FEDGH.server(server_ctx({}))
    # lr 0: the weights stay put, so the last epoch's class means (this network has no
    # dropout) equal the eval-mode pass after training, and every sample counts once
    cli = FEDGH.client(lr0_ctx(part, {"protos": "last_epoch"}))
    out = cli.train(s.make_task(0, R0), LocalRun(cli.ctx, epochs=3, seed=0))
    check_spec(out, s.update_spec())
    want_p, want_n = local_prototypes(cli.ctx.model, part[0], part[1], C)
    np.testing.assert_array_equal(out["counts"], want_n)
    np.testing.assert_allclose(out["protos"], want_p, atol=1e-5)
    # a run cut inside its second epoch: only that epoch's batches count
    run = LocalRun(cli.ctx, epochs=3, seed=0, epochs_to_run=1.5)
    out = cli.train(s.make_task(0, R0), run)
    per_epoch = run.steps_per_epoch()
    assert run.work.steps == round(1.5 * per_epoch)
    assert out["counts"].sum() == run.work.samples - len(part[1])
    # with training, the last epoch's means are those of a moving model: not the pass after
    cli = FEDGH.client(client_ctx(0, part, {"protos": "last_epoch"}))
    out = cli.train(s.make_task(0, R0), LocalRun(cli.ctx, epochs=2, seed=0))
    after, _ = local_prototypes(cli.ctx.model, part[0], part[1], C)
    np.testing.assert_array_equal(out["counts"], want_n)
    assert not np.allclose(out["protos"], after, atol=1e-6)


def test_partial_work_still_updates():
    part = digits_parts(4, ways=5)[3]
    s = FEDGH.server(server_ctx({}))
    cli = FEDGH.client(client_ctx(3, part, {}))
    before = [p.detach().clone() for p in cli.ctx.model.parameters()]
    run = LocalRun(cli.ctx, epochs=4, seed=0, epochs_to_run=0.25)
    out = cli.train(s.make_task(3, R0), run)
    assert run.work.stopped == "partial" and 0 < run.work.fraction < 1
    check_spec(out, s.update_spec())
    assert any(not torch.equal(a, b) for a, b in zip(before, cli.ctx.model.parameters()))
    head0 = s.make_task(3, R0)["head"]["weight"].copy()
    m = s.aggregate([update(3, out, len(part[1]), work=Work(4, run.work.epochs_done,
                                                             run.work.steps,
                                                             run.work.samples))], [], R0)
    assert m["lars"] == 5
    assert not np.array_equal(s.make_task(3, R0)["head"]["weight"], head0)


def test_evaluate_local_and_global_header():
    part = digits_parts(4, ways=5)[0]
    s = FEDGH.server(server_ctx({}))
    rng = np.random.default_rng(1)
    other = {"weight": rng.normal(size=(C, D)).astype(np.float32),
             "bias": rng.normal(size=C).astype(np.float32)}
    for mode in ("local", "global"):
        cli = FEDGH.client(client_ctx(0, part, {"eval_head": mode}))
        cli.train(s.make_task(0, R0), LocalRun(cli.ctx, epochs=2, seed=0))
        own = {k: v.clone() for k, v in cli.ctx.model.state_dict().items()}
        local = head_metrics(cli.ctx.model, part[2], part[3])
        ev = cli.evaluate({"head": other})
        for k, v in cli.ctx.model.state_dict().items():  # the client's own head is back
            assert torch.equal(v, own[k])
        ref = make_model(0)
        ref.load_state_dict(own)
        load_header(ref.fc, other)
        glob = head_metrics(ref, part[2], part[3])
        assert ev["local_head_acc"] == local["acc"] and ev["global_head_acc"] == glob["acc"]
        assert ev["global_head_loss"] == pytest.approx(glob["loss"])
        assert ev["local_head_loss"] == pytest.approx(local["loss"])
        pick = local if mode == "local" else glob
        assert ev["acc"] == pick["acc"] and ev["loss"] == pytest.approx(pick["loss"])
        assert ev["num_test"] == len(part[3])
        assert glob["acc"] != local["acc"]  # the two scores really differ here


def test_config_validation():
    from fedbus.node.config import ConfigError, build_config
    cfg = build_config({"algorithm": {"name": "fedgh"}}).algorithm
    assert cfg["server_epochs"] == 1 and cfg["server_lr"] == 0.01
    assert cfg["protos"] == "after" and cfg["eval_head"] == "local"
    for key, bad in (("server_lr", -0.1), ("server_epochs", -1), ("server_batch_size", -2),
                     ("protos", "during"), ("eval_head", "both")):
        with pytest.raises(ConfigError):
            build_config({"algorithm": {"name": "fedgh", key: bad}})


# --- a short federation -----------------------------------------------------------------------

@pytest.mark.parametrize("params", [{}, {"server_epochs": 100, "server_batch_size": 0}],
                         ids=["authors", "htfllib"])
def test_heterogeneous_federation_learns(params):
    _, clients, hist = simulate("fedgh", params, rounds=5, epochs=3, hetero=True,
                                     metrics=("acc", "global_head_acc"))
    assert clients[0].ctx.model.body[0].out_features != clients[1].ctx.model.body[0].out_features
    # chance on a client's test split is 0.1 over ten classes (0.2 within its five)
    assert hist[-1]["acc"] > 0.7 and hist[-1]["acc"] > hist[0]["acc"] + 0.2, hist
    assert hist[-1]["global_head_acc"] > 0.7, hist


# === fedgen ===================================================================================

FEDGEN = get_algorithm("fedgen")


def test_diversity_loss_and_label_weights_by_hand():
    # eps (0), (1): squared noise distance 1 off the diagonal; outputs (0, 0), (2, 0): mean
    # absolute distance (2 + 0) / 2 = 1 off the diagonal; mean over the 4 pairs of
    # noise * layer = 2 / 4, so exp(-1/2)
    eps = torch.tensor([[0.0], [1.0]])
    out = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    assert diversity_loss(eps, out).item() == pytest.approx(math.exp(-0.5))
    # a_{y,k} = s_k n_k[y] / sum_j s_j n_j[y]: counts (3, 1, 0) and (1, 3, 0), s = (1, 1/2)
    a = label_weights(np.array([[3, 1, 0], [1, 3, 0]]), np.array([1.0, 0.5]))
    np.testing.assert_allclose(a, [[3 / 3.5, 0.5 / 3.5], [1 / 2.5, 1.5 / 2.5], [0, 0]])


def gen_server(**params):
    def make(i):
        return Net(d_in=3, feat=2, classes=2)
    return FEDGEN.server(server_ctx({"hidden_dim": 4, "noise_dim": 3, **params}, make=make,
                                    num_classes=2, feature_dim=2))


def constant_generator(server, b):
    """fc1 = 0: BatchNorm of a constant batch is 0, ReLU 0, so G(eps, y) = fc's bias b."""
    with torch.no_grad():
        server.generator.fc1[0].weight.zero_()
        server.generator.fc1[0].bias.zero_()
        server.generator.fc.bias.copy_(torch.tensor(b))


def head(w, c=(0.0, 0.0)):
    return {"weight": np.array(w, np.float32), "bias": np.array(c, np.float32)}


def test_generator_step_and_head_average_by_hand():
    # G = b = (1, 0) for every (eps, y). Client 1's head I gives logits (1, 0), client 2's
    # head [[0, 1], [1, 0]] gives (0, 1). Counts (3, 1) and (1, 3), both fresh:
    # a_{0,.} = (3/4, 1/4), a_{1,.} = (1/4, 3/4).
    # ensemble: y = 0 -> logits (3/4, 1/4), y = 1 -> (1/4, 3/4): CE = log(1 + e^-1/2) for
    # either label, whatever the sampled labels; diversity exp(0) = 1 (all G equal).
    # clients (authors' code): y = 0 -> 3/4 CE((1,0), 0) + 1/4 CE((0,1), 0)
    #   = 3/4 log(1 + e^-1) + 1/4 log(1 + e), the same for y = 1.
    h1, h2 = head(np.eye(2)), head([[0, 1], [1, 0]])
    ups = [update(0, {"head": h1, "counts": np.array([3, 1])}, n=10),
           update(1, {"head": h2, "counts": np.array([1, 3])}, n=30)]
    ens = math.log(1 + math.exp(-0.5))
    cli = 0.75 * math.log(1 + math.exp(-1)) + 0.25 * math.log(1 + math.e)
    for teacher, want in (("ensemble", ens), ("clients", cli)):
        for eta in (0.0, 1.0):
            s = gen_server(server_epochs=1, teacher=teacher, diversity_weight=eta)
            constant_generator(s, [1.0, 0.0])
            before = s.generator.fc.bias.detach().clone()
            m = s.aggregate(ups, [], R0)
            assert m["generator_loss"] == pytest.approx(want + eta, abs=1e-6)
            assert not torch.equal(s.generator.fc.bias, before)  # one Adam step moved G
            task = s.make_task(0, RoundInfo(1, 3))
            assert task["ready"]
            for k, v in s.generator.state_dict().items():
                np.testing.assert_array_equal(task["generator"][k], v.numpy())
            # the header: sum_k s_k N_k head_k / sum_k s_k N_k = (10 h1 + 30 h2) / 40
            np.testing.assert_allclose(task["head"]["weight"],
                                       (10 * np.eye(2) + 30 * h2["weight"]) / 40, atol=1e-7)
            np.testing.assert_allclose(task["label_dist"], [0.5, 0.5])
    # staleness 3 on client 2 (s = 1/2): a_{0,.} = (3, 1/2)/3.5, a_{1,.} = (1, 3/2)/2.5;
    # y = 0 -> logits (6/7, 1/7), y = 1 -> (2/5, 3/5): the loss depends on the label drawn,
    # so one label class only (client 1 sends counts (3, 0), client 2 (1, 0)): y = 0,
    # a_0 = (3, 1/2) / 3.5 = (6/7, 1/7), CE = log(1 + e^(1/7 - 6/7)). Header (10 h1 + 15 h2)/25.
    ups = [update(0, {"head": h1, "counts": np.array([3, 0])}, n=10),
           update(1, {"head": h2, "counts": np.array([1, 0])}, n=30, staleness=3)]
    s = gen_server(server_epochs=1, diversity_weight=0.0)
    constant_generator(s, [1.0, 0.0])
    m = s.aggregate(ups, [], R0)
    assert m["generator_loss"] == pytest.approx(math.log(1 + math.exp(-5 / 7)), abs=1e-6)
    np.testing.assert_allclose(s.make_task(0, R0)["head"]["weight"],
                               (10 * np.eye(2) + 15 * h2["weight"]) / 25, atol=1e-7)


def test_fedgen_empty_aggregation_round_trip_and_determinism():
    rng = np.random.default_rng(0)
    inputs = [[update(i, {"head": head(rng.normal(size=(C, D)), rng.normal(size=C)),
                          "counts": rng.integers(0, 5, size=C)}, n=20) for i in range(3)]
              for _ in range(3)]
    params = {"server_epochs": 3}
    s = FEDGEN.server(server_ctx(params))
    assert not s.make_task(0, R0)["ready"]
    before = s.state_dict()
    s.aggregate([], [], R0)  # nothing: everything kept
    after = s.state_dict()
    np.testing.assert_array_equal(before["rng"], after["rng"])
    for k in before["generator"]:
        np.testing.assert_array_equal(before["generator"][k], after["generator"][k])
    for k in before["head"]:
        np.testing.assert_array_equal(before["head"][k], after["head"][k])
    assert not after["ready"]

    def run(server, rounds, start=0):
        out = []
        for r, ups in enumerate(rounds, start):
            server.aggregate(ups, [], RoundInfo(r, 3))
            t = server.make_task(0, RoundInfo(r + 1, 3))
            out.append((t["generator"]["fc.weight"].copy(), t["head"]["weight"].copy()))
        return out

    state = torch.get_rng_state()
    one = run(FEDGEN.server(server_ctx(params)), inputs)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    s = FEDGEN.server(server_ctx(params))
    run(s, inputs[:1])
    resumed = FEDGEN.server(server_ctx(params))
    resumed.load_state_dict(s.state_dict())
    two = run(resumed, inputs[1:], start=1)
    for (g1, h1), (g2, h2) in zip(one[1:], two):
        np.testing.assert_array_equal(g1, g2)
        np.testing.assert_array_equal(h1, h2)
    assert not np.array_equal(one[0][0], one[2][0])


def test_fedgen_client_loss_by_hand():
    part = digits_parts(4, ways=5)[0]
    s = FEDGEN.server(server_ctx({"server_epochs": 2}))
    cli = FEDGEN.client(client_ctx(0, part, {"gen_weight": 0.5}))
    x, y = part[0][:8], part[1][:8]
    model = cli.ctx.model
    # before any generator was trained the loss is plain cross-entropy
    task = s.make_task(0, R0)
    cli.train(task, LocalRun(cli.ctx, epochs=0, seed=0))
    np.testing.assert_array_equal(model.fc.weight.detach().numpy(), task["head"]["weight"])
    assert not cli._reg
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(model(x), y).item()
    assert cli.batch_loss(x, y).item() == pytest.approx(ce, rel=1e-6)
    # with one: + 0.5 CE(head(G(eps, y')), y'), y' ~ label_dist, eps ~ U, both drawn from
    # the client's generator (replayed here from the same seed)
    s.aggregate([update(1, {"head": header_weights(make_model(1).fc),
                            "counts": np.bincount(part[1].numpy(), minlength=C)})], [], R0)
    task = s.make_task(0, RoundInfo(1, 3))
    cli.train(task, LocalRun(cli.ctx, epochs=0, seed=0))  # loads the header and generator
    gen = Generator(32, C, D, D)
    gen.load_state_dict({k: torch.tensor(v) for k, v in task["generator"].items()})
    gen.eval()
    cli._p = torch.tensor(task["label_dist"])
    cli._rng = torch.Generator().manual_seed(5)
    cli._reg = True
    rng = torch.Generator().manual_seed(5)
    labels = torch.multinomial(cli._p, 8, replacement=True, generator=rng)
    eps = torch.rand(8, 32, generator=rng)
    with torch.no_grad():
        reg = torch.nn.functional.cross_entropy(model.head(gen(labels, eps)), labels).item()
    assert set(labels.tolist()) <= set(np.flatnonzero(task["label_dist"]).tolist())
    assert cli.batch_loss(x, y).item() == pytest.approx(ce + 0.5 * reg, rel=1e-5)
    cli._reg = False


def test_fedgen_client_update_and_partial_work():
    part = digits_parts(4, ways=5)[2]
    s = FEDGEN.server(server_ctx({"server_epochs": 5}))
    cli = FEDGEN.client(client_ctx(2, part, {}))
    for r, kw in enumerate(({"epochs": 2}, {"epochs": 4, "epochs_to_run": 0.25})):
        before = [p.detach().clone() for p in cli.ctx.model.parameters()]
        run = LocalRun(cli.ctx, seed=r, **kw)
        out = cli.train(s.make_task(2, RoundInfo(r, 3)), run)
        check_spec(out, s.update_spec())
        assert any(not torch.equal(a, b) for a, b in zip(before, cli.ctx.model.parameters()))
        np.testing.assert_array_equal(out["counts"], np.bincount(part[1].numpy(), minlength=C))
        np.testing.assert_array_equal(out["head"]["weight"],
                                      cli.ctx.model.fc.weight.detach().numpy())
        m = s.aggregate([update(2, out, len(part[1]), version=r)], [], RoundInfo(r, 3))
        assert m["classes_received"] == 5 and np.isfinite(m["generator_loss"])
    assert run.work.stopped == "partial"
    ev = cli.evaluate(s.make_eval(2, RoundInfo(2, 3)))
    assert ev["acc"] == ev["global_head_acc"] and ev["num_test"] == len(part[3])


def test_fedgen_config_validation():
    from fedbus.node.config import ConfigError, build_config
    cfg = build_config({"algorithm": {"name": "fedgen"}}).algorithm
    assert (cfg["noise_dim"], cfg["generator_lr"], cfg["server_epochs"]) == (32, 0.1, 100)
    for key, bad in (("noise_dim", 0), ("generator_lr", -1.0), ("teacher", "mean"),
                     ("gen_weight", -0.5), ("eval_head", "both")):
        with pytest.raises(ConfigError):
            build_config({"algorithm": {"name": "fedgen", key: bad}})


def test_fedgen_heterogeneous_federation_learns():
    _, clients, hist = simulate("fedgen", {}, rounds=5, epochs=3, hetero=True,
                                metrics=("acc", "local_head_acc"))
    assert clients[0].ctx.model.body[0].out_features != clients[1].ctx.model.body[0].out_features
    assert hist[-1]["acc"] > 0.7 and hist[-1]["acc"] > hist[0]["acc"] + 0.2, hist
    assert hist[-1]["local_head_acc"] > 0.7, hist

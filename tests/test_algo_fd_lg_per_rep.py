"""fd, lg-fedavg, fedper, fedrep: each server step against a hand computation (FD's
per-class vectors with staleness weights, the mean/weighted rules and keep_missing;
FedAvg's rule on the head or the body), FD's distillation loss in its three forms by
hand, the parts each client shares and keeps, FedRep's two phases (the body unchanged
by the head phase, the head unchanged by the body phase, no momentum or weight-decay
leak), real LocalRuns on digits (spec, partial work), empty aggregations, state round
trips, config validation, and short in-process federations (model groups where the
method supports them)."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from algo_support import (TRAIN, BodyHead, check_spec, client_ctx, digits_parts, freeze,
                          iid_digits_parts, make_model, server_ctx, simulate, update)
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import Failure, LocalRun, RoundInfo, Work, model_weights
from fedbus.algorithms.fd import distillation_loss

torch.set_num_threads(1)

NAMES = ["fd", "lg-fedavg", "fedper", "fedrep"]
R0 = RoundInfo(0, 3)


# --- registry and config ----------------------------------------------------------------------

def test_registry_flags_and_param_validation():
    from fedbus.node.config import ConfigError, build_config

    for name in NAMES:
        assert get_algorithm(name).name == name
    assert not get_algorithm("fd").server.needs_same_model
    lg = get_algorithm("lg-fedavg").server
    assert not lg.needs_same_model and lg.needs_same_head
    assert get_algorithm("fedper").server.needs_same_model
    assert get_algorithm("fedrep").server.needs_same_model
    fd = build_config({"algorithm": {"name": "fd"}}).algorithm
    assert (fd["gamma"], fd["distill_loss"], fd["collect"], fd["aggregate"],
            fd["keep_missing"]) == (1.0, "paper", "during", "mean", True)
    assert build_config({"algorithm": {"name": "fedrep"}}).algorithm["head_epochs"] == 10
    bad = [("fd", "gamma", -1.0), ("fd", "distill_loss", "mse"), ("fd", "collect", "never"),
           ("fd", "aggregate", "median"), ("lg-fedavg", "partial", "skip"),
           ("fedper", "partial", "skip"), ("fedrep", "head_epochs", -1),
           ("lg-fedavg", "gamma", 1.0)]
    for name, key, value in bad:
        with pytest.raises(ConfigError):
            build_config({"algorithm": {"name": name, key: value}})


# --- FD: the server ------------------------------------------------------------------------------

def fd_server(**params):
    return get_algorithm("fd").server(server_ctx(params, num_classes=3))


A_LOGITS = np.array([[1, 0, 0], [0, 2, 0], [0, 0, 0]], np.float32)  # class 2 absent
B_LOGITS = np.array([[3, 0, 0], [0, 0, 0], [0, 0, 4]], np.float32)  # class 1 absent


def fd_updates():
    a = update(0, {"logits": A_LOGITS, "counts": np.array([2, 1, 0], np.int64)}, n=3)
    b = update(1, {"logits": B_LOGITS, "counts": np.array([1, 0, 5], np.int64)}, n=6,
               staleness=3)  # weight 1 / sqrt(4) = 0.5
    return a, b


def test_fd_server_mean_by_hand():
    s = fd_server()
    assert s.update_spec() == {"logits": ("float32", (3, 3)), "counts": ("int64", (3,))}
    task = s.make_task(0, R0)
    assert not task["has"].any() and not task["logits"].any()
    m = s.aggregate(list(fd_updates()), [Failure(2, "late")], R0)
    # class 0: (1 * 1 + 0.5 * 3) / 1.5 = 5/3; class 1: client a alone; class 2: b alone
    np.testing.assert_allclose(s.logits, [[5 / 3, 0, 0], [0, 2, 0], [0, 0, 4]], atol=1e-6)
    assert s.has.tolist() == [True, True, True] and s.logits.dtype == np.float32
    assert m["updates"] == 2 and m["failures"] == 1 and m["mean_staleness"] == 1.5
    assert m["classes_received"] == 3 and m["global_classes"] == 3


def test_fd_server_count_weighted_by_hand():
    s = fd_server(aggregate="weighted")
    s.aggregate(list(fd_updates()), [], R0)
    # class 0: weights 1 * 2 and 0.5 * 1: (2 * 1 + 0.5 * 3) / 2.5 = 1.4
    np.testing.assert_allclose(s.logits, [[1.4, 0, 0], [0, 2, 0], [0, 0, 4]], atol=1e-6)


def test_fd_server_keep_missing():
    a, b = fd_updates()
    a2 = update(0, {"logits": 2 * A_LOGITS, "counts": np.array([2, 1, 0], np.int64)}, n=3)
    for keep in (True, False):
        s = fd_server(keep_missing=keep)
        s.aggregate([a, b], [], R0)
        m = s.aggregate([a2], [], RoundInfo(1, 3))  # class 2 not received this time
        np.testing.assert_allclose(s.logits[:2], [[2, 0, 0], [0, 4, 0]], atol=1e-6)
        assert m["classes_received"] == 2
        if keep:
            np.testing.assert_allclose(s.logits[2], [0, 0, 4])
            assert s.has.tolist() == [True, True, True] and m["global_classes"] == 3
        else:
            np.testing.assert_allclose(s.logits[2], [0, 0, 0])
            assert s.has.tolist() == [True, True, False] and m["global_classes"] == 2


def test_fd_empty_aggregation_and_state_roundtrip():
    s = fd_server()
    s.aggregate(list(fd_updates()), [], R0)
    before = s.state_dict()
    m = s.aggregate([], [Failure(0, "dead")], RoundInfo(1, 3))
    assert m["updates"] == 0 and m["failures"] == 1
    np.testing.assert_array_equal(s.logits, before["logits"])
    np.testing.assert_array_equal(s.has, before["has"])
    fresh = fd_server()
    fresh.load_state_dict(freeze(s.state_dict()))
    np.testing.assert_array_equal(fresh.logits, s.logits)
    np.testing.assert_array_equal(fresh.has, s.has)
    assert fresh.logits.flags.writeable
    assert fresh.make_task(0, R0)["has"].tolist() == [True, True, True]


# --- FD: the distillation loss -------------------------------------------------------------------

def test_fd_distillation_loss_by_hand():
    z = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    y = torch.tensor([0, 1])
    has = torch.tensor([True, False, True])
    ln2, ln3 = math.log(2), math.log(3)
    # "paper": row 0 targets g_0 = [0.5, 0.25, 0.25] (a mean softmax vector);
    # log_softmax([0, 0, 0]) = -ln 3 each, so psi_0 = ln 3 * (0.5 + 0.25 + 0.25) = ln 3;
    # row 1's class has no global vector: 0. The mean over B = 2: ln 3 / 2.
    g = torch.tensor([[0.5, 0.25, 0.25], [9.0, 9.0, 9.0], [0.0, 0.0, 1.0]])
    assert distillation_loss(z, y, g, has, "paper").item() == pytest.approx(ln3 / 2)
    # "softmax": g holds raw logits; softmax([ln 2, 0, 0]) = [2/4, 1/4, 1/4] -> ln 3 / 2 again
    g_raw = torch.tensor([[ln2, 0.0, 0.0], [9.0, 9.0, 9.0], [0.0, 0.0, 0.0]])
    assert distillation_loss(z, y, g_raw, has, "softmax").item() == pytest.approx(ln3 / 2)
    # "raw": row 0's target is [ln 2, 0, 0] itself: -(ln 2 * -ln 3) = ln 2 ln 3; row 1 targets
    # its own detached logits [1, 0, 0]: -(1 * log_softmax(z_1)_0) = ln(e + 2) - 1.
    want = (ln2 * ln3 + math.log(math.e + 2) - 1) / 2
    assert distillation_loss(z, y, g_raw, has, "raw").item() == pytest.approx(want)


def test_fd_raw_form_is_htfllib_cross_entropy_and_softmax_form_has_pfllib_gradient():
    gen = torch.Generator().manual_seed(0)
    z0 = torch.randn(6, 4, generator=gen)
    y = torch.tensor([0, 1, 2, 3, 1, 2])
    g = torch.randn(4, 4, generator=gen)
    has = torch.tensor([True, False, True, True])
    logit_new = z0.clone()  # clientfd.py: deepcopy(output.detach()), rows of known classes
    for i, c in enumerate(y.tolist()):
        if has[c]:
            logit_new[i] = g[c]
    z = z0.clone().requires_grad_(True)
    ours = distillation_loss(z, y, g, has, "raw")
    ref = nn.CrossEntropyLoss()(z0, logit_new)  # HtFLlib HEAD
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    # PFLlib: CE(output, logit_new.softmax(1)) over all rows: the same gradient as ours
    z_ref = z0.clone().requires_grad_(True)
    nn.CrossEntropyLoss()(z_ref, logit_new.softmax(dim=1)).backward()
    z = z0.clone().requires_grad_(True)
    distillation_loss(z, y, g, has, "softmax").backward()
    torch.testing.assert_close(z.grad, z_ref.grad, atol=1e-6, rtol=1e-5)


def test_fd_client_loss_is_ce_plus_gamma_psi():
    part = iid_digits_parts(4)[0]
    h = get_algorithm("fd").client(client_ctx(0, part, {"gamma": 2.5}))
    x, y = part[0][:16], part[1][:16]
    g = torch.softmax(torch.randn(10, 10, generator=torch.Generator().manual_seed(1)), 1)
    has = torch.arange(10) % 2 == 0
    h._global, h._has, h._distill = g, has, True
    with torch.no_grad():
        z = h.ctx.model(x)
        # the paper form by hand: -sum_j g[y_b, j] log softmax(z_b)_j over rows with even y_b
        rows = -(g[y] * torch.log_softmax(z, 1)).sum(1) * has[y].float()
        want = nn.functional.cross_entropy(z, y) + 2.5 * rows.sum() / len(y)
        assert h.batch_loss(x, y).item() == pytest.approx(want.item(), rel=1e-6)
    h._distill = False
    with torch.no_grad():
        assert h.batch_loss(x, y).item() == pytest.approx(
            nn.functional.cross_entropy(h.ctx.model(x), y).item(), rel=1e-6)


# --- FD: the client ------------------------------------------------------------------------------

def fixed_client(name, part, params, **train):
    """A client whose optimiser is built from TRAIN with `train` overrides (lr 0: the
    model does not move)."""
    ctx = client_ctx(0, part, params)
    ctx.train = {**TRAIN, **train}
    return get_algorithm(name).client(ctx)


@pytest.mark.parametrize("form", ["paper", "raw"])
def test_fd_during_upload_is_the_mean_of_training_outputs(form):
    part = digits_parts(4, ways=5)[0]
    h = fixed_client("fd", part, {"distill_loss": form}, lr=0.0)
    server = get_algorithm("fd").server(server_ctx({"distill_loss": form}))
    payload = h.train(freeze(server.make_task(0, R0)), LocalRun(h.ctx, epochs=2, seed=0))
    check_spec(payload, server.update_spec())
    x, y = part[0], part[1]
    with torch.no_grad():
        out = h.ctx.model(x)
    out = torch.softmax(out, 1) if form == "paper" else out
    n = torch.bincount(y, minlength=10)
    np.testing.assert_array_equal(payload["counts"], 2 * n.numpy())  # two epochs, lr 0
    for c in range(10):
        if n[c]:
            np.testing.assert_allclose(payload["logits"][c], out[y == c].mean(0).numpy(),
                                       atol=1e-5)
        else:
            assert not payload["logits"][c].any()


def test_fd_after_upload_uses_the_trained_model():
    part = digits_parts(4, ways=5)[1]
    h = get_algorithm("fd").client(client_ctx(1, part, {"collect": "after"}))
    server = get_algorithm("fd").server(server_ctx({"collect": "after"}))
    payload = h.train(freeze(server.make_task(1, R0)), LocalRun(h.ctx, epochs=1, seed=0))
    x, y = part[0], part[1]
    with torch.no_grad():
        p = torch.softmax(h.ctx.model(x), 1)
    np.testing.assert_array_equal(payload["counts"], torch.bincount(y, minlength=10).numpy())
    for c in torch.unique(y).tolist():
        np.testing.assert_allclose(payload["logits"][c], p[y == c].mean(0).numpy(), atol=1e-5)


def test_fd_distillation_changes_the_local_update():
    part = iid_digits_parts(4)[0]
    g = np.full((10, 10), 0.01, np.float32) + np.eye(10, dtype=np.float32) * 0.9
    task = freeze({"logits": g, "has": np.ones(10, bool)})
    weights = []
    for gamma in (0.0, 1.0):
        h = get_algorithm("fd").client(client_ctx(0, part, {"gamma": gamma}))
        h.train(task, LocalRun(h.ctx, epochs=1, seed=0))
        weights.append(model_weights(h.ctx.model))
    assert any(not np.allclose(weights[0][k], weights[1][k]) for k in weights[0])


# --- the shared-part methods: servers by hand ---------------------------------------------------

class Tiny(BodyHead):
    def __init__(self, head_module="fc"):
        super().__init__()
        self.head_module = head_module
        self.body = nn.Linear(2, 2)
        setattr(self, head_module, nn.Linear(2, 1))
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.body.bias.zero_()
            getattr(self, head_module).weight.copy_(torch.tensor([[1.0, 2.0]]))
            getattr(self, head_module).bias.copy_(torch.tensor([0.5]))

    def head(self, h):
        return getattr(self, self.head_module)(h)


def tiny(i):
    return Tiny()


def test_lg_fedavg_server_averages_the_head_by_hand():
    s = get_algorithm("lg-fedavg").server(server_ctx({}, make=tiny, homogeneous=False))
    # the head only, named relative to the head module
    assert s.update_spec() == {"delta": {"weight": ("float32", (1, 2)), "bias": ("float32", (1,))}}
    assert s.global_weights() is None
    a = update(0, {"delta": {"weight": np.array([[1.0, 0.0]], np.float32),
                             "bias": np.array([1.0], np.float32)}}, n=1)
    b = update(1, {"delta": {"weight": np.array([[0.0, 4.0]], np.float32),
                             "bias": np.array([-1.0], np.float32)}}, n=3, staleness=3)
    m = s.aggregate([a, b], [], R0)
    # coefficients 1 * 1 and 0.5 * 3 = 1.5: step = ([1, 0] + 1.5 [0, 4]) / 2.5 = [0.4, 2.4];
    # bias step = (1 - 1.5) / 2.5 = -0.2
    np.testing.assert_allclose(s.weights["weight"], [[1.4, 4.4]], atol=1e-6)
    np.testing.assert_allclose(s.weights["bias"], [0.3], atol=1e-6)
    assert m["updates"] == 2
    task = s.make_task(0, R0)
    assert set(task["weights"]) == {"weight", "bias"}


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_fedper_fedrep_server_average_the_body_by_hand(name):
    s = get_algorithm(name).server(server_ctx({}, make=tiny))
    assert s.update_spec() == {"delta": {"body.weight": ("float32", (2, 2)),
                                         "body.bias": ("float32", (2,))}}
    a = update(0, {"delta": {"body.weight": np.array([[2, 0], [0, 0]], np.float32),
                             "body.bias": np.array([1, 0], np.float32)}}, n=2)
    b = update(1, {"delta": {"body.weight": np.array([[0, 0], [0, 2]], np.float32),
                             "body.bias": np.array([0, 3], np.float32)}}, n=2, staleness=3)
    s.aggregate([a, b], [], R0)
    # coefficients 2 and 0.5 * 2 = 1: I + (2 [[2,0],[0,0]] + [[0,0],[0,2]]) / 3
    np.testing.assert_allclose(s.weights["body.weight"], [[1 + 4 / 3, 0], [0, 1 + 2 / 3]],
                               atol=1e-6)
    np.testing.assert_allclose(s.weights["body.bias"], [2 / 3, 1.0], atol=1e-6)
    g = s.global_weights()  # the global body with the initial head
    np.testing.assert_allclose(g["body.weight"], s.weights["body.weight"])
    np.testing.assert_allclose(g["fc.weight"], [[1.0, 2.0]])


@pytest.mark.parametrize("name", ["lg-fedavg", "fedper", "fedrep"])
def test_part_servers_partial_drop(name):
    s = get_algorithm(name).server(server_ctx({"partial": "drop"}, make=tiny))
    key = "weight" if name == "lg-fedavg" else "body.bias"
    shape = s.weights[key].shape
    done = update(0, {"delta": {k: np.ones_like(v) for k, v in s.weights.items()}}, n=1,
                  work=Work(2, 2.0, 2, 1))
    part = update(1, {"delta": {k: 5 * np.ones_like(v) for k, v in s.weights.items()}}, n=1,
                  work=Work(2, 0.5, 1, 1))
    before = s.weights[key].copy()
    m = s.aggregate([done, part], [], R0)
    assert m["updates"] == 1 and m["failures"] == 1
    np.testing.assert_allclose(s.weights[key], before + np.ones(shape))


@pytest.mark.parametrize("name", NAMES)
def test_empty_aggregation_keeps_state(name):
    s = get_algorithm(name).server(server_ctx({}))
    before = s.state_dict()
    m = s.aggregate([], [Failure(0, "dead"), Failure(1, "late")], R0)
    assert m["updates"] == 0 and m["failures"] == 2
    after = s.state_dict()
    for key, value in before.items():
        if isinstance(value, dict):
            for k in value:
                np.testing.assert_array_equal(value[k], after[key][k])
        else:
            np.testing.assert_array_equal(value, after[key])


@pytest.mark.parametrize("name", ["lg-fedavg", "fedper", "fedrep"])
def test_part_server_state_roundtrip(name):
    algo = get_algorithm(name)
    s = algo.server(server_ctx({}, make=tiny))
    s.aggregate([update(0, {"delta": {k: np.ones_like(v) for k, v in s.weights.items()}},
                        n=2)], [], R0)
    fresh = algo.server(server_ctx({}, make=tiny))
    fresh.load_state_dict(freeze(s.state_dict()))
    assert set(fresh.weights) == set(s.weights)
    for k in s.weights:
        np.testing.assert_array_equal(fresh.weights[k], s.weights[k])
        assert fresh.weights[k].flags.writeable


# --- the shared-part methods: clients ------------------------------------------------------------

def split(weights):
    head = {k: v for k, v in weights.items() if k.startswith("fc.")}
    body = {k: v for k, v in weights.items() if not k.startswith("fc.")}
    return body, head


@pytest.mark.parametrize("name", NAMES)
def test_client_trains_through_localrun_with_spec(name):
    algo = get_algorithm(name)
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    before = model_weights(h.ctx.model)
    run = LocalRun(h.ctx, epochs=1, seed=3)
    payload = h.train(freeze(server.make_task(0, R0)), run)
    check_spec(payload, server.update_spec())
    assert run.work.steps == run.steps_per_epoch() and run.work.stopped == "done"
    after = model_weights(h.ctx.model)
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    if "delta" in payload:
        assert any(np.abs(v).sum() > 0 for v in payload["delta"].values())
    metrics = h.evaluate(freeze(server.make_eval(0, R0)))
    assert {"acc", "loss", "num_test"} <= set(metrics) and metrics["num_test"] == len(part[3])


@pytest.mark.parametrize("name", NAMES)
def test_partial_work_still_updates(name):
    algo = get_algorithm(name)
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    run = LocalRun(h.ctx, epochs=2, seed=0, epochs_to_run=0.25)
    payload = h.train(freeze(server.make_task(0, R0)), run)
    assert run.work.stopped == "partial" and 1 <= run.work.steps < run.steps_per_epoch()
    if name == "fd":
        assert 0 < payload["counts"].sum() < len(part[1])
    else:
        assert any(np.abs(v).sum() > 0 for v in payload["delta"].values())


def test_lg_fedavg_client_shares_the_head_and_keeps_its_extractor():
    algo = get_algorithm("lg-fedavg")
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({}, homogeneous=False))
    h = algo.client(client_ctx(0, part, {}, model=make_model(0, deep=True)))
    h.train(freeze(server.make_task(0, R0)), LocalRun(h.ctx, epochs=1, seed=0))
    # a global head that differs from anything the client has: it is loaded, the body is not
    g = {k: v + 0.1 for k, v in server.weights.items()}
    task = freeze({"weights": g})
    local_head = {k: v.detach().clone() for k, v in h.ctx.model.fc.state_dict().items()}
    payload = h.train(task, LocalRun(h.ctx, epochs=1, seed=1))
    for k in ("weight", "bias"):
        np.testing.assert_allclose(g[k] + payload["delta"][k],
                                   h.ctx.model.fc.state_dict()[k].numpy(), atol=1e-6)
    # evaluation: the client's own extractor with the global head; its own head put back
    trained = model_weights(h.ctx.model)
    got = h.evaluate(task)
    with torch.no_grad():
        logits = h.ctx.model.features(part[2]) @ torch.tensor(g["weight"]).T + \
            torch.tensor(g["bias"])
    assert got["acc"] == pytest.approx((logits.argmax(1) == part[3]).float().mean().item())
    after = model_weights(h.ctx.model)
    assert all(np.array_equal(trained[k], after[k]) for k in trained)
    assert not torch.equal(local_head["weight"], h.ctx.model.fc.weight.detach())


def test_lg_fedavg_heads_named_differently_share_one_head():
    """A model group's networks may call their head fc or fc2 (FedProto's CNN): the
    head travels under names relative to the head module."""
    algo = get_algorithm("lg-fedavg")
    s = algo.server(server_ctx({}, make=tiny, homogeneous=False))
    other = Tiny("fc2")
    with torch.no_grad():
        other.fc2.weight.fill_(-3.0)
    x = torch.tensor([[1.0, 1.0]] * 8)
    y = torch.zeros(8, dtype=torch.int64)
    from fedbus.algorithms.core.handlers import ClientContext
    ctx = ClientContext(client=1, model=other, device=torch.device("cpu"), train_x=x,
                        train_y=y, test_x=x, test_y=y, num_classes=1, feature_dim=2,
                        params={}, train=TRAIN, seed=0)
    h = algo.client(ctx)
    payload = h.train(freeze(s.make_task(1, R0)), LocalRun(ctx, epochs=1, seed=0))
    check_spec(payload, s.update_spec())
    # training started from the global head [1, 2], not the client's own [-3, -3]
    np.testing.assert_allclose(other.fc2.weight.detach().numpy(),
                               s.weights["weight"] + payload["delta"]["weight"], atol=1e-6)
    # CE over one class has zero gradient, so nothing moved: the delta is exactly 0
    np.testing.assert_allclose(payload["delta"]["weight"], 0.0, atol=1e-7)
    np.testing.assert_allclose(other.fc2.weight.detach().numpy(), [[1.0, 2.0]])


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_fedper_fedrep_client_shares_the_body_and_keeps_its_head(name):
    algo = get_algorithm(name)
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({}))
    h = algo.client(client_ctx(0, part, {}))
    h.train(freeze(server.make_task(0, R0)), LocalRun(h.ctx, epochs=1, seed=0))
    _, head1 = split(model_weights(h.ctx.model))
    g = {k: v + 0.05 for k, v in server.weights.items()}  # a body the client never had
    task = freeze({"weights": g})
    payload = h.train(task, LocalRun(h.ctx, epochs=1, seed=1))
    assert set(payload["delta"]) == set(g) and not any(k.startswith("fc.") for k in g)
    body, head = split(model_weights(h.ctx.model))
    for k, gk in g.items():  # the update is the body's change from the global body sent
        np.testing.assert_allclose(gk + payload["delta"][k], body[k], atol=1e-6)
    # the head went on from the client's own head (FedRep: trained in the head phase)
    assert any(not np.array_equal(head1[k], head[k]) for k in head)
    # evaluation: the global body with the client's own head; its own body put back
    got = h.evaluate(task)
    ref = make_model(0)
    ref.load_state_dict({**{k: torch.tensor(v) for k, v in g.items()},
                         **{k: torch.tensor(v) for k, v in head.items()}})
    with torch.no_grad():
        logits = ref(part[2])
    assert got["acc"] == pytest.approx((logits.argmax(1) == part[3]).float().mean().item())
    assert got["loss"] == pytest.approx(
        nn.functional.cross_entropy(logits, part[3]).item(), rel=1e-5)
    after = model_weights(h.ctx.model)
    assert all(np.array_equal(after[k], body[k]) for k in body)


# --- FedRep's phases ----------------------------------------------------------------------------

def test_fedrep_head_phase_leaves_the_body_and_body_phase_leaves_the_head():
    algo = get_algorithm("fedrep")
    part = iid_digits_parts(4)[0]
    server = algo.server(server_ctx({"head_epochs": 2}))
    # momentum and weight decay would move a frozen part under one shared optimiser
    h = fixed_client("fedrep", part, {"head_epochs": 2}, momentum=0.9, weight_decay=0.01)
    run = LocalRun(h.ctx, epochs=1, seed=5)
    head_run = h.head_run(run)
    assert head_run.epochs == 2 and head_run.epochs_to_run == 2.0
    body0, head0 = split(model_weights(h.ctx.model))
    h.head_phase(head_run)
    body1, head1 = split(model_weights(h.ctx.model))
    assert head_run.work.steps == 2 * head_run.steps_per_epoch()
    assert all(np.array_equal(body0[k], body1[k]) for k in body0)
    assert all(not np.array_equal(head0[k], head1[k]) for k in head0)
    h.body_phase(run)
    body2, head2 = split(model_weights(h.ctx.model))
    assert run.work.steps == run.steps_per_epoch()
    assert all(np.array_equal(head1[k], head2[k]) for k in head1)
    assert all(not np.array_equal(body1[k], body2[k]) for k in body1)
    # a second head phase: the body optimiser's momentum does not leak into the body
    h.head_phase(h.head_run(LocalRun(h.ctx, epochs=1, seed=6)))
    body3, _ = split(model_weights(h.ctx.model))
    assert all(np.array_equal(body2[k], body3[k]) for k in body2)
    assert all(p.requires_grad for p in h.ctx.model.parameters())  # flags restored
    # train() is the two phases in that order, from the task's body
    twin = fixed_client("fedrep", part, {"head_epochs": 2}, momentum=0.9, weight_decay=0.01)
    ref = fixed_client("fedrep", part, {"head_epochs": 2}, momentum=0.9, weight_decay=0.01)
    task = freeze(server.make_task(0, R0))
    twin.train(task, LocalRun(twin.ctx, epochs=1, seed=7))
    run = LocalRun(ref.ctx, epochs=1, seed=7)
    ref.head_phase(ref.head_run(run))
    ref.body_phase(run)
    a, b = model_weights(twin.ctx.model), model_weights(ref.ctx.model)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_fedrep_head_phase_scales_with_partial_work_and_skips_without_epochs():
    part = iid_digits_parts(4)[0]
    h = get_algorithm("fedrep").client(client_ctx(0, part, {}))
    run = LocalRun(h.ctx, epochs=2, seed=0, epochs_to_run=0.5, budget_s=7.0, slow_factor=3.0)
    hr = h.head_run(run)
    # 10 head epochs x (0.5 of 2 epochs asked) = 2.5 epochs, the same budget and slowness
    assert (hr.epochs, hr.epochs_to_run, hr.budget_s, hr.slow_factor) == (10, 2.5, 7.0, 3.0)
    assert hr.seed != run.seed
    h.head_phase(hr)
    assert hr.work.steps == round(2.5 * hr.steps_per_epoch()) and hr.work.stopped == "partial"
    server = get_algorithm("fedrep").server(server_ctx({}))
    before = model_weights(h.ctx.model)
    payload = h.train(freeze(server.make_task(0, R0)), LocalRun(h.ctx, epochs=0, seed=0))
    after = model_weights(h.ctx.model)
    g = server.weights
    # no epochs asked: neither phase runs; the model is the global body with its own head
    assert all(not np.abs(v).any() for v in payload["delta"].values())
    assert all(np.array_equal(after[k], before[k]) for k in before if k.startswith("fc."))
    assert all(np.array_equal(after[k], g[k]) for k in g)


def test_fedrep_client_state_roundtrip_keeps_both_optimisers():
    part = iid_digits_parts(4)[0]
    algo = get_algorithm("fedrep")
    server = algo.server(server_ctx({"head_epochs": 1}))
    h = algo.client(client_ctx(0, part, {"head_epochs": 1}))
    h.train(freeze(server.make_task(0, R0)), LocalRun(h.ctx, epochs=1, seed=0))
    state = copy.deepcopy(h.state_dict())  # as an evicted client's state is kept: a copy
    fresh = algo.client(client_ctx(0, part, {"head_epochs": 1}))
    fresh.load_state_dict(state)
    task = freeze(server.make_task(0, RoundInfo(1, 3)))
    h.train(task, LocalRun(h.ctx, epochs=1, seed=1))
    fresh.train(task, LocalRun(fresh.ctx, epochs=1, seed=1))
    a, b = model_weights(h.ctx.model), model_weights(fresh.ctx.model)
    assert all(np.array_equal(a[k], b[k]) for k in a)


# --- short federations learn ---------------------------------------------------------------------

@pytest.mark.parametrize("name,hetero", [("fd", True), ("lg-fedavg", True), ("fedper", False),
                                         ("fedrep", False)])
def test_short_federation_learns(name, hetero):
    params = {"head_epochs": 3} if name == "fedrep" else {}
    server, _, history = simulate(name, params, rounds=3, clients=4, epochs=2, ways=5,
                                  hetero=hetero, metrics="acc")
    assert history[-1] > 0.6, history  # chance is 0.1 (0.2 on a client's own 5 classes)
    if name == "fd":  # 4 clients of 5 classes each hold classes 0-7 between them
        assert server.has.tolist() == [True] * 8 + [False] * 2

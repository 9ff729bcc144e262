"""fml and fedkd: the auxiliary model's choice ("smallest" on a hand group and on the
registry) and its identical seeded build on server and client; FML's two losses and
FedKD's adaptive distillation losses by hand on a 2-sample batch (with the detached
targets); FedKD's SVD compression by hand (a 3x2 matrix of singular values 3 and 1),
its energy schedule and the server's reconstruction + staleness-weighted aggregation on
tiny inputs; FML's server average by hand; real local training through LocalRun,
partial work, empty aggregations, checkpoints, config validation, and a short
heterogeneous in-process federation on scikit-learn's digits."""
from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from algo_support import (
    BodyHead,
    check_spec,
    client_ctx,
    digits_parts,
    freeze,
    make_model,
    server_ctx,
    update,
)
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import Failure, LocalRun, RoundInfo, Work, model_weights
from fedbus.algorithms.fedkd import (
    energy_rank,
    energy_threshold,
    expand_weights,
    fedkd_losses,
    svd_compress,
    svd_reconstruct,
)
from fedbus.algorithms.fml import choose_arch, count_trainable
from fedbus.algorithms.fml import fml_losses

torch.set_num_threads(1)

NAMES = ("fml", "fedkd")


# --- contexts with an auxiliary-model builder ---------------------------------------------------

def build(arch: str) -> nn.Module:
    """The test federation's 'registry': net = 64 -> 32 -> 10 (2410 parameters), deep =
    64 -> 48 -> 32 -> 10 (5018), same = net again; each seeded (identical every call)."""
    return {"net": lambda: make_model(0), "same": lambda: make_model(0),
            "deep": lambda: make_model(0, deep=True)}[arch]()


ARCHS = ("deep", "net")  # client 0 runs deep, client 1 net: the smallest is net


def sctx(params, archs=ARCHS, builder=build, **kw):
    return dataclasses.replace(server_ctx(params, **kw), archs=archs, build_arch=builder)


def cctx(i, part, params, model=None, archs=ARCHS, builder=build):
    return dataclasses.replace(client_ctx(i, part, params, model=model), archs=archs,
                               build_arch=builder)


@pytest.fixture(scope="module")
def parts():
    return digits_parts(4, ways=5)


# --- registry and config ------------------------------------------------------------------------

def test_registry_and_param_validation():
    from fedbus.node.config import ConfigError, build_config

    for name in NAMES:
        algo = get_algorithm(name)
        assert algo.name == name and not algo.server.needs_same_model
    fml = build_config({"algorithm": {"name": "fml"}}).algorithm
    assert (fml["alpha"], fml["beta"], fml["shared_arch"], fml["kl"]) == \
        (0.5, 0.5, "smallest", "batchmean")
    kd = build_config({"algorithm": {"name": "fedkd"}}).algorithm
    assert (kd["t_start"], kd["t_end"], kd["compress"], kd["mentee_lr"]) == \
        (0.95, 0.98, True, 0.0)
    for name, key, bad in [("fml", "alpha", 1.5), ("fml", "beta", -0.1), ("fml", "kl", "sum"),
                           ("fml", "shared_arch", 5), ("fml", "clip_grad", -1.0),
                           ("fedkd", "t_start", 1.2), ("fedkd", "t_end", -0.5),
                           ("fedkd", "mentee_lr", -0.1), ("fedkd", "compress", "yes"),
                           ("fedkd", "lam", 1.0)]:
        with pytest.raises(ConfigError):
            build_config({"algorithm": {"name": name, key: bad}})


@pytest.mark.parametrize("name", NAMES)
def test_bad_shared_arch_and_missing_builder_are_clear_errors(name, parts):
    algo = get_algorithm(name)
    with pytest.raises(ValueError, match="shared_arch"):
        algo.server(sctx({"shared_arch": "no-such-net"}))
    with pytest.raises(ValueError, match="build_arch"):
        algo.server(server_ctx({}))
    with pytest.raises(ValueError, match="build_arch"):
        algo.client(client_ctx(0, parts[0], {}))


# --- the auxiliary model ---------------------------------------------------------------------------

def test_smallest_arch_of_a_group_ties_to_the_first():
    assert count_trainable(build, "net") == 64 * 32 + 32 + 32 * 10 + 10 == 2410
    assert count_trainable(build, "deep") == 64 * 48 + 48 + 48 * 32 + 32 + 32 * 10 + 10 == 5018
    assert choose_arch("smallest", ("deep", "net"), build) == "net"
    assert choose_arch("smallest", ("net", "deep"), build) == "net"
    assert choose_arch("smallest", ("deep", "same", "net"), build) == "same"  # tie: first
    assert choose_arch("smallest", ("deep",), build) == "deep"
    with pytest.raises(ValueError):
        choose_arch("smallest", (), build)
    assert choose_arch("cnn4", ("deep", "net"), build) == "cnn4"  # a named registry arch


def registry_builder(in_shape=(1, 8, 8), classes=10, feature_dim=32, seed=3):
    from fedbus.models.registry import build_model

    return lambda arch: build_model(arch, in_shape=in_shape, num_classes=classes,
                                    feature_dim=feature_dim, seed=seed)


def test_smallest_on_the_registry_counts_like_a_real_build():
    from fedbus.models.registry import count_params

    builder = registry_builder()
    group = ("resnet8", "cnn4", "cnn", "mlp")
    counts = {a: count_params(builder(a)) for a in group}
    for a in group:  # the meta-device count equals a real build's
        assert count_trainable(builder, a) == counts[a]
    assert choose_arch("smallest", group, builder) == min(group, key=lambda a: counts[a])


@pytest.mark.parametrize("name", NAMES)
def test_server_and_clients_build_identical_initial_auxiliary_weights(name, parts):
    builder = registry_builder()
    archs = ("cnn", "mlp")
    algo = get_algorithm(name)
    server = algo.server(dataclasses.replace(server_ctx({}), archs=archs, build_arch=builder))
    small = choose_arch("smallest", archs, builder)
    assert server.arch == small
    x = [p[0].reshape(-1, 1, 8, 8) for p in parts]
    for i in range(2):
        from fedbus.models.registry import build_model
        own = build_model(archs[i], in_shape=(1, 8, 8), num_classes=10, feature_dim=32, seed=i)
        ctx = dataclasses.replace(client_ctx(i, (x[i], parts[i][1], x[i], parts[i][1]), {},
                                             model=own), archs=archs, build_arch=builder)
        client = algo.client(ctx)
        assert client.arch == small
        mine = model_weights(client.aux)
        assert mine.keys() == server.weights.keys()
        for k in mine:
            np.testing.assert_array_equal(mine[k], server.weights[k])
    # another seed draws other weights: the equality above is the seed's doing
    other = model_weights(registry_builder(seed=4)(small))
    assert any(not np.array_equal(other[k], server.weights[k]) for k in other)


# --- FML's losses by hand -------------------------------------------------------------------------

def two_sample_logits():
    # local: equal logits -> p_local = (1/2, 1/2) for both samples
    # meme:  (ln 3, 0) and (0, ln 3) -> p_meme = (3/4, 1/4) and (1/4, 3/4); labels (0, 0)
    local = torch.zeros(2, 2, requires_grad=True)
    meme = torch.tensor([[math.log(3), 0.0], [0.0, math.log(3)]], requires_grad=True)
    return local, meme, torch.tensor([0, 0])


def test_fml_losses_by_hand():
    local, meme, y = two_sample_logits()
    alpha, beta = 0.3, 0.6
    loss_l, loss_m = fml_losses(local, meme, y, alpha, beta)
    ce_l = math.log(2)
    ce_m = (-math.log(0.75) - math.log(0.25)) / 2
    # KL(p_meme || p_local), per sample (both the same by symmetry):
    kl_ml = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    # KL(p_local || p_meme):
    kl_lm = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert loss_l.item() == pytest.approx(alpha * ce_l + (1 - alpha) * kl_ml, rel=1e-6)
    assert loss_m.item() == pytest.approx(beta * ce_m + (1 - beta) * kl_lm, rel=1e-6)
    # the reference code's nn.KLDivLoss() averages over batch x classes: KL / C
    loss_l2, loss_m2 = fml_losses(local, meme, y, alpha, beta, kl="mean")
    assert loss_l2.item() == pytest.approx(alpha * ce_l + (1 - alpha) * kl_ml / 2, rel=1e-6)
    assert loss_m2.item() == pytest.approx(beta * ce_m + (1 - beta) * kl_lm / 2, rel=1e-6)
    # the other model is a fixed target: L_local trains only the local model
    loss_l.backward()
    assert meme.grad is None and local.grad is not None
    loss_m.backward()
    assert meme.grad is not None


def test_fedkd_losses_by_hand():
    t, s, y = two_sample_logits()  # teacher = the uniform model, student = the (3:1) one
    h_t = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    h_s = torch.tensor([[0.0, 2.0], [1.0, 1.0]], requires_grad=True)  # = W_h H_s
    loss_t, loss_s, parts = fedkd_losses(t, s, h_t, h_s, y)
    ce_t = math.log(2)
    ce_s = (-math.log(0.75) - math.log(0.25)) / 2
    den = ce_t + ce_s
    kl_st = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL(y_s || y_t)
    kl_ts = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(y_t || y_s)
    mse = (1 + 0 + 1 + 1) / 4  # squared differences (1, 0, 1, 1) over batch x dim
    assert loss_t.item() == pytest.approx(ce_t + kl_st / den + mse / den, rel=1e-6)
    assert loss_s.item() == pytest.approx(ce_s + kl_ts / den + mse / den, rel=1e-6)
    assert parts["h"] == pytest.approx(mse / den, rel=1e-6)
    loss_t.backward()
    assert s.grad is None and h_s.grad is None and t.grad is not None and h_t.grad is not None
    loss_s.backward()
    assert s.grad is not None and h_s.grad is not None


# --- FedKD's compression by hand -------------------------------------------------------------------

A = np.array([[2.0, 1.0], [1.0, 2.0], [0.0, 0.0]], np.float32)
# A = 3 u1 v1^T + 1 u2 v2^T, u1 = (1, 1, 0)/sqrt 2, v1 = (1, 1)/sqrt 2, u2 = (1, -1, 0)/sqrt 2,
# v2 = (1, -1)/sqrt 2: singular values 3 and 1, energies 9/10 and 10/10.


def test_energy_rank_by_hand():
    s = np.array([3.0, 1.0])
    assert energy_rank(s, 0.5) == 1
    assert energy_rank(s, 0.9) == 1  # 9 / 10 meets 0.9 exactly
    assert energy_rank(s, 0.95) == 2
    assert energy_rank(s, 1.0) == 2
    assert energy_rank(np.array([0.0, 0.0]), 0.95) == 1  # nothing to keep: one zero factor


def test_svd_compression_of_a_3x2_matrix_by_hand():
    f = svd_compress(A, 0.9)
    assert f["u"].shape == (3, 1) and f["s"].shape == (1,) and f["v"].shape == (1, 2)
    assert all(v.dtype == np.float32 for v in f.values())
    assert f["s"][0] == pytest.approx(3.0, rel=1e-6)
    rec = svd_reconstruct(f, A.shape)
    # rank 1: 3 u1 v1^T = 1.5 * [[1, 1], [1, 1], [0, 0]]; the residual is 1 u2 v2^T, norm 1
    np.testing.assert_allclose(rec, [[1.5, 1.5], [1.5, 1.5], [0, 0]], atol=1e-6)
    assert np.linalg.norm(A - rec) == pytest.approx(1.0, rel=1e-6)
    full = svd_compress(A, 0.95)
    assert full["s"].shape == (2,)
    np.testing.assert_allclose(svd_reconstruct(full, A.shape), A, atol=1e-6)
    # a conv kernel [o, i, kh, kw] is the matrix [o, i*kh*kw]: the round trip keeps its shape
    kernel = np.arange(16, dtype=np.float32).reshape(2, 2, 2, 2)
    back = svd_reconstruct(svd_compress(kernel, 1.0), kernel.shape)
    assert back.shape == kernel.shape
    np.testing.assert_allclose(back, kernel, atol=1e-4)
    with pytest.raises(ValueError):  # factors that do not fit together
        svd_reconstruct({"u": f["u"], "s": np.ones(2, np.float32), "v": f["v"]}, A.shape)


def test_energy_schedule():
    # T(t) = 0.95 + 0.03 t / 3 with t = round + 1: rounds 0, 1, 2 -> 0.96, 0.97, 0.98
    for r, want in enumerate([0.96, 0.97, 0.98]):
        assert energy_threshold(0.95, 0.98, r, 3) == pytest.approx(want)
    assert energy_threshold(0.95, 0.98, 7, 3) == pytest.approx(0.98)  # async: clamped
    assert energy_threshold(0.95, 0.95, 1, 3) == pytest.approx(0.95)  # FedTGP's setting
    server = get_algorithm("fedkd").server(sctx({}, rounds=3))
    task = server.make_task(0, RoundInfo(1, 3))
    assert task["energy"] == pytest.approx(0.97) and task["round"] == 1


# --- the servers by hand ----------------------------------------------------------------------------

class Tiny(BodyHead):
    """features = identity on 2 inputs, head = fc 2 -> 2 with weight I, bias 0."""

    def __init__(self):
        super().__init__()
        self.body = nn.Identity()
        self.fc = nn.Linear(2, 2)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(2))
            self.fc.bias.zero_()


def tiny_server(name, **params):
    return get_algorithm(name).server(sctx(params, archs=("tiny",), builder=lambda a: Tiny()))


def test_fedkd_server_reconstructs_and_aggregates_by_hand():
    server = tiny_server("fedkd")
    spec = server.update_spec()
    assert spec == {"delta": {"fc.weight": {"u": ("float32", (2, None)),
                                            "s": ("float32", (None,)),
                                            "v": ("float32", (None, 2))},
                              "fc.bias": ("float32", (2,))}}
    f32 = lambda v: np.array(v, np.float32)
    # a: rank 1, 2 e1 e1^T = [[2, 0], [0, 0]], bias (1, 1), 1 sample, fresh: c = 1
    a = {"delta": {"fc.weight": {"u": f32([[1], [0]]), "s": f32([2]), "v": f32([[1, 0]])},
                   "fc.bias": f32([1, 1])}}
    # b: rank 1, 4 e2 e2^T = [[0, 0], [0, 4]], bias (-1, 3), 3 samples, staleness 3: c = 3/2
    b = {"delta": {"fc.weight": {"u": f32([[0], [1]]), "s": f32([4]), "v": f32([[0, 1]])},
                   "fc.bias": f32([-1, 3])}}
    # bad: u has 2 columns, s one value
    bad = {"delta": {"fc.weight": {"u": f32([[1, 0], [0, 1]]), "s": f32([1]),
                                   "v": f32([[1, 0]])}, "fc.bias": f32([9, 9])}}
    for p in (a, b, bad):
        check_spec(p, spec)
    m = server.aggregate([update(0, a, n=1), update(1, b, n=3, staleness=3),
                          update(2, bad, n=5)], [], RoundInfo(0, 3))
    # W = I + (1 [[2, 0], [0, 0]] + 1.5 [[0, 0], [0, 4]]) / 2.5 = [[1.8, 0], [0, 3.4]]
    # b = (1 (1, 1) + 1.5 (-1, 3)) / 2.5 = (-0.2, 2.2); the malformed update is a failure
    np.testing.assert_allclose(server.weights["fc.weight"], [[1.8, 0], [0, 3.4]], atol=1e-6)
    np.testing.assert_allclose(server.weights["fc.bias"], [-0.2, 2.2], atol=1e-6)
    assert m["updates"] == 2 and m["failures"] == 1
    assert m["rank_frac"] == pytest.approx(0.5) and m["energy"] == pytest.approx(0.96)
    # sent numbers (2 + 1 + 2 factors + 2 bias) over 6 full: 7/6 for both updates
    assert m["up_ratio"] == pytest.approx(7 / 6)
    # downlink: rank 2 of a 2 x 2 weight would be 2 (2 + 2 + 1) = 10 numbers > 4: sent raw
    task = server.make_task(0, RoundInfo(1, 3))
    assert isinstance(task["weights"]["fc.weight"], np.ndarray)
    np.testing.assert_allclose(expand_weights(task["weights"], server._weights_spec)["fc.weight"],
                               [[1.8, 0], [0, 3.4]], atol=1e-6)


class Wide(BodyHead):
    """fc: 8 -> 8 with weight 3 e1 e1^T + 0.1 I (singular values 3.1, 0.1 x 7), bias 0."""

    def __init__(self):
        super().__init__()
        self.body = nn.Identity()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            w = 0.1 * torch.eye(8)
            w[0, 0] += 3.0
            self.fc.weight.copy_(w)
            self.fc.bias.zero_()


def test_fedkd_downlink_sends_factors_where_they_are_smaller():
    server = get_algorithm("fedkd").server(sctx({}, archs=("wide",), builder=lambda a: Wide()))
    # energy of the first direction: 9.61 / (9.61 + 7 x 0.01) = 0.9928 >= T(1) = 0.97: K = 1,
    # 1 (8 + 8 + 1) = 17 numbers < 64; the copy reconstructs 3.1 e1 e1^T
    f = server.make_task(0, RoundInfo(1, 3))["weights"]["fc.weight"]
    assert f["s"].shape == (1,) and f["s"][0] == pytest.approx(3.1, rel=1e-6)
    want = np.zeros((8, 8))
    want[0, 0] = 3.1
    np.testing.assert_allclose(svd_reconstruct(f, (8, 8)), want, atol=1e-6)
    # T = 0.999 needs all 8 directions, 136 numbers > 64: the weight travels raw and exact
    exact = get_algorithm("fedkd").server(sctx({"t_start": 0.999, "t_end": 0.999},
                                               archs=("wide",), builder=lambda a: Wide()))
    w = exact.make_task(0, RoundInfo(1, 3))["weights"]["fc.weight"]
    assert isinstance(w, np.ndarray)
    np.testing.assert_array_equal(w, exact.weights["fc.weight"])


def test_fedkd_uncompressed_spec_and_aggregate():
    server = tiny_server("fedkd", compress=False)
    assert server.update_spec() == {"delta": {"fc.weight": ("float32", (2, 2)),
                                              "fc.bias": ("float32", (2,))}}
    d = {"delta": {"fc.weight": np.full((2, 2), 2.0, np.float32),
                   "fc.bias": np.array([1, -1], np.float32)}}
    server.aggregate([update(0, d, n=4)], [], RoundInfo(0, 3))
    np.testing.assert_allclose(server.weights["fc.weight"], [[3, 2], [2, 3]])
    assert isinstance(server.make_task(0, RoundInfo(1, 3))["weights"]["fc.weight"], np.ndarray)


def test_fml_server_average_by_hand():
    server = tiny_server("fml")
    assert server.update_spec() == {"delta": {"fc.weight": ("float32", (2, 2)),
                                              "fc.bias": ("float32", (2,))}}
    a = {"delta": {"fc.weight": np.full((2, 2), 1.0, np.float32),
                   "fc.bias": np.array([1, 0], np.float32)}}
    b = {"delta": {"fc.weight": np.full((2, 2), -2.0, np.float32),
                   "fc.bias": np.array([0, 4], np.float32)}}
    # c_a = 2 x 1 (fresh), c_b = 2 x 1/sqrt(1 + 3) = 1: W = I + (2 * 1 + 1 * -2) / 3 = I
    # bias = (2 (1, 0) + 1 (0, 4)) / 3 = (2/3, 4/3)
    server.aggregate([update(0, a, n=2), update(1, b, n=2, staleness=3)], [], RoundInfo(0, 3))
    np.testing.assert_allclose(server.weights["fc.weight"], np.eye(2), atol=1e-6)
    np.testing.assert_allclose(server.weights["fc.bias"], [2 / 3, 4 / 3], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_empty_aggregation_keeps_state_and_state_dict_round_trip(name):
    server = tiny_server(name)
    before = {k: v.copy() for k, v in server.weights.items()}
    m = server.aggregate([], [Failure(0, "late"), Failure(1, "dead")], RoundInfo(0, 3))
    assert m["updates"] == 0 and m["failures"] == 2
    for k, v in before.items():
        np.testing.assert_array_equal(server.weights[k], v)
    d = {"delta": {"fc.weight": np.ones((2, 2), np.float32),
                   "fc.bias": np.ones(2, np.float32)}}
    if name == "fedkd":
        d["delta"]["fc.weight"] = svd_compress(d["delta"]["fc.weight"], 0.95)
    server.aggregate([update(0, d)], [], RoundInfo(0, 3))
    fresh = tiny_server(name)
    fresh.load_state_dict(server.state_dict())
    for k in server.weights:
        np.testing.assert_array_equal(fresh.weights[k], server.weights[k])
    info = RoundInfo(1, 3)
    t1, t2 = server.make_task(0, info), fresh.make_task(0, info)
    np.testing.assert_array_equal(expand_weights(t1["weights"], server._weights_spec)["fc.weight"],
                                  expand_weights(t2["weights"], fresh._weights_spec)["fc.weight"])


# --- clients: real local training ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_client_trains_both_models_and_update_matches_spec(name, parts):
    algo = get_algorithm(name)
    server = algo.server(sctx({}))
    client = algo.client(cctx(0, parts[0], {}, model=make_model(0, deep=True)))
    assert client.arch == "net"
    own = model_weights(client.ctx.model)
    task = freeze(server.make_task(0, RoundInfo(0, 3)))
    run = LocalRun(client.ctx, epochs=1, seed=7)
    payload = client.train(task, run)
    check_spec(payload, server.update_spec())
    assert run.work.steps == run.steps_per_epoch() and math.isfinite(client.last_loss)
    # the private model trained, and the shared one moved away from the task's weights
    assert any(not np.array_equal(v, model_weights(client.ctx.model)[k]) for k, v in own.items())
    delta = expand_weights(payload["delta"], server._weights_spec)
    assert max(float(np.abs(v).max()) for v in delta.values()) > 1e-4
    metrics = server.aggregate([update(0, payload, len(client.ctx.train_y))], [],
                               RoundInfo(0, 3))
    assert metrics["updates"] == 1
    ev = client.evaluate(freeze(server.make_eval(0, RoundInfo(0, 3))))
    assert {"acc", "loss", "num_test", "aux_acc", "aux_loss"} <= set(ev)
    assert 0.0 <= ev["acc"] <= 1.0 and 0.0 <= ev["aux_acc"] <= 1.0
    if name == "fedkd":
        ranks = [v["s"].shape[0] for v in payload["delta"].values() if isinstance(v, dict)]
        assert ranks and all(r >= 1 for r in ranks)
        assert metrics["up_ratio"] < 1.0  # the compressed update is smaller than the delta


def test_fedkd_client_compresses_at_the_tasks_energy(parts):
    algo = get_algorithm("fedkd")
    server = algo.server(sctx({}))
    ranks = {}
    for energy in (0.5, 0.999):
        client = algo.client(cctx(0, parts[0], {}))
        task = dict(server.make_task(0, RoundInfo(0, 3)), energy=energy)
        payload = client.train(freeze(task), LocalRun(client.ctx, epochs=1, seed=7))
        ranks[energy] = payload["delta"]["body.0.weight"]["s"].shape[0]
        s = np.linalg.svd(expand_weights(payload["delta"], server._weights_spec)["body.0.weight"],
                          compute_uv=False)
        assert len(s) >= ranks[energy]
    assert ranks[0.5] < ranks[0.999]


@pytest.mark.parametrize("name", NAMES)
def test_partial_work_still_updates(name, parts):
    algo = get_algorithm(name)
    server = algo.server(sctx({}))
    client = algo.client(cctx(1, parts[1], {}))
    run = LocalRun(client.ctx, epochs=2, seed=1, epochs_to_run=0.2)
    payload = client.train(freeze(server.make_task(1, RoundInfo(0, 3))), run)
    assert run.work.stopped == "partial" and 0 < run.work.steps < run.steps_per_epoch()
    check_spec(payload, server.update_spec())
    before = {k: v.copy() for k, v in server.weights.items()}
    u = update(1, payload, len(client.ctx.train_y),
               work=Work(2, run.work.epochs_done, run.work.steps, run.work.samples, "partial"))
    assert server.aggregate([u], [], RoundInfo(0, 3))["updates"] == 1
    assert any(not np.array_equal(before[k], server.weights[k]) for k in before)


@pytest.mark.parametrize("name", NAMES)
def test_client_state_dict_round_trip(name, parts):
    algo = get_algorithm(name)
    server = algo.server(sctx({}))
    client = algo.client(cctx(0, parts[0], {}))
    task = freeze(server.make_task(0, RoundInfo(0, 3)))
    client.train(task, LocalRun(client.ctx, epochs=1, seed=2))
    state = copy.deepcopy(client.state_dict())  # as a checkpoint: no shared buffers
    other = algo.client(cctx(0, parts[0], {}))
    other.load_state_dict(state)
    for mine, theirs in ((client.ctx.model, other.ctx.model), (client.aux, other.aux)):
        for k, v in mine.state_dict().items():
            torch.testing.assert_close(theirs.state_dict()[k], v)
    if name == "fedkd":
        torch.testing.assert_close(other.proj.weight, client.proj.weight)
    # the restored client trains on exactly as the original does
    a = client.train(task, LocalRun(client.ctx, epochs=1, seed=3))
    b = other.train(task, LocalRun(other.ctx, epochs=1, seed=3))
    ea, eb = expand_weights(a["delta"], server._weights_spec), expand_weights(b["delta"], server._weights_spec)
    for k in ea:
        np.testing.assert_allclose(ea[k], eb[k], atol=1e-6)


# --- a short heterogeneous federation ---------------------------------------------------------------

def simulate_aux(name, params, rounds=5, clients=4, epochs=3, ways=5):
    """As algo_support.simulate(hetero=True), with the contexts' archs/build_arch: odd
    clients run the deep network, the shared model is the smallest (net)."""
    algo = get_algorithm(name)
    data = digits_parts(clients, ways)
    archs = ("net", "deep")
    server = algo.server(sctx(params, archs=archs, clients=clients, rounds=rounds,
                              homogeneous=False))
    handlers = [algo.client(cctx(i, p, params, model=make_model(i, deep=bool(i % 2)),
                                 archs=archs)) for i, p in enumerate(data)]
    history = []
    for r in range(rounds):
        info = RoundInfo(r, rounds)
        ups = []
        for i, h in enumerate(handlers):
            payload = h.train(freeze(server.make_task(i, info)),
                              LocalRun(h.ctx, epochs=epochs, seed=1000 * r + i))
            check_spec(payload, server.update_spec())
            ups.append(update(i, payload, len(h.ctx.train_y), version=r))
        metrics = server.aggregate(ups, [], info)
        assert metrics["updates"] == clients
        evals = [h.evaluate(freeze(server.make_eval(i, info))) for i, h in enumerate(handlers)]
        history.append({k: float(np.mean([e[k] for e in evals])) for k in ("acc", "aux_acc")})
    return server, handlers, history


@pytest.mark.parametrize("name", NAMES)
def test_heterogeneous_federation_learns(name):
    server, handlers, history = simulate_aux(name, {})
    assert server.arch == "net" and all(h.arch == "net" for h in handlers)
    last = history[-1]
    # chance: 0.1 over all classes, 0.2 within a client's five; the shared model predicts
    # all ten classes and learns more slowly than the private ones
    assert last["acc"] > 0.65 and last["aux_acc"] > 0.45, history
    assert last["acc"] > history[0]["acc"] + 0.2, history
    assert last["aux_acc"] > history[0]["aux_acc"] + 0.2, history

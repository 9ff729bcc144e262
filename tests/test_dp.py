"""fedbus.node.privacy.dp: the accountant against dp-accounting's own numbers, the record-level
prototype release on real data (scikit-learn's digits) through a real fedbus network, the
client-level clipping and noise, and which algorithms admit which mechanism."""
from __future__ import annotations

import json
import math

import dp_accounting
import msgpack
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from sklearn.datasets import load_digits

from fedbus.algorithms import available, get_algorithm
from fedbus.algorithms.core.handlers import ServerHandler
from fedbus.algorithms.core.protos import local_prototypes
from fedbus.models.small import MLP
from fedbus.node.privacy.dp import (
    PLD_DISCRETIZATION,
    RDP_ORDERS,
    Accountant,
    clip_update,
    dp_levels,
    dp_prototypes,
    dp_refusal,
    gaussian_like,
    record_noise_multiplier,
)

DELTA = 1e-5


def sampled(z: float, q: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


# --- the accountant ------------------------------------------------------------------------

def test_empty_accountant_is_zero():
    assert Accountant().epsilon() == 0.0
    assert Accountant("pld").epsilon() == 0.0


def test_rdp_full_participation_matches_library():
    ref = rdp.RdpAccountant(list(RDP_ORDERS))
    ref.compose(dp_accounting.GaussianDpEvent(1.1), 10)
    want = ref.get_epsilon(DELTA)
    one = Accountant("rdp", DELTA)
    one.add(1.1, 1.0, 10)
    many = Accountant("rdp", DELTA)
    for _ in range(10):
        many.add(1.1)
    assert one.epsilon() == pytest.approx(want, rel=1e-12)
    assert many.epsilon() == pytest.approx(want, rel=1e-12)
    assert 5 < want < 50  # a real, finite number


def test_rdp_poisson_sampled_rounds_match_library():
    ref = rdp.RdpAccountant(list(RDP_ORDERS))
    for _ in range(100):  # composed one round at a time, as a run does
        ref.compose(sampled(1.0, 0.1))
    acc = Accountant("rdp", DELTA)
    for _ in range(100):
        acc.add(1.0, 0.1)
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    # amplification: far below the unsampled mechanism over the same rounds
    full = Accountant("rdp", DELTA)
    full.add(1.0, 1.0, 100)
    assert acc.epsilon() < 0.25 * full.epsilon()
    # our orders are integers only: close to the library's defaults (module doc)
    default = rdp.RdpAccountant()
    default.compose(sampled(1.0, 0.1), 100)
    assert acc.epsilon() == pytest.approx(default.get_epsilon(DELTA), rel=0.03)


def test_pld_matches_library():
    ref = pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    ref.compose(dp_accounting.SelfComposedDpEvent(sampled(1.0, 0.1), 20))
    acc = Accountant("pld", DELTA)
    for _ in range(20):
        acc.add(1.0, 0.1)
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    # the coarser discretization costs almost nothing against the library's default
    fine = pld.PLDAccountant()
    fine.compose(dp_accounting.SelfComposedDpEvent(sampled(1.0, 0.1), 20))
    assert acc.epsilon() == pytest.approx(fine.get_epsilon(DELTA), rel=1e-3)
    # PLD is tighter than RDP for the same events
    r = Accountant("rdp", DELTA)
    r.add(1.0, 0.1, 20)
    assert acc.epsilon() < r.epsilon()


def test_mixed_events_match_library():
    ref = rdp.RdpAccountant(list(RDP_ORDERS))
    ref.compose(sampled(1.0, 0.1), 3)
    ref.compose(dp_accounting.GaussianDpEvent(2.0), 5)
    ref.compose(sampled(1.0, 0.1), 4)
    acc = Accountant()
    acc.add(1.0, 0.1, 3)
    acc.add(2.0, 1.0, 5)
    acc.add(1.0, 0.1, 4)
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    assert acc.steps == 12


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_epsilon_after_does_not_change_state(kind):
    acc = Accountant(kind)
    acc.add(1.0, 0.1, 5)
    before, state = acc.epsilon(), acc.state_dict()
    after = acc.epsilon_after(1.0, 0.1)
    assert after > before
    assert acc.epsilon() == before
    assert acc.state_dict() == state
    acc.add(1.0, 0.1)
    assert acc.epsilon() == pytest.approx(after, rel=1e-12)
    assert acc.epsilon_after(1.0, 0.1, 0) == acc.epsilon()


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_state_dict_round_trip(kind):
    acc = Accountant(kind, 1e-6)
    for r in range(30):
        acc.add(1.2, 0.2) if r % 3 else acc.add(0.9, 1.0)
    state = acc.state_dict()
    wire = msgpack.unpackb(msgpack.packb(state))
    assert json.loads(json.dumps(state)) == wire
    assert sorted(map(tuple, wire["entries"])) == [(0.9, 1.0, 10), (1.2, 0.2, 20)]
    back = Accountant()  # kind and delta come from the state
    back.load_state_dict(wire)
    assert (back.kind, back.delta) == (kind, 1e-6)
    assert back.epsilon() == acc.epsilon()
    back.add(1.2, 0.2)
    acc.add(1.2, 0.2)
    assert back.epsilon() == acc.epsilon()


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
    eps = []
    acc = Accountant()
    for _ in range(4):
        acc.add(1.0, 0.05, 25)
        eps.append(acc.epsilon())
    assert eps == sorted(eps) and len(set(eps)) == 4
    by_z = []
    for z in (0.8, 1.0, 1.5, 3.0):
        a = Accountant()
        a.add(z, 0.05, 100)
        by_z.append(a.epsilon())
    assert by_z == sorted(by_z, reverse=True) and len(set(by_z)) == 4
    a = Accountant(delta=1e-3)
    a.add(1.0, 0.05, 100)
    assert a.epsilon() < by_z[1]  # a larger delta buys a smaller epsilon


def test_epsilon_after_500_rounds_is_one_composition_and_cached(monkeypatch):
    # 500 rounds of one (z, q) compose as one self-composed event, so epsilon's cost does
    # not grow with the rounds; a second epsilon() composes nothing (cached). Counted on
    # dp-accounting's own RdpAccountant.compose, not timed (tests assert no wall clock)
    composed = []
    real = rdp.RdpAccountant.compose

    def counting(self, event, count=1):
        composed.append(event)
        return real(self, event, count)

    monkeypatch.setattr(rdp.RdpAccountant, "compose", counting)
    acc = Accountant("rdp")
    for _ in range(500):
        acc.add(1.0, 0.1)
    fresh = Accountant()
    fresh.load_state_dict(acc.state_dict())
    eps = fresh.epsilon()
    assert len(composed) == 1 and composed[0].count == 500
    assert fresh.epsilon() == eps and len(composed) == 1  # cached


def test_accountant_refuses_bad_arguments():
    with pytest.raises(ValueError):
        Accountant("moments")
    with pytest.raises(ValueError):
        Accountant(delta=0.0)
    acc = Accountant()
    for args in [(0.0,), (1.0, 0.0), (1.0, 1.5), (1.0, 0.5, -1), (1.0, 0.5, 1.5)]:
        with pytest.raises(ValueError):
            acc.add(*args)
    assert acc.epsilon() == 0.0


def test_record_noise_multiplier():
    assert record_noise_multiplier(1.0) == pytest.approx(1 / math.sqrt(2))
    assert record_noise_multiplier(2.5) == pytest.approx(2.5 / math.sqrt(2))
    # the record release is accounted as the Gaussian of sensitivity sqrt(2) C at noise z C
    acc = Accountant()
    acc.add(record_noise_multiplier(2.0), 1.0, 10)
    ref = rdp.RdpAccountant(list(RDP_ORDERS))
    ref.compose(dp_accounting.GaussianDpEvent(2.0 / math.sqrt(2)), 10)
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(DELTA), rel=1e-12)
    worse = Accountant()
    worse.add(2.0, 1.0, 10)
    assert acc.epsilon() > worse.epsilon()


# --- record level: dp_prototypes ----------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    torch.manual_seed(0)
    model = MLP((64,), 10, feature_dim=32, hidden=48)
    return model, x, y


def clipped_means(model, x, y, clip):
    with torch.no_grad():
        model.eval()
        h = model.features(x).double()
        model.train()
    h = h * torch.clamp(clip / torch.linalg.vector_norm(h, dim=1, keepdim=True), max=1.0)
    out = np.zeros((10, h.shape[1]))
    for k in range(10):
        if (y == k).any():
            out[k] = h[y == k].mean(0).numpy()
    return out, h


def test_dp_prototypes_deterministic_in_seed(digits):
    model, x, y = digits
    a = dp_prototypes(model, x, y, 10, clip=1.0, z=1.0, seed=7)
    b = dp_prototypes(model, x, y, 10, clip=1.0, z=1.0, seed=7)
    c = dp_prototypes(model, x, y, 10, clip=1.0, z=1.0, seed=8)
    assert set(a) == {"protos", "counts"}
    assert a["protos"].dtype == np.float32 and a["protos"].shape == (10, 32)
    assert a["counts"].dtype == np.int64 and a["counts"].shape == (10,)
    np.testing.assert_array_equal(a["protos"], b["protos"])
    np.testing.assert_array_equal(a["counts"], b["counts"])
    assert not np.array_equal(a["protos"], c["protos"])


def test_dp_prototypes_without_noise_are_the_class_means(digits):
    model, x, y = digits
    model.train()
    want, counts = local_prototypes(model, x, y, 10, batch=256)
    with torch.no_grad():
        assert float(torch.linalg.vector_norm(model.features(x), dim=1).max()) < 100
    # clip 100 touches no sample; noise std z clip / n is about 1e-6
    got = dp_prototypes(model, x, y, 10, clip=100.0, z=1e-6, seed=0, batch=256)
    assert model.training  # mode restored
    np.testing.assert_allclose(got["protos"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["counts"], (counts > 0).astype(np.int64))
    model.eval()
    dp_prototypes(model, x, y, 10, clip=1.0, z=1.0, seed=0)
    assert not model.training
    model.train()


def test_dp_prototypes_clip_every_sample(digits):
    model, x, y = digits
    with torch.no_grad():
        norms = torch.linalg.vector_norm(model.features(x), dim=1)
    clip = float(norms.median())  # half the samples are over it
    want, h = clipped_means(model, x, y, clip)
    assert float(torch.linalg.vector_norm(h, dim=1).max()) <= clip * (1 + 1e-9)
    got = dp_prototypes(model, x, y, 10, clip=clip, z=1e-6, seed=0, project=False)
    np.testing.assert_allclose(got["protos"], want, rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(got["protos"], axis=1).max() <= clip * (1 + 1e-5)
    # and not merely the unclipped means, which differ
    unclipped, _ = local_prototypes(model, x, y, 10)
    assert np.abs(unclipped - want).max() > 1e-3


def test_dp_prototypes_noise_scale(digits):
    model, x, y = digits
    z, clip, k = 0.5, 4.0, 3
    n = int((y == k).sum())
    assert n > 150
    exact, _ = clipped_means(model, x, y, clip)
    err = np.stack([dp_prototypes(model, x, y, 10, clip=clip, z=z, seed=s,
                                  project=False)["protos"][k] - exact[k] for s in range(24)])
    assert abs(err.mean()) < 3 * z * clip / n / math.sqrt(err.size)  # unbiased
    assert err.std() == pytest.approx(z * clip / n, rel=0.15)


def test_dp_prototypes_projection_is_post_processing(digits):
    model, x, y = digits
    x, y = x[:60], y[:60]  # about 6 samples a class: the noise on a mean is large
    raw = dp_prototypes(model, x, y, 10, clip=0.5, z=1.0, seed=1, project=False)
    proj = dp_prototypes(model, x, y, 10, clip=0.5, z=1.0, seed=1)
    np.testing.assert_array_equal(raw["counts"], proj["counts"])
    rn, pn = np.linalg.norm(raw["protos"], axis=1), np.linalg.norm(proj["protos"], axis=1)
    assert pn.max() <= 0.5 * (1 + 1e-5)
    assert rn.max() > 0.5  # the noise pushed some over: projection did something
    # same direction, shorter where it was long
    on = rn > 0
    cos = (raw["protos"][on] * proj["protos"][on]).sum(1) / (rn[on] * pn[on])
    np.testing.assert_allclose(cos, 1.0, atol=1e-5)


def test_dp_prototypes_absent_classes(digits):
    model, x, y = digits
    keep = y < 5
    got = dp_prototypes(model, x[keep], y[keep], 10, clip=1.0, z=1e-3, seed=2)
    np.testing.assert_array_equal(got["counts"], [1] * 5 + [0] * 5)
    assert np.all(got["protos"][5:] == 0)
    assert np.all(np.linalg.norm(got["protos"][:5], axis=1) > 0)
    # an empty client still releases (pure noise, flags by chance) of the right shape
    empty = dp_prototypes(model, x[:0], y[:0], 10, clip=1.0, z=1.0, seed=3)
    assert empty["protos"].shape == (10, 32)
    assert set(np.unique(empty["counts"])) <= {0, 1}
    assert np.all(empty["protos"][empty["counts"] == 0] == 0)


def test_dp_prototypes_flags_are_noisy_counts_at_least_one(digits):
    """A flag is 1 exactly where n_k + N(0, z^2) >= 1: with z = 1, P = 0.159 for a class the
    client lacks and 0.5 for a class it holds once."""
    model, x, y = digits
    one = torch.nonzero(y == 1)[:1, 0]
    zeros = torch.nonzero(y == 0)[:20, 0]
    idx = torch.cat([zeros, one])
    flags = np.stack([dp_prototypes(model, x[idx], y[idx], 10, clip=1.0, z=1.0, seed=s)["counts"]
                      for s in range(60)])
    assert flags[:, 0].mean() > 0.95  # 20 samples
    assert 0.33 < flags[:, 1].mean() < 0.67  # one sample: 0.5, sd 0.065
    absent = flags[:, 2:].mean()  # 480 draws: 0.159, sd 0.017
    assert 0.11 < absent < 0.21


def test_dp_prototypes_refuses_dense_labels(digits):
    model, x, _ = digits
    with pytest.raises(ValueError, match="dense"):
        dp_prototypes(model, x[:4], torch.zeros(4, 8, 8, dtype=torch.int64), 10, 1.0, 1.0, 0)


# --- client level: clip_update, gaussian_like ----------------------------------------------

def test_clip_update_bounds_the_norm_and_keeps_the_direction():
    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(size=(20, 10)).astype(np.float32),
            "b": rng.normal(size=10).astype(np.float32),
            "n": np.array(3, dtype=np.int64)}
    flat = np.concatenate([np.ravel(tree[k]).astype(np.float64) for k in ("w", "b", "n")])
    out, norm = clip_update(tree, 2.0)
    assert norm == pytest.approx(np.linalg.norm(flat), rel=1e-12)
    got = np.concatenate([np.ravel(out[k]).astype(np.float64) for k in ("w", "b", "n")])
    assert all(out[k].dtype == np.float32 and out[k].shape == np.shape(tree[k]) for k in out)
    assert np.linalg.norm(got) <= 2.0 * (1 + 1e-6)
    assert np.linalg.norm(got) == pytest.approx(2.0, rel=1e-6)
    np.testing.assert_allclose(got, flat * (2.0 / norm), rtol=1e-6)
    assert tree["w"].dtype == np.float32 and tree["n"] == 3  # the input is not changed


def test_clip_update_leaves_small_trees_alone():
    tree = {"a": np.full((3, 3), 0.01, np.float32), "nested": {"b": np.ones(2, np.float32)}}
    out, norm = clip_update(tree, 10.0)
    assert norm == pytest.approx(math.sqrt(9 * 1e-4 + 2), rel=1e-6)
    np.testing.assert_array_equal(out["a"], tree["a"])
    np.testing.assert_array_equal(out["nested"]["b"], tree["nested"]["b"])
    zero, n0 = clip_update({"a": np.zeros(4, np.float32)}, 1.0)
    assert n0 == 0.0 and np.all(zero["a"] == 0)


def test_gaussian_like_shapes_seed_and_scale():
    tree = {"w": np.zeros((50, 40), np.float32), "inner": {"b": np.zeros(7, np.float32)},
            "s": np.zeros((), np.float32)}
    a = gaussian_like(tree, 0.3, seed=5)
    b = gaussian_like({"s": tree["s"], "inner": tree["inner"], "w": tree["w"]}, 0.3, seed=5)
    c = gaussian_like(tree, 0.3, seed=6)
    assert a["w"].shape == (50, 40) and a["inner"]["b"].shape == (7,) and a["s"].shape == ()
    assert a["w"].dtype == np.float64
    np.testing.assert_array_equal(a["w"], b["w"])  # insertion order does not matter
    np.testing.assert_array_equal(a["inner"]["b"], b["inner"]["b"])
    assert not np.array_equal(a["w"], c["w"])
    assert a["w"].std() == pytest.approx(0.3, rel=0.05)
    assert abs(a["w"].mean()) < 0.03


# --- which algorithms admit which mechanism -------------------------------------------------

def test_dp_levels_declared():
    assert ServerHandler.DP_LEVELS == ()
    levels = {name: dp_levels(get_algorithm(name).server) for name in available()}
    assert {n for n, lv in levels.items() if "record" in lv} == {"fedproto", "fedtgp", "fedgh"}
    assert {n for n, lv in levels.items() if "client" in lv} == {"fedavg", "fedprox"}


@pytest.mark.parametrize("name,level", [("fedproto", "record"), ("fedtgp", "record"),
                                        ("fedgh", "record"), ("fedavg", "client"),
                                        ("fedprox", "client"), ("mpfedcl", "off"),
                                        ("fedavg", "off")])
def test_dp_refusal_supported(name, level):
    assert dp_refusal(get_algorithm(name).server, level) is None
    assert dp_refusal(name, level) is None


@pytest.mark.parametrize("name,level", [("fedavg", "record"), ("fedproto", "client"),
                                        ("mpfedcl", "record"), ("mpfedcl", "client"),
                                        ("fedavg-proto", "client"),
                                        ("proto-attention", "record"),
                                        ("proto-attention", "client"), ("fd", "record")])
def test_dp_refusal_refused(name, level):
    why = dp_refusal(get_algorithm(name).server, level)
    assert isinstance(why, str) and "\n" not in why
    assert why.startswith(f"privacy.dp = {level}: {name} ")
    assert "algorithms that admit it" in why
    admit = why.split("algorithms that admit it: ")[1].split(", ")
    assert admit == (["fedgh", "fedproto", "fedtgp"] if level == "record"
                     else ["fedavg", "fedprox"])
    assert dp_refusal(get_algorithm(name), level) == why


def test_dp_refusal_client_needs_a_sum():
    why = dp_refusal("fedavg", "client", {"robust": "median"})
    assert why is not None and "fedavg" in why and "median" in why
    assert dp_refusal("fedavg", "client", {"robust": "none"}) is None
    assert dp_refusal("fedproto", "record", {"robust": "median"}) is None
    assert "unknown" in dp_refusal("fedavg", "everything")


# --- the noise source (CryptoGaussian) ---------------------------------------------------

def test_the_noise_is_a_chacha20_stream_four_gaussians_halved():
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    from fedbus.node.privacy.dp import CryptoGaussian

    key = __import__("hashlib").sha256(b"fedbus dp noise %d %d" % (0xD1F5, 7)).digest()
    words = np.frombuffer(Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
                          .update(bytes(8 * 4)), dtype="<u8")
    u = ((words >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    r, theta = np.sqrt(-2 * np.log(u[:2])), 2 * math.pi * u[2:]
    expected = 3.0 * (r[0] * np.cos(theta[0]) + r[1] * np.cos(theta[1])
                      + r[0] * np.sin(theta[0]) + r[1] * np.sin(theta[1])) / 2
    assert CryptoGaussian(7).normal(0.0, 3.0, 1)[0] == pytest.approx(expected, rel=1e-12)


def test_the_noise_is_gaussian_with_the_asked_scale():
    from scipy import stats

    from fedbus.node.privacy.dp import CryptoGaussian

    draws = CryptoGaussian(11).normal(0.0, 2.5, (400, 500))
    assert draws.shape == (400, 500) and draws.dtype == np.float64
    assert abs(draws.mean()) < 0.02 and draws.std() == pytest.approx(2.5, rel=0.01)
    assert stats.kstest(draws.ravel() / 2.5, "norm").pvalue > 1e-3
    assert CryptoGaussian(11).normal(5.0, 0.0, (2, 3)).tolist() == [[5.0] * 3] * 2


def test_seeded_noise_repeats_and_secret_noise_does_not():
    from fedbus.node.privacy.dp import CryptoGaussian, _rng

    assert np.array_equal(CryptoGaussian(3).normal(0, 1, 64), CryptoGaussian(3).normal(0, 1, 64))
    assert not np.array_equal(CryptoGaussian(3).normal(0, 1, 64), CryptoGaussian(4).normal(0, 1, 64))
    assert not np.array_equal(_rng(None).normal(0, 1, 64), _rng(None).normal(0, 1, 64))
    # numpy's PCG64 under the old seeding would let anyone with the seed recompute it
    old = np.random.default_rng(np.random.SeedSequence([3, 0xD1F5])).normal(0, 1, 64)
    assert not np.allclose(CryptoGaussian(3).normal(0, 1, 64), old)
    with pytest.raises(ValueError, match="non-negative"):
        CryptoGaussian(-1)

"""Distributed DP (privacy.dp_noise = "distributed", fedbus.node.privacy.ddp): the clients'
Skellam shares sum to the accounted noise, the rotation and rounding round-trip within their
stated bounds, the ring holds the noised sum, the accountant is the Skellam RDP bound
amplified by Poisson sampling, and in a federation the server unmasks a sum that carries the
full noise, adds none, and reports the survivors' epsilon.

Statistical tests use fixed seeds; their tolerances come from the sampling distribution of
the statistic (stated at each), not from observed results."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fedbus.node.config import ConfigError, build_config
from fedbus.node.privacy import ddp
from fedbus.node.privacy.ddp import DDPParams

CTX = b"fedbus-secagg/test/0"


def _params(length=1000, n_min=4, cohort=5, z=1.0, clip=1.0) -> DDPParams:
    return DDPParams(clip, z, length, n_min, cohort)


def _clipped(rng, length, clip):
    x = rng.normal(size=length)
    return x * (clip / np.linalg.norm(x))


# --- rotation, rounding, ring ---

def test_the_hadamard_rotation_is_orthonormal_and_undone_exactly():
    d = 64
    h = np.array([ddp.hadamard(e) for e in np.eye(d)])
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    rng = np.random.default_rng(0)
    x = rng.normal(size=1000)
    signs = ddp.rotation_signs(CTX, 1024)
    y = ddp.rotate(x, signs)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-12)
    np.testing.assert_allclose(ddp.unrotate(y, signs, 1000), x, atol=1e-12)
    # every client of a round and the server draw the same signs; another round others
    np.testing.assert_array_equal(signs, ddp.rotation_signs(CTX, 1024))
    assert np.mean(signs != ddp.rotation_signs(b"fedbus-secagg/test/1", 1024)) > 0.4


def test_rounding_and_rotation_round_trip_within_the_stated_bound():
    p = _params(length=700, n_min=3, cohort=3)
    rng = np.random.default_rng(1)
    signs = ddp.rotation_signs(CTX, p.dim)
    for _ in range(5):
        xs = [_clipped(rng, p.length, p.clip * rng.uniform(0.1, 1.0)) for _ in range(3)]
        rounded = [ddp.conditional_round(p.scale * ddp.rotate(x, signs), p.delta2, rng)
                   for x in xs]
        for r in rounded:
            assert np.linalg.norm(r) <= p.delta2  # the sensitivity the accountant uses
        back = ddp.server_decode(np.sum(rounded, axis=0).astype(np.float64), p, CTX)
        err = np.linalg.norm(back - np.sum(xs, axis=0))
        assert err <= ddp.quantisation_bound(p, 3)
        assert err > 0  # (it does round)


def test_the_rounding_bias_is_within_its_bound():
    # N draws of the rounding of one fixed vector: each value's error r - y has variance
    # f (1 - f) <= 1/4, so its mean's standard error is <= 1 / (2 sqrt(N)); with d = 256
    # values a 5.5-sigma band is crossed by chance with probability < 256 x 4e-8
    p = _params(length=200)
    rng = np.random.default_rng(2)
    y = rng.uniform(-50, 50, size=256)
    n = 4000
    total = np.zeros(256)
    for _ in range(n):
        total += ddp.conditional_round(y, math.sqrt(float(np.sum((np.abs(y) + 1) ** 2))),
                                       rng)
    bias = total / n - y
    tol = ddp.rounding_bias_bound(p) * p.scale + 5.5 / (2 * math.sqrt(n))
    assert np.max(np.abs(bias)) <= tol
    assert np.max(np.abs(bias)) > 0


@pytest.mark.parametrize("survivors", [5, 4, 3])
def test_the_summed_noise_has_the_accounted_variance(survivors):
    """Clients encoding a zero vector send their noise alone (rounding 0 is exact): the sum
    of `survivors` shares must be Sk with variance survivors x mu / n_min per value. The
    sample variance s2 of N values has Var(s2) = sigma^4 (2 / (N - 1) + kappa / N), kappa =
    1 / (2 lam_total) the Skellam's excess kurtosis; 6 such standard errors bound the test."""
    p = _params(length=4000, n_min=4, cohort=5)
    rng = np.random.default_rng(3 + survivors)
    zero = np.zeros(p.length)
    draws = 12
    sums = np.concatenate([
        np.sum([ddp.client_encode(zero, p, CTX, rng) for _ in range(survivors)], axis=0)
        for _ in range(draws)]).astype(np.float64)
    n = len(sums)
    var = survivors * p.mu / p.n_min
    kappa = 1.0 / (2.0 * survivors * p.lam)
    se = var * math.sqrt(2.0 / (n - 1) + kappa / n)
    assert abs(np.var(sums, ddof=1) - var) <= 6 * se
    assert abs(np.mean(sums)) <= 6 * math.sqrt(var / n)
    # in the sum form's units: the std the record reports; with n_min survivors, z x Delta2
    # / gamma, the central mechanism's z C up to the rounding's inflation of the norm
    assert p.noise_std(p.n_min) == pytest.approx(p.z * p.delta2 / p.scale)
    assert p.z * p.clip <= p.noise_std(p.n_min) <= p.z * p.clip * 1.01


def test_the_ring_holds_the_noised_sum_of_the_cohort():
    """cohort x client_range < 2^(bits-1) (the ring is chosen so); each client's values
    stay within client_range (the rounded vector's norm bound plus the noise's 2^-64 tail),
    and the sum of the cohort's inputs, taken mod 2^bits as secure aggregation does, decodes
    to the exact integer sum."""
    from fedbus.node.privacy.secagg import decode, encode_integers

    for length, cohort in ((300, 3), (5000, 20)):
        p = _params(length=length, n_min=max(1, cohort - 2), cohort=cohort)
        ring = p.ring()
        assert cohort * p.client_range < 2 ** (ring.ring_bits - 1)
        rng = np.random.default_rng(length)
        for _ in range(3):
            # worst case for the values: every client's input at the clip, all alike
            x = _clipped(rng, p.length, p.clip)
            ints = [ddp.client_encode(x, p, CTX, rng) for _ in range(cohort)]
            assert max(int(np.max(np.abs(v))) for v in ints) <= p.client_range
            exact = np.sum(ints, axis=0)
            acc = np.zeros(p.dim, np.uint64)
            for v in ints:
                acc += encode_integers(v, ring)[0]  # uint64 wraps mod 2^64
            np.testing.assert_array_equal(decode(acc, ring), exact.astype(np.float64))


def test_a_sum_past_the_ring_would_wrap_and_the_server_bound_says_so():
    """What the ring guards against: a sum past 2^(bits-1) decodes to a wrong value of the
    other sign, and the server's norm check (sum_norm_bound) refuses such a sum."""
    from fedbus.node.privacy.secagg import decode, encode_integers

    p = _params(length=300, n_min=2, cohort=3)
    ring = p.ring()
    big = np.full(p.dim, 2 ** (ring.ring_bits - 2) + 1, np.int64)
    acc = encode_integers(big, ring)[0] + encode_integers(big, ring)[0]
    wrapped = decode(acc, ring)
    assert np.all(wrapped < 0)  # wrapped: the true sum is positive
    assert np.linalg.norm(ddp.server_decode(wrapped, p, CTX)) > ddp.sum_norm_bound(p, 2)


# --- accounting ---

def test_the_skellam_bound_tends_to_the_gaussian_and_is_above_it():
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    p = _params(length=1000, n_min=5, cohort=5, z=1.2)
    rdp = ddp.round_rdp(p, 5, 1.0)
    gauss = np.array([a / (2 * p.z ** 2) for a in ddp.ORDERS])
    assert np.all(rdp >= gauss) and np.all(rdp <= gauss * 1.01)
    eps = ddp.epsilon(rdp * 10, 1e-5)
    eps_gauss, _ = compute_epsilon(list(ddp.ORDERS), list(gauss * 10), 1e-5)
    assert eps_gauss <= eps <= eps_gauss * 1.01
    # more survivors, more noise, a smaller epsilon; fewer, a larger
    assert ddp.epsilon(ddp.round_rdp(p, 4, 1.0), 1e-5) > ddp.epsilon(rdp, 1e-5) > \
        ddp.epsilon(ddp.round_rdp(p, 6, 1.0), 1e-5)


def test_zhu_wang_amplification_bounds_the_exact_subsampled_gaussian_from_above():
    """Theorem 5 of Zhu and Wang is an upper bound for any mechanism: applied to the
    Gaussian's RDP it must be >= dp_accounting's exact RDP of the Poisson-subsampled
    Gaussian (and below the unamplified), or the implementation is wrong."""
    import dp_accounting
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    z, q = 1.0, 0.2
    orders = [2, 3, 4, 8, 16, 32]
    acc = RdpAccountant(orders=orders)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    exact = np.asarray(acc._rdp)
    ours = np.array([ddp.subsampled_rdp(a, q, lambda l: l / (2 * z * z)) for a in orders])
    assert np.all(ours >= exact * (1 - 1e-9))
    assert np.all(ours < np.array(orders) / (2 * z * z))
    assert ours[0] <= 2 * exact[0]  # a bound, but not a vacuous one


# --- preflight ---

@pytest.mark.parametrize("privacy, words", [
    ({"dp": "client"}, "secure_aggregation"),
    ({"secure_aggregation": True}, "dp = client"),
    ({"secure_aggregation": True, "dp": "record"}, "dp = client"),
    ({"secure_aggregation": True, "dp": "client", "target_epsilon": 3.0}, "target_epsilon"),
])
def test_preflight_refuses_distributed_noise_it_cannot_honour(privacy, words):
    with pytest.raises(ConfigError, match=words):
        build_config({"algorithm": {"name": "fedavg"},
                      "privacy": {"dp_noise": "distributed", **privacy}})
    build_config({"algorithm": {"name": "fedavg"},
                  "privacy": {"dp_noise": "distributed", "dp": "client",
                              "secure_aggregation": True}})


def test_a_client_refuses_a_server_asking_for_less_noise():
    privacy = {"dp_noise_multiplier": 1.0, "dp_clip": 1.0, "secagg_dropout": 0.3}
    DDPParams(1.0, 1.0, 100, 7, 10).check(privacy)
    for bad in (DDPParams(1.0, 0.5, 100, 7, 10), DDPParams(2.0, 1.0, 100, 7, 10),
                DDPParams(1.0, 1.0, 100, 10, 10)):
        with pytest.raises(ddp.DDPError):
            bad.check(privacy)


def test_a_client_node_refuses_tasks_that_ask_too_little_noise():
    """The node's SecureClient checks a task's distributed-DP parameters against its own
    [privacy] before anything else: a smaller z, or no noise asked for at all under
    dp_noise = distributed, ends there (nothing is sent)."""
    from fedbus.algorithms import get_algorithm
    from fedbus.algorithms.core.params import resolved_params
    from fedbus.node.privacy.secure_round import SecureClient
    from tests.test_secure_aggregation import _engine

    cfg = _config()
    _, tasks = _engine(cfg)
    server_cls = get_algorithm(cfg.algorithm.name).server
    params = resolved_params(server_cls, dict(cfg.algorithm))

    def node():
        return SecureClient(server_cls.merge_rule(params), params, unit_weight=True,
                            privacy=cfg.privacy)

    t = tasks[0]
    assert node().begin(t.dst, t.body)["step"] == "keys"  # the honest task
    field = t.body["secagg"]
    weak = {**t.body, "secagg": {**field, "ddp": {**field["ddp"], "z": 0.5}}}
    with pytest.raises(ddp.DDPError, match="less noise"):
        node().begin(t.dst, weak)
    bare = {**t.body, "secagg": {k: v for k, v in field.items() if k != "ddp"}}
    with pytest.raises(ValueError, match="no noise"):
        node().begin(t.dst, bare)


# --- the engine with real clients (SecureClient, real secagg), scripted messages ---

def _config(**privacy):
    return build_config({
        "federation": {"clients": 6, "rounds": 3, "seed": 3, "fraction": 1.0,
                       "deadline_s": 5.0},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": "fedavg"},
        "privacy": {"secure_aggregation": True, "secagg_timeout_s": 10.0, "dp": "client",
                    "dp_noise": "distributed", "dp_clip": 0.5, "dp_noise_multiplier": 1.0,
                    **privacy}})


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(-1) for k in sorted(tree)])


def _clip(delta, clip):
    norm = np.linalg.norm(_flat(delta))
    return {k: np.asarray(v, np.float64) * min(1.0, clip / norm) for k, v in delta.items()}


@pytest.mark.parametrize("drop", [None, "input", "shares"])
def test_the_server_unmasks_the_noised_sum_adds_no_noise_and_charges_the_survivors(drop):
    from fedbus.broker.wire import decode as wire_decode
    from fedbus.broker.wire import encode as wire_encode
    from fedbus.node.privacy.secagg import decode as ring_decode
    from fedbus.node.privacy.secagg import unpack
    from tests.test_secure_aggregation import _engine, _global, _payload, secure_round

    cfg = _config()
    engine, tasks = _engine(cfg)
    assert len(tasks) == 6
    field = tasks[0].body["secagg"]
    p = DDPParams.from_dict(field["ddp"])
    assert p.n_min == 5 and p.cohort == 6  # ceil((1 - 0.3) x 6)
    before = _global(engine)
    victim = int(tasks[2].dst[1:])
    kw = {"input": {"drop_input": (victim,)}, "shares": {"drop_shares": (victim,)},
          None: {}}[drop]
    _, cl = secure_round(engine, cfg, tasks, **kw)
    rec = engine.records[-1] if engine.records else engine.evals[max(engine.evals)].record
    survivors = 6 if drop != "shares" else 5
    assert rec["secagg"]["survivors"] == survivors and "failed" not in rec["secagg"]
    counted = [int(t.dst[1:]) for t in tasks if drop != "shares" or int(t.dst[1:]) != victim]
    # the noiseless sum of the survivors' clipped deltas, which no party ever held
    deltas = [_clip(_payload(engine, c, 0)["delta"], 0.5) for c in counted]
    noiseless = np.sum([_flat(d) for d in deltas], axis=0)
    after = _global(engine)
    expected = cfg.federation.fraction * cfg.federation.clients
    noised = (_flat(after) - _flat(before)) * expected  # what the server stepped by x mass
    residual = noised - noiseless
    # the residual is the clients' noise alone: variance per value survivors x mu / n_min /
    # gamma^2 (plus the rounding's, < survivors / 4 / gamma^2, and float32 rounding of the
    # weights). Central noise added by the server on top would double it (z C = noise
    # std): the sample variance of L values has relative s.e. ~ sqrt(2 / L) ~ 0.6 %, the
    # band below is 6 of them around the accounted variance
    var = p.noise_std(survivors) ** 2 + survivors / 4 / p.scale ** 2
    rel = 6 * math.sqrt(2.0 / len(residual))
    assert abs(np.var(residual) / var - 1) <= rel + 1e-3, (np.var(residual), var)
    assert rec["secagg"]["ddp"]["noise_std"] == pytest.approx(p.noise_std(survivors))
    # the epsilon reported is the accountant's for these survivors (q = fraction = 1)
    eps = ddp.epsilon(ddp.round_rdp(p, survivors, 1.0), cfg.privacy.delta)
    assert rec["dp"]["epsilon"] == pytest.approx(eps, abs=1e-6)
    assert rec["dp"]["noise"] == "distributed" and rec["dp"]["survivors"] == survivors
    # everything the server received: no message holds the noiseless sum, or any client's
    # delta, in any form it could read: updates carry masked ring elements only, and a
    # masked input read as a sum of noised integers is nowhere near a client's vector
    signs = ddp.rotation_signs(field["context"].encode(), p.dim)
    seen = 0
    for msg in cl.sent:
        body = wire_decode(wire_encode(msg), max_frame=1 << 30).body  # as it went on the wire
        if msg.kind != "update":
            continue
        assert set(body["payload"]) == {"masked"}
        packed = body["payload"]["masked"]
        assert packed.dtype == np.uint8 and packed.shape == (p.dim, p.ring().ring_bits // 8)
        read = ddp.unrotate(ring_decode(unpack(packed, p.ring().ring_bits), p.ring()) /
                            p.scale, signs, p.length)[:-1]  # (the mass, last, is 0)
        own = _flat(_clip(_payload(engine, int(msg.src[1:]), 0)["delta"], 0.5))
        for target in (noiseless, own):
            # the mask leaves values spread over the ring: hundreds of times the vector
            assert np.linalg.norm(read - target) > 100 * np.linalg.norm(target)
        seen += 1
    assert seen == (6 if drop != "shares" else 5)


def test_a_round_charges_what_its_survivors_carry_and_composes():
    from tests.test_secure_aggregation import _engine, secure_round

    cfg = _config()
    engine, tasks = _engine(cfg)
    secure_round(engine, cfg, tasks)
    p = DDPParams.from_dict(tasks[0].body["secagg"]["ddp"])
    one = engine.ledger.epsilon()
    state = engine.ledger.state_dict()
    assert state["ddp"]["rounds"] == 1
    # a second round with the same survivors composes to the accountant's two rounds
    rdp = ddp.round_rdp(p, 6, 1.0)
    engine.ledger.charge_distributed(p, 6, 1.0)
    assert engine.ledger.epsilon() == pytest.approx(ddp.epsilon(2 * rdp, cfg.privacy.delta))
    assert engine.ledger.epsilon() > one
    # a resumed ledger reads the same composition back
    from fedbus.node.privacy.budget import PrivacyLedger

    again = PrivacyLedger(cfg.privacy, cfg.train)
    again.load_state_dict(engine.ledger.state_dict())
    assert again.epsilon() == pytest.approx(engine.ledger.epsilon())


# --- a real federation: broker, server and nodes on loopback, digits ---

def test_a_federation_with_distributed_noise_reports_the_survivors_epsilon(tmp_path):
    """fedbus run with dp_noise = distributed: each round's sum is unmasked with the clients'
    noise in it (the record says how much), the run's epsilon is the accountant's
    composition over the rounds' survivors, and everything the server received (its
    message log) holds masked ring elements where the updates are: no float vector a
    delta or a sum of deltas could be read from."""
    from fedbus.broker.wire import decode as wire_decode
    from fedbus.record.msglog import read_log
    from tests.helpers import SMALL, fedbus, merged, metrics, run_federation

    sections = merged(SMALL, federation={"clients": 6, "rounds": 2, "fraction": 1.0},
                      privacy={"secure_aggregation": True, "secagg_timeout_s": 60.0,
                               "dp": "client", "dp_noise": "distributed", "dp_clip": 1.0,
                               "dp_noise_multiplier": 1.0})
    run, summary = run_federation(tmp_path, sections)
    assert summary["rounds_completed"] == 2
    recs = metrics(run)
    assert len(recs) == 2
    rdp = np.zeros(len(ddp.ORDERS))
    for r in recs:
        s = r["secagg"]
        assert s.get("failed") is None, s
        m = s["ddp"]
        p = DDPParams(1.0, 1.0, m["length"], m["n_min"], m["cohort"])
        assert s["ring_bits"] == p.ring().ring_bits and s["frac_bits"] == 0
        assert m["noise_std"] == pytest.approx(p.noise_std(s["survivors"]))
        assert m["noise_std"] >= 1.0  # at least the central mechanism's z C
        rdp += ddp.round_rdp(p, s["survivors"], 1.0)
        assert r["dp"]["noise"] == "distributed"
        assert r["dp"]["epsilon"] == pytest.approx(ddp.epsilon(rdp, 1e-5), abs=1e-6)
    length = recs[0]["secagg"]["ddp"]["length"]
    updates = 0
    for rec in read_log(run):
        if rec.direction != "in" or len(rec.frames) < 2:
            continue
        msg = wire_decode(rec.frames, max_frame=max(len(f) for f in rec.frames) + 1)
        if msg.kind == "update":
            assert set(msg.body["payload"]) == {"masked"}
            assert msg.body["payload"]["masked"].dtype == np.uint8
            updates += 1
        stack = [msg.body]
        while stack:  # no float array of a delta's size anywhere in what came in
            v = stack.pop()
            if isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, np.ndarray):
                assert not (v.dtype.kind == "f" and v.size >= length - 1), (msg.kind, v.shape)
    assert updates == 12
    # the server's side is a function of what it received: a replay redoes it exactly
    out = fedbus("replay", str(run), timeout=240)
    assert "replay identical" in out.stdout, out.stdout + out.stderr

"""Issue 42's DP claims, each held to what fedbus states (SECURITY.md 3b/3c, docs/PRIVACY.md):

- record level is refused over a feature extractor trained without DP on the same data,
  and over a DP-SGD extractor both releases are composed (Why 1);
- client level draws its cohorts Poisson, from the server's secret seed, as the accountant
  assumes, divides by the expected cohort size, and still releases noise when no one takes
  part; sampling = size is refused (Why 2);
- the clip holds after float32 and fixed-point rounding, clipped deltas are counted in the
  records, test-set embeddings are not asked for under secure aggregation unless set
  (Why 6);
- every float setting refuses NaN and infinity at load (Why 11).
"""
from __future__ import annotations

import math
import types

import dp_accounting
import numpy as np
import pytest

from fedbus.node.config import ConfigError, build_config
from fedbus.node.engine import client_address
from fedbus.node.privacy.dp import RDP_ORDERS, clip_update
from fedbus.node.server import build_engine, dispatch
from tests.test_secure_aggregation import WORK, _msg

RUN = "r"


def _raw(**sections):
    raw = {"federation": {"clients": 4, "rounds": 2, "seed": 5},
           "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": "mlp"},
           "algorithm": {"name": "fedproto"}}
    for name, table in sections.items():
        raw[name] = {**raw.get(name, {}), **table}
    return raw


def _one_line_error(raw, *words):
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text
    return text


# --- Why 1: record level over a data-dependent extractor ---------------------------------

def test_record_level_dp_over_an_extractor_trained_plainly_is_refused_naming_the_fix():
    _one_line_error(_raw(privacy={"dp": "record"}, train={"epochs": 1}),
                    "privacy.dp = record", "privacy.dp_extractor = sgd", "train.epochs = 0")


@pytest.mark.parametrize("admitted", [{"train": {"epochs": 0}},
                                      {"privacy": {"dp_extractor": "sgd"}}])
def test_record_level_dp_is_admitted_over_an_untrained_or_dp_sgd_extractor(admitted):
    raw = _raw(privacy={"dp": "record"})
    for section, table in admitted.items():
        raw[section] = {**raw.get(section, {}), **table}
    cfg = build_config(raw)
    assert cfg.privacy.dp == "record"


def test_a_dp_sgd_extractor_composes_its_steps_with_the_prototype_releases():
    from fedbus.algorithms.core.dp_sgd import task_sampling
    from fedbus.node.privacy.budget import PrivacyLedger

    cfg = build_config(_raw(privacy={"dp": "record", "dp_extractor": "sgd",
                                     "dp_noise_multiplier": 1.3},
                            train={"epochs": 2, "batch_size": 16}))
    sizes = {0: 100, 1: 40}
    ledger = PrivacyLedger(cfg.privacy, cfg.train, sizes)
    ledger.charge_clients([0, 1])
    ledger.charge_clients([0])
    want = {}
    for c, tasks in ((0, 2), (1, 1)):
        q, steps = task_sampling(sizes[c], 16, 2)
        acc = dp_accounting.rdp.RdpAccountant(orders=list(RDP_ORDERS))
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.3)),
                    tasks * steps)
        acc.compose(dp_accounting.GaussianDpEvent(1.3 / math.sqrt(2)), tasks)
        want[c] = acc.get_epsilon(1e-5)
        assert ledger.epsilon_of(c) == pytest.approx(want[c], rel=1e-6)
    assert ledger.epsilon() == pytest.approx(max(want.values()), rel=1e-6)
    # more than either release alone
    only_protos = PrivacyLedger({**cfg.privacy, "dp_extractor": "plain"}, cfg.train, sizes)
    assert ledger.epsilon_of(1) > only_protos.epsilon_of(1, 1)


def test_the_client_trains_with_dp_sgd_under_a_dp_sgd_extractor():
    """FedProto's own client, on real digits: under a DP-SGD extractor its local run goes
    through Opacus (per-sample clip and noise from the OS), so two runs from the same state
    and task seed differ; seeded noise makes them alike again."""
    import torch

    from fedbus.algorithms.core.handlers import LocalRun
    from fedbus.node.pool import ClientPool

    def repeatable(extra):
        cfg = build_config(_raw(privacy={"dp": "record", "dp_extractor": "sgd", **extra},
                                train={"epochs": 1, "batch_size": 16}))
        handler = ClientPool(cfg, torch.device("cpu"), clients=[0]).get(0)
        model = handler.ctx.model
        start = {k: v.clone() for k, v in model.state_dict().items()}
        ends = []
        for _ in range(2):
            model.load_state_dict(start)
            handler.run_local(LocalRun(handler.ctx, epochs=1, seed=3))
            ends.append({k: v.clone() for k, v in model.state_dict().items()})
        assert any(not torch.equal(ends[0][k], start[k]) for k in start)  # it trained
        return all(torch.equal(ends[0][k], ends[1][k]) for k in start)

    assert not repeatable({})  # secret noise: no two runs alike
    assert repeatable({"dp_noise": "seeded"})


# --- Why 2: client level's cohorts ---------------------------------------------------------

def _fedavg(clients=4, noise_seed=None, **federation):
    cfg = build_config({
        "federation": {"clients": clients, "rounds": 40, "seed": 5, "eval_every": 100,
                       **federation},
        "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": "mlp"},
        "algorithm": {"name": "fedavg"},
        "privacy": {"dp": "client", "dp_clip": 1.0, "dp_noise_multiplier": 1e-6}})
    engine = build_engine(cfg, RUN)
    if noise_seed is not None:
        engine.noise_seed = noise_seed  # as ServerNode sets the run's secret seed
    engine.on_join("n", [client_address(c) for c in range(clients)], 0.0)
    return engine, engine.on_configured("n", RUN, 0.0)


def _delta(engine, client, norm=50.0):
    rng = np.random.default_rng(client)
    spec = engine.handler.update_spec()["delta"]
    raw = {k: rng.normal(0, 1.0, size=shape).astype(np.float32)
           for k, (_, shape) in spec.items()}
    scale = norm / np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in raw.values()))
    return clip_update({k: v * np.float32(scale) for k, v in raw.items()}, 1.0)[0]


def _weights(engine):
    return {k: np.asarray(v, dtype=np.float64)
            for k, v in engine.handler.state_dict()["weights"].items()}


def _answer(engine, outs, now=1.0):
    """Answer every task of a round; returns (its cohort, the next round's outs)."""
    tasks = [o for o in outs if o.kind == "task"]
    nxt = []
    for t in tasks:
        c = int(t.dst[1:])
        body = {"task": t.body["task"], "version": t.body["version"], "num_samples": 10 + c,
                "work": WORK, "payload": {"delta": _delta(engine, c)}}
        nxt += dispatch(engine, _msg("update", t.dst, body, t.round), now)
    return sorted(int(t.dst[1:]) for t in tasks), nxt


def _cohorts(engine, outs, rounds):
    """The cohorts of the next `rounds` rounds (an empty cohort's round closes as it
    starts, so the next round's tasks are already in `outs`)."""
    seen = []
    while len(seen) < rounds:
        version = engine.version
        cohort, outs = _answer(engine, outs)
        seen += [[]] * max(0, engine.version - version - 1) + [cohort]
    return seen[:rounds], outs


def test_client_level_cohorts_come_from_the_servers_secret_seed_poisson():
    a, outs_a = _fedavg(clients=20, noise_seed=11, fraction=0.5)
    b, outs_b = _fedavg(clients=20, noise_seed=11, fraction=0.5)
    c, outs_c = _fedavg(clients=20, noise_seed=12, fraction=0.5)
    got_a, _ = _cohorts(a, outs_a, 8)
    got_b, _ = _cohorts(b, outs_b, 8)
    got_c, _ = _cohorts(c, outs_c, 8)
    assert got_a == got_b  # the same secret (a replay, a resume) draws the same cohorts
    assert got_a != got_c  # not the run's public seed: another secret, other cohorts
    # each client in independently: the cohort's size varies (a fixed-size draw never does)
    assert len({len(x) for x in got_a + got_c}) > 1
    # every round (the one in flight too: charged as its tasks left) composed as
    # PoissonSampled(fraction, Gaussian(z)), whatever its cohort's size
    assert a.ledger.run.state_dict()["entries"] == [[1e-6, 0.5, a.version + 1]]


def test_a_resumed_engine_continues_the_same_cohort_stream():
    a, outs = _fedavg(clients=20, noise_seed=7, fraction=0.3)
    _cohorts(a, outs, 3)
    state = a.state_dict()
    assert "cohort_rng" in state
    b, _ = _fedavg(clients=20, noise_seed=7, fraction=0.3)
    b.load_state_dict(state)
    live = list(range(20))
    assert [a._sample(live, 0) for _ in range(5)] == [b._sample(live, 0) for _ in range(5)]


def test_client_level_steps_by_the_expected_cohort_size_not_the_count():
    # fraction 0.5 of 4 clients: the denominator is 2 whatever the cohort drawn
    engine, outs = _fedavg(clients=4, noise_seed=3, fraction=0.5)
    before = _weights(engine)
    cohort, _ = _answer(engine, outs)
    assert cohort, "this seed's first cohort is not empty"
    want = {k: sum(_delta(engine, c)[k].astype(np.float64) for c in cohort) / 2.0
            for k in before}
    after = _weights(engine)
    for k in before:
        np.testing.assert_allclose(after[k] - before[k], want[k], atol=5e-6, err_msg=k)


def test_an_empty_client_level_cohort_still_releases_the_noise():
    z = 2.0
    for seed in range(200):  # the first secret whose first cohort (q = 0.2 of 4) is empty
        cfg = build_config({
            "federation": {"clients": 4, "rounds": 3, "seed": 5, "fraction": 0.2,
                           "eval_every": 100},
            "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": "mlp"},
            "algorithm": {"name": "fedavg"},
            "privacy": {"dp": "client", "dp_clip": 1.0, "dp_noise_multiplier": z}})
        engine = build_engine(cfg, RUN)
        engine.noise_seed = seed
        before = _weights(engine)
        engine.on_join("n", [client_address(c) for c in range(4)], 0.0)
        engine.on_configured("n", RUN, 0.0)
        if engine.version == 1:
            break
    else:
        pytest.fail("no empty first cohort in 200 secrets")
    rec = engine.records[0] if engine.records else None
    assert rec is not None and rec["participants"] == [] and rec["sampled"] == 0
    moved = np.concatenate([(_weights(engine)[k] - before[k]).ravel() for k in before])
    # N(0, (z C)^2) over the expected cohort q x clients = 0.8
    assert moved.size > 1000 and abs(moved.std() - z / 0.8) < 0.1


def test_size_sampling_is_refused_with_client_level_dp():
    raw = _raw(algorithm={"name": "fedavg"}, privacy={"dp": "client"},
               federation={"sampling": "size"})
    _one_line_error(raw, "federation.sampling = size", "privacy.dp = client")


# --- Why 6: rounding inside the clip, counts, embeddings -----------------------------------

def test_a_clipped_delta_is_no_longer_than_the_clip_after_float32_rounding():
    over = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        tree = {"w": rng.normal(0, 3.0, size=(257,)), "b": rng.normal(0, 3.0, size=(31, 7))}
        out, _ = clip_update(tree, 1.0)
        norm = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in out.values()))
        over.append(norm - 1.0)
    assert max(over) <= 0.0, max(over)


def test_under_secure_aggregation_the_fixed_point_delta_stays_within_the_clip():
    from fedbus.node.client_host import dp_release

    frac_bits = 4  # a coarse grid: its rounding alone would pass the clip
    privacy = {"dp": "client", "dp_clip": 1.0, "dp_noise_multiplier": 1.0,
               "secure_aggregation": True, "secagg_frac_bits": frac_bits}
    handler = types.SimpleNamespace(ctx=None)
    worst = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        delta = {"w": rng.normal(0, 1.0, size=(400,)).astype(np.float32)}
        sent = dp_release(handler, {"delta": delta}, privacy, seed)["delta"]["w"]
        encoded = np.rint(sent.astype(np.float64) * 2 ** frac_bits) / 2 ** frac_bits
        worst.append(float(np.linalg.norm(encoded)))
    assert max(worst) <= 1.0, max(worst)


def test_the_records_count_the_deltas_at_the_clip():
    engine, outs = _fedavg(clients=4, noise_seed=1, fraction=1.0)
    cohort, _ = _answer(engine, outs)
    rec = engine.records[-1]
    assert rec["dp"]["clipped"] == len(cohort) == 4 and rec["dp"]["deltas"] == 4


@pytest.mark.parametrize("log,want", [({}, 0), ({"embeddings": 5}, 5)])
def test_test_set_embeddings_are_off_under_secure_aggregation_unless_set(log, want):
    raw = _raw(privacy={"secure_aggregation": True}, log=log)
    assert build_config(raw).log.embeddings == want
    assert build_config(_raw(log=log)).log.embeddings == (want or 200)


# --- Why 11: NaN and infinity ---------------------------------------------------------------

@pytest.mark.parametrize("section,key,value", [
    ("privacy", "dp_noise_multiplier", float("nan")), ("privacy", "secagg_dropout", float("nan")),
    ("privacy", "dp_clip", float("nan")), ("privacy", "dp_clip", float("inf")),
    ("privacy", "target_epsilon", float("inf")), ("federation", "deadline_s", float("nan")),
    ("train", "lr", float("-inf")), ("algorithm", "lam", float("nan"))])
def test_every_float_setting_refuses_nan_and_infinity_at_load(section, key, value):
    _one_line_error(_raw(**{section: {key: value}}), f"{section}.{key}", "finite")


def test_a_nan_given_with_set_is_refused_too():
    from fedbus.node.config import load_config

    with pytest.raises(ConfigError, match="privacy.dp_noise_multiplier = nan: must be a finite"):
        load_config(None, ["privacy.dp_noise_multiplier=nan"])

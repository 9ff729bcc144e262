"""The group test that finds a client whose masked input spoils secure aggregation
(fedbus.node.privacy.culprit), driven round by round without processes: the cohorts the
search draws, the failures a spoiler causes, and who ends excluded."""
from __future__ import annotations

import numpy as np
import pytest

from fedbus.node.privacy.culprit import CulpritSearch


def _sampler(rng: np.random.Generator):
    def sample(candidates: list[int], k: int) -> list[int]:
        k = min(k, len(candidates))
        return sorted(int(c) for c in rng.choice(candidates, size=k, replace=False))
    return sample


def _run(search: CulpritSearch, n: int, k: int, spoils, rounds: int, seed: int):
    """Rounds of n live clients, k sampled; spoils(client, round) -> whether that client's
    input spoils the sum this round. Returns the cohorts and the failed rounds."""
    sample = _sampler(np.random.default_rng(seed))
    cohorts, failed = [], []
    for r in range(rounds):
        cohort = search.cohort(search.eligible(range(n)), k, sample)
        cohorts.append(cohort)
        if any(spoils(c, r) for c in cohort):
            failed.append(r)
            search.on_failed(r, cohort)
    return cohorts, failed


@pytest.mark.parametrize("seed", range(60))
def test_a_client_spoiling_every_round_is_excluded_with_at_most_min_cohort_minus_one_other(seed):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(6, 41)), int(rng.integers(2, 4))
    spoiler = int(rng.integers(n))
    search = CulpritSearch(seed, min_cohort=m)
    cohorts, failed = _run(search, n, n, lambda c, r: c == spoiler, 80, seed)
    assert spoiler in search.excluded
    assert len(search.excluded) <= m
    assert all(len(c) >= m for c in cohorts), "a round summed fewer inputs than the minimum"
    after = failed[-1] + 1
    assert all(spoiler not in c for c in cohorts[after:]) and len(cohorts) > after
    assert not search.searching
    # each failure after the first at least halves nothing back: the candidates only shrink
    assert len(failed) <= 2 * int(np.ceil(np.log2(n))) + 1


@pytest.mark.parametrize("seed", range(40))
def test_spoilers_that_behave_while_tested_or_come_in_pairs_are_still_among_the_excluded(seed):
    """Adaptive spoilers (each spoils a round it is in with probability 1/2) and two of them
    at once: every exclusion names a group holding a spoiler, never only honest clients."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(8, 33))
    spoilers = {int(c) for c in rng.choice(n, size=2, replace=False)}
    coins = np.random.default_rng(seed)
    search = CulpritSearch(seed, min_cohort=2)
    excluded_groups = []
    sample = _sampler(np.random.default_rng(seed))
    for r in range(300):
        cohort = search.cohort(search.eligible(range(n)), n, sample)
        if any(c in spoilers and coins.random() < 0.5 for c in cohort):
            group = search.on_failed(r, cohort)
            if group:
                excluded_groups.append(set(group))
    assert excluded_groups, "no spoiler was ever excluded"
    for group in excluded_groups:
        assert group & spoilers, f"only honest clients excluded: {group}"
    assert spoilers <= set(search.excluded)


def test_outside_a_search_the_engine_sampler_decides_and_nobody_sits_out():
    search = CulpritSearch(0, min_cohort=2)
    calls = []

    def sample(candidates, k):
        calls.append((list(candidates), k))
        return list(candidates)[:k]

    assert search.cohort(list(range(10)), 4, sample) == [0, 1, 2, 3]
    assert calls == [(list(range(10)), 4)] and search.record() == {}


def test_a_search_whose_candidates_left_ends_and_the_next_failure_starts_another():
    search = CulpritSearch(0, min_cohort=3)
    search.on_failed(4, range(10))
    assert search.searching and search.record()["candidates"] == 10
    # only 2 of the 10 suspects are still live: they can be neither split nor summed
    cohort = search.cohort([0, 1, 20, 21, 22], 5, lambda c, k: list(c)[:k])
    assert cohort == [0, 1, 20, 21, 22] and not search.searching
    search.on_failed(5, [20, 21, 22, 23])
    assert search.excluded == {} and search.record()["candidates"] == 4


def test_the_search_resumes_from_its_state_to_the_same_cohorts():
    a = CulpritSearch(7, min_cohort=2)
    a.on_failed(0, range(16))
    state = a.state_dict()
    b = CulpritSearch(99, min_cohort=2)
    b.load_state_dict(state)
    def sample(c, k):
        return list(c)[:k]

    for r in range(1, 6):
        ca, cb = a.cohort(list(range(16)), 16, sample), b.cohort(list(range(16)), 16, sample)
        assert ca == cb
        a.on_failed(r, ca), b.on_failed(r, cb)
    assert a.excluded == b.excluded and a.excluded
    assert all("spoiled the sum of rounds" in why for why in a.excluded.values())


# --------------------------------------------------------------------------- in the engine


def _rounds_with_a_spoiler(rounds: int, spoiler: int, clients: int = 8):
    """Scripted secure rounds on the real engine and the real client side (SecureClient):
    the spoiler masks random bytes of the right shape every round it is sampled in; every
    evaluation is answered. -> (engine, each round's sampled clients)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_engine import eval_results
    from test_secure_aggregation import _config, _engine, secure_round

    def spoil(client, masked):
        if client != spoiler:
            return masked
        m = masked["payload"]["masked"]
        noise = np.random.default_rng(len(cohorts)).integers(0, 256, m.shape, np.uint8)
        return {**masked, "payload": {**masked["payload"], "masked": noise}}

    cfg = _config("fedproto", True, clients=clients, rounds=rounds)
    engine, tasks = _engine(cfg)
    cohorts, now = [], 1.0
    while tasks:
        cohorts.append(sorted(int(t.dst[1:]) for t in tasks))
        outs, _ = secure_round(engine, cfg, tasks, now=now, masked_of=spoil)
        now += 1.0
        outs += eval_results(engine, [o for o in outs if o.kind == "eval"], now)
        tasks = [o for o in outs if o.kind == "task"]
    return engine, cohorts


def test_the_engine_excludes_a_client_whose_masked_input_spoils_every_round():
    """Issue 42 Why 7: random bytes as one client's masked input failed every round, for
    ever, blaming no one. Now the rounds after the first failure test parts of its survivors
    until the spoiler's group is excluded, and every round after that aggregates."""
    engine, cohorts = _rounds_with_a_spoiler(rounds=12, spoiler=3)
    records = [r for r in engine.records if "secagg" in r]
    failed = [r["round"] for r in records if r["secagg"].get("failed")]
    assert failed and failed[0] == 0
    excluded = records[-1]["secagg"]["search"]["excluded"]
    assert "c3" in excluded and len(excluded) <= 2, excluded
    (event,) = [e for e in engine.events if e.get("event") == "clients excluded"]
    assert event["clients"] == excluded and event["round"] == failed[-1]
    assert "spoiled the sum of rounds 0, " in event["reason"]
    last_failure = failed[-1]
    assert last_failure < 11, "the search never ended"
    assert all(3 not in c for c in cohorts[last_failure + 1:])
    assert all(r["secagg"].get("failed") is None for r in records[last_failure + 1:])
    assert all(len(c) >= 2 for c in cohorts)


def test_a_checkpoint_keeps_the_search_and_who_was_excluded():
    """The engine's checkpoint carries the search (a resumed run samples as the
    uninterrupted one would, and never an excluded client again)."""
    from fedbus.broker.wire import decode_body, encode_body
    from fedbus.node.server import build_engine

    engine, _ = _rounds_with_a_spoiler(rounds=5, spoiler=3)
    assert engine.culprits.excluded
    state = engine.state_dict()
    restored = decode_body(encode_body(state))  # as the checkpoint file carries it
    fresh = build_engine(engine.cfg, "r")
    fresh.load_state_dict(restored)
    assert fresh.culprits.excluded == engine.culprits.excluded
    assert fresh.culprits.state_dict() == engine.culprits.state_dict()
    assert fresh.culprits.eligible(range(8)) == [c for c in range(8)
                                                 if c not in engine.culprits.excluded]

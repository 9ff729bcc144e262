"""The deterministic simulation of the federation (fedbus.bench.simworld, `fedbus bench sim`).

Everything here runs on the simulated clock: no verdict depends on the machine's speed.
The planted defects (fedbus.bench.simplant: production functions patched for the block's
duration) are each reported by some seed of a small range as the matching invariant, and
rerunning that seed reports the same violations with the same trace.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from fedbus.bench.sim import parse_seeds
from fedbus.bench.simplant import planted
from fedbus.bench.simworld import World

CLEAN_SEEDS = range(60)  # 60 federations, 3 faults each


def run(seed: int, **kw):
    world = World(seed, **kw)
    try:
        return world.run()
    finally:
        world.close()


@pytest.fixture(autouse=True)
def _quiet():
    import torch

    from fedbus.broker.log import configure_logging

    configure_logging(level="error")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# The one open finding (docs/RELIABILITY.md, "Simulation"): a node that misses the run's
# shutdown waits for ever, when it registers after the shutdown with no run id (restarted,
# not configured yet), when the server ends while the broker is down, or below a relay,
# whose site broker keeps no ended run (the relay registers there before it knows its run).
OPEN_FINDING = ("(not configured since its start", "(the server ended with the broker down",
                "(its site broker kept no ended run")
BELOW = "(its relay missed the shutdown)"  # explained by its relay's violation


def unexplained(violations) -> list[str]:
    """The violations other than the open finding (a hang is that finding only when a node
    that missed the shutdown explains it)."""
    explained = any(v.invariant == "completion" and any(m in v.detail for m in OPEN_FINDING)
                    for v in violations)
    return [str(v) for v in violations
            if not (v.invariant == "completion" and explained and (
                "never took the shutdown" in v.detail and
                (any(m in v.detail for m in OPEN_FINDING) or BELOW in v.detail)
                or "did not end within" in v.detail))]


def test_seeds_run_clean_with_every_fault_kind():
    kinds, fired = set(), 0
    for seed in CLEAN_SEEDS:
        res = run(seed)
        assert not unexplained(res.violations), (seed, [str(v) for v in res.violations])
        assert res.rounds_done == 6, seed
        kinds |= {f.kind for f in res.faults if f.fired_at >= 0}
        fired += res.faults_fired
    from fedbus.bench.simworld import FAULT_KINDS

    assert kinds == set(FAULT_KINDS)  # every kind of fault fired in some seed
    assert fired >= 2 * len(CLEAN_SEEDS)


def test_relay_seeds_run_clean():
    """Both nodes below one relay (node/relay.py) on its own site broker; relay kills too."""
    kinds = set()
    for seed in range(20):
        res = run(seed, relays=1)
        assert not unexplained(res.violations), (seed, [str(v) for v in res.violations])
        assert res.rounds_done == 6, seed
        kinds |= {f.kind for f in res.faults if f.fired_at >= 0}
    assert "relay_kill" in kinds


def test_async_seeds_run_clean():
    for seed in range(20):
        res = run(seed, mode="async")
        assert not unexplained(res.violations), (seed, [str(v) for v in res.violations])
        assert res.rounds_done == 6, seed


@pytest.mark.xfail(strict=True, reason="open: a node that misses the run's shutdown waits "
                   "for ever (docs/RELIABILITY.md, Simulation, finding 2)")
@pytest.mark.parametrize("seed", [116, 270])
def test_nodes_that_miss_the_shutdown_still_end(seed):
    assert not run(seed).violations


def test_same_seed_same_trace_other_seed_other_trace():
    a, b, c = run(7), run(7), run(8)
    assert a.trace == b.trace and a.events == b.events and a.frames == b.frames
    assert a.trace != c.trace


def test_replay_in_a_new_process_gives_the_same_trace():
    """Another process (another PYTHONHASHSEED, nothing warm) replays the seed bit for bit."""
    here = run(3).trace
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "bench", "sim", "--seeds",
                          "3-3", "--trace"], check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"trace {here}" in out.stdout


def first_violating(seeds: range, invariant: str, **kw):
    for seed in seeds:
        res = run(seed, **kw)
        hits = [v for v in res.violations if v.invariant == invariant]
        if hits:
            return seed, res
    return None, None


def assert_caught_and_replayed(seeds: range, invariant: str, **kw) -> None:
    seed, res = first_violating(seeds, invariant, **kw)
    assert seed is not None, f"no seed of {seeds} reported {invariant}"
    again = run(seed, **kw)
    assert again.trace == res.trace
    assert [str(v) for v in again.violations] == [str(v) for v in res.violations]


def test_planted_duplicate_aggregation_is_caught():
    """The server's two defences against a duplicate update off (the runtime's duplicate
    detection, the engine's one answer per task): the network's duplicated frames reach the
    aggregation twice."""
    with planted("duplicate"):
        assert_caught_and_replayed(range(40), "once")


def test_duplicates_past_the_runtime_still_aggregate_once():
    """With the runtime's duplicate detection alone off, the engine keeps each update once."""
    dups = 0
    with planted("dedup-off"):
        for seed in range(12):
            res = run(seed)
            assert not unexplained(res.violations), (seed, [str(v) for v in res.violations])
            dups += res.duplicated
    assert dups > 0


def test_planted_record_lost_at_resume_is_caught():
    """A resumed server drops one record too many (the last one its checkpoint counts)."""
    with planted("record-lost"):
        assert_caught_and_replayed(range(40), "window")


def test_planted_double_fold_is_caught():
    """A late update folded into one aggregation is folded into the next one too."""
    with planted("double-fold"):
        assert_caught_and_replayed(range(40), "aggregated")


def test_planted_defect_from_the_command_line_prints_its_replay():
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "bench", "sim", "--seeds",
                          "0-9", "--plant", "double-fold"], check=False, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "violated aggregated: seeds" in out.stdout
    assert "--plant double-fold --trace" in out.stdout


def test_fedproto_trains_under_faults():
    """The real FedProto handlers on digits, not only the no-op algorithm."""
    for seed in (0, 1):
        res = run(seed, algorithm="fedproto", rounds=3)
        assert not res.violations, (seed, [str(v) for v in res.violations])
        assert res.rounds_done == 3


def test_seed_ranges_parse_and_bad_ones_say_why():
    assert parse_seeds("3-5") == range(3, 6)
    assert parse_seeds("17") == range(17, 18)
    for bad in ("5-2", "a-b", "1-2-3", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def test_cli_usage_error_is_one_line():
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "bench", "sim", "--seeds",
                          "9-1"], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "fedbus bench sim: --seeds '9-1': need 0 <= A <= B"]

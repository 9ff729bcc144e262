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
    return run_world(seed, **kw)[0]


def run_world(seed: int, **kw):
    """(the result, the finished world: who exited in which order, its brokers)"""
    world = World(seed, **kw)
    try:
        return world.run(), world
    finally:
        world.close()


def problems(res) -> list[str]:
    return [str(v) for v in res.violations]


@pytest.fixture(autouse=True)
def _quiet():
    import torch

    from fedbus.broker.log import configure_logging

    configure_logging(level="error")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_seeds_run_clean_with_every_fault_kind():
    kinds, fired = set(), 0
    for seed in CLEAN_SEEDS:
        res = run(seed)
        assert not res.violations, (seed, problems(res))
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
        assert not res.violations, (seed, problems(res))
        assert res.rounds_done == 6, seed
        kinds |= {f.kind for f in res.faults if f.fired_at >= 0}
    assert "relay_kill" in kinds


def test_batched_seeds_run_clean():
    """bus.batch = auto: a round's tasks one `tasks` message a node, its answers one
    `updates`; the network drops, duplicates and reorders those frames as any other."""
    for seed in range(30):
        res = run(seed, batch="auto")
        assert not res.violations, (seed, problems(res))
        assert res.rounds_done == 6, seed


def test_async_seeds_run_clean():
    for seed in range(20):
        res = run(seed, mode="async")
        assert not res.violations, (seed, problems(res))
        assert res.rounds_done == 6, seed


# A node that misses the run's shutdown learns the run ended and exits, whichever way it
# missed it (docs/RELIABILITY.md, Simulation, finding 2: each scenario below hung before;
# the seeds were drawn again for the same scenarios when the client-state flushes,
# PROTOCOL.md §4.2, added frames and so changed every seed's draws). These seeds were drawn
# with bus.batch = "off", which they keep: batching changes the frames, so every draw.


@pytest.mark.parametrize("seed", [293, 116, 426])
def test_a_node_back_after_the_end_is_told_the_run_ended(seed):
    """It registers after the shutdown, never configured in its life: restarted past the
    end, with its clients' states on disk (293) or before it wrote one (116: its node's
    mark), or cut off before its config ever came (426: the same process, known to the
    broker from the run). The broker sends it the ended run's shutdown."""
    res, world = run_world(seed, batch="off")
    assert not res.violations, problems(res)
    told = [n for n, node in world.nodes.items()
            if world.exited.get(n) == 0 and not node.node.run_id]
    assert told, world.exits
    assert world.brokers["broker"].n_ended_sent >= len(told)


@pytest.mark.parametrize("seed", [270, 378, 448])
def test_a_server_that_ends_with_the_broker_down_still_delivers_its_shutdown(seed):
    """The broker is down as the last round closes: the server keeps its connection,
    reconnects to the restarted broker and resends the shutdown before it exits."""
    res, world = run_world(seed, batch="off")
    assert not res.violations, problems(res)
    assert world.broker_down_at_end
    assert all(world.exited.get(n) == 0 for n in world.nodes)


@pytest.mark.parametrize("seed", [33, 57, 61, 97])
def test_a_node_below_a_relay_that_missed_the_shutdown_is_told_by_its_site_broker(seed):
    """The relay passed the shutdown down and left while a node of its site was away; the
    site's broker kept it under the run its header names and sends it as the node comes
    back."""
    res, world = run_world(seed, relays=1, batch="off")
    assert not res.violations, problems(res)
    assert world.brokers["site0"].n_ended_sent >= 1
    assert world.exits.index("r0") < max(world.exits.index(n) for n in world.nodes)


def test_a_node_away_at_the_end_is_told_by_a_broker_restarted_after_the_shutdown():
    """Seed 188 of 9 clients on 3 nodes, batched: node n1 is stopped across the run's end
    and the broker is killed after the server's shutdown went out and the server left,
    before n1 is back. The restarted broker reads the shutdown its predecessor kept in its
    ended-runs file (`fedbus broker --ended-runs`) and sends it as n1 registers; without
    that file n1 waited for the finished run for ever (a completion violation: found as
    seed 270 before batches were lossy in the simulation, this seed since, the only one
    of 0-1199 in this setting)."""
    res, world = run_world(188, clients=9, nodes=3, batch="auto")
    assert not res.violations, problems(res)
    assert {f.kind for f in res.faults if f.fired_at >= 0} >= {"node_stop", "broker_kill"}
    assert world.brokers["broker"].n_ended_sent >= 1  # the restarted one
    assert world.exits.index("server") < world.exits.index("n1")
    assert all(world.exited.get(n) == 0 for n in world.nodes)


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


def test_planted_duplicate_aggregation_is_caught_in_batches_too():
    """The same defect with batching: a duplicated `updates` frame's members reach the
    aggregation twice (before the simulated network duplicated batches, it went unseen)."""
    with planted("duplicate"):
        assert_caught_and_replayed(range(40), "once", batch="auto")


def test_duplicates_past_the_runtime_still_aggregate_once():
    """With the runtime's duplicate detection alone off, the engine keeps each update once."""
    dups = 0
    with planted("dedup-off"):
        for seed in range(12):
            res = run(seed)
            assert not res.violations, (seed, problems(res))
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
    # (under batching, the default, 4 of seeds 0-39 draw the duplicate it needs: 19, 24, 33, 39)
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "bench", "sim", "--seeds",
                          "0-39", "--plant", "double-fold"], check=False, capture_output=True,
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

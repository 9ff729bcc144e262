"""The round engine (fedbus.node.engine) as the state machine it is: scripted events in,
messages and metric records out. No processes, no sockets, no clocks: each event carries
the time the test says, and every message a client sends goes through
fedbus.node.server.dispatch, the path the live server and `fedbus replay` take.

The no-op algorithm (a fixed float32 [10, 512] "state" each way, updates_seen counted by
its aggregate) exercises the flow; FedAvg where the weights' arithmetic is the point."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fedbus.broker.wire import Message
from fedbus.node.config import build_config
from fedbus.node.engine import Engine, Out, client_address, staleness_weight
from fedbus.node.server import build_engine, dispatch

RUN = "r"
WORK = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1}


def make(clients: int = 4, algorithm: str = "noop", **federation) -> Engine:
    """An engine of `clients` clients (digits, iid, MLP), three rounds unless told."""
    cfg = build_config({"federation": {"clients": clients, "rounds": 3, **federation},
                        "data": {"dataset": "digits", "partition": "iid"},
                        "model": {"arch": "mlp"}, "algorithm": {"name": algorithm}})
    return build_engine(cfg, RUN)


def connect(engine: Engine, node: str, clients, now: float = 0.0) -> list[Out]:
    """Node `node` joins hosting `clients` and acknowledges its config: the engine's answer
    to the acknowledgement."""
    engine.on_join(node, [client_address(c) for c in clients], now)
    return engine.on_configured(node, RUN, now)


def started(clients: int = 4, algorithm: str = "noop", **federation):
    """An engine whose one node "n" hosts every client, configured at t=0: (engine, the
    first round's tasks)."""
    engine = make(clients, algorithm, **federation)
    return engine, connect(engine, "n", range(clients))


def of(outs: list[Out], kind: str = "task") -> list[Out]:
    return [o for o in outs if o.kind == kind]


def dsts(outs: list[Out], kind: str = "task") -> list[str]:
    return [o.dst for o in outs if o.kind == kind]


def client(task: Out) -> int:
    return int(task.dst[1:])


def noop_payload(task: Out) -> dict:
    return {"state": np.asarray(task.body["payload"]["state"])}


def delta(engine: Engine, c: int, version: int) -> dict:
    """FedAvg's upload of client c from `version`: a small delta seeded by (c, version)."""
    rng = np.random.default_rng([c, version])
    spec = engine.handler.update_spec()["delta"]
    return {"delta": {k: rng.normal(0, 0.01, size=shape).astype(np.float32)
                      for k, (_, shape) in spec.items()}}


def seed_of(seed: int, c: int, version: int) -> int:
    """A task's training seed, as engine.task_seed documents it."""
    return int(np.random.SeedSequence([seed, c, version]).generate_state(1)[0])


def update(task: Out, payload: dict | None = None, num_samples: int = 1) -> Message:
    body = {"task": task.body["task"], "version": task.body["version"],
            "num_samples": num_samples, "work": WORK,
            "payload": noop_payload(task) if payload is None else payload}
    return Message("update", task.dst, "server", body, run=RUN, round=task.round)


def answer(engine: Engine, tasks: list[Out], now: float) -> list[Out]:
    """Every task answered (no-op payload) at `now`: what the engine sends back."""
    outs: list[Out] = []
    for t in tasks:
        outs += dispatch(engine, update(t), now)
    return outs


def handler_failed(engine: Engine, task: Out, now: float, src: str | None = None) -> list[Out]:
    body = {"code": "handler_failed", "task": task.body["task"], "reason": "boom"}
    return dispatch(engine, Message("error", src or task.dst, "server", body, run=RUN,
                                    round=task.round), now)


def eval_results(engine: Engine, evals: list[Out], now: float, acc: float = 0.5) -> list[Out]:
    outs: list[Out] = []
    for e in evals:
        body = {"eval": e.body["eval"], "version": e.body["version"],
                "metrics": {"acc": acc, "loss": 1.0, "num_test": 10}}
        outs += dispatch(engine, Message("eval_result", e.dst, "server", body, run=RUN,
                                         round=e.round), now)
    return outs


def latest(engine: Engine) -> dict:
    """The record of the latest aggregation: in its evaluation still, or written."""
    pending = [ev.record for ev in engine.evals.values() if ev.version == engine.version]
    return pending[-1] if pending else engine.records[-1]


# --- start ----------------------------------------------------------------------------


def test_a_join_is_answered_with_the_config_and_its_clients_are_live_once_configured():
    engine = make(4)
    outs = engine.on_join("n", ["c0", "c1", "c9", "x"], 0.0)  # c9: no such client; x: none
    assert outs == [Out("config", "n", -1, {"run": RUN, "config": engine.cfg.to_dict()})]
    assert engine.nodes == {"n": [0, 1]} and engine.live == set()
    assert engine.on_configured("n", "another run", 0.5) == [] and engine.live == set()
    assert engine.on_configured("stranger", RUN, 0.5) == [] and engine.live == set()
    assert engine.on_configured("n", RUN, 1.0) == []  # 2 of 4 live: not yet
    assert engine.live == {0, 1} and not engine.started


def test_the_run_starts_when_every_client_is_live():
    engine = make(4)
    assert connect(engine, "n0", [0, 1], 0.0) == []
    outs = connect(engine, "n1", [2, 3], 1.0)
    assert engine.started
    assert [(o.kind, o.dst, o.round) for o in outs] == [("task", f"c{c}", 0) for c in range(4)]


@pytest.mark.parametrize("min_clients, starts", [(2, True), (3, False)])
def test_after_start_timeout_the_run_starts_with_min_clients_live(min_clients, starts):
    engine = make(4, min_clients=min_clients, start_timeout_s=10.0)
    assert connect(engine, "n0", [0, 1], 1.0) == []
    assert engine.next_deadline() == 11.0  # the timeout counts from the first node ready
    assert engine.on_tick(10.9) == []
    outs = engine.on_tick(11.0)
    assert engine.started is starts
    assert dsts(outs) == (["c0", "c1"] if starts else [])


def test_a_node_configured_after_the_start_takes_part_from_the_next_round():
    engine = make(4, min_clients=2, start_timeout_s=10.0, eval_every=100)
    connect(engine, "n0", [0, 1], 0.0)
    first = engine.on_tick(10.0)
    assert dsts(first) == ["c0", "c1"]
    assert connect(engine, "n1", [2, 3], 11.0) == []  # the round in progress is not widened
    assert engine.live == {0, 1, 2, 3} and engine.round.sampled == [0, 1]
    outs = answer(engine, first, 12.0)
    assert latest(engine)["participants"] == [0, 1]
    assert dsts(outs) == ["c0", "c1", "c2", "c3"] and engine.round.round == 1


# --- sync rounds ----------------------------------------------------------------------


@pytest.mark.parametrize("fraction, min_clients, sampled", [
    (1.0, 1, 10), (0.3, 1, 3), (0.25, 1, 3), (0.1, 4, 4), (0.0, 2, 2)])
def test_a_round_samples_a_fraction_of_the_live_clients_and_at_least_min_clients(
        fraction, min_clients, sampled):
    engine, tasks = started(10, fraction=fraction, min_clients=min_clients)
    assert len(tasks) == sampled == len(set(dsts(tasks)))  # ceil(fraction x live), once each
    assert engine.round.sampled == sorted(client(t) for t in tasks)


def test_sampling_is_seeded_same_seed_same_clients_another_seed_others():
    def sample(seed: int) -> list[list[str]]:
        engine, tasks = started(10, fraction=0.3, seed=seed, eval_every=100)
        second = answer(engine, tasks, 1.0)
        return [dsts(tasks), dsts(second)]

    first = sample(0)
    assert sample(0) == first
    assert first[0] != first[1]  # each round draws anew
    assert sample(1) != first


def test_tasks_carry_ids_version_seed_and_the_nodes_task_count():
    engine = make(5, seed=7, eval_every=100)
    connect(engine, "n0", [0, 1, 2], 0.0)
    tasks = connect(engine, "n1", [3, 4], 0.0)
    assert [(t.dst, t.round, t.body["task"], t.body["version"], t.body["node_tasks"])
            for t in tasks] == [("c0", 0, 1, 0, 3), ("c1", 0, 2, 0, 3), ("c2", 0, 3, 0, 3),
                                ("c3", 0, 4, 0, 2), ("c4", 0, 5, 0, 2)]
    assert [t.body["seed"] for t in tasks] == [seed_of(7, c, 0) for c in range(5)]
    assert sorted(engine.tasks) == [1, 2, 3, 4, 5]
    assert all(t.body["bound"]["samples"] == engine.train_sizes[client(t)] for t in tasks)
    second = answer(engine, tasks, 1.0)
    assert [(t.round, t.body["task"], t.body["version"]) for t in second] == \
        [(1, tid, 1) for tid in range(6, 11)]
    assert [t.body["seed"] for t in second] == [seed_of(7, c, 1) for c in range(5)]


def test_a_round_closes_when_every_sampled_client_answered():
    engine, tasks = started(4, eval_every=100)
    assert answer(engine, tasks[:3], 1.0) == []
    assert engine.version == 0 and engine.round.pending() == [3]
    outs = answer(engine, tasks[3:], 2.0)
    assert engine.version == 1 and engine.round.round == 1
    assert dsts(outs) == ["c0", "c1", "c2", "c3"]
    rec = engine.records[-1]
    assert (rec["round"], rec["version"], rec["sampled"], rec["updates"]) == (0, 1, 4, 4)
    assert rec["participants"] == [0, 1, 2, 3] and rec["failures"] == {}
    assert (rec["failed"], rec["late"], rec["dead"], rec["merged"]) == (0, 0, 0, 0)
    assert rec["messages_up"] == 4 and rec["agg"] == {"updates_seen": 4.0}
    assert rec["time"] == 2.0 and rec["round_s"] == 2.0  # the script's clock


def test_evaluation_comes_every_eval_every_rounds_and_holds_the_next_round():
    engine, tasks = started(3, rounds=4, eval_every=2)
    outs = answer(engine, tasks, 1.0)
    assert [o.kind for o in outs] == ["task"] * 3 and len(engine.records) == 1
    assert "eval_clients" not in engine.records[0]
    outs = answer(engine, of(outs), 2.0)
    evals = of(outs, "eval")
    assert [o.kind for o in outs] == ["eval"] * 3 and engine.round is None
    assert [(e.dst, e.round, e.body["eval"], e.body["version"]) for e in evals] == \
        [(f"c{c}", 1, 1, 2) for c in range(3)]
    assert len(engine.records) == 1  # the record waits for its evaluation
    assert eval_results(engine, evals[:2], 3.0) == []
    outs = eval_results(engine, evals[2:], 4.0, acc=0.8)
    assert dsts(outs) == ["c0", "c1", "c2"] and engine.round.round == 2
    rec = engine.records[-1]
    assert (rec["round"], rec["version"], rec["eval_clients"]) == (1, 2, 3)
    assert rec["acc_mean"] == pytest.approx(0.6) and rec["eval_s"] == 2.0


def test_the_run_shuts_down_after_the_last_rounds_evaluation():
    engine, tasks = started(2, rounds=2, eval_every=100)
    tasks = answer(engine, tasks, 1.0)
    outs = answer(engine, tasks, 2.0)
    assert [(o.kind, o.round, o.body["version"]) for o in outs] == [("eval", 1, 2)] * 2
    done = eval_results(engine, outs, 3.0)
    assert done == [Out("shutdown", "*", 2, {"reason": "run complete"})] and engine.done
    assert [r["version"] for r in engine.records] == [1, 2]
    assert engine.records[-1]["eval_clients"] == 2
    assert engine.on_tick(100.0) == [] and engine.next_deadline() is None


def test_a_resume_from_the_last_versions_checkpoint_ends_the_run_again():
    """A server killed after its final checkpoint (and its shutdown, which a broker that was
    down may have lost) is resumed from a finished run: it must shut down again, not wait
    for a round there is none of (chaos storm, CI 2026-11-27: the resumed server hung)."""
    engine, tasks = started(2, rounds=2, eval_every=100)
    tasks = answer(engine, tasks, 1.0)
    mid = engine.state_dict()
    eval_results(engine, answer(engine, tasks, 2.0), 3.0)
    final = engine.state_dict()

    resumed = make(2, rounds=2, eval_every=100)
    resumed.load_state_dict(final)
    assert resumed.on_resumed(9.0) == [Out("shutdown", "*", 2, {"reason": "run complete"})]
    assert resumed.done and resumed.on_resumed(9.5) == []  # once

    unfinished = make(2, rounds=2, eval_every=100)
    unfinished.load_state_dict(mid)
    assert unfinished.on_resumed(9.0) == [] and not unfinished.done
    assert of(connect(unfinished, "n", range(2), 9.0))  # the missing round runs


def test_a_run_stopped_before_its_rounds_is_still_stopped_after_a_resume():
    engine = make(2, rounds=5)
    engine.rounds, engine.stopped = 1, "privacy budget"  # as Engine._budget_spent leaves it
    engine.version = 1
    resumed = make(2, rounds=5)
    resumed.load_state_dict(engine.state_dict())
    assert (resumed.rounds, resumed.stopped) == (1, "privacy budget")
    assert of(resumed.on_resumed(0.0), "shutdown") and resumed.done
    assert "stopped" not in make(2).state_dict()  # (a run that ran its rounds: as before)


# --- deadlines and late updates ---------------------------------------------------------


def test_a_round_closes_at_its_deadline_once_min_updates_are_in():
    engine, tasks = started(4, deadline_s=5.0, min_updates=2, hard_deadline_s=20.0,
                            eval_every=100)
    answer(engine, tasks[:2], 1.0)
    assert engine.on_tick(4.9) == [] and engine.version == 0
    outs = engine.on_tick(5.0)
    assert engine.version == 1 and dsts(outs) == ["c0", "c1", "c2", "c3"]
    rec = engine.records[-1]
    assert rec["participants"] == [0, 1] and rec["failures"] == {"2": "late", "3": "late"}
    assert (rec["late"], rec["failed"], rec["sampled"]) == (2, 2, 4)


def test_a_round_short_of_min_updates_waits_for_the_hard_deadline():
    engine, tasks = started(4, deadline_s=5.0, min_updates=2, hard_deadline_s=20.0,
                            eval_every=100)
    answer(engine, tasks[:1], 1.0)
    assert engine.on_tick(5.0) == [] and engine.version == 0
    assert engine.on_tick(19.9) == [] and engine.version == 0
    engine.on_tick(20.0)
    rec = engine.records[-1]
    assert engine.version == 1 and rec["participants"] == [0] and rec["late"] == 3


def test_a_late_update_is_dropped_by_default():
    engine, tasks = started(3, deadline_s=5.0, min_updates=2, eval_every=100)
    answer(engine, tasks[:2], 1.0)
    second = engine.on_tick(5.0)
    assert dispatch(engine, update(tasks[2]), 6.0) == []  # accepted, then dropped
    assert engine.totals["late_dropped"] == 1 and engine.late == []
    assert tasks[2].body["task"] not in engine.tasks
    answer(engine, second, 7.0)
    rec = engine.records[-1]
    assert rec["participants"] == [0, 1, 2] and rec["folded"] == 0 and rec["stale"] == []


def test_a_late_update_is_folded_into_the_next_aggregation_with_weight_1_over_sqrt_1_plus_s():
    engine, tasks = started(3, "fedavg", deadline_s=5.0, min_updates=2, late="fold",
                            eval_every=100)
    n = engine.train_sizes
    w0 = {k: v.astype(np.float64) for k, v in engine.handler.weights.items()}
    for t in tasks[:2]:
        dispatch(engine, update(t, delta(engine, client(t), 0), n[client(t)]), 1.0)
    second = engine.on_tick(5.0)  # c2 missed round 0
    late = delta(engine, 2, 0)
    assert dispatch(engine, update(tasks[2], late, n[2]), 6.0) == []
    # set aside now, counted as folded when the next aggregation folds it
    assert engine.totals["late_folded"] == 0 and len(engine.late) == 1
    for t in second:
        dispatch(engine, update(t, delta(engine, client(t), 1), n[client(t)]), 7.0)
    assert engine.totals["late_folded"] == 1 and not engine.late
    rec = engine.records[-1]
    s = 1 / math.sqrt(2)
    assert staleness_weight(1) == s
    assert rec["round"] == 1 and rec["folded"] == 1 and rec["stale_max"] == 1
    assert rec["stale"] == [[2, 0, 1, pytest.approx(s)]] and rec["updates"] == 4
    assert rec["participants"] == [0, 1, 2, 2]  # one entry an update: c2's fresh and folded
    # w2 = w1 + (sum_k n_k b_k + s n_2 d_2) / (sum_k n_k + s n_2), w1 = w0 + the round-0 mean
    d0 = {c: delta(engine, c, 0)["delta"] for c in range(3)}
    d1 = {c: delta(engine, c, 1)["delta"] for c in range(3)}
    for k, w in w0.items():
        w1 = w + (n[0] * d0[0][k] + n[1] * d0[1][k]) / (n[0] + n[1])
        num = sum(n[c] * d1[c][k].astype(np.float64) for c in range(3)) + s * n[2] * d0[2][k]
        want = w1.astype(np.float32).astype(np.float64) + num / (n[0] + n[1] + n[2] + s * n[2])
        np.testing.assert_allclose(engine.handler.weights[k], want, rtol=0, atol=1e-6,
                                   err_msg=k)


def test_a_round_closes_on_its_quorum_with_no_clock_the_rest_late():
    """federation.quorum: the round closes on the quorum's last update, at whatever time it
    comes (no tick, no deadline): who is late depends on the order of events only."""
    engine, tasks = started(4, quorum=3, eval_every=100)
    assert answer(engine, tasks[:2], 1.0) == [] and engine.version == 0
    outs = answer(engine, tasks[3:], 1e6)  # the third update, however late by the clock
    assert engine.version == 1 and dsts(outs) == ["c0", "c1", "c2", "c3"]
    rec = engine.records[-1]
    assert rec["participants"] == [0, 1, 3] and rec["failures"] == {"2": "late"}
    assert (rec["late"], rec["updates"], rec["time"]) == (1, 3, 1e6)


def test_under_a_quorum_a_held_update_is_folded_into_the_next_round():
    """The event-driven straggler's script (system.hold_clients): c2's round-0 update is
    held until round 1's tasks arrive, so it comes after round 0 closed on its quorum and
    before round 1 closes (its node's other client answers after it): late and folded
    with staleness 1, at any times."""
    engine, tasks = started(4, quorum=3, late="fold", eval_every=100)
    second = answer(engine, [t for t in tasks if client(t) != 2], 1.0)
    assert engine.records[-1]["failures"] == {"2": "late"}
    assert dispatch(engine, update(tasks[2]), 1.5) == [] and len(engine.late) == 1
    answer(engine, [t for t in second if client(t) != 2], 2.0)
    rec = engine.records[-1]
    assert rec["round"] == 1 and rec["failures"] == {"2": "late"}
    assert rec["stale"] == [[2, 0, 1, pytest.approx(staleness_weight(1))]]
    assert engine.totals["late_folded"] == 1


def test_a_quorum_counts_updates_not_failures_and_the_deadline_still_applies():
    engine, tasks = started(4, quorum=3, deadline_s=5.0, min_updates=1, eval_every=100)
    handler_failed(engine, tasks[0], 1.0)
    answer(engine, tasks[1:3], 1.0)
    assert engine.version == 0  # two updates and a failure: short of the quorum
    engine.on_tick(5.0)
    rec = engine.records[-1]
    assert engine.version == 1 and rec["participants"] == [1, 2]
    assert rec["failures"] == {"0": "error", "3": "late"}


def test_a_quorum_above_the_sampled_clients_waits_for_all_of_them():
    engine, tasks = started(3, quorum=5, eval_every=100)
    answer(engine, tasks[:2], 1.0)
    assert engine.version == 0
    answer(engine, tasks[2:], 2.0)
    assert engine.version == 1 and engine.records[-1]["failures"] == {}


def test_max_staleness_drops_what_is_too_stale_to_count():
    engine, tasks = started(4, deadline_s=5.0, min_updates=2, late="fold", max_staleness=0,
                            eval_every=100)
    answer(engine, tasks[:2], 1.0)
    second = engine.on_tick(5.0)  # c2 and c3 missed round 0
    dispatch(engine, update(tasks[2]), 6.0)  # one round stale: taken, but not to be folded
    answer(engine, second, 7.0)
    rec = engine.records[-1]
    assert rec["round"] == 1 and rec["folded"] == 0 and rec["stale"] == []
    assert rec["participants"] == [0, 1, 2, 3] and engine.late == []
    # c3's round-0 task was dropped as round 1 closed: its answer is no longer outstanding
    assert tasks[3].body["task"] not in engine.tasks
    outs = dispatch(engine, update(tasks[3]), 8.0)
    assert [(o.kind, o.dst, o.body["code"]) for o in outs] == [("error", "c3", "rejected")]
    assert "not outstanding" in outs[0].body["reason"] and engine.totals["rejected"] == 1


def test_a_late_update_too_stale_to_fold_is_counted_dropped_not_folded():
    engine, tasks = started(4, deadline_s=5.0, min_updates=2, late="fold", max_staleness=0,
                            eval_every=100)
    answer(engine, tasks[:2], 1.0)
    second = engine.on_tick(5.0)
    dispatch(engine, update(tasks[2]), 6.0)
    answer(engine, second, 7.0)
    assert [r["folded"] for r in engine.records] == [0, 0]
    assert (engine.totals["late_folded"], engine.totals["late_dropped"]) == (0, 1)


def test_a_late_update_after_the_last_aggregation_is_counted_dropped_not_folded():
    engine, tasks = started(3, rounds=1, deadline_s=5.0, min_updates=2, late="fold")
    answer(engine, tasks[:2], 1.0)
    evals = engine.on_tick(5.0)  # the last round closes without c2: the final evaluation
    dispatch(engine, update(tasks[2]), 6.0)
    assert eval_results(engine, of(evals, "eval"), 7.0)[0].kind == "shutdown"
    assert engine.records[-1]["folded"] == 0
    assert (engine.totals["late_folded"], engine.totals["late_dropped"]) == (0, 1)


# --- dead clients, failed handlers, rejected updates --------------------------------------


def test_a_node_that_leaves_mid_round_fails_its_tasks_as_dead_and_the_round_closes():
    engine = make(4, eval_every=100)
    connect(engine, "n0", [0, 1])
    tasks = connect(engine, "n1", [2, 3])
    assert answer(engine, tasks[:2], 1.0) == []
    outs = engine.on_leave("n1", [], 2.0)  # the round need not wait for its deadline
    assert engine.version == 1 and engine.live == {0, 1}
    rec = engine.records[-1]
    assert rec["failures"] == {"2": "dead", "3": "dead"} and rec["dead"] == 2
    assert rec["participants"] == [0, 1] and rec["failed"] == 2
    assert dsts(outs) == ["c0", "c1"]  # the next round samples the live clients
    assert {t.client for t in engine.tasks.values()} == {0, 1}


def test_a_clients_handler_failure_ends_its_task_as_error():
    engine, tasks = started(4, eval_every=100)
    # an error from c0 about c1's task is refused and changes nothing
    assert handler_failed(engine, tasks[1], 0.5, src="c0") == []
    assert engine.totals["refused"] == 1 and engine.round.failures == {}
    assert handler_failed(engine, tasks[1], 1.0) == []
    assert engine.round.failures == {1: "error"} and tasks[1].body["task"] not in engine.tasks
    answer(engine, [tasks[0], tasks[2], tasks[3]], 2.0)
    rec = engine.records[-1]
    assert rec["failures"] == {"1": "error"} and rec["failed"] == 1 and rec["dead"] == 0
    assert rec["participants"] == [0, 2, 3]


def test_a_malformed_update_is_rejected_its_task_ends_and_an_error_goes_back():
    engine, tasks = started(3, eval_every=100)
    bad = update(tasks[1], {"state": np.zeros(3, dtype=np.float32)})
    outs = dispatch(engine, bad, 1.0)
    assert [(o.kind, o.dst, o.round, o.body["code"], o.body["task"]) for o in outs] == \
        [("error", "c1", 0, "rejected", tasks[1].body["task"])]
    assert engine.totals["rejected"] == 1 and engine.round.failures == {1: "rejected"}
    assert tasks[1].body["task"] not in engine.tasks
    # the same task answered again, well formed this time: over already
    outs = dispatch(engine, update(tasks[1]), 1.5)
    assert "not outstanding" in outs[0].body["reason"] and engine.totals["rejected"] == 2
    answer(engine, [tasks[0], tasks[2]], 2.0)
    rec = engine.records[-1]
    assert rec["failures"] == {"1": "rejected"} and rec["participants"] == [0, 2]


def test_a_relays_merged_update_is_one_entry_for_its_members_and_answers_their_tasks():
    engine = make(4, eval_every=100)
    connect(engine, "relay", [0, 1, 2])
    tasks = connect(engine, "n", [3])
    assert [t.body["node_tasks"] for t in tasks] == [3, 3, 3, 1]
    seen = []  # what the handler is handed to aggregate
    aggregate = engine.handler.aggregate

    def spy(updates, failures, info):
        seen.append(updates)
        return aggregate(updates, failures, info)

    engine.handler.aggregate = spy
    state = sum(np.asarray(t.body["payload"]["state"], dtype=np.float64) for t in tasks[:3])
    body = {"version": 0, "rule": "array-sums",
            "members": [[t.dst, t.body["task"], 1, WORK] for t in tasks[:3]],
            "payload": {"state": state, "mass": np.array([3.0])}}
    assert dispatch(engine, Message("merged", "relay", "server", body, run=RUN, round=0),
                    1.0) == []
    assert sorted(engine.round.updates) == [0, 1, 2] and engine.round.pending() == [3]
    assert sorted(engine.tasks) == [tasks[3].body["task"]]
    answer(engine, tasks[3:], 2.0)
    assert [(u.client, [m.client for m in u.members]) for u in seen[0]] == \
        [(3, []), (0, [0, 1, 2])]
    rec = engine.records[-1]
    assert rec["participants"] == [0, 1, 2, 3] and rec["updates"] == 4
    assert rec["merged"] == 1 and rec["messages_up"] == 2
    assert rec["agg"] == {"updates_seen": 4.0}


# --- async ------------------------------------------------------------------------------


def test_async_keeps_concurrency_clients_busy():
    engine, tasks = started(6, mode="async", concurrency=3, buffer=3, rounds=5,
                            eval_every=100)
    assert len(tasks) == 3 and len(engine.busy) == 3
    first = tasks[0]
    outs = answer(engine, [first], 1.0)
    assert len(outs) == 1 and outs[0].dst not in dsts(tasks)  # an idle client takes over
    assert outs[0].body["version"] == 0 and len(engine.busy) == 3
    assert engine.buffered_clients == {client(first)}


def test_async_aggregates_every_buffer_updates():
    engine, tasks = started(4, mode="async", concurrency=4, buffer=2, rounds=5,
                            eval_every=100)
    assert answer(engine, tasks[:1], 1.0) == [] and engine.version == 0
    outs = answer(engine, tasks[1:2], 2.0)
    assert engine.version == 1 and dsts(outs) == ["c0", "c1"]
    rec = engine.records[-1]
    assert (rec["round"], rec["version"], rec["updates"], rec["participants"]) == \
        (0, 1, 2, [0, 1])
    assert rec["stale"] == [] and rec["time"] == 2.0
    answer(engine, tasks[2:3], 3.0)
    assert engine.version == 1
    answer(engine, outs[:1], 4.0)
    rec = engine.records[-1]
    assert engine.version == 2 and rec["participants"] == [0, 2]
    assert rec["stale"] == [[2, 0, 1, pytest.approx(staleness_weight(1))]]  # c2 from v0


def test_async_weights_a_stale_update_by_1_over_sqrt_1_plus_staleness():
    engine, tasks = started(3, "fedavg", mode="async", concurrency=2, buffer=1, rounds=5,
                            eval_every=100)
    n = engine.train_sizes
    a, b = tasks
    dispatch(engine, update(a, delta(engine, client(a), 0), n[client(a)]), 1.0)
    assert engine.version == 1
    w1 = {k: v.astype(np.float64) for k, v in engine.handler.weights.items()}
    d = delta(engine, client(b), 0)
    dispatch(engine, update(b, d, n[client(b)]), 2.0)  # made from version 0: one behind
    rec = engine.records[-1]
    assert engine.version == 2 and rec["stale_max"] == 1 and rec["folded"] == 1
    assert rec["stale"] == [[client(b), 0, 1, pytest.approx(1 / math.sqrt(2))]]
    # alone in its buffer, its weight cancels in FedAvg's mean: the step is its delta
    for k, w in w1.items():
        np.testing.assert_allclose(engine.handler.weights[k], w + d["delta"][k], atol=1e-6)


def test_async_a_client_whose_update_waits_in_the_buffer_gets_no_task_until_it_is_aggregated():
    engine, tasks = started(3, mode="async", concurrency=3, buffer=3, rounds=5,
                            eval_every=100)
    assert answer(engine, tasks[:1], 1.0) == []  # c0 waits, and the others are busy
    assert answer(engine, tasks[1:2], 2.0) == []
    assert engine.buffered_clients == {0, 1} and len(engine.busy) == 1
    outs = answer(engine, tasks[2:], 3.0)
    assert engine.version == 1 and engine.buffered_clients == set()
    assert [(o.dst, o.body["version"]) for o in outs] == [("c0", 1), ("c1", 1), ("c2", 1)]


def test_async_with_buffer_concurrency_and_clients_equal_gives_sync_fedavgs_weights():
    """FLSim's check: FedBuff with buffer = concurrency = clients and no staleness is FedAvg."""
    def run(mode: str) -> tuple[Engine, list[list[int]]]:
        engine, tasks = started(3, "fedavg", mode=mode, rounds=3, eval_every=100,
                                concurrency=3 if mode == "async" else 0)
        seeds = []
        while engine.version < 3:
            assert len(tasks) == 3 and {t.body["version"] for t in tasks} == {engine.version}
            seeds.append([t.body["seed"] for t in tasks])
            outs = []
            for t in tasks:
                c, v = client(t), t.body["version"]
                outs += dispatch(engine, update(t, delta(engine, c, v),
                                                engine.train_sizes[c]), 1.0 + v)
            tasks = of(outs)
        return engine, seeds

    sync, sync_seeds = run("sync")
    buffered, async_seeds = run("async")
    assert sync_seeds == async_seeds  # each client trains from the same seed in both
    assert sync.handler.weights.keys() == buffered.handler.weights.keys()
    for k, w in sync.handler.weights.items():
        np.testing.assert_array_equal(buffered.handler.weights[k], w, err_msg=k)
    assert not np.array_equal(sync.handler.weights["fc.bias"],
                              make(3, "fedavg").handler.weights["fc.bias"])
    pick = ("round", "version", "sampled", "updates", "participants", "stale", "failures")
    assert [{k: r[k] for k in pick} for r in sync.records] == \
        [{k: r[k] for k in pick} for r in buffered.records]


# --- determinism --------------------------------------------------------------------------


def _canonical(value):
    """Outs and records in a form == compares exactly (arrays by dtype, shape and bytes)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, Out):
        return (value.kind, value.dst, value.round, _canonical(value.body))
    return value


def _play(seed: int) -> dict:
    """Three rounds of 6 clients, half sampled, a deadline: per round the first sampled
    client's handler fails, the second answers after the deadline (folded), the rest in
    time; every evaluation answered; a stray merged update refused on the way."""
    engine, outs = started(6, fraction=0.5, deadline_s=5.0, min_updates=1, late="fold",
                           seed=seed)
    log, now = [outs], 0.0
    while not engine.done:
        tasks, evals = of(outs), of(outs, "eval")
        assert tasks or evals, "the script stalled"
        outs = []
        if evals:
            now += 1.0
            outs += eval_results(engine, evals, now, acc=0.25 + 0.1 * engine.version)
        if tasks:
            now += 1.0
            outs += handler_failed(engine, tasks[0], now)
            outs += answer(engine, tasks[2:], now + 0.5)
            outs += dispatch(engine, Message("merged", "n", "server", {"version": 0},
                                             run=RUN, round=0), now + 0.6)
            now = engine.round.deadline if engine.round is not None else now
            outs += engine.on_tick(now)
            outs += answer(engine, tasks[1:2], now + 0.5)
        log.append(outs)
    return {"outs": _canonical(log), "records": _canonical(engine.records),
            "totals": dict(engine.totals), "events": engine.events}


def test_the_same_script_twice_gives_identical_outs_and_records():
    first, again = _play(seed=5), _play(seed=5)
    assert len(first["records"]) == 3
    assert [r["folded"] for r in first["records"]] == [0, 1, 1]
    assert first["outs"] == again["outs"]
    assert first["records"] == again["records"]
    assert first["totals"] == again["totals"] and first["events"] == again["events"]
    assert _play(seed=6)["outs"] != first["outs"]  # the comparison is not vacuous


# --- next_deadline ----------------------------------------------------------------------


def test_next_deadline_in_each_phase_of_a_sync_run():
    engine = make(4, rounds=1, start_timeout_s=10.0, deadline_s=5.0, min_updates=2,
                  hard_deadline_s=30.0)
    assert engine.next_deadline() is None  # nothing to wait for
    connect(engine, "n0", [0, 1], 1.0)
    assert engine.next_deadline() == 11.0  # the start timeout
    tasks = connect(engine, "n1", [2, 3], 2.0)
    assert engine.next_deadline() == 7.0  # the round's deadline (its tasks'), not 32
    answer(engine, tasks[:1], 3.0)
    assert engine.on_tick(7.0) == []  # one update of min_updates 2
    assert engine.next_deadline() == 7.0  # passed, and the shell's to tick again
    answer(engine, tasks[1:2], 8.0)
    evals = engine.on_tick(8.0)
    assert dsts(evals, "eval") == ["c0", "c1"]  # c2, c3 still busy with round 0's tasks
    assert engine.next_deadline() == 18.0  # the evaluation's: 2 x deadline_s
    assert eval_results(engine, evals, 9.0)[0].kind == "shutdown"
    assert engine.next_deadline() is None


def test_next_deadline_without_a_round_deadline_is_the_hard_deadline():
    engine, tasks = started(2, hard_deadline_s=30.0, eval_every=100)
    assert engine.next_deadline() == 30.0
    answer(engine, tasks, 4.0)
    assert engine.round.round == 1 and engine.next_deadline() == 34.0


def test_next_deadline_in_async_is_the_earliest_task_deadline_which_times_it_out():
    engine, tasks = started(3, mode="async", concurrency=2, buffer=2, deadline_s=5.0,
                            rounds=5, eval_every=100)
    assert engine.next_deadline() == 5.0
    refill = answer(engine, tasks[:1], 2.0)
    assert len(refill) == 1 and engine.tasks[refill[0].body["task"]].deadline == 7.0
    assert engine.next_deadline() == 5.0  # tasks[1]'s, sent at 0
    late = client(tasks[1])
    outs = engine.on_tick(5.0)
    assert tasks[1].body["task"] not in engine.tasks
    assert engine.window.failures == {late: "timed_out"}
    assert [(client(o), o.body["version"]) for o in outs] == [(late, 0)]  # its slot refilled
    assert engine.next_deadline() == 7.0
    answer(engine, refill, 6.0)
    rec = engine.records[-1]
    assert engine.version == 1 and rec["failures"] == {str(late): "timed_out"}
    assert rec["late"] == 0 and rec["failed"] == 1


# --- evaluating a sample of the clients (federation.eval_clients) ---------------------


def test_an_evaluation_asks_a_seeded_sample_when_eval_clients_is_set():
    """federation.eval_clients = 5 of 20: each evaluation asks 5 distinct live clients,
    the same 5 for the same seed and version (a replay, a resumed server), drawn anew at
    the next version; the record counts the sample (eval_live) and what it was drawn from
    (eval_sample_of), so eval_clients = eval_live - len(eval_missing) still holds."""
    def first_eval(seed):
        engine, tasks = started(20, eval_clients=5, seed=seed)
        return engine, of(answer(engine, of(tasks), 1.0), "eval")

    engine, evals = first_eval(3)
    asked = sorted(client(e) for e in evals)
    assert len(asked) == len(set(asked)) == 5
    assert asked == sorted(client(e) for e in first_eval(3)[1])  # same seed, same sample
    assert any(sorted(client(e) for e in first_eval(s)[1]) != asked for s in (4, 5, 6))
    outs = eval_results(engine, evals, 2.0)
    rec = engine.records[-1]
    assert rec["eval_clients"] == rec["eval_live"] == 5 and rec["eval_sample_of"] == 20
    assert rec["eval_missing"] == {}
    later = of(answer(engine, of(outs), 3.0), "eval")  # version 2's evaluation
    assert len(later) == 5 and sorted(client(e) for e in later) != asked


def test_without_eval_clients_every_live_client_is_evaluated():
    engine, tasks = started(20)
    evals = of(answer(engine, of(tasks), 1.0), "eval")
    assert sorted(client(e) for e in evals) == list(range(20))
    eval_results(engine, evals, 2.0)
    assert engine.records[-1]["eval_live"] == 20
    assert "eval_sample_of" not in engine.records[-1]

"""`fedbus bench chaos`: its invariant checkers fail on hand-made histories that break each
invariant (a check that cannot fail is a defect), its schedule is reproduced by its seed, a
short real storm passes every check, and the broker bug the storm found stays fixed."""
from __future__ import annotations

import argparse
import time

import pytest
from fedbus.bench import chaos
from fedbus.bench.chaos import (check_completion, check_incarnations, check_once,
                                check_resumes, check_window, make_schedule)
from fedbus.broker.peer import Peer


def accept(i, client, rnd, version=None, inc=1, node="n0"):
    return {"op": "accept", "i": i, "client": client, "round": rnd,
            "version": rnd if version is None else version, "task": i, "inc": inc,
            "node": node, "src": f"c{client}"}


def ckpt(i, version, digest, buffered=()):
    return {"op": "checkpoint", "i": i, "version": version, "digest": digest,
            "buffered": [list(b) for b in buffered]}


def resume(i, version, digest):
    return {"op": "resume", "i": i, "version": version, "digest": digest}


def register(i, node, inc):
    return {"op": "register", "i": i, "node": node, "inc": inc}


# --- once ---

def test_once_passes_distinct_updates_and_a_retake_after_a_rollback():
    history = [accept(1, 0, 0), accept(2, 1, 0), ckpt(3, 1, "A"), accept(4, 0, 1),
               resume(5, 1, "A"),  # round 1's update was lost with the killed server
               accept(6, 0, 1), accept(7, 1, 1), ckpt(8, 2, "B")]
    assert check_once(history) == []


def test_once_fails_an_update_taken_twice():
    v = check_once([accept(1, 0, 0), accept(2, 1, 0), accept(9, 0, 0)])
    assert len(v) == 1 and v[0].invariant == "once"
    assert v[0].records == [1, 9] and v[0].rounds == [0]


def test_once_fails_a_retake_of_an_update_the_checkpoint_holds():
    # taken before the checkpoint the server resumed from: it counts already
    history = [accept(1, 0, 0), ckpt(2, 1, "A"), resume(3, 1, "A"), accept(4, 0, 0)]
    v = check_once(history)
    assert [x.records for x in v] == [[1, 4]]


def test_once_passes_a_retake_of_an_update_an_async_buffer_held_at_the_checkpoint():
    """`fedbus bench chaos --seed 9 --mode async --links off --rounds 16` (2026-11-27):
    client 1's version-11 update sat in the async buffer when version 11's checkpoint was
    written (deferred to its evaluation's end); the server was killed, resumed from that
    checkpoint, and took the update again. The state never held it: not a double count.
    Its first take at version 11 was buffered; the retake of client 0's, which the
    checkpointed aggregation did hold, is still one."""
    history = [accept(1, 0, 10), accept(2, 1, 11), ckpt(3, 11, "A", buffered=[(1, 11)]),
               resume(4, 11, "A"), accept(5, 1, 11)]
    assert check_once(history) == []
    history[-1] = accept(5, 0, 10)
    assert [x.records for x in check_once(history)] == [[1, 5]]


# --- incarnation ---

def test_incarnation_passes_a_replacement_and_a_reregistration_of_the_same_one():
    history = [register(1, "n0", 10), accept(2, 0, 0, inc=10), register(3, "n0", 10),
               register(4, "n0", 20), accept(5, 0, 1, inc=20)]
    assert check_incarnations(history) == []


def test_incarnation_fails_an_update_of_a_replaced_incarnation():
    history = [register(1, "n0", 10), accept(2, 0, 0, inc=10), register(3, "n0", 20),
               accept(4, 1, 1, inc=10)]
    v = check_incarnations(history)
    assert len(v) == 1 and v[0].invariant == "incarnation" and v[0].records == [3, 4]
    # (another node's incarnations are not n0's)
    assert check_incarnations(history[:3] + [accept(4, 1, 1, inc=10, node="n1")]) == []


# --- replay (resumes and the final state) ---

def test_resumes_pass_when_each_loaded_state_was_reached():
    history = [ckpt(1, 1, "A"), ckpt(2, 2, "B"), resume(3, 1, "A"), ckpt(4, 2, "B")]
    assert check_resumes(history, "B", 2) == []


def test_resumes_fail_a_state_the_replay_never_reached():
    history = [ckpt(1, 1, "A"), resume(2, 1, "X"), ckpt(3, 2, "B")]
    v = check_resumes(history, "B", 2)
    assert len(v) == 1 and v[0].invariant == "replay" and v[0].records == [2]
    assert "differs" in v[0].detail  # the replay had a version-1 state, another one


def test_resumes_fail_a_final_checkpoint_the_replay_does_not_reach():
    v = check_resumes([ckpt(1, 1, "A"), ckpt(2, 2, "B")], "C", 2)
    assert len(v) == 1 and "final checkpoint" in v[0].detail and v[0].records == [2]


# --- window ---

def _records(versions):
    return [{"round": v - 1, "version": v} for v in versions]


def test_window_passes_a_kill_inside_it_and_whole_metrics():
    kills = [{"fault": 0, "metrics_version": 6, "checkpoint_version": 5},
             {"fault": 1, "metrics_version": 9, "checkpoint_version": 9}]
    assert check_window(kills, _records(range(1, 11)), 10) == []


def test_window_fails_metrics_behind_or_too_far_ahead_of_the_checkpoint():
    for m, c in ((4, 5), (7, 5)):
        v = check_window([{"fault": 3, "metrics_version": m, "checkpoint_version": c}],
                         _records(range(1, 11)), 10)
        assert len(v) == 1 and v[0].invariant == "window" and "fault 3" in v[0].detail


def test_window_allows_a_checkpoint_the_server_said_it_held_for_flushes_and_no_other():
    """A node that has not answered a flush holds the checkpoint back (PROTOCOL.md §4.2):
    two rounds behind passes when the server's log, before record 6, named checkpoint 4 as
    on disk (or 5 as held); not when it named other versions or said nothing for record 6."""
    said = {6: [4, 5], 5: [3, 4]}
    for c in (4, 5):
        kill = {"fault": 2, "metrics_version": 6, "checkpoint_version": c, "held": said}
        assert check_window([kill], _records(range(1, 11)), 10) == []
    for held in ({}, {5: [3, 4]}, {6: [2, 3]}):
        kill = {"fault": 2, "metrics_version": 6, "checkpoint_version": 4, "held": held}
        v = check_window([kill], _records(range(1, 11)), 10)
        assert len(v) == 1 and "held for flushes" in v[0].detail, (held, v)
    kill = {"fault": 2, "metrics_version": 3, "checkpoint_version": 4, "held": {3: [4]}}
    assert check_window([kill], _records(range(1, 11)), 10), "records behind the checkpoint"


def test_window_fails_a_repeated_or_skipped_round():
    v = check_window([], _records([1, 2, 3, 3, 4, 6]), 6)
    assert len(v) == 1
    assert "recorded twice [2]" in v[0].detail and "missing [4]" in v[0].detail
    assert v[0].rounds == [2, 4]


# --- completion ---

def test_completion_fails_a_crash_a_short_run_a_straggling_node_and_a_leftover():
    assert check_completion(0, {"rounds_completed": 5}, 5, [], []) == []
    v = check_completion(1, {"rounds_completed": 3}, 5, ["node-1 did not exit"],
                         ["pid 42 (python -m fedbus.launch node)"])
    assert [x.invariant for x in v] == ["completion"] * 4
    assert "exited 1" in v[0].detail and "3, not 5" in v[1].detail
    assert "left behind" in v[3].detail


# --- the schedule ---

def test_the_seed_reproduces_the_schedule_and_every_kind_is_in_it():
    a = make_schedule(7, 300, 12, nodes=2, relay=True, deadline_s=2.0)
    b = make_schedule(7, 300, 12, nodes=2, relay=True, deadline_s=2.0)
    c = make_schedule(8, 300, 12, nodes=2, relay=True, deadline_s=2.0)
    assert a == b and a != c
    assert {f.kind for f in a} == {"node_kill", "node_stop", "broker_kill", "server_kill",
                                   "relay_kill"}
    assert [f.at_round for f in a] == sorted(f.at_round for f in a)
    assert all(f.hold_s > 2.0 for f in a if f.kind == "node_stop")  # past the deadline
    assert "relay_kill" not in {f.kind for f in make_schedule(7, 300, 12, nodes=2,
                                                              relay=False, deadline_s=2.0)}
    cuts = [f for f in make_schedule(7, 300, 12, nodes=2, relay=False, deadline_s=2.0,
                                     links=True) if f.kind == "link_cut"]
    assert cuts and all(f.target.startswith("node-") and f.hold_s > 2.0 for f in cuts)


# --- the bug the storm found ---

def test_a_node_that_registers_after_its_runs_shutdown_is_sent_it(tcp_endpoint, broker_proc):
    """A node stopped (SIGSTOP) past the broker's liveness was purged; the run ended while
    it was stopped, so the server's shutdown broadcast missed it; thawed, it registered
    again and waited for the finished run forever (`fedbus bench chaos --seed 1 --rounds 20
    --faults 4`: node-0 never exited). The broker now sends such a node its run's
    shutdown when it registers; a node of another run is not sent it, nor one of a run
    whose server registered again (resumed)."""
    broker_proc(tcp_endpoint)
    server = Peer(tcp_endpoint, "srv", role="server", run="r1")
    server.start(60)
    early = Peer(tcp_endpoint, "n0", role="client", addresses=["c0"], run="r1")
    early.start(60)
    server.send("shutdown", "*", {"reason": "run complete"})
    assert _recv(early, "shutdown").body == {"reason": "run complete"}
    late = Peer(tcp_endpoint, "n1", role="client", addresses=["c1"], run="r1")
    other = Peer(tcp_endpoint, "n2", role="client", addresses=["c2"], run="r2")
    try:
        late.start(60)
        other.start(60)
        m = _recv(late, "shutdown")
        assert m.src == "server" and m.body == {"reason": "run complete"}
        # none for the other run's node: a message sent to it now is the first it gets (a
        # shutdown at its registration would have come before it, FIFO)
        server.send("task", "c2", {"mark": 1})
        m = other.recv(60)
        assert (m.kind, m.body) == ("task", {"mark": 1}), m
    finally:
        for p in (early, late, other, server):
            p.close()


def _recv(peer: Peer, kind: str, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = peer.recv(max(0.0, end - time.monotonic()))
        if m is not None and m.kind == kind:
            return m
    raise AssertionError(f"no {kind!r} within {timeout} s")


# --- a short real storm ---

def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    chaos.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.slow
def test_a_short_storm_passes_every_invariant(tmp_path):
    """Broker, server, two nodes as real processes; a kill of a node (after its update), a
    stop of a node past the deadline, a broker restart and a server kill with --resume, in
    a 14-round FedProto run: every fault is injected (its triggers are events, so on any
    machine), every invariant holds and nothing is left running."""
    args = _args(seed=3, rounds=14, faults=4, timeout=240.0, slow_factor=4.0, links="off")
    res = chaos.run_storm(args, mode="sync", relay=False, algorithm="fedproto",
                          out=tmp_path / "storm", say=lambda s: None)
    text = chaos.table(res)
    assert res["violations"] == [], text
    assert all(f["injected"] for f in res["faults"]), text
    injected = {k for k, row in res["by_kind"].items() if row["injected"]}
    assert len(injected) == 4, text
    assert res["rounds_completed"] == 14, text
    assert res["history"]["resumes"] >= ("server_kill" in injected), text


def test_window_fails_a_record_the_checkpoint_counts_done_but_metrics_lack():
    kill = {"fault": 2, "metrics_version": 12, "metrics_versions": [*range(1, 10), 11, 12],
            "checkpoint_version": 12}
    v = check_window([kill], _records(range(1, 13)), 12, "async")
    assert len(v) == 1 and "[10]" in v[0].detail and v[0].rounds == [9]
    # async records may come out of order (one waits for its evaluation); sync ones may not
    shuffled = _records([*range(1, 10), 11, 10, 12])
    assert check_window([], shuffled, 12, "async") == []
    assert "out of order" in check_window([], shuffled, 12, "sync")[0].detail


@pytest.mark.slow
@pytest.mark.parametrize("batch", ["off", "auto"])
def test_an_async_server_killed_while_an_evaluation_waits_loses_no_record(tmp_path, batch):
    """The second bug the storm found (`fedbus bench chaos --seed 4 --rounds 24 --mode async
    --relay --algorithm fedavg` wrote version 10's record after version 19's): an async
    evaluation's record is written when the evaluation ends, after later aggregations, and
    the server checkpointed each aggregation regardless, so a server killed while one
    waited resumed from a checkpoint that counted its version done, and its record was
    never written. Here node-0 is stopped right after version 9's record, so version 10's
    evaluation waits for its clients while node-1's go on, and the server is killed as
    soon as a later record lands."""
    from fedbus.bench.chaos import Fault

    faults = [Fault(0, "node_stop", "node-0", 9, "mid_round", 3.5),
              Fault(1, "server_kill", "server", 10, "mid_round", 0.3)]
    # batch auto: the replay of the message log reads `tasks` and `updates` batches as
    # the server sent and took them (before, its byte counts and its accepted updates
    # missed them and every resume was called a divergence)
    args = _args(seed=5, rounds=16, timeout=240.0, slow_factor=4.0, links="off", batch=batch)
    res = chaos.run_storm(args, mode="async", relay=False, algorithm="fedavg",
                          out=tmp_path / "storm", say=lambda s: None, faults=faults)
    text = chaos.table(res)
    assert all(f["injected"] for f in res["faults"]), text
    assert res["violations"] == [], text

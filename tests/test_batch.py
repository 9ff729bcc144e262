"""Batched tasks and updates (bus.batch = "auto", PROTOCOL.md §4.3): a round's tasks for one
node leave as one `tasks` message, the shared payload encoded once, and the node answers
with one `updates` message whose members the server judges one by one. Real federations on loopback (real
broker, server and node processes, real training on scikit-learn's digits): batched and
unbatched sync runs are bit-identical in their global state and every metrics record, and
`fedbus replay` reproduces a batched run exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fedbus.broker import wire
from fedbus.broker.peer import Peer
from fedbus.broker.wire import Message, decode_body, encode_body
from fedbus.node.config import build_config
from fedbus.node.engine import client_address, out_params, unbatch_tasks
from fedbus.node.server import build_engine, dispatch, read_checkpoint
from fedbus.record.msglog import read_log
from tests.helpers import (
    SLOW,
    SMALL,
    Processes,
    fedbus,
    free_port,
    late_rounds,
    logged_messages,
    merged,
    metrics,
    run_federation,
    straggler,
    wait_until,
    write_config,
)

# Six clients on two nodes (three each), all sampled every round, one torch thread: every
# client trains exactly as it would anywhere. No deadline: rounds close on events only.
EXACT = merged(SMALL, federation={"deadline_s": 0.0, "hard_deadline_s": 120.0},
               launch={"threads": 1}, bus={"liveness": 10})

# What may differ between a batched and an unbatched run's records: the clock, and the
# bytes sent down (the point of batching: the payload once a node)
VOLATILE = {"time", "wall_s", "round_s", "eval_s", "bytes_down", "bytes_up"}


def _arrays(state, path=""):
    if isinstance(state, dict):
        out = {}
        for k, v in state.items():
            out.update(_arrays(v, f"{path}/{k}"))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, v in enumerate(state):
            out.update(_arrays(v, f"{path}[{i}]"))
        return out
    return {path: state}


def _logged(run, direction="out"):
    return [json.loads(line) for line in (run / "messages.jsonl").read_text().splitlines()
            if json.loads(line)["dir"] == direction]


def _pair(tmp_path, sections, name):
    """The same federation run unbatched and batched: their run directories."""
    runs = {}
    for batch in ("off", "auto"):
        runs[batch], summary = run_federation(tmp_path, merged(sections, bus={"batch": batch}),
                                              name=f"{name}-{batch}", timeout=300)
        assert summary["rounds_completed"] == sections["federation"]["rounds"]
    return runs


def assert_bit_identical(runs):
    off, auto = (read_checkpoint(runs[b] / "checkpoint.fbk")[1]["handler"]
                 for b in ("off", "auto"))
    a, b = _arrays(off), _arrays(auto)
    assert sorted(a) == sorted(b) and a
    for key in a:
        if isinstance(a[key], np.ndarray):
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key],
                                                                   equal_nan=True), key
        else:
            assert a[key] == b[key], key
    recs = {k: metrics(runs[k]) for k in runs}
    assert len(recs["off"]) == len(recs["auto"]) == 3
    for r_off, r_auto in zip(recs["off"], recs["auto"]):
        assert {k: v for k, v in r_off.items() if k not in VOLATILE} == \
            {k: v for k, v in r_auto.items() if k not in VOLATILE}
        assert r_auto["bytes_down"] < r_off["bytes_down"]
    # the batched run sent each node one message a round, the unbatched one a task a client
    kinds = {k: [e["kind"] for e in _logged(runs[k])] for k in runs}
    assert kinds["off"].count("task") == 18 and "tasks" not in kinds["off"]
    assert kinds["auto"].count("tasks") == 6 and "task" not in kinds["auto"]
    # and each round's evaluation: one `evals` message a node (a node's single evaluation
    # stays an `eval`), asking the same clients as the unbatched run, one a client
    asked = {k: sorted((m.round, m.dst) for m in logged_messages(runs[k], "eval", "out"))
             for k in runs}
    assert asked["off"] == asked["auto"] and "evals" not in kinds["off"]
    assert kinds["off"].count("eval") == len(asked["off"]) >= 12
    assert 3 <= kinds["auto"].count("evals") <= 6 and kinds["auto"].count("eval") <= 3


@pytest.mark.parametrize("algorithm", ["fedavg", "fedproto", "fedtgp", "fedgh"])
def test_sync_runs_batched_and_unbatched_are_bit_identical(tmp_path, algorithm):
    runs = _pair(tmp_path, merged(EXACT, algorithm={"name": algorithm}), algorithm)
    assert_bit_identical(runs)
    # and each node answered each round with one `updates` message
    kinds = {k: [e["kind"] for e in _logged(runs[k], "in")] for k in runs}
    assert kinds["off"].count("update") == 18 and "updates" not in kinds["off"]
    assert kinds["auto"].count("updates") == 6 and "update" not in kinds["auto"]
    if algorithm == "fedproto":
        # a member is charged its body's size, which is the unbatched update's body frame
        # (the same bytes: the training is bit-identical), whatever the batching
        up: dict[int, int] = {}
        for rec in read_log(runs["off"]):
            head = wire.header_fields(rec.frames[0]) if rec.direction == "in" else None
            if head and head[0] == "update":
                up[head[4]] = up.get(head[4], 0) + len(rec.frames[1])
        assert [r["bytes_up"] for r in metrics(runs["auto"])] == [up[r] for r in range(3)]
        # the batched run replays byte for byte (its batches remade by the engine), and a
        # client's update is retrained from its member of a batch
        out = fedbus("replay", str(runs["auto"])).stdout
        assert "replay identical" in out, out
        out = fedbus("replay", str(runs["auto"]), "--client", "4", "--round", "2").stdout
        assert "update identical" in out, out


def test_a_straggler_folded_late_is_accounted_alike_batched_and_not(tmp_path):
    """Client SLOW's node holds its update until the next round's first message (a batch,
    when batched) arrives, and each round closes at the quorum: late by events, folded a
    round later. The accounting (late, stale, folded weights) is the same either way."""
    runs = _pair(tmp_path, straggler(merged(EXACT, algorithm={"name": "fedproto"})),
                 "straggler")
    recs = {k: metrics(runs[k]) for k in runs}
    assert late_rounds(recs["auto"]) == late_rounds(recs["off"]) != []
    assert any(e[0] == SLOW for r in recs["auto"] for e in r["stale"])
    assert_bit_identical(runs)


# --- the engine's output stage, without processes ---

BOTH = ("tasks", "evals")  # what a node of this version says it takes


def _engine(batch="auto", secure=False, acks=("n0", "n1"), algorithm="fedproto", said=BOTH):
    raw = {"federation": {"clients": 6, "rounds": 3},
           "data": {"dataset": "digits", "partition": "iid"},
           "model": {"arch": "mlp"}, "algorithm": {"name": algorithm},
           "bus": {"batch": batch}}
    if secure:
        raw["privacy"] = {"secure_aggregation": True}
    engine = build_engine(build_config(raw), "r")
    engine.on_join("n0", [client_address(c) for c in range(4)], 0.0)
    engine.on_join("n1", [client_address(c) for c in range(4, 6)], 0.0)
    engine.on_configured("n0", "r", 0.0, said if "n0" in acks else ())
    return engine, engine.on_configured("n1", "r", 0.0, said if "n1" in acks else ())


def _evaluation(engine, outs):
    """What the engine sends once every task of `outs` is answered (no-op updates): the
    round's evaluation."""
    after = []
    for to, body in [m for o in outs for m in unbatch_tasks(o.body)]:
        after += engine.on_update(to, {"task": body["task"], "version": body["version"],
                                       "num_samples": 1, "work": dict(WORK),
                                       "payload": {"state": body["payload"]["state"]}}, 0, 1.0)
    return [o for o in after if o.kind in ("eval", "evals")]


def test_a_round_s_evaluation_is_one_evals_message_a_node_that_said_it_takes_them():
    engine, outs = _engine(algorithm="noop")
    evals = _evaluation(engine, outs)
    assert [(o.kind, o.dst) for o in evals] == [("evals", "n0"), ("evals", "n1")]
    members = [m for o in evals for m in unbatch_tasks(decode_body(encode_body(o.body)),
                                                        "evals")]
    assert [to for to, _ in members] == [client_address(c) for c in range(6)]
    assert {body["eval"] for _, body in members} == {1}
    # a node that said only "tasks" (an older one) gets its evaluations one a client
    engine, outs = _engine(algorithm="noop", said=("tasks",))
    assert [(o.kind, o.dst) for o in _evaluation(engine, outs)] == \
        [("eval", client_address(c)) for c in range(6)]


def test_a_round_is_one_tasks_message_a_node_that_said_it_takes_them():
    _, plain = _engine(batch="off")
    _, outs = _engine()
    assert [(o.kind, o.dst) for o in outs] == [("tasks", "n0"), ("tasks", "n1")]
    # the payload once a batch; each member unpacks to the unbatched run's task, byte for byte
    assert [len(o.body["payloads"]) for o in outs] == [1, 1]
    members = [m for o in outs for m in unbatch_tasks(decode_body(encode_body(o.body)))]
    assert [(to, encode_body(body)) for to, body in members] == \
        [(o.dst, encode_body(o.body)) for o in plain]
    assert sum(out_params(o) for o in outs) == sum(out_params(o) for o in plain)


def test_nodes_that_did_not_say_so_and_secure_runs_get_one_task_a_client():
    _, outs = _engine(acks=("n1",))  # n0 (say, a relay) did not say it takes batches
    assert [(o.kind, o.dst) for o in outs] == \
        [("task", f"c{c}") for c in range(4)] + [("tasks", "n1")]
    engine, outs = _engine(secure=True)
    assert not engine.batching
    assert [(o.kind, o.dst) for o in outs] == [("task", f"c{c}") for c in range(6)]


def test_a_node_that_registers_again_is_unbatched_until_it_acknowledges_again():
    engine, _ = _engine()
    engine.on_join("n0", [client_address(c) for c in range(4)], 1.0)
    assert engine.batch_nodes == {"n1"}


@pytest.mark.parametrize("body, why", [
    ([], "a map"),
    ({"payloads": [{}], "members": [{"task": 1, "payload": 0}]}, "members[0]"),
    ({"payloads": [{}], "members": [{"to": "c1", "task": 1, "payload": 1}]}, "members[0]"),
    ({"payloads": [{}], "members": [{"to": "c1", "task": 1, "payload": True}]}, "members[0]"),
])
def test_a_malformed_batch_is_refused_with_its_reason(body, why):
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        unbatch_tasks(body)


# --- an `updates` batch with bad members, judged by the server's own dispatch ---

WORK = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1}


def _noop_engine():
    engine = build_engine(build_config({
        "federation": {"clients": 6, "rounds": 3}, "bus": {"batch": "auto"},
        "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": "mlp"},
        "algorithm": {"name": "noop"}}), "r")
    engine.on_join("n0", [client_address(c) for c in range(4)], 0.0)
    engine.on_join("n1", [client_address(c) for c in range(4, 6)], 0.0)
    engine.on_configured("n0", "r", 0.0, BOTH)
    outs = engine.on_configured("n1", "r", 0.0, BOTH)
    return engine, {to: body for o in outs for to, body in unbatch_tasks(o.body)}


def _answer(to, task, state=None):
    state = np.asarray(task["payload"]["state"]) if state is None else state
    return {"from": to, "task": task["task"], "version": task["version"],
            "num_samples": 1, "work": WORK, "payload": {"state": state}}


def _wire(kind, src, body, round_=0):
    return wire.decode(wire.encode(Message(kind, src, "server", body, run="r",
                                           round=round_)))


def test_a_batch_with_bad_members_refuses_each_alone_and_takes_the_rest():
    engine, tasks = _noop_engine()
    good = np.asarray(tasks["c0"]["payload"]["state"])
    nan = good.copy()
    nan[0] = np.nan
    members = [_answer("c0", tasks["c0"]),
               _answer("c1", tasks["c1"], nan),                      # not finite
               _answer("c2", tasks["c2"], good[:-1].copy()),         # the wrong shape
               _answer("c4", tasks["c4"])]                           # n1's client, not n0's
    outs = dispatch(engine, _wire("updates", "n0", {"members": members}), 1.0)
    assert sorted(engine.round.updates) == [0]
    assert engine.totals["rejected"] == 3
    errors = [(o.dst, o.body["reason"]) for o in outs if o.kind == "error"]
    assert [dst for dst, _ in errors] == ["c1", "c2", "n0"], errors
    assert "NaN" in errors[0][1] and "shape" in errors[1][1]
    assert "not a client of node 'n0'" in errors[2][1]
    # c1's and c2's tasks are over (rejected); c4's is untouched: n1 answers it itself
    outstanding = {t.client for t in engine.tasks.values()}
    assert outstanding == {3, 4, 5}
    for c in (3, 4, 5):
        dispatch(engine, _wire("update", f"c{c}", {k: v for k, v in
                                                    _answer(f"c{c}", tasks[f"c{c}"]).items()
                                                    if k != "from"}), 2.0)
    assert engine.version == 1
    record = engine.records[-1] if engine.records else \
        engine.evals[min(engine.evals)].record
    assert record["participants"] == [0, 3, 4, 5]
    assert record["failures"] == {"1": "rejected", "2": "rejected"}


@pytest.mark.parametrize("src, members, why", [
    ("c0", "ok", "from a node of this run"),
    ("n1", "ok", "more than the 2 clients"),
    ("n0", [], "non-empty list members"),
    ("n0", [{"task": 1}], "members[0]"),
])
def test_a_malformed_updates_batch_is_refused_whole(src, members, why):
    engine, tasks = _noop_engine()
    if members == "ok":
        members = [_answer(f"c{c}", tasks[f"c{c}"]) for c in range(3)]
    outs = dispatch(engine, _wire("updates", src, {"members": members}), 1.0)
    errors = [o.body["reason"] for o in outs if o.kind == "error"]
    assert len(errors) == 1 and why in errors[0], errors
    assert engine.round.updates == {} and len(engine.tasks) == 6  # no task touched


def test_a_hostile_nodes_batch_with_poisoned_members_costs_only_those(tmp_path):
    """A real federation (broker, server and an honest node hosting c4-c5 as processes) where
    node n0, hosting c0-c3, is a Peer of this test speaking the protocol: it takes batches,
    and answers round 0's batch with c1's update not finite and c2's of the wrong shape.
    Those two are refused alone; c0's and c3's count; round 1 takes all six."""
    d = tmp_path / "hostile"
    d.mkdir()
    procs = Processes(d)
    ep = f"tcp://127.0.0.1:{free_port()}"
    cfg = write_config(d / "cfg.toml", merged(EXACT, algorithm={"name": "noop"},
                                              federation={"rounds": 2, "eval_every": 2},
                                              model={"arch": "mlp"}, bus={"batch": "auto"}))
    run = d / "run"
    node = None
    try:
        procs.start("broker", "broker", "--bind", ep, "--heartbeat-s", "0.3",
                    "--liveness", "10")
        procs.start("server", "server", "--broker", ep, str(cfg), "--out", str(run))
        procs.start("node", "node", "--broker", ep, "--clients", "4-5", "--name", "n1",
                    "--heartbeat-s", "0.3", "--liveness", "10")
        node = Peer(ep, "n0", role="client", addresses=[f"c{c}" for c in range(4)],
                    heartbeat_s=0.3, liveness=10)
        node.start()
        batches = 0

        def serve() -> bool:
            nonlocal batches
            msg = node.recv(timeout=0.1)
            if msg is None:
                return procs.procs["server"].poll() is not None
            if msg.kind == "config":
                node.run = msg.body["run"]
                node.send("config", "server", {"node": "n0", "run": node.run,
                                               "batch": ["tasks"]}, src="c0")
            elif msg.kind == "tasks":
                members = []
                for to, task in unbatch_tasks(msg.body):
                    state = np.array(task["payload"]["state"])
                    if batches == 0 and to == "c1":
                        state[0, 0] = np.nan
                    if batches == 0 and to == "c2":
                        state = state[:, :-1].copy()
                    members.append(_answer(to, task, state))
                batches += 1
                node.send("updates", "server", {"members": members}, src="n0",
                          round=msg.round)
            elif msg.kind == "eval":  # (n0 trains nothing to evaluate: it leaves)
                node.close()
                return True
            return False

        wait_until(serve, 120, "the hostile node's rounds")
        wait_until(lambda: procs.procs["server"].poll() is not None, 120, "the run's end")
        assert procs.procs["server"].returncode == 0, procs.log("server")
        assert batches == 2
        recs = metrics(run)
        assert recs[0]["participants"] == [0, 3, 4, 5]
        assert recs[0]["failures"] == {"1": "rejected", "2": "rejected"}
        assert len(recs[0]["refusals"]) == 2
        assert recs[1]["participants"] == list(range(6)) and recs[1]["failures"] == {}
    finally:
        if node is not None:
            node.close()
        procs.close()

"""Partial participation counted honestly (issue 47): every live client that is free when an
evaluation starts is evaluated, and each evaluation record accounts for the others by name
(`eval_missing`); each failure is named for what it is (a dropped task is "dropped", not
"late"); and `fedbus log` and `fedbus replay --client` agree on every task of a run.

The engine's part is scripted event by event (no clocks, no sockets: each event carries the
time the test says). The run's part is real processes on loopback, with a client that drops
every task (system.drop_clients), a straggler late by events (system.hold_clients with
federation.quorum) and a node killed when a round's record appears."""
from __future__ import annotations

import contextlib
import io
import re
import signal
from argparse import Namespace

import numpy as np
import pytest

from fedbus.broker.wire import Message
from fedbus.node.config import build_config
from fedbus.node.engine import (EVAL_MISSING, FAILURES, Engine, Out, client_address, client_index,
                                unbounded_wait)
from fedbus.node.server import build_engine, dispatch
from tests.helpers import (SMALL, Processes, free_port, logged_messages, merged, metrics,
                           wait_until, write_config)

RUN = "r"
WORK = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1}


def make(clients: int = 6, *, system: dict | None = None, **federation) -> Engine:
    cfg = build_config({"federation": {"clients": clients, "rounds": 3, **federation},
                        "data": {"dataset": "digits", "partition": "iid"},
                        "model": {"arch": "mlp"}, "algorithm": {"name": "noop"},
                        "system": system or {}})
    return build_engine(cfg, RUN)


def connect(engine: Engine, node: str, clients, now: float = 0.0) -> list[Out]:
    engine.on_join(node, [client_address(c) for c in clients], now)
    return engine.on_configured(node, RUN, now)


def of(outs: list[Out], kind: str = "task") -> list[Out]:
    return [o for o in outs if o.kind == kind]


def by_client(outs: list[Out], kind: str = "task") -> dict[int, Out]:
    return {int(o.dst[1:]): o for o in outs if o.kind == kind}


def update(task: Out, num_samples: int = 1) -> Message:
    body = {"task": task.body["task"], "version": task.body["version"],
            "num_samples": num_samples, "work": WORK,
            "payload": {"state": np.asarray(task.body["payload"]["state"])}}
    return Message("update", task.dst, "server", body, run=RUN, round=task.round)


def result(ev: Out, acc: float = 0.5) -> Message:
    body = {"eval": ev.body["eval"], "version": ev.body["version"],
            "metrics": {"acc": acc, "loss": 1.0, "num_test": 10}}
    return Message("eval_result", ev.dst, "server", body, run=RUN, round=ev.round)


def send(engine: Engine, msgs: list[Message], now: float) -> list[Out]:
    outs: list[Out] = []
    for m in msgs:
        outs += dispatch(engine, m, now)
    return outs


def accounted(rec: dict) -> None:
    """The record's evaluation accounts for every live client: scored, or named with a
    reason; eval_clients is the live count less those named."""
    scored = set(rec.get("per_client", {}))
    missing = rec["eval_missing"]
    assert rec["eval_clients"] == rec["eval_live"] - len(missing) == len(scored), rec
    assert not scored & set(missing), rec
    assert set(missing.values()) <= set(EVAL_MISSING), rec


# --- the engine, event by event --------------------------------------------------------


def test_a_dropped_task_frees_its_client_and_every_live_free_client_is_evaluated():
    """Client 1 drops every task; client 2 straggles past round 0's deadline; node b (clients
    3-5) dies during round 0's evaluation. Round 0 names 1 dropped and 2 late; its
    evaluation scores 0, 1 and 3 and names 2 (busy with its late task), 4 and 5 (dead).
    Round 1 evaluates 1 again (a dropped task never held it) and 2, free again."""
    engine = make(system={"drop_clients": [1]}, deadline_s=5.0, hard_deadline_s=20.0)
    connect(engine, "a", [0, 1, 2])
    tasks = by_client(connect(engine, "b", [3, 4, 5]))
    assert sorted(tasks) == [0, 1, 2, 3, 4, 5] and tasks[1].body["sim"]["drop"]
    send(engine, [update(tasks[c]) for c in (0, 3, 4, 5)], 1.0)
    evals = by_client(engine.on_tick(5.0), "eval")
    rec0 = engine.evals[next(iter(engine.evals))].record
    assert rec0["failures"] == {"1": "dropped", "2": "late"} and rec0["late"] == 1
    # today's engine left client 1 busy with its dropped task: it was never evaluated again
    assert sorted(evals) == [0, 1, 3, 4, 5]
    send(engine, [result(evals[c]) for c in (0, 1, 3)], 6.0)
    tasks1 = by_client(engine.on_leave("b", [], 6.5))
    rec = engine.records[-1]
    assert (rec["eval_clients"], rec["eval_live"]) == (3, 6)
    assert rec["eval_missing"] == {"2": "busy", "4": "dead", "5": "dead"}
    accounted(rec)

    assert sorted(tasks1) == [0, 1, 2]  # round 1: the live clients
    late = update(tasks[2])  # round 0's straggler answers, late: discarded (late = drop)
    send(engine, [late, update(tasks1[0]), update(tasks1[2])], 7.0)
    evals = by_client(engine.on_tick(11.5), "eval")  # round 1 began at 6.5
    assert sorted(evals) == [0, 1, 2]
    send(engine, [result(evals[c]) for c in (0, 1, 2)], 12.0)
    rec = engine.records[-1]
    assert rec["failures"] == {"1": "dropped"} and rec["late_discarded"] == [[2, 0]]
    assert rec["eval_missing"] == {} and (rec["eval_clients"], rec["eval_live"]) == (3, 3)
    accounted(rec)


def test_an_async_task_that_expires_is_timed_out_not_late_and_its_answer_is_refused():
    """Async mode: a task whose deadline passes is forgotten (its client gets a fresh task),
    so its answer can no longer count: the failure is "timed_out", not "late" (a late sync
    update may still be folded), and the outcome line says so."""
    from fedbus.launch.log_cmd import outcome_text
    engine = make(3, mode="async", concurrency=3, buffer=2, deadline_s=5.0, rounds=3,
                  eval_every=100)
    tasks = by_client(connect(engine, "a", range(3)))
    assert sorted(tasks) == [0, 1, 2]
    refilled = by_client(engine.on_tick(5.0))  # every task expired: each client asked again
    assert sorted(refilled) == [0, 1, 2]
    send(engine, [update(refilled[0]), update(refilled[1])], 6.0)
    rec = engine.records[-1]
    assert rec["failures"] == {"0": "timed_out", "1": "timed_out", "2": "timed_out"}, rec
    assert rec["late"] == 0 and rec["failed"] == 3
    rejected = engine.totals["rejected"]
    answer = send(engine, [update(tasks[2])], 7.0)  # the expired task's answer, after all
    assert engine.totals["rejected"] == rejected + 1  # refused, not folded or buffered
    assert [o.body["code"] for o in of(answer, "error")] == ["rejected"]
    assert len(engine.buffer) == 0 and engine.records[-1] is rec
    line = outcome_text({"round": rec["round"], "sampled": rec["sampled"], "answered": [],
                         "failures": {c: "timed out" for c in rec["failures"]}})
    assert "timed out: 0,1,2" in line and "late" not in line


def test_a_result_that_never_comes_is_named_timed_out_and_a_refused_one_refused():
    engine = make(4, deadline_s=5.0)
    tasks = by_client(connect(engine, "a", range(4)))
    evals = by_client(send(engine, [update(t) for t in tasks.values()], 1.0), "eval")
    bad = result(evals[1])
    bad.body["metrics"]["num_test"] = 10 ** 9  # more test samples than the client has
    send(engine, [result(evals[0]), bad], 2.0)
    assert engine.on_tick(1.0 + 9.9) == []
    engine.on_tick(11.0)  # the evaluation's deadline: twice the round's
    rec = engine.records[-1]
    assert rec["eval_missing"] == {"1": "refused", "2": "timed_out", "3": "timed_out"}
    accounted(rec)


def test_a_refused_update_is_named_refused_with_the_validators_reason():
    engine = make(3)
    tasks = by_client(connect(engine, "a", range(3)))
    send(engine, [update(tasks[0]), update(tasks[1]), update(tasks[2], num_samples=10 ** 9)],
         1.0)
    rec = next(iter(engine.evals.values())).record
    assert rec["failures"] == {"2": "rejected"}
    assert "num_samples" in rec["refusals"]["2"], rec["refusals"]


def test_async_a_dropped_task_past_its_deadline_is_dropped_and_a_slow_one_timed_out():
    engine = make(3, system={"drop_clients": [1]}, mode="async", concurrency=3, buffer=1,
                  deadline_s=5.0, eval_every=100, rounds=3)
    tasks = by_client(connect(engine, "a", range(3)))
    tasks[0] = by_client(send(engine, [update(tasks[0])], 1.0))[0]  # version 1; 0 goes on
    refill = by_client(engine.on_tick(5.0))  # 1 (dropped) and 2 (slow) expire: refilled
    assert engine.window.failures == {1: "dropped", 2: "timed_out"} and sorted(refill) == [1, 2]
    send(engine, [update(tasks[0])], 6.0)
    assert engine.records[-1]["failures"] == {"1": "dropped", "2": "timed_out"}
    # async evaluates every live client, busy or not: here the final evaluation
    evals = by_client(send(engine, [update(refill[2])], 7.0), "eval")
    assert engine.version == 3 and sorted(evals) == [0, 1, 2]
    send(engine, [result(e) for e in evals.values()], 8.0)
    accounted(engine.records[-1])
    assert engine.records[-1]["eval_clients"] == 3


def merged_update(tasks: list[Out], src: str = "relay") -> Message:
    """A relay's merged update of `tasks` (the no-op's array sums)."""
    state = sum(np.asarray(t.body["payload"]["state"], dtype=np.float64) for t in tasks)
    body = {"version": tasks[0].body["version"], "rule": "array-sums",
            "members": [[t.dst, t.body["task"], 1, WORK] for t in tasks],
            "payload": {"state": state, "mass": np.array([float(len(tasks))])}}
    return Message("merged", src, "server", body, run=RUN, round=tasks[0].round)


def test_below_a_relay_a_dropped_member_is_dropped_and_evaluated():
    """The relay merges the members that answered (its own deadline cut the wait for the
    one that dropped): the server names the silent member dropped and evaluates it."""
    engine = make(system={"drop_clients": [1]}, deadline_s=5.0)
    connect(engine, "relay", range(4))
    tasks = by_client(connect(engine, "n", [4, 5]))
    send(engine, [merged_update([tasks[0], tasks[2], tasks[3]]), update(tasks[4]),
                  update(tasks[5])], 4.5)
    evals = by_client(engine.on_tick(5.0), "eval")
    assert sorted(evals) == list(range(6))
    send(engine, [result(e) for e in evals.values()], 6.0)
    rec = engine.records[-1]
    assert rec["failures"] == {"1": "dropped"} and rec["merged"] == 1
    assert (rec["eval_clients"], rec["eval_live"], rec["eval_missing"]) == (6, 6, {})


def test_after_a_resume_the_dropping_client_is_evaluated_and_named_as_before():
    """A server resumed from round 0's checkpoint (a fresh engine, its state loaded): round
    1 names the dropping client dropped and its evaluation accounts for every live client."""
    cfg = {"system": {"drop_clients": [1]}, "deadline_s": 5.0}
    first = make(3, **cfg)
    tasks = by_client(connect(first, "a", range(3)))
    evals = by_client(send(first, [update(tasks[0]), update(tasks[2])], 1.0) +
                      first.on_tick(5.0), "eval")
    send(first, [result(e) for e in evals.values()], 6.0)
    resumed = make(3, **cfg)
    resumed.load_state_dict(first.state_dict())
    tasks = by_client(connect(resumed, "a", range(3), now=100.0))
    assert resumed.version == 1 and sorted(tasks) == [0, 1, 2]
    evals = by_client(send(resumed, [update(tasks[0]), update(tasks[2])], 101.0) +
                      resumed.on_tick(105.0), "eval")
    send(resumed, [result(e) for e in evals.values()], 106.0)
    rec = resumed.records[-1]
    assert rec["round"] == 1 and rec["failures"] == {"1": "dropped"}
    assert (rec["eval_clients"], rec["eval_live"], rec["eval_missing"]) == (3, 3, {})


def test_failure_names_are_documented():
    assert {"late", "dropped", "dead", "rejected", "error"} <= set(FAILURES)
    assert set(EVAL_MISSING) == {"busy", "dead", "refused", "timed_out"}


def test_a_run_that_may_wait_for_its_hard_deadline_is_warned_about_at_start():
    cfg = make(system={"drop_prob": 0.2}).cfg
    line = unbounded_wait(cfg)
    assert line and "system.drop_prob = 0.2" in line and "600 s" in line and "\n" not in line
    assert unbounded_wait(make(system={"drop_prob": 0.2}, deadline_s=2.0).cfg) is None
    assert unbounded_wait(make().cfg) is None
    assert "drop_clients" in unbounded_wait(make(system={"drop_clients": [3]}).cfg)
    engine = make(2, system={"drop_clients": [1]})
    connect(engine, "a", range(2))
    assert [e for e in engine.events if e["event"] == "warning"] == \
        [{"event": "warning", "message": unbounded_wait(engine.cfg)}]


# --- a real run: drops, a straggler late by events, a node killed by an event ---------

LIVENESS = ("--heartbeat-s", "0.3", "--liveness", "10")
DROPS = 1  # drops every task it is sent (system.drop_clients)
HELD = 2  # a straggler: its node holds each update until a later round's message arrives
# Six clients, every one sampled each round, on two nodes (n0: 0-2, n1: 3-5). A round closes
# once 4 updates are in (federation.quorum: 0, 3, 4 and 5), so client 2 is late in every
# round by events, on any machine. The deadline closes only the rounds after n1's death,
# where a dropped task and a held one are all that is left (a silent drop is known only by
# a clock); before it the deadline is a liveness guard, 20 s for one epoch on digits (and an
# evaluation twice that), never what decides who is late on a loaded machine.
ROUNDS = 4
PARTIAL = merged(SMALL, federation={"clients": 6, "rounds": ROUNDS, "quorum": 4,
                                    "deadline_s": 20.0,
                                    "hard_deadline_s": 60.0, "late": "fold"},
                 system={"drop_clients": [DROPS], "hold_clients": [HELD]},
                 launch={"threads": 1}, bus={"liveness": 10})


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    """A whole run of PARTIAL in which node n1 (clients 3-5) is SIGKILLed when round 1's
    record appears."""
    d = tmp_path_factory.mktemp("partial")
    procs = Processes(d)
    broker = f"tcp://127.0.0.1:{free_port()}"
    run = d / "run"
    try:
        procs.start("broker", "broker", "--bind", broker, *LIVENESS)
        procs.start("server", "server", "--broker", broker,
                    str(write_config(d / "cfg.toml", PARTIAL)), "--out", str(run))
        for i, clients in enumerate(("0-2", "3-5")):
            procs.start(f"node-{i}", "node", "--broker", broker, "--clients", clients,
                        "--name", f"n{i}", *LIVENESS)
        wait_until(lambda: (run / "metrics.jsonl").exists() and len(metrics(run)) >= 2, 240,
                   "round 1's record", interval=0.002)
        # n1 dies in the round after that record whatever the machine's speed: the server is
        # stopped while n1 is killed, so it cannot have run further in the meantime
        server = procs.procs["server"]
        server.send_signal(signal.SIGSTOP)
        try:
            assert len(metrics(run)) == 2, "the server ran past round 2 before it was stopped"
            procs.kill("node-1")
        finally:
            server.send_signal(signal.SIGCONT)
        wait_until(lambda: procs.procs["server"].poll() is not None, 300, "the run's end")
        assert procs.procs["server"].returncode == 0, procs.log("server")[-3000:]
    finally:
        procs.close()
    return run


def test_every_live_client_free_at_evaluation_is_evaluated_the_rest_named(partial_run):
    recs = metrics(partial_run)
    assert [r["round"] for r in recs] == list(range(ROUNDS))
    for rec in recs:
        accounted(rec)
        # the client that drops every task is dropped, never late, and never held back
        # from an evaluation (today's engine kept it busy: 7, 5, 2, ... clients evaluated)
        assert rec["failures"][str(DROPS)] == "dropped", rec["failures"]
        assert str(DROPS) in rec["per_client"] and "0" in rec["per_client"], rec
        assert rec["failures"].get(str(HELD), "late") == "late", rec["failures"]
        assert set(rec["failures"].values()) <= set(FAILURES), rec["failures"]
        assert {c for c, why in rec["failures"].items() if why == "dead"} <= {"3", "4", "5"}
    # n1's clients, gone: whether the round n1 died in names them "dead" (the broker's purge
    # came first) or "late" (its deadline did) is the machine's speed; that they are
    # accounted for in every evaluation, and gone after, is not
    assert recs[-1]["eval_live"] == 3 and recs[-1]["sampled"] == 3, recs[-1]
    folded = [e for r in recs for e in r["stale"]]
    assert any(c == HELD for c, *_ in folded), folded  # the straggler's late updates counted


def _main(module, **args) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = module.main(Namespace(**args))
        except SystemExit as err:
            rc = int(err.code or 0)
    return rc, out.getvalue()


def test_log_and_replay_agree_on_every_task_dropped_late_and_dead_ones_too(partial_run):
    """Every task of the run, through `fedbus log --round R --client C` and `fedbus replay
    --client C --round R`: the replay says what the log says became of the task, and exits 0
    (its update recomputed identically, or no update there was to compare, for that reason)."""
    from fedbus.launch import log_cmd, replay_cmd

    # every task sent, alone or as a `tasks` batch's member
    tasks = [(m.round, client_index(m.dst)) for m in logged_messages(partial_run, "task", "out")]
    assert len(tasks) >= 8, tasks
    seen = set()
    for rnd, c in tasks:
        rc, log = _main(log_cmd, run=str(partial_run), round=rnd, client=c, kind=["task"],
                        outcomes_only=False, json=False)
        assert rc == 0, log
        state = re.search(rf"^round {rnd}: c{c} (\S+)", log, re.MULTILINE).group(1)
        rc, replay = _main(replay_cmd, run=str(partial_run), round=rnd, client=c,
                           until_round=None, dump_state=None)
        where = f"c{c} round {rnd}:\n{log}\n{replay}"
        assert rc == 0, where
        seen.add(state)
        if state == "answered":
            assert ": update identical" in replay, where
        elif state == "dropped":
            assert "dropped (at task)" in log and "dropped (at task)" in replay, where
        else:
            assert state in ("late", "dead"), where
            assert f", {state}): update identical" in replay or \
                f"(the round's record: {state})" in replay, where
    assert {"answered", "dropped", "late"} <= seen, seen


def test_drop_and_late_are_told_apart_in_metrics_outcomes_plot_log_and_console(partial_run):
    from fedbus.analysis.plots import STATUSES, participation_matrix
    from fedbus.launch import log_cmd
    from fedbus.launch.progress import failures_text

    recs = metrics(partial_run)
    # metrics.jsonl
    assert recs[0]["failures"] == {str(DROPS): "dropped", str(HELD): "late"}, recs[0]
    # the console's line per round
    assert "(dropped 1, late 1)" in failures_text(recs[0])
    # the outcome lines: the round's, and the held client's own, with its late update's fate
    rc, text = _main(log_cmd, run=str(partial_run), round=0, client=None, kind=None,
                     outcomes_only=True, json=False)
    assert rc == 0 and f"dropped: {DROPS}  late: {HELD}" in text, text
    rc, text = _main(log_cmd, run=str(partial_run), round=0, client=HELD, kind=None,
                     outcomes_only=True, json=False)
    assert text.strip() == f"round 0: c{HELD} late (folded into round 1)", text
    # the message line of the dropped task says so, and the client's outcome agrees
    rc, text = _main(log_cmd, run=str(partial_run), round=0, client=DROPS, kind=["task"],
                     outcomes_only=False, json=False)
    assert "dropped (at task)" in text and f"round 0: c{DROPS} dropped" in text, text
    # the participation plot's cells
    grid, rounds = participation_matrix(recs, 6)
    names = {code: name for code, name, _ in STATUSES}
    assert all(names[grid[DROPS, j]] == "dropped its task" for j in range(len(rounds)))
    assert all(names[grid[HELD, j]].startswith("late (") for j in range(len(rounds)))


def test_the_progress_line_says_whom_a_round_waits_for_and_when_it_must_close():
    from fedbus.launch.progress import status_line

    engine = make(4, system={"drop_clients": [1]}, hard_deadline_s=600.0)
    tasks = by_client(connect(engine, "a", range(4)))
    send(engine, [update(tasks[0]), update(tasks[2])], 10.0)
    st = {"version": 0, "rounds": 3, "live": 4, "sampled": 4, "pending": 2,
          **engine.waiting(10.0)}
    assert st["waiting"] == [1, 3] and st["hard_deadline_in_s"] == 590.0
    assert "waiting for c1,c3 (hard deadline in 590s)" in status_line(st)
    # an accuracy says how many live clients it is the mean over
    line = status_line({**st, "acc": 0.5, "eval_clients": 3, "eval_live": 4})
    assert "acc 50.0% (3 of 4 clients)" in line


def test_fedbus_run_warns_at_start_when_a_dropped_task_holds_its_round(tmp_path):
    """drop_clients and no deadline: one warning line before the first round; the round
    closes at the hard deadline with 1 dropped. The hard deadline is also all that client 0's
    task and the evaluation get (and must beat): 20 s for one epoch on digits, a liveness
    bound, where 2 s could be missed by a loaded machine."""
    from tests.helpers import fedbus

    cfg = write_config(tmp_path / "c.toml", merged(
        SMALL, federation={"clients": 2, "rounds": 1, "hard_deadline_s": 20.0},
        system={"drop_clients": [1]}, launch={"nodes": 1}))
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "run"))
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 1 and "system.drop_clients = [1]" in warned[0], proc.stderr
    assert "hard_deadline_s (20 s)" in warned[0]
    assert metrics(tmp_path / "run")[0]["failures"] == {"1": "dropped"}
    assert re.search(r"failed 1 \(dropped 1\)  acc \d+\.\d% \(2 clients\)", proc.stderr), \
        proc.stderr


def test_outcome_lines_name_refusals_with_their_reason_and_discarded_late_updates(tmp_path):
    """The outcome lines read a record's `refusals` and `late_discarded` as the engine
    writes them (the refusal's reason from the validator; the late update of round 0 that
    arrived in round 1 with late = drop)."""
    import json

    from fedbus.launch.log_cmd import outcome_text, round_outcomes

    engine = make(3, deadline_s=5.0, eval_every=100)
    tasks = by_client(connect(engine, "a", range(3)))
    send(engine, [update(tasks[0]), update(tasks[1], num_samples=10 ** 9)], 1.0)
    tasks1 = by_client(engine.on_tick(5.0))  # round 0 closes: 1 refused, 2 late
    send(engine, [update(tasks[2])] + [update(t) for t in tasks1.values()], 6.0)
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in engine.records))
    # (no message log here: "sampled" is the record's count)
    r0, r1 = (outcome_text(o) for o in round_outcomes(tmp_path, None, None))
    assert r0.startswith("round 0: sampled 3  answered 0  late: 2  refused: 1  c1 "
                         "refused: num_samples = 1000000000 is out of range"), r0
    assert r1 == "round 1: sampled 3  answered 0,1,2", r1
    (o,) = round_outcomes(tmp_path, 0, 2)
    assert outcome_text(o) == "round 0: c2 late (discarded in round 1)"

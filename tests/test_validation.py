"""Update validation at the server (issue #7, item 2), and a run with client-side privacy.

Unit level: a real engine and FedProto handler built from a small config; every rule of
Engine.is_expected_update and node/validate.check_update rejects its bad update through the
server's own `dispatch` (an "error" with code "rejected" and the reason goes back, the
`rejected` counter grows, nothing reaches the handler). An update that answers no live task
leaves the tasks as they were; a bad answer to a live task ends it (failure "rejected"), so
the round closes with the other clients' updates without waiting for its deadline.

Federation level: broker, server and an honest node as real processes, plus a hostile client
node (a Peer hosting c4) that answers its tasks with bad updates: the run completes, the
hostile node gets an error with the reason for each, summary.json counts them, and the NaN
answer to its first task makes c4 a "rejected" failure of that round. The honest
clients run with privacy.clip_norm/noise_sigma/withhold_counts set (item 3): their logged
uploads are checked to be protected.
"""
from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest
from helpers import (SMALL, Processes, free_port, logged_messages, merged, metrics, wait_until,
                     write_config)

from fedbus.broker import wire
from fedbus.broker.wire import Message
from fedbus.node.config import build_config
from fedbus.node.server import build_engine, dispatch
from fedbus.node.validate import Rejected, check_update

RUN = "run-val"


def _config(**changes):
    sections = merged(SMALL, federation={"clients": 2, "rounds": 1, "seed": 3},
                      algorithm={"name": "fedproto"}, bus={"max_frame_mb": 1}, **changes)
    return build_config(sections)


@pytest.fixture(scope="module")
def engine_factory():
    cfg = _config()

    def make():
        engine = build_engine(cfg, RUN)
        outs = engine.on_join("node-0", ["c0", "c1"], 0.0)
        assert outs[0].kind == "config"
        outs = engine.on_configured("node-0", RUN, 0.0)
        tasks = {o.dst: o for o in outs if o.kind == "task"}
        assert set(tasks) == {"c0", "c1"}
        return engine, tasks

    return make


def _received(kind, src, body, *, run=RUN, round=0, seq=1):
    """A message as the server's Peer hands it over: encoded, then decoded (read-only views)."""
    m = Message(kind, src, "server", body, run=run, round=round, seq=seq, inc=7, ts=0.0)
    return wire.decode(wire.encode(m), max_frame=4 << 20)


def _good(engine, task_out, client: int) -> dict:
    spec = engine.handler.update_spec()
    (_, pshape), (_, cshape) = spec["protos"], spec["counts"]
    protos = np.zeros(pshape, np.float32)
    counts = np.zeros(cshape, np.int64)
    k = int(np.argmax(engine.class_max(client)))  # a class the client holds
    protos[k] = 0.5
    counts[k] = 3
    return {"task": task_out.body["task"], "version": task_out.body["version"],
            "num_samples": 5, "work": {"epochs_asked": 1, "epochs_done": 1.0, "steps": 2,
                                       "samples": 5},
            "payload": {"protos": protos, "counts": counts}, "train_s": 0.1}


def _with(body: dict, path: str, value) -> dict:
    """A copy of body with one (dotted) field replaced; value None deletes it."""
    out = json.loads(json.dumps({k: v for k, v in body.items() if k != "payload"}))
    out["payload"] = dict(body["payload"])
    node = out
    parts = path.split(".")
    for p in parts[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return out


_DELETE = object()


def _header_cases(engine, tasks):
    """(name, src, body, header overrides, expected reason fragment) for every rule of
    Engine.is_expected_update: the update answers no live task, so nothing changes."""
    return _cases(engine, tasks)[:8]


def _content_cases(engine, tasks):
    """The same for every rule of check_update: c0's answer to its live task is bad."""
    return _cases(engine, tasks)[8:]


def _cases(engine, tasks):
    good = _good(engine, tasks["c0"], 0)
    spec = engine.handler.update_spec()
    _, pshape = spec["protos"]
    c, d = pshape
    nan = np.zeros(pshape, np.float32)
    nan[2, 3] = np.nan
    inf = np.zeros(pshape, np.float32)
    inf[0, 0] = -np.inf
    other = tasks["c1"].body["task"]
    return [
        ("body not a map", "c0", [1, 2, 3], {}, "update body must be a map"),
        ("unknown task", "c0", {**good, "task": 999}, {}, "task 999 is not outstanding"),
        ("task id not an int", "c0", {**good, "task": "1"}, {}, "is not outstanding"),
        ("another client's task", "c0", {**good, "task": other}, {}, f"task {other} was sent to c1"),
        ("wrong version", "c0", {**good, "version": 5}, {}, "version 5 does not match"),
        ("wrong run id", "c0", good, {"run": "someone-else"}, "is not this server's run"),
        ("wrong round", "c0", good, {"round": 4}, "round 4 does not match"),
        ("sender not a client", "node-0", good, {}, "is not a client"),
        ("no payload", "c0", _with(good, "payload", _DELETE), {}, "lacks 'payload'"),
        ("no work", "c0", _with(good, "work", _DELETE), {}, "lacks 'work'"),
        ("work field missing", "c0", _with(good, "work.steps", _DELETE), {}, "work lacks 'steps'"),
        ("work negative", "c0", _with(good, "work.samples", -1), {}, "work.samples = -1"),
        ("work NaN", "c0", _with(good, "work.epochs_done", math.nan), {}, "work.epochs_done"),
        ("num_samples negative", "c0", {**good, "num_samples": -3}, {}, "num_samples = -3"),
        ("num_samples implausible", "c0", {**good, "num_samples": 10**9}, {}, "out of range"),
        ("num_samples not a number", "c0", {**good, "num_samples": "5"}, {}, "must be a number"),
        ("num_samples a bool", "c0", {**good, "num_samples": True}, {}, "must be a number"),
        ("payload not a map", "c0", {**good, "payload": [1]}, {}, "payload must be a map"),
        ("protos missing", "c0", _with(good, "payload.protos", _DELETE), {}, "lacks 'protos'"),
        ("protos not an array", "c0", _with(good, "payload.protos", [[0.0] * d] * c), {},
         "protos must be an array"),
        ("protos wrong dtype", "c0",
         _with(good, "payload.protos", np.zeros(pshape, np.float64)), {}, "has dtype float64"),
        ("protos wrong shape", "c0",
         _with(good, "payload.protos", np.zeros((c, d + 1), np.float32)), {}, "has shape"),
        ("protos wrong rank", "c0",
         _with(good, "payload.protos", np.zeros((c * d,), np.float32)), {}, "has shape"),
        ("protos NaN", "c0", _with(good, "payload.protos", nan), {}, "NaN or Inf"),
        ("protos Inf", "c0", _with(good, "payload.protos", inf), {}, "NaN or Inf"),
        ("counts wrong dtype", "c0",
         _with(good, "payload.counts", np.zeros(c, np.float32)), {}, "has dtype float32"),
        ("counts negative", "c0",
         _with(good, "payload.counts", np.array([-1] + [0] * (c - 1), np.int64)), {},
         "counts must be non-negative"),
        ("counts implausible", "c0",
         _with(good, "payload.counts", np.full(c, 10**6, np.int64)), {}, "more than the client's"),
        ("class ids out of range", "c0",
         _with(good, "payload.classes", np.array([0, c], np.int64)), {},
         f"class ids must lie in [0, {c})"),
        ("class ids negative", "c0",
         _with(good, "payload.classes", np.array([-1], np.int64)), {}, "class ids must lie"),
        ("NaN in an extra list", "c0", _with(good, "payload.extra", [1.0, math.inf]), {},
         "payload.extra[1] is inf"),
        ("over the size cap", "c0",
         _with(good, "payload.pad", np.zeros(1 << 20, np.uint8)), {}, "-byte cap"),
    ]


def test_header_rules_reject_and_leave_the_task_outstanding(engine_factory):
    engine, tasks = engine_factory()
    before = {k: np.array(v, copy=True) for k, v in engine.handler.state_dict().items()}
    seq = 0
    cases = _header_cases(engine, tasks)
    assert [c[0] for c in cases][0] == "body not a map" and cases[-1][0] == "sender not a client"
    for name, src, body, hdr, fragment in cases:
        seq += 1
        msg = _received("update", src, body, seq=seq, **hdr)
        outs = dispatch(engine, msg, 1.0)
        assert len(outs) == 1, name
        err = outs[0]
        assert (err.kind, err.dst, err.body["code"]) == ("error", src, "rejected"), name
        assert fragment in err.body["reason"], (name, err.body["reason"])
        assert engine.totals["rejected"] == seq, name
        assert engine.events[-1] == {"event": "rejected", "kind": "update", "src": src,
                                     "reason": err.body["reason"]}, name
    # nothing reached the handler and both tasks are still outstanding
    assert engine.version == 0 and engine.round is not None and not engine.round.updates
    assert not engine.round.failures
    assert sorted(t.client for t in engine.tasks.values()) == [0, 1]
    for k, v in engine.handler.state_dict().items():
        assert np.array_equal(v, before[k]), k
    # the honest updates go through; a second copy of one (a replay) is rejected
    seq += 1
    assert dispatch(engine, _received("update", "c0", _good(engine, tasks["c0"], 0), seq=seq),
                    2.0) == []
    seq += 1
    dup = dispatch(engine, _received("update", "c0", _good(engine, tasks["c0"], 0), seq=seq),
                   2.0)
    assert dup[0].body["code"] == "rejected" and "not outstanding" in dup[0].body["reason"]
    seq += 1
    outs = dispatch(engine, _received("update", "c1", _good(engine, tasks["c1"], 1), seq=seq),
                    3.0)
    assert engine.version == 1  # the round closed (its evaluation follows)
    assert {o.kind for o in outs} == {"eval"}
    rec = next(iter(engine.evals.values())).record
    assert rec["participants"] == [0, 1] and rec["updates"] == 2
    assert engine.totals["rejected"] == len(cases) + 1
    assert bool(engine.handler.state_dict()["has"][1])  # the good prototypes were aggregated


def test_content_rules_reject_and_end_the_task(engine_factory):
    probe, probe_tasks = engine_factory()
    names = [c[0] for c in _content_cases(probe, probe_tasks)]
    assert len(names) >= 24 and names[0] == "no payload"
    for i, name in enumerate(names):
        engine, tasks = engine_factory()
        before = {k: np.array(v, copy=True) for k, v in engine.handler.state_dict().items()}
        _, src, body, hdr, fragment = _content_cases(engine, tasks)[i]
        task_id = tasks["c0"].body["task"]
        outs = dispatch(engine, _received("update", src, body, seq=1, **hdr), 1.0)
        assert len(outs) == 1, name  # the round still waits for c1
        err = outs[0]
        assert (err.kind, err.dst, err.body["code"]) == ("error", "c0", "rejected"), name
        assert fragment in err.body["reason"], (name, err.body["reason"])
        assert err.body["task"] == task_id, name
        assert engine.totals["rejected"] == 1, name
        assert engine.events[-2:] == [
            {"event": "rejected", "kind": "update", "src": "c0", "reason": err.body["reason"]},
            {"event": "task_failed", "client": 0, "task": task_id, "reason": "rejected"}], name
        # c0's task is over (a failure of this round), and nothing reached the handler
        assert [t.client for t in engine.tasks.values()] == [1], name
        assert engine.round.failures == {0: "rejected"} and not engine.round.updates, name
        for k, v in engine.handler.state_dict().items():
            assert np.array_equal(v, before[k]), (name, k)
    # (the last engine) c0's honest answer comes too late; c1's closes the round at once
    late = dispatch(engine, _received("update", "c0", _good(engine, tasks["c0"], 0), seq=2), 2.0)
    assert late[0].body["code"] == "rejected" and "not outstanding" in late[0].body["reason"]
    assert engine.round.failures == {0: "rejected"}
    outs = dispatch(engine, _received("update", "c1", _good(engine, tasks["c1"], 1), seq=3), 3.0)
    assert engine.version == 1 and {o.kind for o in outs} == {"eval"}
    rec = next(iter(engine.evals.values())).record
    assert rec["participants"] == [1] and rec["updates"] == 1
    assert rec["failures"] == {"0": "rejected"}
    assert engine.totals["rejected"] == 2
    assert bool(engine.handler.state_dict()["has"][1])


def test_size_cap_on_payload_arrays_and_on_the_message():
    spec = {"protos": ("float32", (2, 3))}
    body = {"task": 1, "version": 0, "num_samples": 1,
            "work": {"epochs_asked": 1, "epochs_done": 1, "steps": 1, "samples": 1},
            "payload": {"protos": np.zeros((2, 3), np.float32),
                        "extra": np.zeros(100, np.float64)}}
    check_update(body, spec, num_classes=2, max_samples=10, max_bytes=1000, nbytes=900)
    with pytest.raises(Rejected, match="payload arrays of 824 bytes exceed the 800-byte cap"):
        check_update(body, spec, num_classes=2, max_samples=10, max_bytes=800, nbytes=700)
    with pytest.raises(Rejected, match="update of 1200 bytes exceeds the 1000-byte cap"):
        check_update(body, spec, num_classes=2, max_samples=10, max_bytes=1000, nbytes=1200)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_the_one_pass_finiteness_and_norm_check_agrees_with_the_two_pass_one(dtype):
    """check_update proves an array finite by its sum of squares being finite, and hands
    that sum to the norm bound: NaN or Inf anywhere (alone or beside huge values) is still
    named, a finite array whose squares overflow its float type is finite and measured in
    float64, and the bound sees the norm the separate computation gives."""
    from fedbus.node.validate import Norms, _sq_norm, check_norms

    def body(delta):
        return {"task": 1, "version": 0, "num_samples": 1,
                "work": {"epochs_asked": 1, "epochs_done": 1, "steps": 1, "samples": 1},
                "payload": {"delta": delta, "protos": np.ones((2, 3), np.float32)}}

    def check(delta, bound):
        check_update(body(delta), None, num_classes=2, max_samples=10,
                     norms=Norms(proto=0.0, update=bound))

    big = float(np.finfo(dtype).max) / 4
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore", invalid="ignore"):  # (what the inputs are made of)
        for bad in (np.nan, np.inf, -np.inf):
            for fill in (0.0, big):
                delta = np.full(64, fill, dtype)
                delta[rng.integers(64)] = bad
                with pytest.raises(Rejected, match=r"payload\.delta contains NaN or Inf"):
                    check(delta, 0.0)
        huge = np.full(64, big, dtype)  # finite, but its squares overflow
        want = math.sqrt(_sq_norm(huge))
        with pytest.raises(Rejected, match=re.escape(f"L2 norm {want:.4g}, above")):
            check(huge, 1.0)
    small = rng.normal(size=64).astype(dtype)
    norm = math.sqrt(_sq_norm(small))
    check(small, norm * 1.00001)  # the same norm both ways: at the bound, accepted
    with pytest.raises(Rejected, match="above the server's bound"):
        check(small, norm * 0.999)
    check_norms({"delta": small}, Norms(update=norm * 1.00001))


# --------------------------------------------------------------------------- a real federation
HOSTILE = r'''
import json, sys, time
import numpy as np
from fedbus.broker.peer import Peer

cfg = json.loads(sys.argv[1])
out = lambda **kw: print(json.dumps(kw), flush=True)
peer = Peer(cfg["broker"], "evil", role="client", addresses=["c4"], heartbeat_s=0.3, liveness=4)
peer.start(60)
out(event="ready")
run = ""
sent = 0
answered = set()
deadline = time.time() + 240
while time.time() < deadline:
    m = peer.recv(timeout=0.5)
    if m is None:
        continue
    if m.kind == "config":
        run = m.body["run"]
        peer.run = run
        peer.send("config", "server", {"node": "evil", "run": run}, src="c4")
    elif m.kind == "task" and m.body["task"] not in answered:
        t = m.body
        answered.add(t["task"])
        c, d = cfg["c"], cfg["d"]
        def upd(**kw):
            body = {"task": t["task"], "version": t["version"], "num_samples": 5,
                    "work": {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 5},
                    "payload": {"protos": np.zeros((c, d), np.float32),
                                "counts": np.zeros(c, np.int64)}}
            body["payload"].update(kw.pop("payload", {}))
            body.update(kw)
            return body
        nan = np.zeros((c, d), np.float32); nan[0, 0] = np.nan
        # answers to no live task first (they change nothing), then answers to this task
        answers = [("unknown task", upd(task=10**6), {}),
                   ("wrong round", upd(), {"round": m.round + 7})]
        if t["version"] == 0:  # a NaN answer ends the task; the next answer comes too late
            answers += [("nan", upd(payload={"protos": nan}), {}),
                    ("shape", upd(payload={"protos": np.zeros((c, d + 2), np.float32)}), {})]
        else:  # one honest answer (not a bad one), then a copy of it
            answers += [("honest", upd(), {"honest": True}), ("duplicate", upd(), {})]
        for name, body, kw in answers:
            peer.send("update", "server", body, round=kw.get("round", m.round), src="c4")
            sent += 0 if kw.get("honest") else 1
        out(event="sent", version=t["version"], total=sent)
    elif m.kind == "eval":
        peer.send("eval_result", "server", {"eval": m.body["eval"], "version": m.body["version"],
                  "metrics": {"acc": 0.0, "loss": 0.0, "num_test": 0}}, round=m.round, src="c4")
    elif m.kind == "error":
        out(event="error", **{k: v for k, v in m.body.items() if isinstance(v, (str, int))})
    elif m.kind == "shutdown":
        out(event="shutdown", sent=sent)
        break
peer.close()
'''


def test_hostile_client_in_a_real_federation(tmp_path, spawn_py):
    port = free_port()
    broker = f"tcp://127.0.0.1:{port}"
    # the honest clients also protect their prototypes (item 3): clipped, noised, no counts
    # no round deadline: every round ends when each client answered or failed (the hostile's
    # NaN answer fails its task), so slow honest clients are never cut; the hard deadline is
    # only a liveness guard
    sections = merged(SMALL, federation={"clients": 5, "rounds": 2, "seed": 2,
                                         "hard_deadline_s": 120.0},
                      algorithm={"name": "fedproto"},
                      privacy={"clip_norm": 1.0, "noise_sigma": 0.05, "withhold_counts": True})
    cfg_path = write_config(tmp_path / "cfg.toml", sections)
    run_dir = tmp_path / "run"
    procs = Processes(tmp_path)
    try:
        procs.start("broker", "broker", "--bind", broker, "--heartbeat-s", "0.3",
                    "--liveness", "4")
        cfg = build_config(sections)
        engine = build_engine(cfg, "x")
        c, d = engine.handler.update_spec()["protos"][1]
        evil = spawn_py(HOSTILE, {"broker": broker, "c": c, "d": d}, name="evil")
        evil.expect("ready", timeout=90)
        procs.start("server", "server", "--broker", broker, str(cfg_path), "--out", str(run_dir))
        procs.start("node", "node", "--broker", broker, "--clients", "0-3", "--name", "honest",
                    "--heartbeat-s", "0.3", "--liveness", "4")
        evil.expect("shutdown", timeout=240)
        wait_until(lambda: procs.procs["server"].poll() is not None, 60, "the server to exit")
        assert procs.procs["server"].returncode == 0, procs.log("server")[-3000:]
    finally:
        procs.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    sent = evil.records("sent")
    assert [r["version"] for r in sent] == [0, 1]
    total = sent[-1]["total"]  # 4 bad answers to the first task, 2 + the duplicate to the second
    assert total == 7
    errors = [r for r in evil.records("error") if r.get("code") == "rejected"]
    reasons = [r["reason"] for r in errors]
    assert len(errors) == total, reasons
    for fragment in ("NaN or Inf", "task 1000000 is not", "round 7 does not", "round 8 does not"):
        assert any(fragment in r for r in reasons), (fragment, reasons)
    # 2 unknown tasks, the answer after the NaN one (its task was over), the duplicate
    assert sum("is not outstanding" in r for r in reasons) == 4, reasons
    assert summary["rejected"] == total
    recs = [r for r in metrics(run_dir) if "participants" in r]
    assert [r["round"] for r in recs] == [0, 1]
    assert 4 not in recs[0]["participants"] and recs[0]["participants"] == [0, 1, 2, 3]
    assert recs[0]["failures"] == {"4": "rejected"}  # ended by its NaN answer, not the deadline
    assert recs[1]["participants"] == [0, 1, 2, 3, 4]  # its one honest update counted once
    _check_protected_uploads(run_dir, honest={0, 1, 2, 3}, sigma=0.05)


def _check_protected_uploads(run_dir, honest: set[int], sigma: float) -> None:
    """The honest updates the server logged are clipped to norm 1, noised, and carry 0/1
    presence flags instead of counts (privacy.clip_norm/noise_sigma/withhold_counts)."""
    seen = 0
    for m in logged_messages(run_dir, "update", "in"):  # alone or a batch's members
        if int(m.src[1:]) not in honest:
            continue
        seen += 1
        protos, counts = m.body["payload"]["protos"], m.body["payload"]["counts"]
        assert set(np.unique(counts).tolist()) <= {0, 1} and counts.sum() > 0
        norms = np.linalg.norm(protos[counts > 0], axis=1)
        # clipped to 1, then N(0, sigma^2) per dimension: far below 1 + 6 sigma sqrt(D)
        assert norms.max() < 1.0 + 6 * sigma * math.sqrt(protos.shape[1]), norms
        assert norms.min() > 0
        assert np.all(protos[counts == 0] == 0)  # absent classes stay zero rows
    assert seen == 2 * len(honest)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_a_diverged_client_is_flagged_at_home_and_its_round_ends_at_the_server():
    """Real training on digits with an absurd learning rate: the model's prototypes turn
    NaN/Inf; the node's check names the array, the server rejects the update and ends the
    client's task (the round then closes with the other client alone)."""
    import torch

    from fedbus.node.client_host import ClientPool, run_task
    from fedbus.node.validate import non_finite

    cfg = _config(train={"lr": 1e30, "momentum": 0.0, "epochs": 1})
    engine = build_engine(cfg, RUN)
    engine.on_join("node-0", ["c0", "c1"], 0.0)
    tasks = {o.dst: o for o in engine.on_configured("node-0", RUN, 0.0) if o.kind == "task"}
    pool = ClientPool(cfg, torch.device("cpu"))
    update, _ = run_task(pool.get(0), tasks["c0"].body)
    assert non_finite(update["payload"]) == ["payload.protos"]
    outs = dispatch(engine, _received("update", "c0", update, seq=1), 1.0)
    assert outs[0].body["code"] == "rejected" and "NaN or Inf" in outs[0].body["reason"]
    assert engine.round.failures == {0: "rejected"}
    # a sane client's update passes the same check
    sane = _config()
    update, _ = run_task(ClientPool(sane, torch.device("cpu")).get(1), tasks["c1"].body)
    assert non_finite(update["payload"]) == []
    assert non_finite({"a": [np.zeros(2), {"b": np.array([1.0, np.inf])}], "n": 3,
                       "x": math.nan, "i": np.array([1, 2])}) == ["payload.a[1].b", "payload.x"]
    # every float width and layout; finite float32 values whose squares overflow are finite
    big = np.full(8, 3e38, np.float32)
    assert non_finite({"big": big, "h": np.array([1, np.nan], np.float16),
                       "t": np.array([[1.0, np.nan], [2.0, 3.0]]).T, "c": np.array([1j, np.inf]),
                       "ok": np.ones((3, 4), np.float32)[:, ::2]}) == \
        ["payload.h", "payload.t", "payload.c"]


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_partial_fraction_is_the_share_of_partial_tasks(fraction):
    """system.partial_fraction (Michieli & Ozay's delta): each task is partial, F' ~ U[0, F],
    with this probability; the others run all F epochs."""
    cfg = build_config(merged(SMALL, federation={"clients": 2, "rounds": 1, "seed": 3},
                              train={"epochs": 4},
                              system={"partial_work": True, "partial_fraction": fraction}))
    engine = build_engine(cfg, RUN)
    sims = [engine._simulate(0) for _ in range(2000)]
    partial = [s["epochs_to_run"] for s in sims if s["epochs_to_run"] != 4.0]
    assert abs(len(partial) / len(sims) - fraction) < 0.04
    assert all(0.0 <= e < 4.0 for e in partial)

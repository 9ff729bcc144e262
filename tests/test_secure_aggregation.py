"""Secure aggregation in the engine (`privacy.secure_aggregation`): the server's global state
equals the plain federation's within the fixed-point tolerance, with dropouts before and
after masking, through relays and in replay; a round that loses too many clients fails
cleanly and the next goes on; the message log never holds a client's prototypes.

The engine tests script every message with the real client side (SecureClient, the real
X25519/AES-GCM/Shamir of fedbus.node.privacy.secagg) and no sockets; the process tests run real
brokers, relays, nodes and servers on loopback."""
from __future__ import annotations

import numpy as np
import pytest

from fedbus.broker.wire import Message
from fedbus.node.config import build_config
from fedbus.node.engine import client_address
from fedbus.node.privacy.secure_round import SecureClient, privacy_refusal
from fedbus.node.server import build_engine, dispatch

WORK = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1}
RUN = "r"


def _config(algorithm: str = "fedproto", secure: bool = True, **federation):
    return build_config({
        "federation": {"clients": 6, "rounds": 3, "seed": 3, **federation},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": algorithm},
        "privacy": {"secure_aggregation": secure, "secagg_timeout_s": 10.0}})


def _engine(cfg):
    engine = build_engine(cfg, RUN)
    engine.on_join("n", [client_address(c) for c in range(cfg.federation.clients)], 0.0)
    return engine, engine.on_configured("n", RUN, 0.0)


def _payload(engine, client: int, version: int) -> dict:
    """What client `client` would upload: FedProto's prototypes and counts (within its
    partition's class sizes), or FedAvg's weight delta; seeded by (client, version)."""
    rng = np.random.default_rng([client, version])
    if "delta" in engine.handler.update_spec():
        spec = engine.handler.update_spec()["delta"]
        return {"delta": {k: rng.normal(0, 0.01, size=shape).astype(np.float32)
                          for k, (_, shape) in spec.items()}}
    c, d = engine.handler.ctx.num_classes, engine.handler.ctx.feature_dim
    counts = np.array([rng.integers(0, n + 1) for n in engine.class_samples[client]])
    protos = rng.normal(size=(c, d)).astype(np.float32) * (counts > 0)[:, None]
    return {"protos": protos, "counts": counts.astype(np.int64)}


def _update(engine, task, client: int) -> dict:
    return {"task": task.body["task"], "version": task.body["version"],
            "num_samples": int(engine.train_sizes[client]), "work": WORK,
            "payload": _payload(engine, client, task.body["version"])}


def _msg(kind, src, body, round_):
    return Message(kind, src, "server", body, run=RUN, round=round_)


class Clients:
    """The client side of a scripted round: SecureClient, as a node runs it."""

    def __init__(self, engine, cfg):
        from fedbus.algorithms import get_algorithm
        from fedbus.algorithms.core.params import resolved_params

        server_cls = get_algorithm(cfg.algorithm.name).server
        params = resolved_params(server_cls, dict(cfg.algorithm))
        self.secure = SecureClient(server_cls.merge_rule(params), params,
                                   unit_weight=cfg.privacy.dp == "client")
        self.engine = engine
        self.sent: list[Message] = []  # every message a client sent (what the server saw)
        self.held: dict[str, dict] = {}  # masked updates of clients that vanished

    def send(self, kind, src, body, round_, now):
        msg = _msg(kind, src, body, round_)
        self.sent.append(msg)
        return dispatch(self.engine, msg, now)


def secure_round(engine, cfg, tasks, *, drop_shares=(), drop_input=(), now=1.0,
                 update=None, masked_of=None):
    """One securely aggregated round, message by message. drop_shares: clients that send
    keys and shares and then vanish; drop_input: clients that send their masked input and
    vanish before unmasking; update(engine, task, client): the trained update (default
    _update); masked_of(client, masked): what the client sends instead of its masked
    update. Returns (the round's outs, the Clients)."""
    update = update or _update
    cl = Clients(engine, cfg)
    outs = []
    for t in tasks:
        outs += cl.send("secagg", t.dst, cl.secure.begin(t.dst, t.body), t.round, now)
    peers = [o for o in outs if o.kind == "secagg" and o.body["step"] == "peers"]
    assert sorted(o.dst for o in peers) == sorted(t.dst for t in tasks)
    by_dst = {t.dst: t for t in tasks}
    masking = []
    for o in peers:
        masking += cl.send("secagg", o.dst, cl.secure.on_peers(o.dst, o.body), o.round, now)
    masking = [o for o in masking if o.kind == "secagg" and o.body["step"] == "masking"]
    assert sorted(o.dst for o in masking) == sorted(t.dst for t in tasks)
    unmasks = []
    for o in masking:
        c = int(o.dst[1:])
        assert cl.secure.ready(o.dst, update(engine, by_dst[o.dst], c)) is None  # held
        masked = cl.secure.on_masking(o.dst, o.body)
        if masked_of is not None:
            masked = masked_of(c, masked)
        if c not in drop_shares:
            unmasks += cl.send("update", o.dst, masked, o.round, now)
        else:
            cl.held[o.dst] = masked  # (it may come late)
    if drop_shares:  # the round closes at its deadline without them
        unmasks += engine.on_tick(now + cfg.federation.deadline_s + 0.1)
    after = []
    for o in [o for o in unmasks if o.kind == "secagg" and o.body["step"] == "unmask"]:
        if int(o.dst[1:]) in drop_input:
            continue
        after += cl.send("secagg", o.dst, cl.secure.on_unmask(o.dst, o.body), o.round, now)
    if drop_input:  # the server unmasks at its reveal deadline
        after += engine.on_tick(now + cfg.federation.deadline_s + 100.0)
    return unmasks + after, cl


def plain_round(engine, tasks, *, missing=(), now=1.0):
    outs = []
    for t in tasks:
        c = int(t.dst[1:])
        if c not in missing:
            outs += dispatch(engine, _msg("update", t.dst, _update(engine, t, c), t.round),
                             now)
    if missing:
        outs += engine.on_tick(now + engine.fed.deadline_s + 0.1)
    return outs


def _record(engine):
    return engine.records[-1] if engine.records else \
        engine.evals[max(engine.evals)].record


def _global(engine) -> dict:
    state = engine.handler.state_dict()
    if "protos" in state:
        return {"protos": np.asarray(state["protos"], dtype=np.float64)}
    return {k: np.asarray(v, dtype=np.float64) for k, v in state["weights"].items()}


@pytest.mark.parametrize("algorithm", ["fedproto", "fedavg"])
@pytest.mark.parametrize("drop", ["none", "shares", "input"])
def test_the_unmasked_sum_gives_the_plain_global_state(algorithm, drop):
    fed = {"fraction": 0.6, "deadline_s": 5.0}  # partial participation: 4 of 6
    secure_cfg, plain_cfg = (_config(algorithm, s, **fed) for s in (True, False))
    (secure, s_tasks), (plain, p_tasks) = _engine(secure_cfg), _engine(plain_cfg)
    assert [t.dst for t in s_tasks] == [t.dst for t in p_tasks] and len(s_tasks) == 4
    victim = int(s_tasks[1].dst[1:])
    kw = {"shares": {"drop_shares": (victim,)}, "input": {"drop_input": (victim,)},
          "none": {}}[drop]
    secure_round(secure, secure_cfg, s_tasks, **kw)
    plain_round(plain, p_tasks, missing=(victim,) if drop == "shares" else ())
    assert secure.version == plain.version == 1
    rec = _record(secure)
    assert rec["secagg"].get("failed") is None, rec["secagg"]
    assert rec["participants"] == _record(plain)["participants"]
    assert rec["secagg"]["dropped"] == (1 if drop == "shares" else 0)
    assert rec["secagg"]["survivors"] == (3 if drop == "shares" else 4)
    tol = rec["secagg"]["quant_bound"]
    assert 0 < tol < 1e-3
    got, want = _global(secure), _global(plain)
    assert sorted(got) == sorted(want)
    for k in want:  # a mean of sums each off by at most quant_bound
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=tol, err_msg=k)
        assert np.abs(want[k]).max() > 10 * tol  # (the comparison is not vacuous)


def test_too_many_dropouts_fail_the_round_cleanly_and_the_next_goes_on():
    cfg = _config("fedproto", True, deadline_s=5.0)
    engine, tasks = _engine(cfg)
    before = _global(engine)["protos"].copy()
    # six clients, complete graph, threshold 5 of 6 holders: two silent survivors are too many
    outs, _ = secure_round(engine, cfg, tasks, drop_input=(0, 1))
    rec = _record(engine)
    assert "fewer than" in rec["secagg"]["failed"] or "shares" in rec["secagg"]["failed"]
    assert rec["updates"] == 0 and rec["participants"] == []
    # every survivor's input is lost with the round (0 and 1 sent theirs, then vanished)
    assert sorted(int(c) for c, why in rec["failures"].items() if why == "secagg") == \
        list(range(6))
    np.testing.assert_array_equal(_global(engine)["protos"], before)  # nothing unmasked
    assert any(e["event"] == "secagg_failed" for e in engine.events)
    # the next round starts, securely, with every live client
    nxt = [o for o in outs if o.kind == "task"] or \
        [o for o in engine.on_tick(200.0) if o.kind == "task"]
    if not nxt:  # the evaluation of version 1 runs first
        for eid in list(engine.evals):
            nxt += [o for o in engine._finish_eval(eid, 200.0) if o.kind == "task"]
    assert len(nxt) == 6 and all("secagg" in o.body for o in nxt)
    assert engine.round.round == 1


def test_a_masked_input_is_uncorrelated_with_the_prototypes_and_the_sum_matches():
    cfg = _config("fedproto", True)
    engine, tasks = _engine(cfg)
    _, cl = secure_round(engine, cfg, tasks)
    from fedbus.node.privacy.secagg import RingParams, decode, unpack

    ring = RingParams.from_dict(tasks[0].body["secagg"]["ring"])
    masked = {m.src: m.body["payload"]["masked"] for m in cl.sent if m.kind == "update"}
    assert len(masked) == 6
    for t in tasks:
        c = int(t.dst[1:])
        truth = _payload(engine, c, 0)["protos"].reshape(-1).astype(np.float64)
        seen = decode(unpack(masked[t.dst], ring.ring_bits), ring)[:truth.size]
        # what the server held of this client: noise, not its prototypes
        assert abs(np.corrcoef(seen, truth)[0, 1]) < 0.1
        assert np.abs(seen).max() > 1e3 * np.abs(truth).max()
    # a masked update says nothing else of its input: no count of values clipped to the
    # ring's range (issue 42, Why-6), and the record has none to report
    assert all(set(m.body) <= {"task", "version", "num_samples", "work", "payload", "secagg"}
               for m in cl.sent if m.kind == "update"), [sorted(m.body) for m in cl.sent]
    assert "clipped" not in _record(engine)["secagg"]
    # no message a client sent carries a float array (the only floats: none)
    for m in cl.sent:
        payload = m.body.get("payload", {}) if isinstance(m.body, dict) else {}
        assert not any(isinstance(v, np.ndarray) and v.dtype.kind == "f"
                       for v in payload.values())
    assert _record(engine)["secagg"].get("failed") is None


def test_steps_out_of_turn_and_garbage_are_refused_without_harm():
    cfg = _config("fedproto", True)
    engine, tasks = _engine(cfg)
    cl = Clients(engine, cfg)
    t = tasks[0]
    keys = cl.secure.begin(t.dst, t.body)
    # a reveal before any unmasking, shares before peers, a step of another's task
    for body in ({"step": "reveal", "task": t.body["task"], "b": {}, "s": {}},
                 {"step": "shares", "task": t.body["task"], "shares": {}},
                 {**keys, "task": tasks[1].body["task"]},
                 {"step": "nonsense", "task": t.body["task"]},
                 {**keys, "c_pk": b"short"}):
        before = (engine.totals["refused"], engine.totals["rejected"])
        dispatch(engine, _msg("secagg", t.dst, body, t.round), 1.0)
        assert (engine.totals["refused"], engine.totals["rejected"]) != before, body
    assert engine.round is not None and engine.round.secure.phase == "keys"
    # the bad keys ended c0's task: the round goes on without it
    assert engine.round.failures.get(0) == "rejected"
    # an unmasked update under secure aggregation is refused, its task ended
    outs = dispatch(engine, _msg("update", tasks[2].dst, _update(engine, tasks[2], 2),
                                 tasks[2].round), 1.0)
    assert any(o.kind == "error" for o in outs) and engine.round.failures.get(2) == "rejected"


@pytest.mark.parametrize("sections,words", [
    ({"algorithm": {"name": "fedtgp"}}, "FedTGP"),
    ({"algorithm": {"name": "mpfedcl"}}, "MP-FedCL"),
    ({"federation": {"mode": "async"}}, "async"),
    ({"federation": {"late": "fold"}}, "late"),
    ({"algorithm": {"name": "fedproto", "robust": "median"}}, "robust"),
    ({"privacy": {"secure_aggregation": True, "secagg_range": 1e12,
                  "secagg_frac_bits": 30}}, "secagg_range"),
])
def test_what_secure_aggregation_cannot_serve_is_refused_with_one_line(sections, words):
    raw = {"data": {"dataset": "digits"}, "model": {"arch": "mlp"},
           "algorithm": {"name": "fedproto"}, **sections}
    raw["privacy"] = {"secure_aggregation": True, **sections.get("privacy", {})}
    reason = privacy_refusal(build_config(raw))
    assert reason is not None and words in reason and "\n" not in reason


# --- real processes: broker, server, nodes, relays on loopback ---

def _arrays_of(run) -> dict:
    from fedbus.node.server import read_checkpoint

    state = read_checkpoint(run / "checkpoint.fbk")[1]["handler"]
    if "protos" in state:
        return {"protos": np.asarray(state["protos"], dtype=np.float64)}
    return {k: np.asarray(v, dtype=np.float64) for k, v in state["weights"].items()}


@pytest.mark.parametrize("algorithm", ["fedproto", "fedavg"])
def test_two_relays_with_secure_aggregation_give_the_flat_plain_global_state(tmp_path,
                                                                             algorithm):
    from tests.helpers import merged, metrics
    from tests.test_relay import EQUIV, run_to_end

    runs = {name: run_to_end(tmp_path, merged(EQUIV, algorithm={"name": algorithm},
                                              privacy={"secure_aggregation": secure}),
                             relays=secure, name=name)
            for name, secure in (("flat", False), ("secure", True))}
    flat, secure = _arrays_of(runs["flat"]), _arrays_of(runs["secure"])
    recs = metrics(runs["secure"])
    assert len(recs) == 3
    for r, f in zip(recs, metrics(runs["flat"])):
        # every client's masked input went up inside its relay's one merged update
        assert r["participants"] == f["participants"] == list(range(6))
        assert r["merged"] == 2 and r["messages_up"] == 2
        assert r["secagg"]["survivors"] == 6 and r["secagg"].get("failed") is None
        assert r["acc_mean"] == pytest.approx(f["acc_mean"], abs=0.02)
    # three rounds of training from sums off by at most quant_bound each round
    for k in flat:
        np.testing.assert_allclose(secure[k], flat[k], rtol=0, atol=1e-3, err_msg=k)


def test_a_client_gone_after_its_masked_input_is_recovered_and_replay_is_identical(tmp_path):
    from fedbus.broker.wire import decode
    from fedbus.record.msglog import read_log
    from tests.helpers import SMALL, fedbus, merged, metrics, run_federation

    # c2 never answers the unmasking, so the round's reveal phase ends at secagg_timeout_s:
    # 30 s is a liveness guard for the five honest reveals (each a few ms), which a slow or
    # loaded machine cannot outlast; the round aggregates as soon as it passes
    sections = merged(SMALL, algorithm={"name": "fedproto"},
                      federation={"clients": 6, "rounds": 1},
                      system={"drop_clients": [2], "drop_stage": "input"},
                      privacy={"secure_aggregation": True, "secagg_timeout_s": 30.0})
    run, summary = run_federation(tmp_path, sections)
    assert summary["rounds_completed"] == 1
    for r in metrics(run):
        # c2 sent its masked input and never answered the unmasking: the other five's
        # shares of its self mask recovered its input, which counts in the sum
        assert r["secagg"].get("failed") is None, r["secagg"]
        assert r["secagg"]["survivors"] == 6 and 2 in r["participants"]
    # what the server held: masked integers only, never a client's prototypes
    kinds = set()
    for rec in read_log(run):
        if rec.direction != "in" or len(rec.frames) < 2:
            continue
        msg = decode(rec.frames, max_frame=max(len(f) for f in rec.frames) + 1)
        kinds.add(msg.kind)
        if msg.kind == "update":
            assert set(msg.body["payload"]) == {"masked"}
            assert msg.body["payload"]["masked"].dtype == np.uint8
    assert {"update", "secagg"} <= kinds
    out = fedbus("replay", str(run), timeout=240)
    assert "replay identical" in out.stdout, out.stdout + out.stderr


def test_a_masked_input_that_comes_after_unmasking_began_is_dropped_as_late():
    cfg = _config("fedproto", True, deadline_s=5.0)
    engine, tasks = _engine(cfg)
    _, cl = secure_round(engine, cfg, tasks, drop_shares=(4,))
    rec = _record(engine)
    assert rec["secagg"]["dropped"] == 1 and 4 not in rec["participants"]
    before = (engine.totals["late_dropped"], engine.totals["rejected"], engine.version)
    outs = dispatch(engine, _msg("update", "c4", cl.held["c4"], tasks[4].round), 50.0)
    # not refused (the client did nothing wrong), not folded (it would need its own
    # unmasking): counted as late and dropped
    assert not [o for o in outs if o.kind == "error"]
    assert (engine.totals["late_dropped"], engine.totals["rejected"], engine.version) == \
        (before[0] + 1, before[1], before[2])


"""Merge rules of FedPer, FedRep, FedAvg-proto and FD (fedbus.algorithms.core.merge): a server fed
a relay's merged updates (the rule's sum forms, lifted and added as a relay does) ends in
the global state of a server fed the same clients' single updates; the options that make
the server step no sum of fixed shape declare no rule; FedPer through real relays, and
under secure aggregation, computes what the flat federation computes."""
from __future__ import annotations

import numpy as np
import pytest

from fedbus.algorithms.core.handlers import Work
from fedbus.algorithms.core.params import resolved_params
from fedbus.broker.wire import Message
from fedbus.node.config import build_config
from fedbus.node.engine import client_address
from fedbus.node.privacy.secure_round import privacy_refusal
from fedbus.node.server import build_engine, dispatch
from tests.helpers import merged
from tests.test_relay import (EQUIV, _arrays, _final_state, assert_relays_give_the_flat_run,
                              run_to_end)

DONE = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 4, "samples": 64}
HALF = {"epochs_asked": 2, "epochs_done": 1.0, "steps": 4, "samples": 64, "stopped": "partial"}
SITES = ((0, 1, 2), (3, 4, 5))  # the two relays' clients


def _cfg(algorithm: str, arch: str = "mlp", secure: bool = False, fed=None, **params):
    return build_config({
        "federation": {"clients": 6, "rounds": 3, "seed": 3, **(fed or {})},
        "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": arch},
        "algorithm": {"name": algorithm, **params},
        "privacy": {"secure_aggregation": secure, "secagg_timeout_s": 10.0}})


def _engine(cfg, nodes):
    """An engine whose clients sit below `nodes` ({name: clients}); the round's tasks."""
    engine = build_engine(cfg, "r")
    tasks = []
    for name, clients in nodes.items():
        engine.on_join(name, [client_address(c) for c in clients], 0.0)
    for name in nodes:
        tasks += [o for o in engine.on_configured(name, "r", 0.0) if o.kind == "task"]
    assert sorted(t.dst for t in tasks) == [client_address(c) for c in range(6)]
    return engine, sorted(tasks, key=lambda t: int(t.dst[1:]))


def _payload(engine, task, client: int) -> dict:
    """A random update as the client would send it, shaped by the handler's update_spec and
    the task (FedAvg-proto's prototypes when asked), counts within the client's classes."""
    rng = np.random.default_rng([client, task.body["version"], 7])
    spec = engine.handler.update_spec()
    c, d = engine.handler.ctx.num_classes, engine.handler.ctx.feature_dim
    counts = np.array([rng.integers(0, n + 1) for n in engine.class_samples[client]], np.int64)
    counts[rng.integers(c)] = 0  # every client lacks a class,
    counts[-1] = 0  # and nobody holds the last one (it stays without a global vector)
    out = {}
    if "delta" in spec:
        out["delta"] = {k: (rng.normal(0, 0.01, size=shape) if np.dtype(dt).kind == "f" else
                            np.zeros(shape)).astype(dt) for k, (dt, shape) in spec["delta"].items()}
    if "logits" in spec:
        out["logits"] = (rng.normal(size=(c, c)) * (counts > 0)[:, None]).astype(np.float32)
        out["counts"] = counts
    if task.body["payload"].get("send_protos"):
        out["protos"] = (rng.normal(size=(c, d)) * (counts > 0)[:, None]).astype(np.float32)
        out["counts"] = counts
    return out


def _body(engine, task, work=DONE) -> dict:
    c = int(task.dst[1:])
    return {"task": task.body["task"], "version": task.body["version"],
            "num_samples": int(engine.train_sizes[c]), "work": work,
            "payload": _payload(engine, task, c)}


def _record(engine) -> dict:
    return engine.records[-1] if engine.records else engine.evals[max(engine.evals)].record


def _global(engine) -> dict:
    return {k: np.asarray(v, dtype=np.float64) for k, v in _arrays(engine.handler.state_dict())
            .items()}


def _equal(got: dict, want: dict, before: dict) -> None:
    assert sorted(got) == sorted(want)
    moved = 0
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
        moved += not np.array_equal(want[k], before[k])
    assert moved  # the round changed the global state: the comparison is not vacuous


def flat_and_merged(algorithm: str, *, partial_clients=(), arch: str = "mlp", **params):
    """One round fed to two engines: every client's update alone, and each site's updates
    lifted and added by the handler's merge rule, as a relay does (an update the rule
    keeps apart goes up alone). Returns (flat engine, merged engine, state before)."""
    cfg = _cfg(algorithm, arch, **params)
    flat, f_tasks = _engine(cfg, {"n": range(6)})
    tree, t_tasks = _engine(cfg, {f"relay-{i}": s for i, s in enumerate(SITES)})
    before = _global(flat)
    rule = tree.handler.merge_rule()
    assert rule is not None and rule is type(tree.handler).__dict__["MERGE"]
    params_of = resolved_params(type(tree.handler), dict(cfg.algorithm))  # a relay's
    for t in f_tasks:
        body = _body(flat, t, HALF if int(t.dst[1:]) in partial_clients else DONE)
        assert not [o for o in dispatch(flat, Message("update", t.dst, "server", body, run="r",
                                                      round=t.round), 1.0) if o.kind == "error"]
    merged_count = 0
    for i, site in enumerate(SITES):
        total, members = None, []
        for t in (t for t in t_tasks if int(t.dst[1:]) in site):
            body = _body(tree, t, HALF if int(t.dst[1:]) in partial_clients else DONE)
            form = rule.lift(body["payload"], body["num_samples"], Work.from_dict(body["work"]),
                             params_of, int(t.dst[1:]))
            if form is None:  # kept apart: forwarded as it is
                outs = dispatch(tree, Message("update", t.dst, "server", body, run="r",
                                              round=t.round), 1.0)
                assert not [o for o in outs if o.kind == "error"]
                continue
            total = rule.add(total, form)
            members.append([t.dst, t.body["task"], body["num_samples"], body["work"]])
        if members:
            msg = Message("merged", f"relay-{i}", "server",
                          {"version": 0, "rule": rule.name, "members": members,
                           "payload": total}, run="r", round=0)
            outs = dispatch(tree, msg, 1.0)
            assert not [o for o in outs if o.kind == "error"], outs
            merged_count += 1
    assert flat.version == tree.version == 1
    assert merged_count
    assert _record(tree)["merged"] == merged_count
    return flat, tree, before


@pytest.mark.parametrize("algorithm,params,partial", [
    ("fedper", {}, ()),
    ("fedper", {"partial": "drop"}, (1, 4)),  # partial work is kept apart and dropped
    ("fedper", {"partial": "tolerate"}, (1, 4)),
    ("fedrep", {"partial": "drop"}, (2,)),
])
def test_shared_body_merged_gives_the_flat_body(algorithm, params, partial):
    flat, tree, before = flat_and_merged(algorithm, partial_clients=partial, **params)
    _equal(_global(tree), _global(flat), before)
    f_agg, t_agg = (_record(e)["agg"] for e in (flat, tree))
    dropped = len(partial) if params.get("partial") == "drop" else 0
    assert f_agg == t_agg and (f_agg["updates"], f_agg["failures"]) == (6 - dropped, dropped)


@pytest.mark.parametrize("params", [
    {"every_round": True},
    {"every_round": True, "aggregate": "weighted"},
])
def test_fedavg_proto_merged_gives_the_flat_weights_and_prototypes(params):
    flat, tree, before = flat_and_merged("fedavg-proto", **params)
    got, want = _global(tree), _global(flat)
    assert any(k.startswith("weights/") for k in want) and "protos" in want
    _equal(got, want, before)
    np.testing.assert_array_equal(tree.handler.has, flat.handler.has)
    assert flat.handler.has[:-1].all() and not flat.handler.has[-1]
    # the weighting option matters: the other one gives other prototypes
    other = "mean" if params.get("aggregate") == "weighted" else "weighted"
    alt, _, _ = flat_and_merged("fedavg-proto", every_round=True, aggregate=other)
    assert np.abs(_global(alt)["protos"] - want["protos"]).max() > 1e-3


@pytest.mark.parametrize("params", [
    {}, {"aggregate": "weighted"}, {"collect": "after", "keep_missing": False},
])
def test_fd_merged_gives_the_flat_global_vectors(params):
    flat, tree, before = flat_and_merged("fd", **params)
    _equal(_global(tree), _global(flat), before)
    np.testing.assert_array_equal(tree.handler.has, flat.handler.has)
    assert flat.handler.has[:-1].all() and not flat.handler.has[-1]


def test_options_that_make_no_fixed_sum_declare_no_rule():
    from fedbus.algorithms import get_algorithm
    from fedbus.algorithms.core.merge import DeltaAndPrototypeSums, DeltaSums, LogitSums

    def rule(name, **params):
        cls = get_algorithm(name).server
        return cls.merge_rule(resolved_params(cls, params))

    assert isinstance(rule("fedper"), DeltaSums) and isinstance(rule("fedrep"), DeltaSums)
    assert isinstance(rule("fedper", partial="drop"), DeltaSums)
    assert isinstance(rule("fd", aggregate="weighted", collect="after"), LogitSums)
    assert isinstance(rule("fedavg-proto", every_round=True), DeltaAndPrototypeSums)
    # without every_round only the last round's updates carry prototypes; robust is no sum
    assert rule("fedavg-proto") is None
    assert rule("fedavg-proto", every_round=True, robust="median") is None
    engine, tasks = _engine(_cfg("fedavg-proto"), {"relay": range(6)})
    assert engine.handler.merge_rule() is None
    body = {"version": 0, "rule": "x", "members": [[tasks[0].dst, tasks[0].body["task"], 1,
                                                     DONE]], "payload": {}}
    outs = dispatch(engine, Message("merged", "relay", "server", body, run="r", round=0), 1.0)
    assert [o.kind for o in outs] == ["error"] and "no merge rule" in outs[0].body["reason"]
    for name, params, ok in (("fedper", {}, True), ("fedrep", {}, True), ("fd", {}, True),
                             ("fedavg-proto", {"every_round": True}, True),
                             ("fedavg-proto", {}, False)):
        reason = privacy_refusal(_cfg(name, secure=True, **params))
        assert (reason is None) == ok, (name, reason)


def test_a_merged_payload_claiming_more_prototype_mass_than_its_members_is_refused():
    from fedbus.algorithms.core.merge import DeltaAndPrototypeSums

    members = [["c0", 1, 10, DONE], ["c1", 2, 5, DONE]]
    payload = {"proto_sums": {"mass": np.array([15.0, 2.0])}}
    assert DeltaAndPrototypeSums().check(payload, members) is None
    assert "more than" in DeltaAndPrototypeSums().check(
        {"proto_sums": {"mass": np.array([15.5, 0.0])}}, members)
    assert "negative" in DeltaAndPrototypeSums().check(
        {"proto_sums": {"mass": np.array([-1.0, 0.0])}}, members)


@pytest.mark.parametrize("partial", ["tolerate", "drop"])
def test_fedper_under_secure_aggregation_gives_the_plain_body(partial):
    """4 of 6 clients, one drops after masking; the first did half its epochs (under "drop"
    its masked input adds zeros, and the sum's other members still count)."""
    from tests.test_secure_aggregation import secure_round

    fed = {"fraction": 0.6, "deadline_s": 5.0}
    secure_cfg, plain_cfg = (_cfg("fedper", secure=s, fed=fed, partial=partial)
                             for s in (True, False))
    (secure, s_tasks), (plain, p_tasks) = (_engine_sampled(c) for c in (secure_cfg, plain_cfg))
    assert [t.dst for t in s_tasks] == [t.dst for t in p_tasks] and len(s_tasks) == 4
    first = int(s_tasks[0].dst[1:])

    def update(engine, task, client):
        return _body(engine, task, HALF if client == first else DONE)

    before = _global(plain)
    secure_round(secure, secure_cfg, s_tasks, drop_input=(int(s_tasks[1].dst[1:]),),
                 update=update)
    for t in p_tasks:
        dispatch(plain, Message("update", t.dst, "server", update(plain, t, int(t.dst[1:])),
                                run="r", round=t.round), 1.0)
    assert secure.version == plain.version == 1
    rec = _record(secure)
    assert rec["secagg"].get("failed") is None and rec["secagg"]["survivors"] == 4
    tol = rec["secagg"]["quant_bound"]
    assert 0 < tol < 1e-3
    got, want = _global(secure), _global(plain)
    assert sorted(got) == sorted(want) and all(k.startswith("weights/") for k in want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=tol, err_msg=k)
    assert max(np.abs(want[k] - before[k]).max() for k in want) > 10 * tol


def _engine_sampled(cfg):
    engine = build_engine(cfg, "r")
    engine.on_join("n", [client_address(c) for c in range(cfg.federation.clients)], 0.0)
    return engine, engine.on_configured("n", "r", 0.0)


def test_fedper_through_two_relays_gives_the_flat_federations_body(tmp_path):
    sections = merged(EQUIV, algorithm={"name": "fedper"})
    runs = {name: run_to_end(tmp_path, sections, relays=relays, name=name)
            for name, relays in (("flat", False), ("relays", True))}
    flat, tree = (_arrays(_final_state(runs[k])) for k in ("flat", "relays"))
    assert any(k.startswith("weights/") for k in flat) and sorted(flat) == sorted(tree)
    assert_relays_give_the_flat_run(runs, flat, tree, "fedper")

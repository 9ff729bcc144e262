"""Cohort training (train.cohort, fedbus.algorithms.core.cohort): a node's clients of one
architecture trained as one vectorised cohort equal the same clients trained one by one.

Real handlers over real digits (the `mlp`, so auto would vectorise it on the CPU), real
federations on loopback. Tolerance: the cohort computes each client's gradient with batched
matrix products under vmap and weighted sums, the same arithmetic in another order, so
results agree to float32 rounding, not bit for bit: after several epochs of momentum SGD
the largest difference measured is ~5e-7 (weights of order 0.1-1); ATOL = 1e-5 with
RTOL = 1e-4 leaves room for the rounding to grow over the steps while a real error (one
wrong step, a masked client moved, a padded sample counted: ~1e-3 and more, across a
whole matrix) fails. One more case is rounding too: on an AVX-512 machine (2026-11-27)
FedProx with persisted momentum tips one hidden unit across ReLU's kink in one path and
not the other after two rounds; that unit's row, column, bias entry and momentum differ by
up to 2.3e-3, and what backpropagates through it moves the layer below by up to 1.4e-4.
assert_close allows exactly that (KINK_*): differences confined to 1 % of a matrix's rows
or columns (below 5e-3), or spread but below 2.5e-4.
FedProto's "eq8" form is left out of the exactness checks: it amplifies rounding itself
(one by one on 1 thread against 2 threads differs by 0.17 after 3 rounds, as much as the
cohort does)."""
from __future__ import annotations

import copy
import functools
import itertools

import numpy as np
import pytest
import torch
from helpers import TINY, merged, metrics, run_federation
from structlog.testing import capture_logs
from test_replay import assert_identical

from fedbus.algorithms.core import cohort
from fedbus.algorithms.core.cohort import cohort_unsupported, train_handlers
from fedbus.algorithms.core.handlers import ClientUpdate, LocalRun, RoundInfo, Work
from fedbus.broker.wire import decode_body, encode_body
from fedbus.node.client_host import ClientPool, cohort_reason, run_task, run_tasks
from fedbus.node.config import build_config
from fedbus.node.engine import task_seed
from fedbus.node.server import build_handler

torch.set_num_threads(1)

ATOL, RTOL = 1e-5, 1e-4
KINK_SHARE, KINK_ROW_ATOL, KINK_SPREAD_ATOL = 0.01, 5e-3, 2.5e-4
CLIENTS = 6


def _cfg(name: str = "fedavg", arch: str = "mlp", **sections) -> object:
    raw = {"federation": {"clients": CLIENTS, "seed": 3},
           # dirichlet: unequal client sizes, so last batches and run lengths differ
           "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
           "model": {"arch": arch}, "algorithm": {"name": name},
           "train": {"momentum": 0.9, "batch_size": 16, "weight_decay": 1e-3,
                     "lr_decay": 0.9}}
    for section, table in sections.items():
        raw.setdefault(section, {}).update(table)
    return build_config(raw)


def _bodies(cfg, server, version: int, partial: dict[int, float]) -> list[dict]:
    out = []
    for c in range(CLIENTS):
        task = decode_body(encode_body(server.make_task(c, RoundInfo(version, 3))))
        body = {"task": version + 1, "version": version, "epochs": 2,
                "seed": task_seed(3, c, version), "payload": task}
        if c in partial:
            body["sim"] = {"epochs_to_run": partial[c]}
        out.append(body)
    return out


def _cohort_round(pool: ClientPool, bodies: list[dict]) -> list[tuple[dict, float]]:
    """As ClientNode.on_tasks: chunks of what the pool's budget holds, pinned while they
    train."""
    out, rest = [], list(range(len(bodies)))
    while rest:
        room = pool.cohort_room(rest[0])
        chunk, rest = rest[:room], rest[room:]
        try:
            handlers = []
            for c in chunk:
                handlers.append(pool.get(c))
                pool.pinned.add(c)
            out += run_tasks(handlers, [bodies[c] for c in chunk], "on")
        finally:
            pool.release()
    return out


def _federate(cfg, pool: ClientPool, cohort: bool, rounds: int = 3,
              partial: dict[int, float] | None = None) -> tuple[list[dict], list]:
    """`rounds` rounds of every client through the server's handler; the update bodies and
    each client's handler state after the last round."""
    server = build_handler(cfg)
    sent = []
    for version in range(rounds):
        bodies = _bodies(cfg, server, version, partial or {})
        if cohort:
            results = _cohort_round(pool, bodies)
        else:
            results = [run_task(pool.get(c), b) for c, b in enumerate(bodies)]
        updates = []
        for c, (update, _) in enumerate(results):
            sent.append(update)
            updates.append(ClientUpdate(c, decode_body(encode_body(update["payload"])),
                                        update["num_samples"], Work.from_dict(update["work"]),
                                        version))
        server.aggregate(updates, [], RoundInfo(version, rounds))
    # copied: a tight pool evicts a client as the next is got, and its network serves another
    states = [(copy.deepcopy(pool.get(c).state_dict()), pool.get(c).last_loss)
              for c in range(CLIENTS)]
    return sent, states


def _leaves(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, obj


def _one_unit_tipped(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether x and y differ only as a hidden unit tipped across ReLU's kink makes them
    (the module's docstring): within KINK_ROW_ATOL on at most KINK_SHARE of the rows or
    columns, or within KINK_SPREAD_ATOL wherever they differ."""
    diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
    if diff.max() < KINK_SPREAD_ATOL:
        return True
    if diff.max() >= KINK_ROW_ATOL or x.ndim > 2:
        return False
    big = np.nonzero(diff >= KINK_SPREAD_ATOL)
    return any(np.unique(i).size <= max(1, KINK_SHARE * n) for i, n in zip(big, x.shape))


def assert_close(a, b) -> None:
    """Same structure; arrays and tensors equal within ATOL/RTOL, everything else equal."""
    la, lb = list(_leaves(a)), list(_leaves(b))
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (key, x), (_, y) in zip(la, lb):
        if isinstance(x, (torch.Tensor, np.ndarray)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape, key
            if not np.allclose(x, y, rtol=RTOL, atol=ATOL) and _one_unit_tipped(x, y):
                continue
            np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL, err_msg=key)
        elif isinstance(x, float):
            assert x == pytest.approx(y, rel=RTOL, abs=ATOL, nan_ok=True), key
        else:
            assert x == y, key


@pytest.mark.parametrize("path", ["chain", "vmap"])
@pytest.mark.parametrize("algorithm,params,state,tail", [
    ("fedavg", {}, "fresh", 2),
    ("fedavg", {}, "fresh", 6),
    ("fedprox", {"mu": 0.1}, "persist", 2),
    ("fedproto", {}, "persist", 2),  # proto_loss = mse, the default
    ("fedproto", {}, "persist", 4),
    ("fedproto", {"proto_loss": "eq8_mean"}, "fresh", 2),
    ("local", {}, "persist", 3),
    ("fedavg-proto", {}, "fresh", 2),
    ("proto-attention", {}, "persist", 2),
])
def test_cohort_equals_one_by_one(algorithm, params, state, tail, path, monkeypatch):
    # unequal client sizes, two clients on partial work (one of them below one epoch),
    # momentum, weight decay, lr decay; every update body (payload, work, loss) and every
    # client's state after 3 rounds (weights, momentum buffers, last loss). `tail`: below
    # this many live clients the rest finish one by one (2: the stack shrinks client by
    # client; 6 = every client: one by one as soon as the first run ends). `path`: the
    # mlp's affine chain written out (the default for it), or the generic vmap forward
    monkeypatch.setattr(cohort, "TAIL_CPU", tail)
    if path == "vmap":
        monkeypatch.setattr(cohort, "affine_chain", lambda model, names: None)
    off = _cfg(algorithm, algorithm=params, train={"optimizer_state": state, "cohort": "off"})
    on = _cfg(algorithm, algorithm=params, train={"optimizer_state": state, "cohort": "on"})
    partial = {1: 0.4, 4: 1.5}
    seq = _federate(off, ClientPool(off, torch.device("cpu")), cohort=False, partial=partial)
    with capture_logs() as logs:
        coh = _federate(on, ClientPool(on, torch.device("cpu")), cohort=True, partial=partial)
    # every round's clients went through a cohort (none fell back to one by one)
    trained = [e["clients"] for e in logs if e["event"] == "cohort trained"]
    assert sum(trained) == 3 * CLIENTS and not [e for e in logs if e["event"] == "cohort off"]
    assert [u["work"] for u in seq[0]] == [u["work"] for u in coh[0]]
    assert {u["work"]["stopped"] for u in seq[0]} == {"done", "partial"}
    assert len({u["work"]["steps"] for u in seq[0]}) > 3  # the clients' runs differ in length
    assert_close([u["payload"] for u in seq[0]], [u["payload"] for u in coh[0]])
    assert_close(seq[1], coh[1])


@pytest.mark.parametrize("algorithm,params", [
    ("fedavg", {}), ("fedprox", {"mu": 0.1}), ("fedproto", {}),
    ("fedproto", {"proto_loss": "eq8"})])
def test_plain_sgd_cohort_steps_in_place_and_equals_one_by_one(algorithm, params,
                                                                monkeypatch):
    # no momentum, no weight decay, one rate (Michieli & Ozay's setting): the chain takes
    # each step in place (baddbmm_ into the weights, no gradient tensors); the loss's
    # gradient written out (ce, prox, mse) or by autograd (eq8)
    rates = []
    real = cohort._chain_grads

    def spy(*args, **kwargs):
        rates.append(kwargs.get("lr"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cohort, "_chain_grads", spy)
    plain = {"momentum": 0.0, "weight_decay": 0.0, "lr_decay": 1.0}
    off = _cfg(algorithm, algorithm=params, train={**plain, "cohort": "off"})
    on = _cfg(algorithm, algorithm=params, train={**plain, "cohort": "on"})
    partial = {1: 0.4, 4: 1.5}
    seq = _federate(off, ClientPool(off, torch.device("cpu")), cohort=False, partial=partial)
    coh = _federate(on, ClientPool(on, torch.device("cpu")), cohort=True, partial=partial)
    assert rates and set(rates) == {on.train["lr"]}, set(rates)
    assert [u["work"] for u in seq[0]] == [u["work"] for u in coh[0]]
    assert_close([u["payload"] for u in seq[0]], [u["payload"] for u in coh[0]])
    assert_close(seq[1], coh[1])


@pytest.mark.parametrize("arch", ["mlp", "mlp:32", "mlp-fedcl"])
def test_affine_chain_gradients_equal_autograd_through_the_network(arch):
    # the declared chain (ProtoNet.affine_chain) must be the network: the written-out
    # forward and backward give every client the gradient autograd takes through its own
    # features() and head(), for a loss that reads the features (FedProto's mse regulariser)
    # and one that reads the parameters (FedProx), padding rows included
    from fedbus.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(arch, in_shape=(1, 8, 8), num_classes=10)
    names = [n for n, _ in model.named_parameters()]
    layers, feat = cohort.affine_chain(model, names)
    k, b = 3, 7
    params = {n: torch.stack([p.detach() + 0.05 * torch.randn_like(p) for _ in range(k)])
              for n, p in model.named_parameters()}
    x, y = torch.randn(k, b, 1, 8, 8), torch.randint(0, 10, (k, b))
    w = torch.ones(k, b)
    w[1, 5:] = 0.0  # client 1's last two rows are padding
    g = torch.randn(k, 10, model.feature_dim)
    consts = {"g": g, "has": torch.rand(k, 10) > 0.3, "anchor": {n: p.detach() for n, p in
                                                               model.named_parameters()}}

    def loss(h, logits, y_, w_, p_, c_):
        anchor = {n: c_["anchor"][n] for n in names}
        return cohort.proto_loss(h, logits, y_, w_, p_, c_, lam=0.7, form="mse") + \
            cohort.prox_loss(h, logits, y_, w_, p_, {"anchor": anchor}, mu=0.3)

    consts["anchor"] = {n: torch.stack([v] * k) for n, v in consts["anchor"].items()}
    grads, losses = cohort._chain_grads(layers, feat,
                                        cohort._through_autograd(torch.func.vmap(loss)),
                                        names, params, consts, x, y, w)
    for j in range(k):
        one = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in one.named_parameters():
                p.copy_(params[n][j])
        h = one.features(x[j])
        value = loss(h, one.head(h), y[j], w[j], dict(one.named_parameters()),
                     {"g": g[j], "has": consts["has"][j],
                      "anchor": {n: consts["anchor"][n][j] for n in names}})
        value.backward()
        assert losses[j].item() == pytest.approx(value.item(), rel=1e-5)
        for n, p in one.named_parameters():
            torch.testing.assert_close(grads[n][j], p.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fn", [
    cohort.ce_loss, functools.partial(cohort.prox_loss, mu=0.3),
    functools.partial(cohort.proto_loss, lam=0.5, form="mse"),
    functools.partial(cohort.proto_loss, lam=0.5, form="eq8"),
    functools.partial(cohort.proto_loss, lam=0.5, form="eq8_mean")])
def test_batched_losses_equal_the_vmapped_per_client_losses(fn):
    # the chain's step computes a built-in loss in its batched twin: the same values and
    # gradients (features, logits, parameters) as vmap of the per-client form, with
    # padding rows, classes without a global prototype and an all-padding client
    torch.manual_seed(1)
    k, b, d, c = 4, 6, 5, 3
    h, logits = torch.randn(k, b, d), torch.randn(k, b, c)
    y, w = torch.randint(0, c, (k, b)), torch.ones(k, b)
    w[1, 4:] = 0.0
    w[3] = 0.0
    params = {"fc.weight": torch.randn(k, c, d), "fc.bias": torch.randn(k, c)}
    consts = {"g": torch.randn(k, c, d), "has": torch.rand(k, c) > 0.4,
              "anchor": {n: torch.randn_like(v) for n, v in params.items()}}
    twin = cohort.batched_form(fn)
    assert twin is not None

    def value_and_grads(loss_fn):
        leaves = [t.clone().requires_grad_() for t in (h, logits, *params.values())]
        out = loss_fn(leaves[0], leaves[1], y, w, dict(zip(params, leaves[2:])), consts)
        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        return out.detach(), grads

    want, want_grads = value_and_grads(torch.func.vmap(fn))
    got, got_grads = value_and_grads(twin)
    torch.testing.assert_close(got, want)
    for a, e in zip(got_grads, want_grads):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e)
    assert cohort.batched_form(lambda *a: 0) is None  # any other loss: vmapped
    # and where the loss's gradient is written out (all but the eq8 forms), the same values
    # and gradients as autograd's through the per-client form
    written = cohort.written_form(fn)
    assert (written is None) == (getattr(fn, "keywords", {}).get("form", "mse") != "mse")
    if written is None:
        return
    loss, d_h, d_logits, terms = written(h, logits, y, w, params, consts)
    torch.testing.assert_close(loss, want)
    for a, e in zip([d_h, d_logits, *[terms.get(n) for n in params]], want_grads):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e)
    assert cohort.written_form(lambda *a: 0) is None


def test_a_network_that_changes_its_features_is_no_chain():
    from fedbus.models.small import MLP

    class Scaled(MLP):
        def features(self, x):
            return 2 * super().features(x)

    plain, scaled = MLP((60,), 10), Scaled((60,), 10)
    names = [n for n, _ in plain.named_parameters()]
    assert cohort.affine_chain(plain, names) is not None
    assert cohort.affine_chain(scaled, names) is None
    assert cohort.affine_chain(plain, names[:-1]) is None  # a frozen layer: the vmap path


def test_evicted_and_restored_clients_in_a_cohort(monkeypatch):
    # a budget that holds about two clients: every round restores most clients from their
    # packed state and the cohort trains in chunks of what fits; FedProto with persisted
    # momentum, so the restored state matters
    monkeypatch.setattr(cohort, "TAIL_CPU", 2)
    off = _cfg("fedproto", train={"optimizer_state": "persist", "cohort": "off"})
    seq = _federate(off, ClientPool(off, torch.device("cpu")), cohort=False)
    cfg = _cfg("fedproto", train={"optimizer_state": "persist"})
    tight = ClientPool(cfg, torch.device("cpu"), memory_mb=2.0, evict_to="memory")
    coh = _federate(cfg, tight, cohort=True)
    assert tight.evictions > CLIENTS and tight.restores > CLIENTS
    assert 1 < tight.cohort_room(0) < CLIENTS
    assert_close([u["payload"] for u in seq[0]], [u["payload"] for u in coh[0]])
    # the states (last_loss is no state: an evicted handler is rebuilt without it)
    assert_close([s for s, _ in seq[1]], [s for s, _ in coh[1]])


def test_budget_cut_clients_are_masked_not_moved(monkeypatch):
    # each run on its own step-counting clock: its budget cuts it after a set number of
    # steps, one by one and in the cohort alike; clients cut early stay where they stopped
    monkeypatch.setattr(cohort, "TAIL_CPU", 2)
    cfg = _cfg("fedprox", algorithm={"mu": 0.05})
    budgets = [0.035, 0.105, 0.0, 0.055, 1.0, 0.025]

    def runs(pool):
        out = []
        for c, budget in enumerate(budgets):
            ticks = itertools.count()
            out.append(LocalRun(pool.get(c).ctx, epochs=3, seed=task_seed(3, c, 0),
                                budget_s=budget, clock=lambda t=ticks: next(t) * 0.01))
        return out

    server = build_handler(cfg)
    tasks = [decode_body(encode_body(server.make_task(c, RoundInfo(0, 1))))
             for c in range(CLIENTS)]
    seq_pool, coh_pool = ClientPool(cfg, torch.device("cpu")), ClientPool(cfg,
                                                                          torch.device("cpu"))
    seq_runs, coh_runs = runs(seq_pool), runs(coh_pool)
    seq = [seq_pool.get(c).train(tasks[c], seq_runs[c]) for c in range(CLIENTS)]
    handlers = [coh_pool.get(c) for c in range(CLIENTS)]
    coh, fallbacks = train_handlers(handlers, tasks, coh_runs)
    assert not fallbacks
    assert [r.work.to_dict() for r in seq_runs] == [r.work.to_dict() for r in coh_runs]
    assert sum(r.work.stopped == "budget" for r in seq_runs) >= 3
    assert_close(seq, coh)
    assert_close([seq_pool.get(c).state_dict() for c in range(CLIENTS)],
                 [h.state_dict() for h in handlers])


def test_a_clients_result_does_not_depend_on_its_cohort():
    # the node gathers whatever tasks arrive together: which clients share a cohort must
    # not change any client's result (each client's batch is padded to train.batch_size,
    # so its shapes never depend on the others; a lone task trains as a cohort of one), or
    # runs would not repeat; `fedbus replay --client` (run_task) recomputes it bit for bit
    cfg = _cfg("fedproto")
    server = build_handler(cfg)
    bodies = _bodies(cfg, server, 0, {})

    def protos(clients):
        pool = ClientPool(cfg, torch.device("cpu"))
        out = run_tasks([pool.get(c) for c in clients], [bodies[c] for c in clients], "on")
        return out[0][0]["payload"]["protos"]

    alone = run_task(ClientPool(cfg, torch.device("cpu")).get(0), bodies[0])[0]
    for other in (protos([0, 1]), protos([0, 3, 4, 5])):
        np.testing.assert_array_equal(alone["payload"]["protos"], other)


def test_auto_trains_one_by_one_where_unsupported_and_says_why(monkeypatch):
    mlp = ClientPool(_cfg("fedavg"), torch.device("cpu"))
    assert mlp.size_balance > 0.5 and cohort_reason(mlp.get(0), "auto") is None
    # Michieli's synthetic data: power-law sizes (a node's mean/max about 0.2): the mlp, an
    # affine chain, is vectorised anyway; were it no chain (the vmap path), auto would say no
    skewed = ClientPool(_cfg("fedavg", data={"dataset": "synthetic", "partition": "natural",
                                             "synthetic_alpha": 1.0, "synthetic_beta": 1.0}),
                        torch.device("cpu"))
    assert skewed.size_balance < 0.5
    assert cohort_reason(skewed.get(0), "auto") is None
    with monkeypatch.context() as m:
        m.setattr(cohort, "affine_chain", lambda model, names: None)
        assert "unbalanced" in cohort_reason(skewed.get(0), "auto")
        assert cohort_reason(skewed.get(0), "on") is None
    cnn4 = ClientPool(_cfg("fedavg", arch="cnn4"), torch.device("cpu"))
    assert "convolutions" in cohort_reason(cnn4.get(0), "auto")
    assert cohort_reason(cnn4.get(0), "on") is None  # on: forced where supported
    assert "dropout" in cohort_unsupported(ClientPool(_cfg("fedavg", arch="cnn"),
                                                      torch.device("cpu")).get(0))
    # FedRep's own training loop (its head epochs): no functional loss, one by one
    cfg = _cfg("fedrep")
    pool = ClientPool(cfg, torch.device("cpu"))
    server = build_handler(cfg)
    bodies = _bodies(cfg, server, 0, {})[:3]
    seq_pool = ClientPool(cfg, torch.device("cpu"))
    expected = [run_task(seq_pool.get(c), b)[0] for c, b in enumerate(bodies)]
    with capture_logs() as logs:
        got = run_tasks([pool.get(c) for c in range(3)], bodies, "auto")
    off = [e for e in logs if e["event"] == "cohort off"]
    assert len(off) == 1 and "functional loss" in off[0]["reason"], logs
    assert not any(e["event"] == "cohort trained" for e in logs)
    for e, (g, _) in zip(expected, got):  # trained one by one: bit for bit
        for k, v in e["payload"]["delta"].items():
            np.testing.assert_array_equal(v, g["payload"]["delta"][k])
    # FedProto's proto_source = "during": its functional_loss() says why not
    cfg = _cfg("fedproto", algorithm={"proto_source": "during"})
    pool = ClientPool(cfg, torch.device("cpu"))
    server = build_handler(cfg)
    with capture_logs() as logs:
        run_tasks([pool.get(c) for c in range(3)], _bodies(cfg, server, 0, {})[:3], "on")
    assert any(e["event"] == "cohort off" and "during" in e["reason"] for e in logs), logs


# --------------------------------------------------------------------------- federations
# FedProto (its regulariser from round 1) on the mlp, 4 clients in 2 nodes (cohorts of 2),
# persisted momentum, partial work.
FED = merged(TINY, model={"arch": "mlp"}, algorithm={"name": "fedproto"},
             train={"epochs": 2, "momentum": 0.5, "optimizer_state": "persist"},
             system={"partial_work": True, "partial_fraction": 0.5})


@pytest.fixture(scope="module")
def federations(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cohort")
    return {mode: run_federation(tmp, merged(FED, train={"cohort": mode}), name=mode)[0]
            for mode in ("off", "on")}


def test_federation_cohort_on_equals_off(federations):
    on, off = metrics(federations["on"]), metrics(federations["off"])
    assert [r["round"] for r in on] == [r["round"] for r in off] == [0, 1, 2]
    assert any(r["partial"] for r in on)
    for a, b in zip(off, on):
        assert a["participants"] == b["participants"]
        assert a["partial_clients"] == b["partial_clients"]
        assert a["loss_mean"] == pytest.approx(b["loss_mean"], rel=RTOL, abs=ATOL)
        assert a["acc_mean"] == pytest.approx(b["acc_mean"], abs=1e-9)
    logs = "".join(p.read_text() for p in (federations["on"] / "logs").glob("node-*.log"))
    assert "cohort trained" in logs
    assert "cohort trained" not in "".join(
        p.read_text() for p in (federations["off"] / "logs").glob("node-*.log"))


def test_federation_cohort_run_replays_identically(federations):
    assert_identical(federations["on"], rounds=3)


def test_the_kink_allowance_passes_one_tipped_unit_and_fails_a_real_error():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (200, 200)).astype(np.float32)
    tipped = w.copy()
    tipped[193] += rng.normal(0, 1e-3, 200).astype(np.float32)  # one unit's row
    assert _one_unit_tipped(tipped, w)
    wrong_step = w + 0.01 * rng.normal(0, 0.1, w.shape).astype(np.float32)  # ~1e-3 everywhere
    assert not _one_unit_tipped(wrong_step, w)
    with pytest.raises(AssertionError):
        assert_close({"w": wrong_step}, {"w": w})
    assert_close({"w": tipped}, {"w": w})

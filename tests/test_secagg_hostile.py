"""A hostile client, or keys changed in transit, against secure aggregation and record-level
DP (issue 42, Why 4, 5, 7, 8, 9 and 10): each is refused with a named reason, or its effect
is bounded, and the honest clients' round goes on.

Scripted with the real classes: secagg's ClientSession/ServerSession (real X25519, AES-GCM,
Shamir, ChaCha20), the engine's secure rounds through the server's dispatch with the real
client side (SecureClient), and the server's validator; no sockets (the process tests of
secure aggregation are in tests/test_secure_aggregation.py)."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from test_secure_aggregation import Clients, _config, _engine, _global, _msg, _record, _update

from fedbus.node.config import build_config
from fedbus.node.engine import client_address
from fedbus.node.privacy import shamir
from fedbus.node.privacy.secagg import (
    ClientSession,
    RingParams,
    SecAggError,
    ServerSession,
    decode,
    encode,
    low_order,
)
from fedbus.node.privacy.secure_round import SecureClient, run_graph_key
from fedbus.node.server import build_engine, dispatch
from fedbus.node.validate import (
    DEFAULT_PROTO_NORM,
    SECURE_PROTO_CLIP,
    Rejected,
    check_update,
    run_norms,
)

RANGE, FRAC = 8.0, 20
CTX = b"run-h/round-0"
KEY = bytes(range(32))  # a fixed graph key: these tests need no secret one
P = 2**255 - 19
# every low-order point of Curve25519 and its twist, canonical (u < p) and not, top bit off
# and on (libsodium's blocklist, RFC 7748)
LOW_ORDER_U = [0, 1, P - 1, P, P + 1,
               int.from_bytes(bytes.fromhex(
                   "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"), "little"),
               int.from_bytes(bytes.fromhex(
                   "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"), "little")]
LOW_ORDER = [(u | top).to_bytes(32, "little") for u in LOW_ORDER_U for top in (0, 1 << 255)]


def _server(ids, *, dropout=0.3):
    return ServerSession(ids, CTX, neighbours=0, dropout=dropout,
                         ring=RingParams.for_cohort(RANGE, FRAC, len(ids)), graph_key=KEY)


def _keyed(ids, *, dropout=0.3):
    """A server and clients that sent their keys; -> (server, clients, peers messages)."""
    server = _server(ids, dropout=dropout)
    clients = {u: ClientSession(u, CTX) for u in ids}
    for u, c in clients.items():
        server.add_keys(u, **c.public_keys())
    return server, clients, server.fix_graph()


def _finish(server, clients, inputs, told, *, reveal=None):
    """Masked inputs, unmask requests and reveals (`reveal(u, request)` may replace a
    client's answer); -> the unmasked sum."""
    for u, x in inputs.items():
        server.add_input([u], clients[u].mask(x, told.get(u))[0])
    for u, req in server.unmask_requests().items():
        rev = reveal(u, req) if reveal else None
        if rev is None:
            rev = clients[u].on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])
        server.add_reveal(u, rev["b"], rev["s"])
    return server.unmask()


def _want(inputs, ring):
    total = sum(encode(x, ring)[0] for x in inputs.values())
    if ring.ring_bits < 64:
        total &= np.uint64((1 << ring.ring_bits) - 1)
    return decode(total, ring)


# --------------------------------------------------------------------------- Why 4


def test_a_client_refuses_to_mask_with_fewer_than_t_minus_1_share_senders():
    """Bonawitz's U2 check: told that no neighbour sent shares, a client masked only with
    its self mask, whose shares the server could then collect: it aborts instead."""
    ids = [1, 2, 3, 4, 5]
    server, clients, msgs = _keyed(ids)
    for u, m in msgs.items():
        server.add_shares(u, clients[u].on_peers(m["peers"], m["t"], m["ring"]))
    t = msgs[1]["t"]
    assert t == 4
    c = clients[1]
    for told in ([], [2], [2, 3]):  # t - 1 = 3 needed
        with pytest.raises(SecAggError, match=r"aborts its round: \d neighbours sent shares, "
                                              r"fewer than t-1=3"):
            c.mask(np.zeros(4), told)
    with pytest.raises(SecAggError, match="not neighbours it shared with"):
        c.mask(np.zeros(4), [2, 3, 99])
    packed, _ = c.mask(np.zeros(4), [2, 3, 4])  # enough: it masks
    assert packed.shape[0] == 4


def test_the_node_side_aborts_on_an_empty_masking_step_before_it_trains():
    cfg = _config("fedproto", True)
    engine, tasks = _engine(cfg)
    cl = Clients(engine, cfg)
    outs = []
    for task in tasks:
        outs += cl.send("secagg", task.dst, cl.secure.begin(task.dst, task.body), task.round, 1.0)
    peers = {o.dst: o for o in outs if o.kind == "secagg" and o.body["step"] == "peers"}
    t = next(iter(peers.values())).body["t"]
    cl.secure.on_peers(tasks[0].dst, peers[tasks[0].dst].body)
    body = {"step": "masking", "task": tasks[0].body["task"], "sharers": []}
    with pytest.raises(SecAggError, match=f"fewer than t-1={t - 1}"):
        cl.secure.on_masking(tasks[0].dst, body)


def test_a_client_aborts_unless_its_own_keys_come_back_unchanged():
    ids = [1, 2, 3]
    _, clients, msgs = _keyed(ids)
    peers, t, ring = msgs[1]["peers"], msgs[1]["t"], msgs[1]["ring"]
    assert 1 in peers  # the server echoes each client's own keys
    without = {v: k for v, k in peers.items() if v != 1}
    with pytest.raises(SecAggError, match=r"does not echo its own keys back unchanged \(miss"):
        ClientSession(1, CTX).on_peers(without, t, ring)
    other = ClientSession(1, CTX).public_keys()  # keys the server swapped in for client 1
    for swapped in ([other["c_pk"], peers[1][1]], [peers[1][0], other["s_pk"]]):
        with pytest.raises(SecAggError, match=r"own keys back unchanged \(altered\)"):
            clients[1].on_peers({**peers, 1: swapped}, t, ring)
    assert sorted(clients[1].on_peers(peers, t, ring)) == [2, 3]


def test_a_client_refuses_peers_whose_keys_repeat_and_goes_on_if_enough_remain():
    ids = list(range(1, 8))  # complete graph: 7 holders; dropout 0.5: t = 4, 3 links needed
    _, clients, msgs = _keyed(ids, dropout=0.5)
    peers, t, ring = dict(msgs[1]["peers"]), msgs[1]["t"], msgs[1]["ring"]
    assert t == 4
    peers[3] = list(peers[2])  # 3 advertises 2's keys: one of them is not who it says
    peers[4] = [peers[1][0], peers[4][1]]  # 4 advertises a key of client 1's own
    cts = clients[1].on_peers(peers, t, ring)
    assert clients[1].refused_peers() == {2: "another peer advertises the same key",
                                          3: "another peer advertises the same key",
                                          4: "it advertises a key of this client's"}
    assert sorted(cts) == [5, 6, 7]  # shares for the others only: its round goes on
    # too few acceptable neighbours left: the round is aborted, with the reasons
    peers = dict(msgs[5]["peers"])
    for v in (1, 2, 3):
        peers[v] = list(peers[4])
    with pytest.raises(SecAggError, match=r"client 5 aborts its round: 2 acceptable "
                                          r"neighbours, fewer than t-1=3 \(refused: 1: another"):
        clients[5].on_peers(peers, t, ring)


# --------------------------------------------------------------------------- Why 8


def test_the_low_order_list_is_exactly_the_keys_x25519_cannot_agree_with():
    mine = X25519PrivateKey.generate()
    for pk in LOW_ORDER:
        assert low_order(pk)
        with pytest.raises(ValueError):  # cryptography's own all-zero check
            mine.exchange(X25519PublicKey.from_public_bytes(pk))
    rng = np.random.default_rng(0)
    for _ in range(200):
        pk = rng.bytes(32)
        assert not low_order(pk)
        mine.exchange(X25519PublicKey.from_public_bytes(pk))


@pytest.mark.parametrize("bad", ["zeros", "low-order", "same-twice", "copied"])
def test_the_server_refuses_bad_keys_blaming_their_sender(bad):
    ids = [1, 2, 3, 4]
    server = _server(ids)
    honest = {u: ClientSession(u, CTX).public_keys() for u in ids}
    server.add_keys(1, **honest[1])
    c_pk, s_pk = {"zeros": (bytes(32), bytes(32)),
                  "low-order": (honest[3]["c_pk"], LOW_ORDER[5]),
                  "same-twice": (honest[3]["c_pk"], honest[3]["c_pk"]),
                  "copied": (honest[3]["c_pk"], honest[1]["s_pk"])}[bad]
    why = {"zeros": "its c_pk is a low-order X25519 point",
           "low-order": "its s_pk is a low-order X25519 point",
           "same-twice": "its c_pk and s_pk are the same key",
           "copied": "it repeats a key client 1 sent"}[bad]
    with pytest.raises(SecAggError, match=f"client 3's keys are refused: {why}"):
        server.add_keys(3, c_pk, s_pk)
    for u in (2, 4):  # the honest ones are not touched
        server.add_keys(u, **honest[u])
    assert server.key_senders() == [1, 2, 4]


def _round_with(engine, cfg, tasks, *, keys_of=None, peers_of=None, reveal_of=None):
    """One secure round with the real client side; keys_of(client, keys) may replace what a
    client sends as its keys, peers_of(dst, body) what a client is told as its peers,
    reveal_of(dst, reveal) what it reveals. -> the Clients (whose `sent` is every message)."""
    cl = Clients(engine, cfg)
    outs = []
    for task in tasks:
        keys = cl.secure.begin(task.dst, task.body)
        if keys_of:
            keys = keys_of(int(task.dst[1:]), keys)
        outs += cl.send("secagg", task.dst, keys, task.round, 1.0)
    by_dst = {task.dst: task for task in tasks}
    masking = []
    for o in [o for o in outs if o.kind == "secagg" and o.body["step"] == "peers"]:
        body = peers_of(o.dst, o.body) if peers_of else o.body
        masking += cl.send("secagg", o.dst, cl.secure.on_peers(o.dst, body), o.round, 1.0)
    unmasks = []
    for o in [o for o in masking if o.kind == "secagg" and o.body["step"] == "masking"]:
        cl.secure.ready(o.dst, _update(engine, by_dst[o.dst], int(o.dst[1:])))
        unmasks += cl.send("update", o.dst, cl.secure.on_masking(o.dst, o.body), o.round, 1.0)
    for o in [o for o in unmasks if o.kind == "secagg" and o.body["step"] == "unmask"]:
        rev = cl.secure.on_unmask(o.dst, o.body)
        if reveal_of:
            rev = reveal_of(o.dst, rev)
        cl.send("secagg", o.dst, rev, o.round, 1.0)
    return cl


def test_a_client_with_zero_keys_is_refused_alone_and_the_round_goes_on():
    """Issue 42 Why 8: 32 zero bytes as both keys made every honest neighbour's key
    agreement fail, every round, with the blame on the honest clients."""
    cfg = _config("fedproto", True)
    engine, tasks = _engine(cfg)
    before = _global(engine)["protos"].copy()

    def zero_keys(client, keys):
        return {**keys, "c_pk": bytes(32), "s_pk": bytes(32)} if client == 2 else keys

    _round_with(engine, cfg, tasks, keys_of=zero_keys)
    rec = _record(engine)
    assert rec["secagg"].get("failed") is None, rec["secagg"]
    assert rec["failures"] == {"2": "rejected"}
    assert "low-order X25519 point" in rec["refusals"]["2"]
    assert rec["participants"] == [0, 1, 3, 4, 5]
    assert not np.array_equal(_global(engine)["protos"], before)  # the round aggregated


def test_a_peer_key_changed_in_transit_is_refused_by_its_neighbour_and_the_sum_holds():
    """The server refuses such keys itself; a key changed after it (a relay, the broker)
    reaches one client only: that client refuses the peer (no shares, no pairwise mask
    with it), the server links the rest, and the sum is exact."""
    ids = list(range(10, 16))  # complete graph, 6 holders, t = 5
    server, clients, msgs = _keyed(ids)
    victim, peer = 10, 13
    msgs[victim]["peers"][peer] = [LOW_ORDER[0], LOW_ORDER[2]]
    for u, m in msgs.items():
        server.add_shares(u, clients[u].on_peers(m["peers"], m["t"], m["ring"]))
    assert clients[victim].refused_peers() == {peer: "its c_pk is a low-order X25519 point"}
    told = server.close_shares()
    assert peer not in told[victim] and victim not in told[peer]
    assert len(told[victim]) == 4 and server.excluded() == []
    rng = np.random.default_rng(1)
    inputs = {u: rng.uniform(-RANGE, RANGE, 30) for u in ids}
    got = _finish(server, clients, inputs, told)
    np.testing.assert_allclose(got, _want(inputs, server.ring), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- Why 5


def _graph_config(**privacy):
    return build_config({
        "federation": {"clients": 12, "rounds": 2, "seed": 3},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": "fedproto"},
        "privacy": {"secure_aggregation": True, "secagg_neighbours": 4, **privacy}})


def _peers_of_round(engine, tasks):
    """Every sampled client sends keys; -> client -> the peers it is told (the graph)."""
    outs = []
    for task in tasks:
        session = ClientSession(int(task.dst[1:]), task.body["secagg"]["context"].encode())
        keys = {"step": "keys", "task": task.body["task"], **session.public_keys()}
        outs += dispatch(engine, _msg("secagg", task.dst, keys, task.round), 1.0)
    return {o.dst: sorted(o.body["peers"]) for o in outs
            if o.kind == "secagg" and o.body["step"] == "peers"}


def test_the_neighbour_graph_comes_from_the_servers_secret_not_the_runs_seed():
    """Issue 42 Why 5: the graph was drawn from fed.seed and the round, which every node
    knows. Two servers of the same config and seed now draw different graphs; the same
    secret key (a replay, a resume) draws the same one."""
    cfg = _graph_config()
    graphs = []
    for key in (None, None, b"k" * 32, b"k" * 32, b"j" * 32):
        engine = build_engine(cfg, "r")
        engine.secagg_key = key
        engine.on_join("n", [client_address(c) for c in range(12)], 0.0)
        tasks = engine.on_configured("n", "r", 0.0)
        assert len(tasks) == 12
        graphs.append(_peers_of_round(engine, tasks))
    assert all(len(p) == 5 for g in graphs for p in g.values())  # 4 neighbours and itself
    assert graphs[0] != graphs[1]  # fresh randomness each time: no seed reproduces it
    assert graphs[2] == graphs[3]  # the same key redraws the same graph
    assert graphs[2] != graphs[4]


def test_the_graph_key_file_is_made_once_private_and_read_back(tmp_path):
    key = run_graph_key(tmp_path, create=True)
    path = tmp_path / "secagg_key"
    assert len(key) == 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert run_graph_key(tmp_path, create=True) == key == run_graph_key(tmp_path, create=False)
    path.write_text("not hex\n")
    with pytest.raises(ValueError, match="does not hold a 32-byte key"):
        run_graph_key(tmp_path, create=False)
    path.unlink()
    with pytest.raises(FileNotFoundError, match="cannot be redrawn without it"):
        run_graph_key(tmp_path, create=False)


# --------------------------------------------------------------------------- Why 9


def _record_dp_engine():
    cfg = build_config({
        "federation": {"clients": 4, "rounds": 2, "seed": 3},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": "fedproto"},
        # an extractor never trained on the data (the rule record-level DP needs); the
        # server-side check does not train anyway
        "train": {"epochs": 0},
        "privacy": {"dp": "record", "dp_clip": 1.0, "dp_noise_multiplier": 1.0}})
    engine = build_engine(cfg, "r")
    engine.on_join("n", [client_address(c) for c in range(4)], 0.0)
    return engine, engine.on_configured("n", "r", 0.0)


def test_record_dp_refuses_any_count_above_one_with_the_reason_in_the_task_failure():
    """Issue 42 Why 9: honest record-DP clients send presence flags, but the server kept
    only the total-count bound: counts of n / C on every class outweighed every honest
    client."""
    engine, tasks = _record_dp_engine()
    c, d = engine.handler.ctx.num_classes, engine.handler.ctx.feature_dim
    evil, honest = tasks[0], tasks[1]
    n = int(engine.train_sizes[0])
    payload = {"protos": np.full((c, d), 0.5 / np.sqrt(d), np.float32),
               "counts": np.full(c, n // c, np.int64)}
    body = {**_update(engine, evil, 0), "payload": payload}
    outs = dispatch(engine, _msg("update", evil.dst, body, evil.round), 1.0)
    errors = [o for o in outs if o.kind == "error"]
    assert errors and "a count is a presence flag, 0 or 1" in errors[0].body["reason"]
    assert engine.round.failures[0] == "rejected"
    flags = {**payload, "counts": np.ones(c, np.int64)}
    body = {**_update(engine, honest, 1), "payload": flags}
    assert not [o for o in dispatch(engine, _msg("update", honest.dst, body, honest.round), 1.0)
                if o.kind == "error"]
    assert 1 not in engine.round.failures


def test_withheld_counts_are_presence_flags_and_a_count_above_one_is_refused():
    """privacy.withhold_counts: honest clients send class presence (0/1), as under record
    DP, so a client's counts of n / C a class would outweigh every honest one (the hole of
    issue 42 Why 9 without DP): refused, and the mass a relay or secure round may sum is
    bounded by one a class per member."""
    cfg = build_config({
        "federation": {"clients": 4, "rounds": 2, "seed": 3},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": "fedproto"},
        "privacy": {"withhold_counts": True}})
    engine = build_engine(cfg, "r")
    engine.on_join("n", [client_address(c) for c in range(4)], 0.0)
    tasks = engine.on_configured("n", "r", 0.0)
    c, d = engine.handler.ctx.num_classes, engine.handler.ctx.feature_dim
    assert [int(v) for v in engine.class_max(0)] == [1] * c
    n = int(engine.train_sizes[0])
    payload = {"protos": np.full((c, d), 0.1, np.float32),
               "counts": np.full(c, n // c, np.int64)}
    outs = dispatch(engine, _msg("update", tasks[0].dst,
                                 {**_update(engine, tasks[0], 0), "payload": payload},
                                 tasks[0].round), 1.0)
    errors = [o for o in outs if o.kind == "error"]
    assert errors and "a count is a presence flag, 0 or 1" in errors[0].body["reason"]
    assert "withhold_counts" in errors[0].body["reason"]
    flags = {**payload, "counts": np.ones(c, np.int64)}
    outs = dispatch(engine, _msg("update", tasks[1].dst,
                                 {**_update(engine, tasks[1], 1), "payload": flags},
                                 tasks[1].round), 1.0)
    assert not [o for o in outs if o.kind == "error"] and 1 not in engine.round.failures


def test_check_update_presence_names_the_class():
    body = {"task": 1, "version": 0, "num_samples": 50, "work": {
        "epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 50},
        "payload": {"counts": np.array([1, 0, 2, 1], np.int64)}}
    check_update(body, None, num_classes=4, max_samples=50)  # counts, not flags: fine
    with pytest.raises(Rejected, match=r"counts\[2\] = 2: a count is a presence flag"):
        check_update(body, None, num_classes=4, max_samples=50, presence=True)


# --------------------------------------------------------------------------- Why 10


@pytest.mark.parametrize("privacy,security,want", [
    ({"secure_aggregation": True}, {}, SECURE_PROTO_CLIP),
    ({"secure_aggregation": True, "dp": "record", "dp_clip": 2.0}, {}, 2.0),
    ({"dp": "record", "dp_clip": 2.0}, {}, 2.0),
    ({"secure_aggregation": True, "clip_norm": 3.0}, {}, 3.0),
    ({"secure_aggregation": True}, {"max_proto_norm": 7.0}, 7.0),
    ({}, {}, DEFAULT_PROTO_NORM),
])
def test_the_prototype_bound_comes_from_the_clip(privacy, security, want):
    assert run_norms(security, privacy, 64).proto == want


def test_client_level_dp_bounds_the_update_by_its_clip():
    assert run_norms({"max_update_norm": 1e4}, {"dp": "client", "dp_clip": 0.5}, 8).update == 0.5
    assert run_norms({"max_update_norm": 1e4}, {}, 8).update == 1e4


def _long_protos(engine, task, client, norm):
    upd = _update(engine, task, client)
    protos = upd["payload"]["protos"].astype(np.float64)
    rows = np.linalg.norm(protos, axis=1, keepdims=True)
    upd["payload"]["protos"] = (protos / np.maximum(rows, 1e-12) * norm
                                * (rows > 0)).astype(np.float32)
    return upd


def test_secure_aggregation_bounds_a_poisoners_sum_by_the_clip():
    """Issue 42 Why 10: with the bound 1e4 a client drove the global prototypes to norms of
    9,000. Honest clients now clip to SECURE_PROTO_CLIP (the task says so) and the server
    refuses a sum longer than mass x that clip: long honest rows are cut, not refused, and
    a poisoner's round unmasks nothing."""
    cfg = _config("fedproto", True)
    engine, tasks = _engine(cfg)
    assert all(t.body["secagg"]["clip"] == SECURE_PROTO_CLIP for t in tasks)
    cl = Clients(engine, cfg)
    outs = []
    for t in tasks:
        outs += cl.send("secagg", t.dst, cl.secure.begin(t.dst, t.body), t.round, 1.0)
    masking = []
    for o in [o for o in outs if o.kind == "secagg" and o.body["step"] == "peers"]:
        masking += cl.send("secagg", o.dst, cl.secure.on_peers(o.dst, o.body), o.round, 1.0)
    by_dst = {t.dst: t for t in tasks}
    unmasks = []
    for o in [o for o in masking if o.kind == "secagg" and o.body["step"] == "masking"]:
        c = int(o.dst[1:])
        # every honest client's rows at 3 x the clip: cut to the clip on the client
        cl.secure.ready(o.dst, _long_protos(engine, by_dst[o.dst], c, 3 * SECURE_PROTO_CLIP))
        unmasks += cl.send("update", o.dst, cl.secure.on_masking(o.dst, o.body), o.round, 1.0)
    for o in [o for o in unmasks if o.kind == "secagg" and o.body["step"] == "unmask"]:
        cl.send("secagg", o.dst, cl.secure.on_unmask(o.dst, o.body), o.round, 1.0)
    assert _record(engine)["secagg"].get("failed") is None
    norms = np.linalg.norm(_global(engine)["protos"], axis=1)
    assert norms.max() <= SECURE_PROTO_CLIP * (1 + 1e-4) and norms.max() > 0.5 * SECURE_PROTO_CLIP

    # round 2: a poisoner that does not clip (its own code) sends rows of norm 9,000
    engine, tasks = _engine(cfg)
    before = _global(engine)["protos"].copy()
    poisoner = SecureClient(cl.secure.rule, cl.secure.params)
    cl2 = Clients(engine, cfg)
    outs = []
    for t in tasks:
        side = poisoner if t.dst == "c1" else cl2.secure
        outs += cl2.send("secagg", t.dst, side.begin(t.dst, t.body), t.round, 1.0)
    poisoner.sessions["c1"]["clip"] = 0.0  # what a hostile client's code does
    masking = []
    for o in [o for o in outs if o.kind == "secagg" and o.body["step"] == "peers"]:
        side = poisoner if o.dst == "c1" else cl2.secure
        masking += cl2.send("secagg", o.dst, side.on_peers(o.dst, o.body), o.round, 1.0)
    by_dst = {t.dst: t for t in tasks}
    unmasks = []
    for o in [o for o in masking if o.kind == "secagg" and o.body["step"] == "masking"]:
        c = int(o.dst[1:])
        side = poisoner if o.dst == "c1" else cl2.secure
        upd = _long_protos(engine, by_dst[o.dst], c, 9000.0 if c == 1 else 1.0)
        side.ready(o.dst, upd)
        unmasks += cl2.send("update", o.dst, side.on_masking(o.dst, o.body), o.round, 1.0)
    for o in [o for o in unmasks if o.kind == "secagg" and o.body["step"] == "unmask"]:
        side = poisoner if o.dst == "c1" else cl2.secure
        cl2.send("secagg", o.dst, side.on_unmask(o.dst, o.body), o.round, 1.0)
    rec = _record(engine)
    assert "longer than mass x the prototype bound" in rec["secagg"]["failed"]
    np.testing.assert_array_equal(_global(engine)["protos"], before)


# --------------------------------------------------------------------------- Why 7


def _wrong_share(rng: np.random.Generator) -> bytes:
    # well-formed (field elements, the right length), so only its consistency gives it away
    return rng.integers(0, shamir.P, shamir.CHUNKS).astype("<u4").tobytes()


def _ten_masked():
    ids = list(range(20, 30))  # complete graph: 10 holders, t = 7, three shares to spare
    server, clients, msgs = _keyed(ids)
    for u, m in msgs.items():
        server.add_shares(u, clients[u].on_peers(m["peers"], m["t"], m["ring"]))
    rng = np.random.default_rng(4)
    inputs = {u: rng.uniform(-RANGE, RANGE, 50) for u in ids}
    return server, clients, inputs, server.close_shares()


def test_a_holder_revealing_wrong_shares_is_blamed_and_the_sum_is_still_exact():
    """Issue 42 Why 7: the server rebuilt each seed from the t lowest-numbered shares
    unchecked, so one client's random shares cost every round, untraceably. Client 20 is
    share 1 of every secret, so its lies are in every first-t basis."""
    server, clients, inputs, told = _ten_masked()
    liar = 20
    rng = np.random.default_rng(9)

    def lie(u, req):
        if u != liar:
            return None
        rev = clients[u].on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])
        return {"b": {v: _wrong_share(rng) for v in rev["b"]}, "s": rev["s"]}

    got = _finish(server, clients, inputs, told, reveal=lie)
    np.testing.assert_allclose(got, _want(inputs, server.ring), rtol=0, atol=1e-12)
    assert list(server.blamed) == [liar] and "inconsistent" in server.blamed[liar]
    assert server.stats()["blamed"] == server.blamed


@pytest.mark.parametrize("spare", [3, 1])
def test_a_holder_whose_wrong_shares_the_sum_did_not_need_is_blamed_all_the_same(spare):
    """Client 29 is the last share of every secret, beyond the t lowest-numbered the seeds
    are rebuilt from: its random reveals changed nothing (the bench's 42.7a found them never
    checked). Every spare share is now checked: with three spares it is blamed; with one
    spare (only t + 1 holders revealed) any of them could be the odd one, and no one is."""
    server, clients, inputs, told = _ten_masked()
    liar = 29
    rng = np.random.default_rng(9)
    silent = set(range(20, 29)[-(3 - spare):]) if spare < 3 else set()

    for u, x in inputs.items():
        server.add_input([u], clients[u].mask(x, told.get(u))[0])
    for u, req in server.unmask_requests().items():
        if u in silent:  # it never reveals (the reveal phase's deadline passes)
            continue
        rev = clients[u].on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])
        if u == liar:
            rev = {"b": {v: _wrong_share(rng) for v in rev["b"]}, "s": rev["s"]}
        server.add_reveal(u, rev["b"], rev["s"])
    got = server.unmask()
    np.testing.assert_allclose(got, _want(inputs, server.ring), rtol=0, atol=1e-12)
    if spare == 3:
        assert list(server.blamed) == [liar], server.blamed
        assert "the sum did not need them" in server.blamed[liar]
    else:
        assert server.blamed == {}
        assert server.stats()["unattributed"] == 10  # every secret: c29 holds a share of each


def test_a_malformed_masked_input_fails_the_round_saying_so_and_blames_no_one():
    server, clients, inputs, told = _ten_masked()
    for u, x in inputs.items():
        packed = clients[u].mask(x, told[u])[0]
        if u == 25:  # random bytes as its masked input
            packed = np.random.default_rng(2).integers(0, 256, packed.shape, dtype=np.uint8)
        server.add_input([u], packed)
    for u, req in server.unmask_requests().items():
        rev = clients[u].on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])
        server.add_reveal(u, rev["b"], rev["s"])
    with pytest.raises(SecAggError, match="out of bounds and every revealed share is "
                                          "consistent: a masked input is malformed"):
        server.unmask()
    assert server.blamed == {}


def test_an_engine_round_with_a_lying_holder_aggregates_and_records_the_blame():
    cfg = build_config({
        "federation": {"clients": 10, "rounds": 3, "seed": 3},
        "data": {"dataset": "digits", "partition": "iid"},
        "model": {"arch": "mlp"}, "algorithm": {"name": "fedproto"},
        "privacy": {"secure_aggregation": True, "secagg_timeout_s": 10.0}})
    engine, tasks = _engine(cfg)
    rng = np.random.default_rng(5)

    def lie(dst, rev):
        if dst != "c0":
            return rev
        return {**rev, "b": {a: _wrong_share(rng) for a in rev["b"]}}

    _round_with(engine, cfg, tasks, reveal_of=lie)
    rec = _record(engine)
    assert rec["secagg"].get("failed") is None, rec["secagg"]
    assert list(rec["secagg"]["blamed"]) == ["c0"]
    assert rec["participants"] == list(range(10))

"""Secure aggregation core (fedbus.node.privacy.secagg): real X25519/AES-GCM/ChaCha20/Shamir,
full rounds simulated in-process, dropouts, refusals and garbage on the server side."""
from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedbus.node.privacy import secagg, shamir
from fedbus.node.privacy.secagg import (
    ClientSession,
    RingParams,
    SecAggError,
    ServerSession,
    add_packed,
    decode,
    encode,
    neighbour_count,
    neighbour_graph,
    pack,
    quantisation_bound,
    threshold,
    unpack,
)

RANGE, FRAC = 8.0, 20
CTX = b"run-a/round-3/task-0"


def key_of(i: int) -> bytes:
    """A fixed graph key, for tests that need the same graph twice."""
    return bytes([i % 256]) * 32


# --------------------------------------------------------------------------- simulation


def encoded_sum(inputs: dict[int, np.ndarray], ring: RingParams) -> np.ndarray:
    """decode(sum of encode(x_i)): what an exact unmasking must give."""
    total = np.zeros(len(next(iter(inputs.values()))), dtype=np.uint64)
    for x in inputs.values():
        total += encode(x, ring)[0]
    if ring.ring_bits < 64:
        total &= np.uint64((1 << ring.ring_bits) - 1)
    return decode(total, ring)


def run_round(n: int, *, length: int = 40, neighbours: int = 0, dropout: float = 0.3,
              seed: int = 7, drop_after_keys=(), drop_after_shares=(), drop_after_input=(),
              relay=(), close_shares: bool = False, lie=None):
    """Clients and a server through steps 1-5; returns (server, clients, inputs, reveals).
    drop_after_keys: send keys, never shares; drop_after_shares: shares but no input;
    drop_after_input: masked input but no reveal; relay: members pre-added by a relay;
    lie(u, reveal) -> the reveal client u sends instead of its own."""
    rng = np.random.default_rng(seed)
    ids = [100 + 3 * i for i in range(n)]  # ids need not be contiguous
    ring = RingParams.for_cohort(RANGE, FRAC, n)
    server = ServerSession(ids, CTX, neighbours=neighbours, dropout=dropout, ring=ring,
                           graph_key=key_of(seed))
    clients = {u: ClientSession(u, CTX) for u in ids}
    for u in ids:
        pk = clients[u].public_keys()
        server.add_keys(u, pk["c_pk"], pk["s_pk"])
    for u, msg in server.fix_graph().items():
        peers = {v: (k[0], k[1]) for v, k in msg["peers"].items()}
        cts = clients[u].on_peers(peers, msg["t"], RingParams.from_dict(msg["ring"]))
        if u not in drop_after_keys:
            server.add_shares(u, cts)
    told = server.close_shares() if close_shares else {}
    inputs: dict[int, np.ndarray] = {}
    relay_sum, relay_members = None, []
    for u in server.share_senders():
        x = rng.uniform(-RANGE, RANGE, length)
        packed, clipped = clients[u].mask(x, told.get(u))
        assert clipped == 0 and packed.shape == (length, ring.ring_bits // 8)
        if u in drop_after_shares:
            continue
        inputs[u] = x
        if u in relay:
            relay_sum = add_packed(relay_sum, packed, ring.ring_bits)
            relay_members.append(u)
        else:
            server.add_input([u], packed)
    if relay_members:
        server.add_input(relay_members, relay_sum)
    reveals = {}
    for u, req in server.unmask_requests().items():
        if u in drop_after_input:
            continue
        reveals[u] = clients[u].on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])
        if lie is not None:
            reveals[u] = lie(u, reveals[u])
        server.add_reveal(u, reveals[u]["b"], reveals[u]["s"])
    return server, clients, inputs, reveals


def check_sum(server: ServerSession, inputs: dict[int, np.ndarray]) -> None:
    got = server.unmask()
    ring = server.ring
    np.testing.assert_array_equal(got, encoded_sum(inputs, ring))
    plain = np.sum(list(inputs.values()), axis=0)
    assert np.max(np.abs(got - plain)) <= quantisation_bound(ring, len(inputs))
    assert server.missing() == []


def ids_of(n: int) -> list[int]:
    return [100 + 3 * i for i in range(n)]


# --------------------------------------------------------------------------- encoding


def test_encode_decode_round_trip_and_negatives():
    ring = RingParams.for_cohort(RANGE, FRAC, 1)
    x = np.random.default_rng(0).uniform(-RANGE, RANGE, 1000)
    x[:3] = [-RANGE, RANGE, -1e-9]
    enc, clipped = encode(x, ring)
    assert enc.dtype == np.uint64 and clipped == 0
    assert int(enc.max()) < 1 << ring.ring_bits
    back = decode(enc, ring)
    assert np.max(np.abs(back - x)) <= quantisation_bound(ring, 1)
    assert (back[x < -1e-3] < 0).all() and back[0] == -RANGE


def test_encode_clips_and_counts():
    ring = RingParams(2.0, 8, 32)
    enc, clipped = encode(np.array([5.0, -7.0, 1.5, 2.0, -2.0]), ring)
    assert clipped == 2
    np.testing.assert_array_equal(decode(enc, ring), [2.0, -2.0, 1.5, 2.0, -2.0])
    with pytest.raises(SecAggError, match="NaN"):
        encode(np.array([0.0, np.nan]), ring)
    with pytest.raises(SecAggError, match="1-D"):
        encode(np.zeros((2, 2)), ring)


@pytest.mark.parametrize("bits", [32, 40, 48, 56, 64])
def test_pack_unpack_round_trip(bits):
    v = np.random.default_rng(bits).integers(0, 2**63, 257, dtype=np.uint64) * np.uint64(2)
    v[0] = np.uint64(2**64 - 1)
    if bits < 64:
        v &= np.uint64((1 << bits) - 1)
    p = pack(v, bits)
    assert p.dtype == np.uint8 and p.shape == (257, bits // 8)
    np.testing.assert_array_equal(unpack(p, bits), v)


def test_unpack_refuses_wrong_dtype_and_shape():
    with pytest.raises(SecAggError):
        unpack(np.zeros((4, 4), dtype=np.int8), 32)
    with pytest.raises(SecAggError):
        unpack(np.zeros((4, 5), dtype=np.uint8), 32)
    with pytest.raises(SecAggError):
        unpack(np.zeros(16, dtype=np.uint8), 32)
    with pytest.raises(SecAggError):
        unpack([[0, 0, 0, 0]], 32)
    with pytest.raises(SecAggError):
        unpack(np.zeros((4, 4), dtype=np.uint8), 36)


def test_add_packed_wraps():
    a = pack(np.array([2**32 - 1, 5], dtype=np.uint64), 32)
    b = pack(np.array([2, 2**32 - 5], dtype=np.uint64), 32)
    s = add_packed(add_packed(None, a, 32), b, 32)
    np.testing.assert_array_equal(unpack(s, 32), [1, 0])
    big = pack(np.array([2**64 - 1], dtype=np.uint64), 64)
    np.testing.assert_array_equal(unpack(add_packed(big, big, 64), 64), [2**64 - 2])
    with pytest.raises(SecAggError):
        add_packed(a, pack(np.zeros(3, dtype=np.uint64), 32), 32)


def test_ring_for_cohort_picks_bits_and_refuses():
    assert RingParams.for_cohort(1.0, 16, 1).ring_bits == 32
    # 2 * 2^30 = 2^31 is not < 2^31
    assert RingParams.for_cohort(1.0, 30, 1).ring_bits == 32
    assert RingParams.for_cohort(1.0, 30, 2).ring_bits == 40
    assert RingParams.for_cohort(100.0, 24, 1000).ring_bits == 48
    with pytest.raises(SecAggError, match="64-bit"):
        RingParams.for_cohort(1.0, 62, 2)
    with pytest.raises(SecAggError):
        RingParams(1.0, 16, 33)
    with pytest.raises(SecAggError):
        RingParams(-1.0, 16, 32)
    ring = RingParams.for_cohort(RANGE, FRAC, 30)
    assert RingParams.from_dict(ring.to_dict()) == ring
    with pytest.raises(SecAggError):
        RingParams.from_dict({"range": 1.0})


def test_threshold_and_neighbour_count():
    assert threshold(10, 0.3) == 7  # 0.7 * 10 in floats is 7.000000000000001
    assert threshold(10, 0.9) == 6  # never below a majority
    assert threshold(15, 0.0) == 15
    assert threshold(1, 0.5) == 1
    assert neighbour_count(5) == 4 and neighbour_count(20) == 19
    assert neighbour_count(100) == 20 and neighbour_count(30) == 16
    assert neighbour_count(100, 14) == 14 and neighbour_count(5, 14) == 4
    with pytest.raises(SecAggError):
        threshold(10, 1.0)


# --------------------------------------------------------------------------- graph


@pytest.mark.parametrize("n,k", [(30, 16), (50, 14), (31, 7), (12, 4)])
def test_neighbour_graph_regular_symmetric_deterministic(n, k):
    clients = ids_of(n)
    g = neighbour_graph(clients, k, key_of(5))
    k_even = k + k % 2
    assert sorted(g) == clients
    for u, nb in g.items():
        assert nb == sorted(nb) and u not in nb and len(nb) == k_even
        for v in nb:
            assert u in g[v]
    assert neighbour_graph(list(reversed(clients)), k, key_of(5)) == g
    assert neighbour_graph(clients, k, key_of(6)) != g


@pytest.mark.parametrize("n,k", [(5, 4), (5, 9), (6, 5), (2, 1), (1, 0)])
def test_neighbour_graph_complete_for_small_n(n, k):
    clients = ids_of(n)
    g = neighbour_graph(clients, k, key_of(1))
    assert g == {u: [v for v in clients if v != u] for u in clients}


# --------------------------------------------------------------------------- full rounds


def test_round_five_clients_complete_graph():
    server, _, inputs, _ = run_round(5)
    assert server.stats()["neighbours"] == 4
    check_sum(server, inputs)


def test_round_thirty_clients_sparse_graph_with_relay_and_dropouts():
    ids = ids_of(30)
    server, _, inputs, reveals = run_round(30, relay=ids[:6], drop_after_shares=ids[10:12],
                                           drop_after_input=ids[20:22])
    stats = server.stats()
    assert stats["neighbours"] == 16 and stats["inputs"] == 28  # sparse: 16 < 29
    assert stats["dropped"] == 2 and stats["reveals"] == 26
    check_sum(server, inputs)
    for rev in reveals.values():
        assert not set(rev["b"]) & set(rev["s"])


def test_dropout_after_shares_is_recovered():
    ids = ids_of(5)
    server, _, inputs, reveals = run_round(5, drop_after_shares=[ids[2]])
    assert ids[2] not in inputs and server.stats()["t"] == 4
    check_sum(server, inputs)
    assert all(ids[2] in r["s"] and ids[2] not in r["b"] for r in reveals.values())


def test_dropouts_after_input_are_fine_with_t_holders():
    ids = ids_of(7)
    server, _, inputs, _ = run_round(7, dropout=0.4, drop_after_shares=[ids[0]],
                                     drop_after_input=[ids[5]])
    assert server.stats()["t"] == 5 and len(inputs) == 6
    check_sum(server, inputs)


def test_dropout_between_keys_and_shares():
    ids = ids_of(6)
    # without telling the clients who sent shares, their masks cannot be undone: refused
    with pytest.raises(SecAggError, match="close_shares"):
        run_round(6, drop_after_keys=[ids[1]])
    server, _, inputs, _ = run_round(6, drop_after_keys=[ids[1]], close_shares=True)
    check_sum(server, inputs)


def test_too_many_dropouts_before_input_fail_cleanly():
    ids = ids_of(5)
    with pytest.raises(SecAggError, match="fewer than t=4"):
        run_round(5, drop_after_shares=ids[:2])


def test_too_many_dropouts_before_reveal_fail_cleanly():
    ids = ids_of(5)
    server, _, _, _ = run_round(5, drop_after_input=ids[:2])
    assert server.missing() and all("of t=4" in m for m in server.missing())
    with pytest.raises(SecAggError, match="cannot unmask: b_seed of client"):
        server.unmask()


def test_masked_input_is_uncorrelated_with_plaintext():
    ring = RingParams.for_cohort(RANGE, FRAC, 3)
    clients = {u: ClientSession(u, CTX) for u in (1, 2, 3)}
    keys = {u: c.public_keys() for u, c in clients.items()}
    c = clients[1]
    c.on_peers({v: (keys[v]["c_pk"], keys[v]["s_pk"]) for v in (1, 2, 3)}, 2, ring)
    x = np.random.default_rng(3).uniform(-RANGE, RANGE, 2000)
    packed, _ = c.mask(x)
    seen = decode(unpack(packed, ring.ring_bits), ring)
    # the metric does detect a leak: the unmasked encoding is perfectly correlated
    assert np.corrcoef(decode(encode(x, ring)[0], ring), x)[0, 1] > 0.99
    assert abs(np.corrcoef(seen, x)[0, 1]) < 0.1
    with pytest.raises(SecAggError, match="already masked"):
        c.mask(x)


# --------------------------------------------------------------------------- shares


def _wrong_share(rng: np.random.Generator) -> bytes:
    # well-formed (field elements, the right length): only its consistency gives it away
    return rng.integers(0, shamir.P, shamir.CHUNKS).astype("<u4").tobytes()


def test_shares_on_the_wire_are_prime_field_shares_that_rebuild_the_seeds():
    """The ciphertexts carry shamir.py's byte format (a b-share and an s-share of
    SHARE_BYTES each, at the holder's place among the sorted holders); any t of a client's
    revealed b-shares rebuild its self-mask seed."""
    server, clients, reqs = masked_clients(5)
    ids, t = ids_of(5), server.stats()["t"]
    assert t == 4 and secagg.SHARE_BYTES == shamir.SHARE_BYTES
    assert {len(ct) for req in reqs.values() for ct in req["ciphertexts"].values()} == \
        {secagg.NONCE_BYTES + 2 * shamir.SHARE_BYTES + 16}
    reveals = {u: clients[u].on_unmask(r["survivors"], r["dropped"], r["ciphertexts"])
               for u, r in reqs.items()}
    owner = ids[1]
    shares = np.stack([[shamir.share_from_bytes(reveals[h]["b"][owner])] for h in ids])
    for pick in ([0, 1, 2, 3], [1, 2, 3, 4], [0, 2, 3, 4]):
        # the seed is the client's secret: read here only to check what its shares rebuild
        assert shamir.combine(pick, shares[pick]) == [clients[owner]._b_seed]
    for u, rev in reveals.items():
        server.add_reveal(u, rev["b"], rev["s"])
    np.testing.assert_array_equal(server.unmask(), np.full(8, 5.0))


def test_a_revealed_share_of_the_wrong_size_or_outside_the_field_is_refused_naming_its_sender():
    server, clients, reqs = masked_clients(4)
    ids = ids_of(4)
    u, v = ids[0], ids[1]
    revs = {w: clients[w].on_unmask(r["survivors"], r["dropped"], r["ciphertexts"])
            for w, r in reqs.items()}
    b = revs[u]["b"]
    outside = np.full(shamir.CHUNKS, shamir.P, dtype="<u4").tobytes()  # p: one past the field
    with pytest.raises(SecAggError, match=f"client {u}'s b-share of {v} holds a value "
                                          f"outside the field"):
        server.add_reveal(u, {**b, v: outside}, {})
    with pytest.raises(SecAggError, match=f"client {u}'s b-share of {v} must be "
                                          f"{shamir.SHARE_BYTES} bytes, got 16"):
        server.add_reveal(u, {**b, v: b[v][:16]}, {})
    # a refused reveal takes nothing: the sender's real one still counts
    for w, rev in revs.items():
        server.add_reveal(w, rev["b"], rev["s"])
    np.testing.assert_array_equal(server.unmask(), np.full(8, 4.0))


def test_a_peer_share_outside_the_field_is_refused_naming_the_peer():
    _, clients, reqs = masked_clients(4)
    me, sender = ids_of(4)[0], ids_of(4)[2]
    req = reqs[me]
    # what a hostile peer could encrypt: an authentic pair of shares holding the value p
    nonce = bytes(secagg.NONCE_BYTES)
    plain = np.full(2 * shamir.CHUNKS, shamir.P, dtype="<u4").tobytes()
    ct = nonce + AESGCM(clients[sender]._share_keys[me]).encrypt(
        nonce, plain, secagg._share_aad(sender, me, CTX))
    with pytest.raises(SecAggError, match=f"client {me}: the share client {sender} sent holds "
                                          f"a value outside the field"):
        clients[me].on_unmask(req["survivors"], req["dropped"],
                              {**req["ciphertexts"], sender: ct})
    # nothing was revealed, so the request as the server sent it is still answered
    rev = clients[me].on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])
    assert sorted(rev["b"]) == ids_of(4)


def test_a_lying_holder_is_blamed_when_seeds_come_from_different_holder_sets():
    """30 clients on a sparse graph, two dropped before their input and two before their
    reveal: the seeds (dropped clients' s_seeds among them) are rebuilt from several sets of
    share indices, one product each. A holder lying in every share it reveals is found by
    the consistency check, and the sum without its shares is exact."""
    ids = ids_of(30)
    liar = ids[4]
    rng = np.random.default_rng(5)

    def lie(u, rev):
        if u != liar:
            return rev
        return {kind: {v: _wrong_share(rng) for v in rev[kind]} for kind in ("b", "s")}

    server, _, inputs, _ = run_round(30, drop_after_shares=ids[10:12],
                                     drop_after_input=ids[20:22], lie=lie)
    t = server.stats()["t"]
    check_sum(server, inputs)
    assert list(server.blamed) == [liar]
    patterns = {tuple(i for i, _ in shares[:t])
                for shares in server._secrets(without={liar}).values()}
    assert len(patterns) > 1


# --------------------------------------------------------------------------- client refusals


def masked_clients(n: int = 4, ctx_of=None):
    """n clients through mask; -> (server, clients, unmask requests)."""
    ids = ids_of(n)
    ring = RingParams.for_cohort(RANGE, FRAC, n)
    server = ServerSession(ids, CTX, neighbours=0, dropout=0.3, ring=ring, graph_key=key_of(3))
    clients = {u: ClientSession(u, (ctx_of or {}).get(u, CTX)) for u in ids}
    for u, c in clients.items():
        server.add_keys(u, **c.public_keys())
    for u, msg in server.fix_graph().items():
        server.add_shares(u, clients[u].on_peers(msg["peers"], msg["t"], msg["ring"]))
    for u, c in clients.items():
        server.add_input([u], c.mask(np.ones(8))[0])
    return server, clients, server.unmask_requests()


def test_client_refuses_inconsistent_unmask_requests():
    _, clients, reqs = masked_clients()
    me, other = ids_of(4)[0], ids_of(4)[1]
    req, c = reqs[me], clients[me]
    with pytest.raises(SecAggError, match="survivor and dropped"):
        c.on_unmask(req["survivors"], [other], req["ciphertexts"])
    with pytest.raises(SecAggError, match="fewer than t"):
        c.on_unmask([me], [v for v in ids_of(4) if v != me], req["ciphertexts"])
    with pytest.raises(SecAggError, match="non-neighbours"):
        c.on_unmask(req["survivors"] + [999], [], req["ciphertexts"])
    with pytest.raises(SecAggError, match="dropped in its own"):
        c.on_unmask(req["survivors"], [me], req["ciphertexts"])
    rev = c.on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])
    assert sorted(rev["b"]) == ids_of(4) and rev["s"] == {}
    with pytest.raises(SecAggError, match="already revealed"):
        c.on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])


def test_client_refuses_bad_peers():
    ring = RingParams.for_cohort(RANGE, FRAC, 3)
    me = ClientSession(1, CTX)
    keys = {u: ClientSession(u, CTX).public_keys() for u in (2, 3)}
    peers = {v: (k["c_pk"], k["s_pk"]) for v, k in keys.items()}
    own = {1: (me.public_keys()["c_pk"], me.public_keys()["s_pk"])}
    with pytest.raises(SecAggError, match="32 bytes"):
        me.on_peers({**own, 2: (b"x" * 31, peers[2][1])}, 2, ring)
    with pytest.raises(SecAggError, match="own keys"):  # not echoed
        ClientSession(2, CTX).on_peers(peers, 2, ring)
    with pytest.raises(SecAggError, match="threshold"):
        me.on_peers({**own, **peers}, 4, ring)
    with pytest.raises(SecAggError, match="threshold"):
        me.on_peers({**own, **peers}, 1, ring)  # t <= holders / 2
    with pytest.raises(SecAggError, match="before on_peers"):
        ClientSession(1, CTX).mask(np.zeros(3))


def test_tampered_ciphertext_names_sender():
    _, clients, reqs = masked_clients()
    me, sender = ids_of(4)[0], ids_of(4)[2]
    req = reqs[me]
    cts = dict(req["ciphertexts"])
    ct = bytearray(cts[sender])
    ct[20] ^= 1
    cts[sender] = bytes(ct)
    with pytest.raises(SecAggError, match=f"from client {sender} fails authentication"):
        clients[me].on_unmask(req["survivors"], req["dropped"], cts)
    # a ciphertext moved to another pair fails too
    a, b = ids_of(4)[1], ids_of(4)[3]
    swapped = dict(req["ciphertexts"])
    swapped[a], swapped[b] = req["ciphertexts"][b], req["ciphertexts"][a]
    with pytest.raises(SecAggError, match="fails authentication"):
        clients[me].on_unmask(req["survivors"], req["dropped"], swapped)


def test_wrong_context_fails():
    me = ids_of(4)[0]
    _, clients, reqs = masked_clients(ctx_of={me: b"run-a/round-4/task-0"})
    req = reqs[me]
    with pytest.raises(SecAggError, match="fails authentication"):
        clients[me].on_unmask(req["survivors"], req["dropped"], req["ciphertexts"])


# --------------------------------------------------------------------------- server garbage


def test_server_refuses_garbage():
    ids = ids_of(4)
    ring = RingParams.for_cohort(RANGE, FRAC, 4)
    server = ServerSession(ids, CTX, neighbours=0, dropout=0.3, ring=ring, graph_key=key_of(3))
    clients = {u: ClientSession(u, CTX) for u in ids}
    pk = {u: c.public_keys() for u, c in clients.items()}
    good = (pk[ids[0]]["c_pk"], pk[ids[0]]["s_pk"])
    for bad in [("100", *good), (True, *good), (None, *good), (7, *good),
                (ids[0], b"x" * 31, good[1]), (ids[0], "x" * 32, good[1]),
                (ids[0], good[0], None), (ids[0], bytearray(32), good[1])]:
        with pytest.raises(SecAggError):
            server.add_keys(*bad)
    with pytest.raises(SecAggError, match="not fixed"):
        server.add_shares(ids[0], {})
    for u in ids[:3]:
        server.add_keys(u, pk[u]["c_pk"], pk[u]["s_pk"])
    with pytest.raises(SecAggError, match="twice"):
        server.add_keys(ids[0], *good)
    msgs = server.fix_graph()
    with pytest.raises(SecAggError, match="after the graph"):
        server.add_keys(ids[3], pk[ids[3]]["c_pk"], pk[ids[3]]["s_pk"])
    cts = {u: clients[u].on_peers(msgs[u]["peers"], msgs[u]["t"], ring) for u in ids[:3]}
    u, v = ids[0], ids[1]
    for bad in [(ids[3], cts[u]), (999, cts[u]), (u, []), (u, {v: cts[u][v]}),
                (u, {**cts[u], 999: cts[u][v]}), (u, {**cts[u], v: cts[u][v][:-1]}),
                (u, {**cts[u], v: "text"}), (u, {str(k): x for k, x in cts[u].items()})]:
        with pytest.raises(SecAggError):
            server.add_shares(*bad)
    for w in ids[:3]:
        server.add_shares(w, cts[w])
    with pytest.raises(SecAggError, match="twice"):
        server.add_shares(u, cts[u])
    packed = {w: clients[w].mask(np.zeros(5))[0] for w in ids[:3]}
    for bad in [([ids[3]], packed[u]), ([], packed[u]), ([u, u], packed[u]), (u, packed[u]),
                ([u], packed[u].astype(np.int8)), ([u], packed[u][:, :3]), ([u], "bytes")]:
        with pytest.raises(SecAggError):
            server.add_input(*bad)
    server.add_input([u], packed[u])
    for bad in [([u], packed[v]), ([v], packed[v][:4])]:
        with pytest.raises(SecAggError):
            server.add_input(*bad)
    with pytest.raises(SecAggError, match="before the survivors"):
        server.add_reveal(u, {}, {})
    server.add_input([v, ids[2]], add_packed(packed[v], packed[ids[2]], ring.ring_bits))
    reqs = server.unmask_requests()
    with pytest.raises(SecAggError, match="after the survivors"):
        server.add_input([u], packed[u])
    rev = clients[u].on_unmask(reqs[u]["survivors"], reqs[u]["dropped"], reqs[u]["ciphertexts"])
    share = rev["b"][u]
    for bad in [(ids[3], rev["b"], {}), (u, {u: share[:15]}, {}), (u, {u: "s" * 16}, {}),
                (u, {999: share}, {}), (u, {}, {v: share}), (u, [share], {}),
                (u, {"x": share}, {}), (u, rev["b"], None)]:
        with pytest.raises(SecAggError):
            server.add_reveal(*bad)
    server.add_reveal(u, rev["b"], rev["s"])
    with pytest.raises(SecAggError, match="twice"):
        server.add_reveal(u, rev["b"], rev["s"])


@pytest.mark.parametrize("change", [{"cohort": [1, 1]}, {"cohort": []}, {"context": "ctx"},
                                    {"context": b""}, {"neighbours": -1}, {"dropout": 1.0},
                                    {"graph_key": b"short"}, {"ring": "ring"},
                                    {"cohort": list(range(300))}])
def test_server_refuses_bad_setup(change):
    ring = RingParams.for_cohort(RANGE, FRAC, 4)  # holds 255 clients' sums, not 300
    args = {"cohort": [1, 2, 3], "context": CTX, "neighbours": 0, "dropout": 0.3, "ring": ring,
            "graph_key": key_of(0), **change}
    with pytest.raises(SecAggError):
        ServerSession(args.pop("cohort"), args.pop("context"), **args)


def test_server_refuses_fix_graph_without_keys():
    ring = RingParams.for_cohort(RANGE, FRAC, 4)
    server = ServerSession([1, 2], CTX, neighbours=0, dropout=0.3, ring=ring, graph_key=key_of(0))
    with pytest.raises(SecAggError, match="no client sent keys"):
        server.fix_graph()


def test_server_graph_is_deterministic_in_its_key():
    ids = ids_of(25)
    ring = RingParams.for_cohort(RANGE, FRAC, 25)
    keys = {u: ClientSession(u, CTX).public_keys() for u in ids}
    graphs = []
    for order in (ids, list(reversed(ids))):
        server = ServerSession(ids, CTX, neighbours=6, dropout=0.3, ring=ring, graph_key=key_of(11))
        for u in order:
            server.add_keys(u, keys[u]["c_pk"], keys[u]["s_pk"])
        graphs.append({u: sorted(m["peers"]) for u, m in server.fix_graph().items()})
    assert graphs[0] == graphs[1]
    # six neighbours, and the client itself (its own keys echoed back)
    assert all(len(nb) == 7 and u in nb for u, nb in graphs[0].items())

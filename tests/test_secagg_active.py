"""Secure aggregation against a server that lies (issue 42, Why 3; SECURITY.md 3a): signed key
advertisements, the consistency check on the survivor set, one kind of share per peer.

A scripted malicious server drives real ClientSession objects (the real X25519, AES-GCM,
Shamir and Ed25519 of fedbus.node.privacy) with: (a) different survivor sets to different
clients, (b) a live client claimed dropped, (c) substituted keys, (d) last round's messages
replayed, (e) both kinds of share of one peer asked for. Each is refused by the honest
clients under a named reason, and each test then tries the recovery the attack aims at,
with everything the server received plus a colluding client's shares, and finds the
target's input out of reach. Where the attack works without signing keys, the unsigned run
shows it (what SECURITY.md says the honest-but-curious mode cannot stop). The last test
runs a real CURVE federation (broker, server, nodes on loopback) with signing on."""
from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedbus.node.privacy import secagg
from fedbus.node.privacy.identity import Identity, survivors_message
from fedbus.node.privacy.secagg import ClientSession, Refused, SecAggError, ServerSession

N = 5  # complete graph: every client holds shares of every other (m = 5 holders)
L = 24
RING = secagg.RingParams(4.0, 16, 48)
TARGET = 4  # the client whose input the attacks aim at
COLLUDER = 3  # a client that hands the server everything it holds


def context(round_: int = 1) -> bytes:
    return f"fedbus-secagg/run-a/{round_}".encode()


class Cohort:
    """N clients of one round: their sessions (signing with a long-term Ed25519 key each, or
    unsigned), public keys and inputs. rogue: clients that sign with a key no one's list of
    verification keys names."""

    def __init__(self, ctx: bytes = context(), *, signed: bool = True, rogue=(), keys=None,
                 seed: int = 0):
        self.ctx = ctx
        self.signers = keys or {c: Ed25519PrivateKey.generate() for c in range(N)}
        verifiers = {c: k.public_key() for c, k in self.signers.items()}
        self.ids = {c: Identity.from_keys(Ed25519PrivateKey.generate() if c in rogue
                                          else self.signers[c], verifiers) if signed else None
                    for c in range(N)}
        self.sessions = {c: ClientSession(c, ctx, identity=self.ids[c]) for c in range(N)}
        self.keys = {c: s.public_keys() for c, s in self.sessions.items()}
        rng = np.random.default_rng(seed)
        self.inputs = {c: rng.uniform(-1, 1, L) for c in range(N)}

    def advert(self, v: int) -> tuple:
        k = self.keys[v]
        return (k["c_pk"], k["s_pk"], k["sig"]) if "sig" in k else (k["c_pk"], k["s_pk"])


def through_masking(cohort: Cohort, dropout: float = 0.3):
    """An honest server up to the masked inputs: -> (server, masked inputs by client)."""
    server = ServerSession(list(range(N)), cohort.ctx, neighbours=0, dropout=dropout,
                           ring=RING)
    for c, k in cohort.keys.items():
        server.add_keys(c, k["c_pk"], k["s_pk"], k.get("sig"))
    for c, m in server.fix_graph().items():
        try:
            cts = cohort.sessions[c].on_peers({v: tuple(p) for v, p in m["peers"].items()},
                                              m["t"], m["ring"])
        except SecAggError:
            continue
        server.add_shares(c, cts)
    masked = {}
    for c, senders in server.close_shares().items():
        try:
            masked[c], _ = cohort.sessions[c].mask(cohort.inputs[c], senders)
        except SecAggError:
            continue
        server.add_input([c], masked[c])
    return server, masked


def honest_round(cohort: Cohort):
    """A whole round with an honest server (the consistency check when signed)."""
    server, masked = through_masking(cohort)
    asks = server.unmask_requests()
    if server.signed():
        for c in asks:
            server.add_survivor_signature(c, cohort.sessions[c].sign_survivors(
                server.survivor_set()))
    for c, m in asks.items():
        reveal = cohort.sessions[c].on_unmask(
            m["survivors"], m["dropped"], m["ciphertexts"],
            server.signatures_for(c) if server.signed() else None)
        server.add_reveal(c, reveal["b"], reveal["s"])
    return server.unmask(), server, masked


# --------------------------------------------------------------------------- the attacker's tools


def rebuild(shares: dict[int, bytes], t: int) -> bytes | None:
    """A secret from the shares of its holders (client id -> share; the complete graph's
    holders are 0..N-1, Shamir index = id + 1), or None with fewer than t of them."""
    if len(shares) < t:
        return None
    chosen = sorted(shares)[:t]
    if hasattr(secagg, "shamir"):  # fedbus.node.privacy.shamir's prime field
        ys = np.stack([secagg.shamir.share_from_bytes(shares[h]) for h in chosen])[:, None, :]
        return secagg.shamir.combine(chosen, ys)[0]
    from Crypto.Protocol.SecretSharing import Shamir  # GF(2^128), before it

    return Shamir.combine([(h + 1, shares[h]) for h in chosen])


def unmask_alone(u: int, packed: np.ndarray, ctx: bytes, b_seed: bytes,
                 pair_seeds: dict[int, bytes]) -> np.ndarray:
    """Client u's input from its masked vector, its self-mask seed and its pairwise seeds."""
    bits = RING.ring_bits
    y = secagg.unpack(packed, bits)
    secagg._add_signed(y, secagg._prg(b_seed, secagg._PRG_SELF_INFO + ctx, L, bits), -1)
    for v, seed in pair_seeds.items():
        secagg._add_signed(y, secagg._prg(seed, secagg._PRG_PAIR_INFO + ctx, L, bits),
                           -secagg._sign(u, v))
    return secagg.decode(secagg._reduce(y, bits), RING)


def open_share(c_sk: X25519PrivateKey, sender: int, sender_c_pk: bytes, recipient: int,
               ct: bytes, ctx: bytes) -> tuple[bytes, bytes]:
    """(b-share, s-share) in a ciphertext, for whoever holds the recipient's c key."""
    key = secagg._hkdf(secagg._exchange(c_sk, sender_c_pk, sender),
                       secagg._SHARE_KEY_INFO + ctx)
    plain = AESGCM(key).decrypt(ct[:secagg.NONCE_BYTES], ct[secagg.NONCE_BYTES:],
                                secagg._share_aad(sender, recipient, ctx))
    return plain[:secagg.SHARE_BYTES], plain[secagg.SHARE_BYTES:]


def colluder_holds(cohort: Cohort, server: ServerSession, colluder: int) -> dict[int, tuple]:
    """Owner -> (b-share, s-share) the colluding client holds of it (it opens every share
    it was sent and hands them all to the server)."""
    session = cohort.sessions[colluder]
    held = {}
    for v, cts in server._shares.items():
        if colluder in cts:
            held[v] = open_share(session._c_sk, v, cohort.keys[v]["c_pk"], colluder,
                                 cts[colluder], cohort.ctx)
    return held


def learned(cohort: Cohort, masked: dict, b_shares: dict[int, bytes],
            s_shares: dict[int, bytes], t: int, target: int = TARGET) -> np.ndarray | None:
    """The target's input as the server rebuilds it from the b- and s-shares of it that it
    received, or None when either secret is out of reach."""
    b_seed, s_seed = rebuild(b_shares, t), rebuild(s_shares, t)
    if b_seed is None or s_seed is None:
        return None
    s_sk = secagg._s_private_key(s_seed)
    pair = {v: secagg._pairwise_seed(s_sk, cohort.keys[v]["s_pk"], v, cohort.ctx)
            for v in cohort.sessions[target]._masked_with}
    return unmask_alone(target, masked[target], cohort.ctx, b_seed, pair)


def local_view(server: ServerSession, c: int, survivors: set[int]) -> dict:
    """Client c's unmask request as if the round's survivor set were `survivors`."""
    linked = server._links()[c]
    return {"survivors": sorted(v for v in [c, *linked] if v in survivors),
            "dropped": sorted(v for v in linked if v not in survivors),
            "ciphertexts": {v: server._shares[v][c] for v in linked}}


def equivocate(cohort: Cohort, server: ServerSession, told: dict[int, set[int]],
               colluder: int | None = COLLUDER):
    """The server tells each client in `told` its own survivor set (signed rounds: each
    signs what it was told; the colluder signs every set), forwards every signature on the
    set a client was told, and asks it to reveal. -> (b-shares and s-shares of TARGET it
    got, colluder's included; refusals: client -> Refused)."""
    sigs: dict[frozenset, dict[int, bytes]] = {}
    refusals: dict[int, SecAggError] = {}
    signed = cohort.ids[0] is not None
    if signed:
        for c, g in told.items():
            try:
                sigs.setdefault(frozenset(g), {})[c] = cohort.sessions[c].sign_survivors(g)
            except SecAggError as err:
                refusals[c] = err
        if colluder is not None:
            for g in {frozenset(g) for g in told.values()}:
                sigs.setdefault(g, {})[colluder] = cohort.ids[colluder].sign(
                    survivors_message(cohort.ctx, g))
    b, s = {}, {}
    for c, g in told.items():
        if c in refusals:
            continue
        ask = local_view(server, c, g)
        try:
            reveal = cohort.sessions[c].on_unmask(ask["survivors"], ask["dropped"],
                                                  ask["ciphertexts"],
                                                  sigs.get(frozenset(g)) if signed else None)
        except SecAggError as err:
            refusals[c] = err
            continue
        if TARGET in reveal["b"]:
            b[c] = reveal["b"][TARGET]
        if TARGET in reveal["s"]:
            s[c] = reveal["s"][TARGET]
    if colluder is not None:
        b[colluder], s[colluder] = colluder_holds(cohort, server, colluder)[TARGET]
    return b, s, refusals


def reasons(refusals: dict[int, SecAggError]) -> dict[int, str]:
    return {c: getattr(err, "reason", "-") for c, err in refusals.items()}


# --------------------------------------------------------------------------- honest runs


def test_a_signed_round_sums_and_leaves_a_client_whose_signature_fails_out():
    cohort = Cohort(rogue={TARGET})
    total, server, _ = honest_round(cohort)
    np.testing.assert_allclose(total, sum(cohort.inputs[c] for c in range(4)), atol=1e-3)
    assert server.excluded() == [TARGET]
    for c in range(4):  # refused by every honest client, named; the round went on
        why = cohort.sessions[c].refused_peers()[TARGET]
        assert why.startswith("bad-key-signature: "), why


def test_an_unsigned_advertisement_is_refused_by_a_signing_client():
    cohort = Cohort()
    peers = {v: cohort.advert(v) for v in range(N)}
    peers[1] = peers[1][:2]  # the signature stripped on the way
    cohort.sessions[0].on_peers(peers, 4, RING)
    assert cohort.sessions[0].refused_peers()[1].startswith("unsigned-keys: ")
    assert set(cohort.sessions[0].refused_peers()) == {1}


# --------------------------------------------------------------------------- (c) substitution


def _substituting_server(cohort: Cohort, target: int = 0):
    """Tells `target` that every other client's keys are the server's own (their genuine
    signatures kept); -> (the ciphertexts target sent, or the refusal; the server's keys)."""
    fake = {v: (X25519PrivateKey.generate(), X25519PrivateKey.generate())
            for v in range(N) if v != target}
    peers = {target: cohort.advert(target)}
    for v, (c_sk, s_sk) in fake.items():
        pair = (secagg._public_bytes(c_sk), secagg._public_bytes(s_sk))
        peers[v] = (*pair, cohort.advert(v)[2]) if len(cohort.advert(v)) == 3 else pair
    try:
        return cohort.sessions[target].on_peers(peers, 4, RING), fake
    except SecAggError as err:
        return err, fake


def test_c_a_substituted_key_is_refused_and_the_input_stays_hidden():
    # unsigned: the server reads every share the client sent and knows every pairwise mask
    plain = Cohort(signed=False)
    cts, fake = _substituting_server(plain)
    b = {v: open_share(fake[v][0], 0, plain.keys[0]["c_pk"], v, ct, plain.ctx)[0]
         for v, ct in cts.items()}  # t = 4: its 4 neighbours' shares suffice
    packed, _ = plain.sessions[0].mask(plain.inputs[0], sorted(cts))
    pair = {v: secagg._pairwise_seed(fake[v][1], plain.keys[0]["s_pk"], 0, plain.ctx)
            for v in cts}
    stolen = unmask_alone(0, packed, plain.ctx, rebuild(b, 4), pair)
    np.testing.assert_allclose(stolen, plain.inputs[0], atol=1e-4)

    # signed: every substituted neighbour refused by name, the round aborted, nothing sent
    cohort = Cohort()
    err, _ = _substituting_server(cohort)
    assert isinstance(err, SecAggError) and "aborts its round" in str(err)
    assert str(err).count("bad-key-signature") == N - 1, err
    with pytest.raises(SecAggError, match="mask before on_peers"):
        cohort.sessions[0].mask(cohort.inputs[0])


def test_c_one_substituted_key_costs_that_neighbour_only():
    cohort = Cohort()
    peers = {v: cohort.advert(v) for v in range(N)}
    evil = X25519PrivateKey.generate()
    peers[2] = (secagg._public_bytes(evil), peers[2][1], peers[2][2])
    cts = cohort.sessions[0].on_peers(peers, 4, RING)
    assert sorted(cts) == [1, 3, 4]  # no share for the key the server holds
    assert cohort.sessions[0].refused_peers()[2].startswith("bad-key-signature: ")


# --------------------------------------------------------------------------- (d) replay


def test_d_last_rounds_keys_and_signatures_replayed_are_refused():
    keys = {c: Ed25519PrivateKey.generate() for c in range(N)}
    last = Cohort(context(1), keys=keys, seed=1)
    honest_round(last)  # round 1, every message of which the server kept
    now = Cohort(context(2), keys=keys, seed=2)
    # round 2: client 0 is told its neighbours' keys of round 1, signatures and all
    peers = {v: last.advert(v) for v in range(N)}
    peers[0] = now.advert(0)
    with pytest.raises(SecAggError) as err:
        now.sessions[0].on_peers(peers, 4, RING)
    assert str(err.value).count("bad-key-signature") == N - 1
    # the keys step honestly this time; then round 1's survivor-set signatures replayed
    server, masked = through_masking(now)
    asks = server.unmask_requests()
    for c in asks:
        server.add_survivor_signature(c, now.sessions[c].sign_survivors(server.survivor_set()))
    old = {c: last.ids[c].sign(survivors_message(context(1), range(N))) for c in range(N)}
    for c, m in asks.items():
        with pytest.raises(Refused) as err:
            now.sessions[c].on_unmask(m["survivors"], m["dropped"], m["ciphertexts"], old)
        assert err.value.reason == "too-few-signatures"
    # nothing was revealed: the colluder's shares alone rebuild no secret
    b, s = colluder_holds(now, server, COLLUDER)[TARGET]
    assert learned(now, masked, {COLLUDER: b}, {COLLUDER: s}, 4) is None


# --------------------------------------------------------------------------- (a) equivocation


def test_a_different_survivor_sets_to_different_clients_are_refused():
    everyone, without = set(range(N)), set(range(N)) - {TARGET}
    # unsigned, at the lowest threshold a client accepts (t = 3 of 5): telling 0 and the
    # target that the target survived (b-shares) and 1 and 2 that it dropped (s-shares), with
    # one colluder holding both kinds, gives the server the target's input
    plain = Cohort(signed=False)
    server, masked = through_masking(plain, dropout=0.5)
    told = {0: everyone, TARGET: everyone, 1: without, 2: without}
    b, s, refusals = equivocate(plain, server, told)
    assert not refusals
    np.testing.assert_allclose(learned(plain, masked, b, s, 3), plain.inputs[TARGET],
                               atol=1e-4)

    # signed: that threshold is refused up front ...
    cohort = Cohort()
    with pytest.raises(Refused) as err:
        through_masking_strict(cohort, dropout=0.5)
    assert err.value.reason == "threshold-too-low"
    # ... and at t = 4 the same equivocation finds every client refusing to reveal
    cohort = Cohort()
    server, masked = through_masking(cohort)
    b, s, refusals = equivocate(cohort, server, told)
    assert reasons(refusals) == {c: "too-few-signatures" for c in told}, refusals
    assert learned(cohort, masked, b, s, 4) is None


def through_masking_strict(cohort: Cohort, dropout: float):
    """through_masking, but a client's refusal of the peers step propagates."""
    server = ServerSession(list(range(N)), cohort.ctx, neighbours=0, dropout=dropout,
                           ring=RING)
    for c, k in cohort.keys.items():
        server.add_keys(c, k["c_pk"], k["s_pk"], k.get("sig"))
    for c, m in server.fix_graph().items():
        cohort.sessions[c].on_peers({v: tuple(p) for v, p in m["peers"].items()}, m["t"],
                                    m["ring"])


def test_a_a_client_asked_to_sign_two_survivor_sets_refuses_the_second():
    cohort = Cohort()
    through_masking(cohort)
    cohort.sessions[0].sign_survivors(range(N))
    with pytest.raises(Refused) as err:
        cohort.sessions[0].sign_survivors([0, 1, 2, 3])
    assert err.value.reason == "second-survivor-set"


# --------------------------------------------------------------------------- (b) claimed dropped


def test_b_a_live_client_claimed_dropped_is_refused():
    everyone, without = set(range(N)), set(range(N)) - {TARGET}
    cohort = Cohort()
    server, masked = through_masking(cohort)
    # the target's input is in; the server tells it and 0, 1 that it dropped (to collect
    # s-shares), 2 that it survived (b-shares); a colluder signs and holds both
    told = {TARGET: without, 0: without, 1: without, 2: everyone}
    b, s, refusals = equivocate(cohort, server, told)
    assert reasons(refusals) == {TARGET: "survivors-omit-self", 0: "too-few-signatures",
                                 1: "too-few-signatures", 2: "too-few-signatures"}, refusals
    assert learned(cohort, masked, b, s, 4) is None
    # an unmask request that differs from the set a client signed is refused too
    cohort = Cohort()
    server, masked = through_masking(cohort)
    asks = server.unmask_requests()
    for c in asks:
        server.add_survivor_signature(c, cohort.sessions[c].sign_survivors(everyone))
    lie = local_view(server, 0, without)
    with pytest.raises(Refused) as err:
        cohort.sessions[0].on_unmask(lie["survivors"], lie["dropped"], lie["ciphertexts"],
                                     server.signatures_for(0))
    assert err.value.reason == "survivors-mismatch"


# --------------------------------------------------------------------------- (e) both kinds


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_e_both_kinds_of_share_of_one_peer_are_never_revealed(signed):
    cohort = Cohort(signed=signed)
    server, masked = through_masking(cohort)
    asks = server.unmask_requests()
    if signed:
        for c in asks:
            server.add_survivor_signature(c, cohort.sessions[c].sign_survivors(range(N)))
    sigs = {c: server.signatures_for(c) if signed else None for c in asks}
    # the target listed as survivor and as dropped in one request
    b, s = {}, {}
    for c in (0, 1, 2):
        ask = dict(asks[c])
        ask["dropped"] = [TARGET]
        with pytest.raises(Refused) as err:
            cohort.sessions[c].on_unmask(ask["survivors"], ask["dropped"], ask["ciphertexts"],
                                         sigs[c])
        assert err.value.reason == "both-share-kinds"
    # then honestly (b-shares), and again for the s-shares: refused, the round is revealed
    for c in (0, 1, 2):
        m = asks[c]
        b[c] = cohort.sessions[c].on_unmask(m["survivors"], m["dropped"], m["ciphertexts"],
                                            sigs[c])["b"][TARGET]
        lie = local_view(server, c, set(range(N)) - {TARGET})
        with pytest.raises(SecAggError, match="already revealed"):
            cohort.sessions[c].on_unmask(lie["survivors"], lie["dropped"], lie["ciphertexts"],
                                         sigs[c])
    b[COLLUDER], s[COLLUDER] = colluder_holds(cohort, server, COLLUDER)[TARGET]
    assert learned(cohort, masked, b, s, 4) is None


# --------------------------------------------------------------------------- real processes


def test_a_curve_federation_with_signed_keys_completes(tmp_path):
    """Real broker, server and two client nodes on loopback under CURVE, secure aggregation
    on: every node signs its clients' keys (RUN/keys/node-I.sign), every client verifies its
    neighbours' and the survivor set's signatures, and the rounds aggregate."""
    from fedbus.broker.wire import decode
    from fedbus.record.msglog import read_log
    from tests.helpers import SMALL, fedbus, merged, metrics, run_federation

    sections = merged(SMALL, algorithm={"name": "fedproto"},
                      federation={"clients": 6, "rounds": 2},
                      bus={"curve": True},
                      privacy={"secure_aggregation": True, "secagg_timeout_s": 120.0})
    run, summary = run_federation(tmp_path, sections)
    assert summary["rounds_completed"] == 2
    assert sorted(p.name for p in (run / "keys").glob("*.sign")) == ["node-0.sign",
                                                                     "node-1.sign"]
    for r in metrics(run):
        assert r["secagg"].get("failed") is None, r["secagg"]
        assert r["secagg"]["survivors"] == 6
    steps = {}
    for rec in read_log(run):
        if rec.direction != "in" or len(rec.frames) < 2:
            continue
        msg = decode(rec.frames, max_frame=max(len(f) for f in rec.frames) + 1)
        if msg.kind == "secagg":
            steps.setdefault(msg.body["step"], []).append(msg.body)
    assert all(len(body["sig"]) == 64 for body in steps["keys"])
    assert len(steps["signed"]) == 12 and len(steps["reveal"]) == 12
    logs = [line for p in run.rglob("*.log") for line in p.read_text().splitlines()]
    assert logs
    assert not [line for line in logs if "secure aggregation" in line and (
        "refused" in line or "without a signing identity" in line)]
    # the survivors/signed steps replay like the rest (the server verifies nothing)
    out = fedbus("replay", str(run), timeout=240)
    assert "replay identical" in out.stdout, out.stdout + out.stderr


# --------------------------------------------------------------------------- identities on disk


def test_keygen_writes_a_signing_key_that_nodes_load_and_a_forged_list_is_refused(tmp_path):
    from fedbus.node.privacy.identity import IdentityError, advert_message, load_identity
    from tests.helpers import fedbus

    d = tmp_path / "keys"
    out = fedbus("keygen", "node-a", "--clients", "0-2", "--dir", str(d)).stdout
    assert "node-a.sign" in out and (d / "node-a.sign_secret").stat().st_mode & 0o077 == 0
    fedbus("keygen", "node-b", "--clients", "3-5", "--dir", str(d))
    fedbus("keygen", "relay-a", "--clients", "0-5", "--dir", str(d), "--no-signing-key")
    assert not (d / "relay-a.sign").exists()
    a, b = load_identity(d, "node-a"), load_identity(d, "node-b")
    msg = advert_message(b"ctx", 4, bytes(32), bytes(32))
    assert a.verify(4, b.sign(msg), msg) is None  # c4 is node-b's
    assert "does not verify" in a.verify(1, b.sign(msg), msg)  # node-b cannot sign for c1
    assert "no verification key" in a.verify(9, b.sign(msg), msg)
    assert load_identity(d, "relay-a") is None  # no signing key: unsigned, stated at start
    # a .sign that claims clients its certificate does not list is refused at load
    text = (d / "node-b.sign").read_text()
    (d / "node-b.sign").write_text(text.replace("c3-5", "c0-5"))
    with pytest.raises(IdentityError, match="its certificate"):
        load_identity(d, "node-a")


# --------------------------------------------------------------------------- the engine's steps


def test_the_engines_signed_round_gives_the_plain_state_when_a_survivor_never_signs():
    """The engine's secure steps with signing clients (SecureClient, one node's identity for
    c0-5): keys signed, the survivors/signed steps, signatures forwarded with each unmask;
    c2 never answers `survivors`, so the server sends the unmask requests at the phase's
    deadline (simulated clock) with five signatures each, t = 5 of 6: enough, and the round
    gives the plain run's global state."""
    from tests.test_secure_aggregation import (
        Clients,
        _config,
        _engine,
        _global,
        _record,
        _update,
        plain_round,
    )

    cfg, plain_cfg = _config("fedproto", True), _config("fedproto", False)
    (engine, tasks), (plain, p_tasks) = _engine(cfg), _engine(plain_cfg)
    node = Ed25519PrivateKey.generate()
    cl = Clients(engine, cfg)
    cl.secure.identity = Identity.from_keys(node, {c: node.public_key() for c in range(6)})
    now = 1.0

    def steps(outs, step):
        return [o for o in outs if o.kind == "secagg" and o.body["step"] == step]

    outs = []
    for t in tasks:
        outs += cl.send("secagg", t.dst, cl.secure.begin(t.dst, t.body), t.round, now)
    keys = [m.body for m in cl.sent if m.body.get("step") == "keys"]
    assert len(keys) == 6 and all(len(k["sig"]) == 64 for k in keys)
    masking = []
    for o in steps(outs, "peers"):
        assert all(len(pk) == 3 for pk in o.body["peers"].values())  # signatures forwarded
        masking += cl.send("secagg", o.dst, cl.secure.on_peers(o.dst, o.body), o.round, now)
    closing = []
    for o in steps(masking, "masking"):
        c = int(o.dst[1:])
        cl.secure.ready(o.dst, _update(engine, tasks[c], c))
        closing += cl.send("update", o.dst, cl.secure.on_masking(o.dst, o.body), o.round, now)
    asked = steps(closing, "survivors")
    assert sorted(o.dst for o in asked) == [f"c{c}" for c in range(6)]
    assert not steps(closing, "unmask")  # nothing revealed before the survivors sign
    unmasks = []
    for o in asked:
        if o.dst != "c2":
            unmasks += cl.send("secagg", o.dst, cl.secure.on_survivors(o.dst, o.body),
                               o.round, now)
    assert not steps(unmasks, "unmask")  # c2's signature is still awaited
    unmasks = steps(engine.on_tick(now + cfg.privacy.secagg_timeout_s + 0.1), "unmask")
    assert len(unmasks) == 6 and all(sorted(o.body["signatures"]) ==
                                     [f"c{c}" for c in range(6) if c != 2] for o in unmasks)
    later = now + cfg.privacy.secagg_timeout_s + 0.2
    for o in unmasks:
        if o.dst == "c2":  # it never signed: it refuses to reveal, and is not needed
            with pytest.raises(Refused) as err:
                cl.secure.on_unmask(o.dst, o.body)
            assert err.value.reason == "survivors-unsigned"
            continue
        cl.send("secagg", o.dst, cl.secure.on_unmask(o.dst, o.body), o.round, later)
    engine.on_tick(later + cfg.privacy.secagg_timeout_s + 0.1)  # c2's reveal never comes
    plain_round(plain, p_tasks)
    rec = _record(engine)
    assert rec["secagg"].get("failed") is None and rec["secagg"]["survivors"] == 6
    got, want = _global(engine), _global(plain)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=rec["secagg"]["quant_bound"])
        assert np.abs(want[k]).max() > 10 * rec["secagg"]["quant_bound"]


def test_a_threshold_signing_clients_refuse_fails_the_round_at_once_and_fedbus_run_says_so(
        tmp_path):
    from fedbus.node.config import build_config
    from tests.helpers import SMALL, fedbus, merged
    from tests.test_secure_aggregation import Clients, _engine, _record

    cfg = build_config({
        "federation": {"clients": 6, "rounds": 2, "seed": 3},
        "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": "mlp"},
        "algorithm": {"name": "fedproto"},
        "privacy": {"secure_aggregation": True, "secagg_dropout": 0.5}})
    engine, tasks = _engine(cfg)
    cl = Clients(engine, cfg)
    node = Ed25519PrivateKey.generate()
    cl.secure.identity = Identity.from_keys(node, {c: node.public_key() for c in range(6)})
    outs = []
    for t in tasks:
        outs += cl.send("secagg", t.dst, cl.secure.begin(t.dst, t.body), t.round, 1.0)
    assert not [o for o in outs if o.kind == "secagg"]  # no peers step to refuse
    assert "below 1/3" in _record(engine)["secagg"]["failed"]
    # a local CURVE run would write signing keys: refused before anything starts
    from fedbus.bench.common import write_toml

    path = write_toml(tmp_path / "c.toml", merged(
        SMALL, algorithm={"name": "fedproto"}, bus={"curve": True},
        privacy={"secure_aggregation": True, "secagg_dropout": 0.5}))
    out = fedbus("run", str(path), "--out", str(tmp_path / "run"), "--quiet", check=False)
    assert out.returncode == 2 and "secagg_dropout below 1/3" in out.stderr, out.stderr

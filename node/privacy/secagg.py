"""The cryptographic core of secure aggregation: the server learns the sum of
the clients' vectors and nothing else about any one of them. Pure: no
networking, no torch; the engine and the client host carry the messages.

Protocol (SecAgg+, Bell et al. CCS 2020; Bonawitz et al. CCS 2017 where
SecAgg+ is silent), one round, one ``context`` (run + round + task) bound into
every KDF info and every AEAD associated data:

1. Keys. Each client u makes two X25519 key pairs: c (encrypts its shares to
   its peers) and s (pairwise masks; its private key is HKDF of a random
   16-byte ``s_seed`` so that one 16-byte Shamir secret carries it) and sends
   both public keys.
   The server refuses keys of low order, a pair of equal keys, or a key another
   client sent (blaming the sender: ServerSession.add_keys).
2. Graph. The server links the key senders in a random k-regular Harary
   graph (SecAgg+; complete when the cohort is small) drawn from its secret
   graph key and the context (never from a seed the clients know), and sends
   each client its neighbours' public keys and its own (which the client checks
   came back unchanged) and the threshold t. A client refuses a neighbour whose
   keys are of low order or repeat another listed key, and aborts if fewer than
   t - 1 acceptable neighbours remain.
3. Shares. u draws a self-mask seed ``b_seed``, Shamir-splits ``b_seed`` and
   ``s_seed`` t-of-m among holders = sorted(neighbours + u) (share index =
   position + 1), both in one call over the prime field of
   fedbus.node.privacy.shamir (a share: SHARE_BYTES, field elements < p; a revealed
   or received share of another size or outside the field is refused, naming its
   sender), and sends each neighbour it accepts its pair of shares through
   the server, encrypted with AES-GCM under HKDF(X25519(c_u, c_v)); the
   associated data names (context, u, v). The set of share senders is U2; u and
   v are linked (mask with, and hold shares of, each other) when each sent the
   other shares.
4. Input. u encodes x in fixed point in Z_{2^ring_bits} and sends
   y = x + PRG(b_u) + sum_v sign(u, v) PRG(s_uv), v over its neighbours in U2
   (sign +1 if u < v), PRG = ChaCha20 keystream, s_uv = HKDF(X25519(s_u, s_v)).
   Pairwise terms cancel between two survivors. A relay may pre-add the masked
   vectors of its members (``add_packed``). U2 reaches the clients through
   ``ServerSession.close_shares`` -> ``ClientSession.mask(x, share_senders)``,
   which refuses fewer than t - 1 of them (Bonawitz's check on U2: else x +
   PRG(b_u) alone would reach a server that can then ask for b_u's shares);
   without that step a client masks with all its neighbours, and the server
   refuses (at ``unmask_requests``) a round where a survivor's neighbour sent
   keys but no shares, since that pairwise mask could never be removed.
5. Unmask. With the survivors U3 (input senders) fixed, each survivor reveals,
   for each peer it holds shares of, the b-share of a survivor or the s-share
   of a dropped client, never both for one peer.
6. The server rebuilds b_seed of every survivor and s_seed of every dropped
   client from t shares each (all secrets whose t shares sit at the same indices in
   one product with cached Lagrange weights: with no holder dropout, every one of
   them), removes PRG(b_u) and the dropped clients' leftover
   pairwise terms, and decodes the sum. A secret short of t shares fails the
   whole round (``SecAggError``) before anything is unmasked. A sum outside
   what the inputs can add up to (a wrong share gives a mask spread over the
   ring) makes the server check every secret with spare shares for consistency
   and leave out the one holder whose removal explains it (``blamed``); a sum
   out of bounds with consistent shares (a malformed masked input) fails. A sum
   in bounds has its spare shares checked too, and a holder whose wrong shares it
   did not need is blamed all the same.

Threat model: an honest-but-curious server and relays (they follow the
protocol and read everything they are sent); clients are honest. Hidden from
them: each client's vector (a masked vector, alone or in any partial sum, is
uniform in the ring) and every share (end-to-end encrypted between peers).
Not hidden: the sum of the survivors' inputs (its purpose; a one-client sum is
that client's input), who sent keys, shares and inputs and who dropped, the
vector length, timing and sizes. Collusion: the server and fewer than t of a
client's holders learn nothing of it; in SecAgg+ that holds with high
probability over the random graph for a bounded fraction of colluding clients.
A server (or relay, or broker) that lies: with a signing identity
(fedbus.node.privacy.identity) each client's key advertisement is signed over
(context, client, c_pk, s_pk) and verified by every neighbour (substituted or
replayed keys are refused: Refused reasons unsigned-keys, bad-key-signature);
before revealing, each survivor signs the survivor set it was told and reveals
only if t of its holders signed that same set (Bonawitz's consistency check:
sign_survivors, on_unmask's signatures); t must be at least active_threshold(m),
so a server colluding with c of a client's m holders gets both kinds of its
shares only if m + c >= 2t. Without an identity, only the honest-but-curious
guarantee holds (SECURITY.md 3a). Not covered: a malicious client
can still poison the sum within the server's bounds on it, send a malformed
masked input (the round fails, its sender unknown), withhold its reveal, or
lie in its shares when no spare shares expose it (t of t revealed), and two
colluding liars holding shares of one secret are not told apart; what the sum
itself reveals (use differential privacy for that).

Cost, per client with k neighbours and a vector of L elements: 2 X25519 key
generations, 2k key agreements, one Shamir split of both seeds t-of-(k+1) (one
[k+1, t] x [t, 12] product mod p, ~0.06 ms at t = 22), k AES-GCM encryptions, k+1
ChaCha20 streams of 8L bytes; upload 64 B of keys, k x 76 B of ciphertexts, L x
ring_bits/8 B of masked vector, at most (k+1) x 24 B of shares. Server: one product
per set of share indices rebuilding all the seeds (~10 ms for 1,000 seeds at t = 22,
where pycryptodome's GF(2^128) Shamir took ~28 ms a seed), one ChaCha20 stream of
8L bytes per survivor, and per dropped client one key agreement and one stream per
surviving neighbour. Dropouts cost O(dropped x k x L); no dropout, O(n x L).
Measured on 2 shared CPU cores, L = 6500: k = 20 (100 clients, t = 15), a
client's on_peers 3-6 ms (14 ms with pycryptodome), mask 1.5-3 ms, and the
server's unmask of 100 clients 8-42 ms (1.9 s before), with or without 5
dropouts; k = 30 (1,000 clients, t = 22), on_peers 5 ms (26 ms before) and the
unmask of 1,000 clients 94 ms (31 s before).
"""
from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedbus.node.privacy import shamir

__all__ = [
    "REASONS",
    "ClientSession",
    "Refused",
    "RingParams",
    "SecAggError",
    "ServerSession",
    "active_threshold",
    "add_packed",
    "decode",
    "encode",
    "encode_integers",
    "low_order",
    "neighbour_count",
    "neighbour_graph",
    "pack",
    "quantisation_bound",
    "threshold",
    "unpack",
]

KEY_BYTES = 32
SIGNATURE_BYTES = 64  # Ed25519 (fedbus.node.privacy.identity)
SEED_BYTES = 16
SHARE_BYTES = shamir.SHARE_BYTES  # one seed's share: CHUNKS field elements
NONCE_BYTES = 12
# nonce + AES-GCM of (b-share, s-share) + tag
CIPHERTEXT_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + 16
RING_BITS = (32, 40, 48, 56, 64)
GRAPH_KEY_BYTES = 32

# The u-coordinates (mod p, RFC 7748 decoding) of the X25519 points of small order: the
# shared secret with any of them is all-zero whatever the private key (X25519 clamps
# scalars to multiples of 8), so a peer advertising one would make every key agreement
# with it fail, or, where a library let the zero through, a key everyone can compute.
_P25519 = 2**255 - 19
_LOW_ORDER_U = frozenset({0, 1, _P25519 - 1} | {
    int.from_bytes(bytes.fromhex(h), "little") for h in (
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
    "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157")})

# KDF labels. Contexts are appended without a separator, which is unambiguous
# because no label is a prefix of another.
_S_KEY_INFO = b"fedbus-secagg s key"
_PAIRWISE_INFO = b"fedbus-secagg pairwise"
_SHARE_KEY_INFO = b"fedbus-secagg share key"
_PRG_SELF_INFO = b"fedbus-secagg prg self"
_PRG_PAIR_INFO = b"fedbus-secagg prg pair"
_SHARE_AAD = b"fedbus-secagg share"
_GRAPH_INFO = b"fedbus-secagg graph"


class SecAggError(Exception):
    """Every refusal and failure of secure aggregation (one-line message)."""


class SpoiledSum(SecAggError):
    """The unmasked sum is out of bounds and every revealed share is consistent: some
    client's masked input spoiled it, and the sum cannot tell whose
    (fedbus.node.privacy.culprit looks for it across rounds)."""


class Refused(SecAggError):
    """A client's refusal of what a server (or whoever carries its messages) asked, under a
    named reason (one of REASONS), which leads the message and is logged on its own."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason


#: the named reasons of a client's refusals against a lying server (SECURITY.md 3a)
REASONS = (
    "unsigned-keys",         # a neighbour's key advertisement has no signature
    "bad-key-signature",     # ... one that does not verify: substituted, or another round's
    "survivors-omit-self",   # asked to sign a survivor set without itself, having masked
    "second-survivor-set",   # asked to sign a second, different survivor set in one round
    "survivors-unsigned",    # asked to reveal before signing the survivor set
    "survivors-mismatch",    # an unmask request that differs from the survivor set signed
    "too-few-signatures",    # fewer than t holders' valid signatures on that same set
    "threshold-too-low",     # t below active_threshold(holders)
    "both-share-kinds",      # asked for a peer's b-share and its s-share in one round
)


# --------------------------------------------------------------------------- helpers


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def _s_private_key(s_seed: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(_hkdf(s_seed, _S_KEY_INFO))


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def _exchange(private: X25519PrivateKey, public: bytes, peer: int) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as e:  # a low-order point gives an all-zero secret
        raise SecAggError(f"key agreement with client {peer} failed: {e}") from None


def low_order(public: bytes) -> bool:
    """Whether a 32-byte X25519 public key is a point of small order (any encoding of it:
    the top bit is ignored and the value taken mod p, as X25519 decodes it)."""
    u = int.from_bytes(public, "little") & ((1 << 255) - 1)
    return u % _P25519 in _LOW_ORDER_U


def _key_problem(c_pk: bytes, s_pk: bytes) -> str | None:
    """Why a pair of advertised public keys is unusable, or None."""
    for name, pk in (("c_pk", c_pk), ("s_pk", s_pk)):
        if low_order(pk):
            return f"its {name} is a low-order X25519 point"
    if c_pk == s_pk:
        return "its c_pk and s_pk are the same key"
    return None


def _pairwise_seed(s_sk: X25519PrivateKey, s_pk_peer: bytes, peer: int, context: bytes) -> bytes:
    return _hkdf(_exchange(s_sk, s_pk_peer, peer), _PAIRWISE_INFO + context)


def _share_aad(sender: int, recipient: int, context: bytes) -> bytes:
    # decimal ids between separators cannot run into each other or the context
    return _SHARE_AAD + b"|%d|%d|" % (sender, recipient) + context


def _prg(seed: bytes, info: bytes, length: int, ring_bits: int) -> np.ndarray:
    key = _hkdf(seed, info)
    # a fresh key per (seed, label, context), so the all-zero nonce is never reused
    enc = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    out = np.frombuffer(enc.update(bytes(8 * length)), dtype="<u8").astype(np.uint64)
    return _reduce(out, ring_bits)


def _add_prg(acc: np.ndarray, seed: bytes, info: bytes, sign: int) -> None:
    """acc += sign x _prg(seed, info, len(acc), .) mod 2^64, the stream read in place: the
    same values as _prg's before its reduction, which the caller does once at the end
    (2^ring_bits divides 2^64, so reducing each term first changes nothing)."""
    enc = Cipher(algorithms.ChaCha20(_hkdf(seed, info), bytes(16)), mode=None).encryptor()
    _add_signed(acc, np.frombuffer(enc.update(bytes(8 * len(acc))), dtype="<u8"), sign)


def _reduce(values: np.ndarray, ring_bits: int) -> np.ndarray:
    if ring_bits < 64:
        values &= np.uint64((1 << ring_bits) - 1)
    return values


def _sign(u: int, v: int) -> int:
    return 1 if u < v else -1


def _add_signed(acc: np.ndarray, term: np.ndarray, sign: int) -> None:
    # uint64 arithmetic wraps mod 2^64, and 2^ring_bits divides 2^64
    with np.errstate(over="ignore"):
        if sign > 0:
            np.add(acc, term, out=acc)
        else:
            np.subtract(acc, term, out=acc)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _client_id(x: Any, what: str = "client id") -> int:
    if not _is_int(x):
        raise SecAggError(f"{what} must be an int, got {type(x).__name__}")
    return int(x)


def _bytes(x: Any, length: int, what: str) -> bytes:
    if not isinstance(x, bytes):
        raise SecAggError(f"{what} must be bytes, got {type(x).__name__}")
    if len(x) != length:
        raise SecAggError(f"{what} must be {length} bytes, got {len(x)}")
    return x


def _mapping(x: Any, what: str) -> Mapping:
    if not isinstance(x, Mapping):
        raise SecAggError(f"{what} must be a mapping, got {type(x).__name__}")
    return x


def _id_list(x: Any, what: str) -> list[int]:
    if not isinstance(x, (list, tuple)):
        raise SecAggError(f"{what} must be a list of client ids, got {type(x).__name__}")
    ids = [_client_id(v, f"{what} entry") for v in x]
    if len(set(ids)) != len(ids):
        raise SecAggError(f"{what} lists a client twice")
    return ids


def _context(x: Any) -> bytes:
    if not isinstance(x, bytes) or not x:
        raise SecAggError("context must be non-empty bytes")
    return x


def _revealed(u: int, shares: Any, kind: str, allowed: set[int], which: str
              ) -> dict[int, bytes]:
    """Client u's revealed shares of one kind, each of a client in `allowed`."""
    out: dict[int, bytes] = {}
    for v, share in _mapping(shares, f"{kind} shares").items():
        v = _client_id(v, f"{kind} share owner")
        if v not in allowed:
            raise SecAggError(f"client {u} revealed a {kind}-share of {v}, not {which} "
                              f"client it holds shares of")
        out[v] = _bytes(share, SHARE_BYTES, f"client {u}'s {kind}-share of {v}")
    outside = _outside_field(out.values())
    if outside is not None:
        v = list(out)[outside]
        raise SecAggError(f"client {u}'s {kind}-share of {v} holds a value outside the field")
    return out


def _outside_field(shares: Iterable[bytes]) -> int | None:
    """The position of the first share (SHARE_BYTES each) holding a value >= p, or None."""
    data = b"".join(shares)
    if not data:
        return None
    bad = (np.frombuffer(data, dtype="<u4").reshape(-1, shamir.CHUNKS) >= shamir.P).any(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


def _field_shares(shares: list[bytes]) -> np.ndarray:
    """[len(shares), CHUNKS] int64 from share bytes already checked to be in the field."""
    return np.frombuffer(b"".join(shares), dtype="<u4").reshape(-1, shamir.CHUNKS) \
        .astype(np.int64)


def _holders(client: int, neighbours: Iterable[int]) -> list[int]:
    return sorted({client, *neighbours})


# --------------------------------------------------------------------------- ring


@dataclass(frozen=True)
class RingParams:
    """Fixed-point encoding: values clipped to [-range, range], scaled by
    2^frac_bits, rounded, two's complement in Z_{2^ring_bits}."""

    range: float
    frac_bits: int
    ring_bits: int

    def __post_init__(self) -> None:
        if not isinstance(self.range, (int, float)) or isinstance(self.range, bool) \
                or not math.isfinite(self.range) or self.range <= 0:
            raise SecAggError(f"ring range must be a finite number > 0, got {self.range!r}")
        if not _is_int(self.frac_bits) or not 0 <= self.frac_bits <= 62:
            raise SecAggError(f"frac_bits must be an int in 0..62, got {self.frac_bits!r}")
        if not _is_int(self.ring_bits) or self.ring_bits not in RING_BITS:
            raise SecAggError(f"ring_bits must be one of {RING_BITS}, got {self.ring_bits!r}")
        if _max_clients(float(self.range), int(self.frac_bits), int(self.ring_bits)) < 1:
            raise SecAggError(f"one value of range {self.range} with {self.frac_bits} fractional "
                              f"bits does not fit a {self.ring_bits}-bit ring")

    @classmethod
    def for_cohort(cls, range: float, frac_bits: int, clients: int) -> RingParams:
        """The smallest ring_bits (multiple of 8, 32..64) such that
        clients * range * 2^frac_bits < 2^(ring_bits-1); SecAggError if 64 is not enough."""
        if not _is_int(clients) or clients < 1:
            raise SecAggError(f"clients must be an int >= 1, got {clients!r}")
        probe = cls(range, frac_bits, 64)  # validates range and frac_bits
        for bits in RING_BITS:
            if _max_clients(float(probe.range), int(frac_bits), bits) >= clients:
                return cls(range, frac_bits, bits)
        raise SecAggError(f"{clients} clients of range {range} with {frac_bits} fractional bits "
                          f"overflow a 64-bit ring; lower range or frac_bits")

    def max_clients(self) -> int:
        """How many clients' sums this ring holds without wrapping."""
        return _max_clients(float(self.range), self.frac_bits, self.ring_bits)

    def to_dict(self) -> dict:
        return {"range": float(self.range), "frac_bits": int(self.frac_bits),
                "ring_bits": int(self.ring_bits)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RingParams:
        d = _mapping(d, "ring")
        if set(d) != {"range", "frac_bits", "ring_bits"}:
            raise SecAggError(f"ring must have keys range, frac_bits, ring_bits, got {sorted(d)}")
        return cls(d["range"], d["frac_bits"], d["ring_bits"])


def _max_clients(range_: float, frac_bits: int, ring_bits: int) -> int:
    # The largest encoded magnitude is the rounded range (<= its ceiling); exact
    # arithmetic so that no float rounding lets a sum reach 2^(ring_bits-1).
    top = math.ceil(Fraction(range_) * 2**frac_bits)  # >= 1 since range > 0
    return (2 ** (ring_bits - 1) - 1) // top


def encode(values: np.ndarray, ring: RingParams) -> tuple[np.ndarray, int]:
    """float [L] -> (uint64 [L] in Z_{2^ring_bits}, number of clipped elements)."""
    x = np.asarray(values)
    if x.ndim != 1 or x.dtype.kind not in "fiu":
        raise SecAggError(f"encode takes a 1-D real array, got {x.dtype} of shape {x.shape}")
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise SecAggError("encode: values contain NaN or inf")
    clipped = int(np.count_nonzero(np.abs(x) > ring.range))
    # scaling by a power of two is exact, so the only error is the rounding (<= half a unit)
    q = np.rint(np.clip(x, -ring.range, ring.range) * float(2**ring.frac_bits)).astype(np.int64)
    return _reduce(q.view(np.uint64).copy(), ring.ring_bits), clipped


def encode_integers(values: np.ndarray, ring: RingParams) -> tuple[np.ndarray, int]:
    """int [L] -> (uint64 [L] in Z_{2^ring_bits}, 0): two's complement mod 2^ring_bits, no
    clipping and no scaling (ring.frac_bits is not applied: the caller scaled already)."""
    x = np.asarray(values)
    if x.ndim != 1 or x.dtype.kind not in "iu":
        raise SecAggError(f"encode_integers takes a 1-D integer array, got {x.dtype} of "
                          f"shape {x.shape}")
    return _reduce(x.astype(np.int64).view(np.uint64).copy(), ring.ring_bits), 0


def decode(summed: np.ndarray, ring: RingParams) -> np.ndarray:
    """uint64 [L] in Z_{2^ring_bits} -> float64 [L] (two's complement, / 2^frac_bits)."""
    v = np.asarray(summed)
    if v.ndim != 1 or v.dtype != np.uint64:
        raise SecAggError(f"decode takes a 1-D uint64 array, got {v.dtype} of shape {v.shape}")
    bits = ring.ring_bits
    if bits == 64:
        signed = v.view(np.int64)
    else:
        v = _reduce(v.copy(), bits)
        signed = v.astype(np.int64)
        signed[v >= np.uint64(1 << (bits - 1))] -= np.int64(1 << bits)
    return signed.astype(np.float64) / float(2**ring.frac_bits)


def _check_ring_bits(ring_bits: Any) -> int:
    if not _is_int(ring_bits) or ring_bits not in RING_BITS:
        raise SecAggError(f"ring_bits must be one of {RING_BITS}, got {ring_bits!r}")
    return int(ring_bits)


def pack(ring_values: np.ndarray, ring_bits: int) -> np.ndarray:
    """uint64 [L] -> uint8 [L, ring_bits // 8], the low bytes little-endian."""
    bits = _check_ring_bits(ring_bits)
    v = np.asarray(ring_values)
    if v.ndim != 1 or v.dtype != np.uint64:
        raise SecAggError(f"pack takes a 1-D uint64 array, got {v.dtype} of shape {v.shape}")
    raw = v.astype("<u8").view(np.uint8).reshape(len(v), 8)
    return np.ascontiguousarray(raw[:, : bits // 8])


def unpack(packed: np.ndarray, ring_bits: int) -> np.ndarray:
    """uint8 [L, ring_bits // 8] -> uint64 [L]."""
    bits = _check_ring_bits(ring_bits)
    width = bits // 8
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.ndim != 2 \
            or packed.shape[1] != width:
        got = (f"{packed.dtype} of shape {packed.shape}" if isinstance(packed, np.ndarray)
               else type(packed).__name__)
        raise SecAggError(f"a packed vector must be uint8 [L, {width}], got {got}")
    raw = np.zeros((packed.shape[0], 8), dtype=np.uint8)
    raw[:, :width] = packed
    return raw.view("<u8").reshape(-1).astype(np.uint64)


def add_packed(a: np.ndarray | None, b: np.ndarray, ring_bits: int) -> np.ndarray:
    """The packed sum a + b mod 2^ring_bits (a None starts a sum: a copy of b)."""
    vb = unpack(b, ring_bits)
    if a is None:
        return pack(vb, ring_bits)
    va = unpack(a, ring_bits)
    if va.shape != vb.shape:
        raise SecAggError(f"cannot add packed vectors of {va.shape[0]} and {vb.shape[0]} elements")
    _add_signed(va, vb, 1)
    return pack(_reduce(va, ring_bits), ring_bits)


def quantisation_bound(ring: RingParams, clients: int) -> float:
    """Worst-case absolute error of a decoded sum of `clients` inputs, clipping aside."""
    return clients * 2.0 ** -(ring.frac_bits + 1)


# --------------------------------------------------------------------------- graph


def neighbour_count(cohort: int, asked: int = 0) -> int:
    """asked > 0: min(asked, cohort-1); 0 (auto): cohort-1 up to 20 clients, else the
    smallest even number >= 3 log2(cohort) (SecAgg+'s O(log n)), capped at cohort-1."""
    if not _is_int(cohort) or cohort < 1:
        raise SecAggError(f"cohort must be an int >= 1, got {cohort!r}")
    if not _is_int(asked) or asked < 0:
        raise SecAggError(f"neighbours must be an int >= 0, got {asked!r}")
    if asked > 0:
        return min(int(asked), cohort - 1)
    if cohort <= 20:
        return cohort - 1
    k = math.ceil(3 * math.log2(cohort))
    return min(k + (k % 2), cohort - 1)


def threshold(holders: int, dropout: float) -> int:
    """t = max(holders // 2 + 1, ceil((1 - dropout) * holders)), at most holders."""
    if not _is_int(holders) or holders < 1:
        raise SecAggError(f"holders must be an int >= 1, got {holders!r}")
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) \
            or not 0 <= dropout < 1:
        raise SecAggError(f"dropout must be a number in [0, 1), got {dropout!r}")
    # the tolerance keeps 0.7 * 10 = 7.000000000000001 from rounding up to 8
    need = math.ceil((1 - dropout) * holders - 1e-9)
    return min(holders, max(holders // 2 + 1, need))


def active_threshold(holders: int) -> int:
    """The least t a signing client accepts: floor(2m/3) + 1 (Bonawitz et al.'s active
    setting). Each honest holder reveals one kind of share of a peer, so a server colluding
    with c of its m holders gets both kinds (its input) only if m + c >= 2t: with this t,
    only if c >= m/3 or so. threshold() with dropout < 1/3 is never below it."""
    return 2 * holders // 3 + 1


def neighbour_graph(clients: list[int], k: int, key: bytes) -> dict[int, list[int]]:
    """SecAgg+'s Harary graph H(k, n) over a random relabelling of the clients:
    each is linked to the k/2 next on either side of a ring permuted by a ChaCha20
    keystream under `key` (32 secret bytes: Bell et al.'s bound on colluding
    neighbours assumes the graph is drawn independently of the colluders, so no
    client may be able to compute it). An odd k is rounded up to even; complete
    when k >= n-1."""
    ids = sorted(_id_list(list(clients), "clients"))
    if not _is_int(k) or k < 0:
        raise SecAggError(f"k must be an int >= 0, got {k!r}")
    key = _bytes(key, GRAPH_KEY_BYTES, "graph key")
    n = len(ids)
    k = int(k) + int(k) % 2
    if k >= n - 1:
        return {c: [d for d in ids if d != c] for c in ids}
    order = [ids[i] for i in _permutation(n, key)]
    graph: dict[int, set[int]] = {c: set() for c in ids}
    for pos, c in enumerate(order):
        for step in range(1, k // 2 + 1):
            d = order[(pos + step) % n]
            graph[c].add(d)
            graph[d].add(c)
    return {c: sorted(graph[c]) for c in ids}


def _permutation(n: int, key: bytes) -> list[int]:
    """A uniform permutation of range(n): Fisher-Yates on a ChaCha20 keystream, each index
    drawn by rejection so that none is favoured by the modulo."""
    enc = Cipher(algorithms.ChaCha20(_hkdf(key, _GRAPH_INFO), bytes(16)), mode=None).encryptor()
    words: list[int] = []

    def word() -> int:
        if not words:
            words.extend(np.frombuffer(enc.update(bytes(8 * max(64, n))), dtype="<u8").tolist())
            words.reverse()
        return words.pop()

    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        span = i + 1
        limit = (1 << 64) - (1 << 64) % span
        while (r := word()) >= limit:
            pass
        j = r % span
        perm[i], perm[j] = perm[j], perm[i]
    return perm


# --------------------------------------------------------------------------- client


class ClientSession:
    """One client's side of one round. Never reuse one across rounds: its seeds
    and keys are fresh per session, and it masks only once."""

    def __init__(self, client: int, context: bytes, identity: Any = None):
        """identity: a fedbus.node.privacy.identity.Identity (its signing key and every
        client's verification key), or None: keys and survivor sets unsigned and unchecked,
        secure against an honest-but-curious server only (SECURITY.md 3a)."""
        self.client = _client_id(client)
        self.context = _context(context)
        self.identity = identity
        self._survivor_set: list[int] | None = None  # the one survivor set it signed
        self._c_sk = X25519PrivateKey.generate()
        self._s_seed = os.urandom(SEED_BYTES)
        self._s_sk = _s_private_key(self._s_seed)
        self._b_seed = os.urandom(SEED_BYTES)
        self._ring: RingParams | None = None
        self._t = 0
        self._holders: list[int] = []
        self._neighbours: list[int] = []
        self._share_keys: dict[int, bytes] = {}
        self._pairwise: dict[int, bytes] = {}
        self._refused: dict[int, str] = {}
        self._own_b_share = b""
        self._masked_with: list[int] | None = None
        self._unmasked = False

    def public_keys(self) -> dict:
        """{"c_pk", "s_pk"}, and with an identity "sig": its signature over (context, client,
        c_pk, s_pk), which every neighbour verifies before using the keys."""
        keys = {"c_pk": _public_bytes(self._c_sk), "s_pk": _public_bytes(self._s_sk)}
        if self.identity is not None:
            from fedbus.node.privacy.identity import advert_message

            keys["sig"] = self.identity.sign(
                advert_message(self.context, self.client, keys["c_pk"], keys["s_pk"]))
        return keys

    def on_peers(self, peers: dict[int, tuple[bytes, bytes]], t: int,
                 ring: RingParams | Mapping[str, Any]) -> dict[int, bytes]:
        """peers: its neighbours' and its own id -> (c_pk, s_pk) or (c_pk, s_pk, sig).
        Returns neighbour -> share ciphertext, for each neighbour it accepts.

        With an identity, a neighbour whose advertisement carries no signature, or one that
        does not verify under the neighbour's long-term key for this round's context (keys
        substituted by whoever carried them, or replayed from another round), is refused
        (named reasons unsigned-keys, bad-key-signature), as below.

        Its own keys must come back unchanged (else the keys it is told of are not the
        round's, and the round is aborted). A neighbour whose keys are of low order, equal
        to each other, or equal to any other key listed (its own included) is refused: it
        gets no shares, and is not masked with (`refused_peers` says why). The round goes
        on if at least t - 1 neighbours remain, since t holders are needed to remove its
        self mask; else it is aborted."""
        me = self.client
        if self._ring is not None:
            raise SecAggError(f"client {me}: peers already set for this round")
        ring = ring if isinstance(ring, RingParams) else RingParams.from_dict(ring)
        keys: dict[int, tuple[bytes, bytes]] = {}
        sigs: dict[int, Any] = {}
        for v, pair in _mapping(peers, "peers").items():
            v = _client_id(v, "peer id")
            if not isinstance(pair, (tuple, list)) or len(pair) not in (2, 3):
                raise SecAggError(f"peer {v}: keys must be (c_pk, s_pk) or (c_pk, s_pk, sig)")
            keys[v] = (_bytes(pair[0], KEY_BYTES, f"peer {v} c_pk"),
                       _bytes(pair[1], KEY_BYTES, f"peer {v} s_pk"))
            sigs[v] = pair[2] if len(pair) == 3 else None
        own = keys.pop(me, None)
        mine = (_public_bytes(self._c_sk), _public_bytes(self._s_sk))
        if own is None or tuple(own) != mine:
            how = "missing" if own is None else "altered"
            raise SecAggError(f"client {me} aborts its round: the peers step does not echo "
                              f"its own keys back unchanged ({how})")
        holders = _holders(me, keys)
        m = len(holders)
        if not _is_int(t) or not m // 2 + 1 <= t <= m:
            # t <= m/2 would let two disjoint sets of holders rebuild both of a client's seeds
            raise SecAggError(f"client {me}: threshold {t!r} outside "
                              f"{m // 2 + 1}..{m} for {m} holders")
        t = int(t)
        if self.identity is not None and t < active_threshold(m):
            raise Refused("threshold-too-low", f"client {me} aborts its round: threshold "
                          f"{t} of {m} holders is below {active_threshold(m)}, what the "
                          f"signed protocol needs against a lying server (2t > m + c for c "
                          f"colluding holders; secagg_dropout < 1/3 gives it)")
        seen: dict[bytes, int] = {}
        for pk in (*mine, *(pk for pair in keys.values() for pk in pair)):
            seen[pk] = seen.get(pk, 0) + 1
        refused: dict[int, str] = {}
        for v, (c_pk, s_pk) in sorted(keys.items()):
            why = _key_problem(c_pk, s_pk)
            if why is None and (c_pk in mine or s_pk in mine):
                why = "it advertises a key of this client's"
            if why is None and (seen[c_pk] > 1 or seen[s_pk] > 1):
                why = "another peer advertises the same key"
            if why is None and self.identity is not None:
                why = self._advert_problem(v, c_pk, s_pk, sigs[v])
            if why is not None:
                refused[v] = why
        share_keys: dict[int, bytes] = {}
        pairwise: dict[int, bytes] = {}
        for v, (c_pk, s_pk) in sorted(keys.items()):
            if v in refused:
                continue
            try:
                share_keys[v] = _hkdf(_exchange(self._c_sk, c_pk, v),
                                      _SHARE_KEY_INFO + self.context)
                pairwise[v] = _pairwise_seed(self._s_sk, s_pk, v, self.context)
            except SecAggError as err:
                refused[v] = str(err)
                share_keys.pop(v, None)
        if len(share_keys) < t - 1:
            raise SecAggError(f"client {me} aborts its round: {len(share_keys)} acceptable "
                              f"neighbours, fewer than t-1={t - 1} (refused: "
                              f"{', '.join(f'{v}: {w}' for v, w in sorted(refused.items()))})")
        # shares are indexed by the holder's place among all of them, refused ones included,
        # so that the server's indices do not depend on who refused whom (and with no
        # dropout every owner's first t shares sit at the same points: one set of Lagrange
        # coefficients rebuilds every seed)
        try:
            rows = shamir.split([self._b_seed, self._s_seed], t, range(m))  # [m, 2, CHUNKS]
        except ValueError as e:
            raise SecAggError(f"client {me}: {e}") from None
        wire = np.ascontiguousarray(rows.astype("<u4"))
        pair = {h: wire[i].tobytes() for i, h in enumerate(holders)}  # b-share + s-share
        out: dict[int, bytes] = {}
        for v in sorted(share_keys):
            nonce = os.urandom(NONCE_BYTES)
            out[v] = nonce + AESGCM(share_keys[v]).encrypt(
                nonce, pair[v], _share_aad(me, v, self.context))
        self._share_keys, self._pairwise, self._refused = share_keys, pairwise, refused
        self._own_b_share = pair[me][:SHARE_BYTES]
        self._t, self._holders, self._neighbours = t, holders, sorted(share_keys)
        self._ring = ring
        return out

    def refused_peers(self) -> dict[int, str]:
        """The neighbours on_peers refused, and why."""
        return dict(self._refused)

    def _advert_problem(self, v: int, c_pk: bytes, s_pk: bytes, sig: Any) -> str | None:
        """Why neighbour v's signed advertisement is refused, or None; led by its reason."""
        from fedbus.node.privacy.identity import advert_message

        if sig is None:
            return "unsigned-keys: its key advertisement carries no signature"
        why = self.identity.verify(v, sig, advert_message(self.context, v, c_pk, s_pk))
        if why is not None:
            return (f"bad-key-signature: {why} for this round's keys (substituted on the "
                    f"way, or another round's)")
        return None

    def sign_survivors(self, survivors: Iterable[int]) -> bytes:
        """Its signature over the round's survivor set as the server tells it (Bonawitz et
        al.'s consistency check), given once per round and only after it masked its input:
        a set without itself, or a second set, is refused."""
        me = self.client
        if self.identity is None:
            raise SecAggError(f"client {me}: no signing identity to sign survivors with")
        if self._masked_with is None:
            raise SecAggError(f"client {me}: survivor set before it masked an input")
        ids = sorted(_id_list(list(survivors), "survivors"))
        if me not in ids:
            raise Refused("survivors-omit-self", f"client {me} masked its input, but the "
                          f"survivor set it is asked to sign leaves it out")
        if self._survivor_set is not None and self._survivor_set != ids:
            raise Refused("second-survivor-set", f"client {me} signed one survivor set this "
                          f"round already and is asked to sign another")
        from fedbus.node.privacy.identity import survivors_message

        self._survivor_set = ids
        return self.identity.sign(survivors_message(self.context, ids))

    def _check_consistency(self, alive: set[int], gone: set[int],
                           signatures: Mapping[int, Any] | None) -> None:
        """With an identity: the unmask request must agree with the survivor set it signed,
        and at least t of its holders (itself included) must have signed that same set."""
        me = self.client
        if self._survivor_set is None:
            raise Refused("survivors-unsigned", f"client {me} is asked to reveal shares "
                          f"before it signed the round's survivor set")
        signed = set(self._survivor_set)
        mine = {me, *(self._masked_with or [])}
        want_alive, want_gone = mine & signed, set(self._masked_with or []) - signed
        if alive != want_alive or gone != want_gone:
            raise Refused("survivors-mismatch", f"client {me}: the unmask request's survivors "
                          f"{sorted(alive)} and dropped {sorted(gone)} are not those of the "
                          f"survivor set it signed")
        from fedbus.node.privacy.identity import survivors_message

        message = survivors_message(self.context, self._survivor_set)
        good = {me}
        bad: list[str] = []
        for v, sig in _mapping(signatures or {}, "signatures").items():
            v = _client_id(v, "signer")
            if v == me or v not in want_alive or len(good) >= self._t:
                continue  # only holders in the signed set count, each once; t are enough
            why = self.identity.verify(v, sig, message)
            if why is None:
                good.add(v)
            else:
                bad.append(f"{v}: {why}")
        if len(good) < self._t:
            raise Refused("too-few-signatures", f"client {me}: {len(good)} of its holders "
                          f"signed the survivor set it signed, fewer than t={self._t}"
                          + (f" (refused: {'; '.join(bad)})" if bad else ""))

    def check_share_senders(self, share_senders: Iterable[int]) -> list[int]:
        """The neighbours to mask with, from the server's list of those that sent shares;
        SecAggError (the round is aborted) if it names a neighbour this client refused or
        does not have, or fewer than t - 1 of them (Bonawitz et al.'s check on U2: masked
        with too few pairwise masks, its input would be x + PRG(b) alone, and the server
        could then ask its holders for b's shares)."""
        me = self.client
        if self._ring is None:
            raise SecAggError(f"client {me}: share senders before on_peers")
        peers = sorted(set(_id_list(list(share_senders), "share_senders")) - {me})
        stray = sorted(set(peers) - set(self._neighbours))
        if stray:
            raise SecAggError(f"client {me} aborts its round: share senders {stray} are not "
                              f"neighbours it shared with")
        if len(peers) < self._t - 1:
            raise SecAggError(f"client {me} aborts its round: {len(peers)} neighbours sent "
                              f"shares, fewer than t-1={self._t - 1}: masked now, its input "
                              f"could be unmasked alone")
        return peers

    def mask(self, values: np.ndarray,
             share_senders: Iterable[int] | None = None, *,
             integers: bool = False) -> tuple[np.ndarray, int]:
        """float64 [L] -> (packed uint8 [L, ring_bits // 8], clipped count); once, after
        on_peers. share_senders: the neighbours that sent shares (ServerSession.close_shares;
        checked by check_share_senders); None masks with every neighbour it accepted, which
        the server can only undo if all of them sent shares. integers: values are int64
        ring elements already (distributed DP's noised integers, fedbus.node.privacy.ddp),
        taken mod 2^ring_bits as they are, never clipped (encode_integers)."""
        if self._ring is None:
            raise SecAggError(f"client {self.client}: mask before on_peers")
        if self._masked_with is not None:
            # two masked vectors under the same masks would reveal their difference
            raise SecAggError(f"client {self.client}: already masked an input this round")
        peers = list(self._neighbours) if share_senders is None else \
            self.check_share_senders(share_senders)
        ring = self._ring
        y, clipped = encode_integers(values, ring) if integers else encode(values, ring)
        _add_prg(y, self._b_seed, _PRG_SELF_INFO + self.context, 1)
        for v in peers:
            _add_prg(y, self._pairwise[v], _PRG_PAIR_INFO + self.context, _sign(self.client, v))
        self._masked_with = peers
        return pack(_reduce(y, ring.ring_bits), ring.ring_bits), clipped

    def on_unmask(self, survivors: list[int], dropped: list[int],
                  ciphertexts: dict[int, bytes],
                  signatures: Mapping[int, Any] | None = None) -> dict:
        """-> {"b": {peer: share}, "s": {peer: share}}: the b-share of each survivor
        (itself included) and the s-share of each dropped peer, never both for one peer
        (named reason both-share-kinds). With an identity, only after the consistency
        check (_check_consistency): survivors and dropped as the survivor set it signed
        says, and signatures: holder -> its signature on that set, t of them valid."""
        me = self.client
        if self._masked_with is None:
            raise SecAggError(f"client {me}: unmask request before it masked an input")
        if self._unmasked:
            # a second, different request could be used to collect both shares of a peer
            raise SecAggError(f"client {me}: already revealed shares this round")
        alive = set(_id_list(survivors, "survivors"))
        gone = set(_id_list(dropped, "dropped"))
        if me in gone:
            raise SecAggError(f"client {me} is listed as dropped in its own unmask request")
        both = sorted(alive & gone)
        if both:
            raise Refused("both-share-kinds", f"client {me}: peers {both} are listed as "
                          f"survivor and dropped: it would reveal both of their shares")
        alive.add(me)
        if self.identity is not None:
            self._check_consistency(alive, gone, signatures)
        strangers = sorted((alive | gone) - set(self._holders))
        if strangers:
            raise SecAggError(f"client {me}: unmask request names non-neighbours {strangers}")
        if (alive | gone) - {me} != set(self._masked_with):
            raise SecAggError(f"client {me}: survivors and dropped do not match the peers it "
                              f"masked with {self._masked_with}")
        if len(alive) < self._t:
            raise SecAggError(f"client {me}: only {len(alive)} of its holders survive, "
                              f"fewer than t={self._t}")
        cts = _mapping(ciphertexts, "ciphertexts")
        cts = {_client_id(v, "ciphertext sender"): ct for v, ct in cts.items()}
        if set(cts) != (alive | gone) - {me}:
            raise SecAggError(f"client {me}: ciphertexts from {sorted(cts)} do not match "
                              f"the listed peers {sorted((alive | gone) - {me})}")
        b: dict[int, bytes] = {me: self._own_b_share}
        s: dict[int, bytes] = {}
        for v in sorted(cts):
            ct = cts[v]
            if not isinstance(ct, bytes) or len(ct) != CIPHERTEXT_BYTES:
                raise SecAggError(f"client {me}: ciphertext from client {v} is malformed")
            try:
                plain = AESGCM(self._share_keys[v]).decrypt(
                    ct[:NONCE_BYTES], ct[NONCE_BYTES:], _share_aad(v, me, self.context))
            except InvalidTag:
                raise SecAggError(f"client {me}: ciphertext from client {v} fails "
                                  f"authentication (tampered, or another round/pair)") from None
            if v in alive:
                b[v] = plain[:SHARE_BYTES]
            else:
                s[v] = plain[SHARE_BYTES:]
        # checked after decrypting all (one numpy call), revealed only if all are in the field
        revealed = [(v, share) for v, share in (*b.items(), *s.items()) if v != me]
        outside = _outside_field(share for _, share in revealed)
        if outside is not None:
            raise SecAggError(f"client {me}: the share client {revealed[outside][0]} sent "
                              f"holds a value outside the field")
        self._unmasked = True
        return {"b": b, "s": s}


# --------------------------------------------------------------------------- server


class ServerSession:
    """The server's side of one round; deterministic given its inputs (a replay of
    the message log redoes it exactly, given the same `graph_key`).

    Phases: add_keys* -> fix_graph -> add_shares* -> [close_shares] -> add_input* ->
    unmask_requests -> add_reveal* -> unmask. Each add_* refuses once its phase is over.

    A pair of clients u, v is linked for the round (each masks with the other, each holds
    the other's shares) when the graph joins them and each sent the other a share: a client
    may refuse a neighbour whose keys it cannot use (ClientSession.on_peers)."""

    def __init__(self, cohort: list[int], context: bytes, *, neighbours: int, dropout: float,
                 ring: RingParams, graph_key: bytes | None = None):
        self.cohort = sorted(_id_list(cohort, "cohort"))
        if not self.cohort:
            raise SecAggError("cohort is empty")
        self.context = _context(context)
        if not _is_int(neighbours) or neighbours < 0:
            raise SecAggError(f"neighbours must be an int >= 0, got {neighbours!r}")
        threshold(1, dropout)  # validates dropout
        if not isinstance(ring, RingParams):
            raise SecAggError(f"ring must be RingParams, got {type(ring).__name__}")
        if ring.max_clients() < len(self.cohort):
            raise SecAggError(f"a {ring.ring_bits}-bit ring holds the sum of "
                              f"{ring.max_clients()} clients, not {len(self.cohort)}")
        # the server's own secret (None: fresh); per round, the context keys a new graph
        self.graph_key = secrets.token_bytes(GRAPH_KEY_BYTES) if graph_key is None else \
            _bytes(graph_key, GRAPH_KEY_BYTES, "graph_key")
        self.neighbours_asked, self.dropout = int(neighbours), float(dropout)
        self.ring = ring
        self._cohort_set = set(self.cohort)
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._key_sigs: dict[int, bytes] = {}  # signed advertisements (forwarded, unverified)
        self._survivor_sigs: dict[int, bytes] = {}  # the consistency check's signatures
        self._key_owner: dict[bytes, int] = {}
        self._graph: dict[int, list[int]] | None = None
        self._t = 0
        self._shares: dict[int, dict[int, bytes]] = {}
        self._linked: dict[int, list[int]] | None = None  # fixed when masking starts
        self._excluded: list[int] = []  # share senders left with too few links
        self._shares_closed = False
        self._told = False  # whether clients were given the share senders to mask with
        self._sum: np.ndarray | None = None
        self._inputs: set[int] = set()
        self._survivors: list[int] | None = None
        self._dropped: list[int] = []
        self._needed: list[int] = []  # dropped clients with a surviving neighbour
        self._reveals: dict[int, tuple[dict[int, bytes], dict[int, bytes]]] = {}
        self._result: np.ndarray | None = None
        self.blamed: dict[int, str] = {}  # holders whose revealed shares were wrong
        # secrets whose spare shares disagree while no single holder can be named (one
        # spare share: any of its holders could be the odd one)
        self.unattributed = 0

    # ---- phase 1: keys

    def add_keys(self, client: int, c_pk: bytes, s_pk: bytes, sig: bytes | None = None
                 ) -> None:
        """A client's public keys, and its signature of them (64 bytes, or None: unsigned;
        the server holds no verification key: the receiving clients verify it). Keys of low
        order, a client's two keys alike, or a key another client sent already are refused,
        blaming this sender: no honest client draws such keys, and in the graph they would
        fail every neighbour's key agreement (or hand a copier's peers shares it could not
        read)."""
        if self._graph is not None:
            raise SecAggError("keys arrive after the graph was fixed")
        u = self._member(client)
        if u in self._keys:
            raise SecAggError(f"client {u} sent keys twice")
        pair = (_bytes(c_pk, KEY_BYTES, f"client {u} c_pk"),
                _bytes(s_pk, KEY_BYTES, f"client {u} s_pk"))
        why = _key_problem(*pair)
        if why is None:
            copied = [self._key_owner[pk] for pk in pair if pk in self._key_owner]
            if copied:
                why = f"it repeats a key client {copied[0]} sent"
        if why is not None:
            raise SecAggError(f"client {u}'s keys are refused: {why}")
        if sig is not None:
            self._key_sigs[u] = _bytes(sig, SIGNATURE_BYTES, f"client {u}'s key signature")
        self._keys[u] = pair
        for pk in pair:
            self._key_owner[pk] = u

    def key_senders(self) -> list[int]:
        return sorted(self._keys)

    def fix_graph(self) -> dict[int, dict]:
        """Links the key senders; -> per client {"peers": {v: [c_pk, s_pk] (+ [sig] where v
        signed)} (its neighbours and itself: a client checks that its own keys come back
        unchanged), "t", "ring"}."""
        if self._graph is not None:
            raise SecAggError("the graph is already fixed")
        senders = self.key_senders()
        if not senders:
            raise SecAggError("no client sent keys")
        k = neighbour_count(len(senders), self.neighbours_asked)
        graph = neighbour_graph(senders, k, _hkdf(self.graph_key, _GRAPH_INFO + self.context))
        # the graph is regular (even-k Harary or complete), so every client has m holders
        self._t = threshold(len(graph[senders[0]]) + 1, self.dropout)
        self._graph = graph
        ring = self.ring.to_dict()
        return {u: {"peers": {v: [*self._keys[v], *([self._key_sigs[v]]
                                                     if v in self._key_sigs else [])]
                              for v in sorted([*graph[u], u])},
                    "t": self._t, "ring": dict(ring)} for u in senders}

    def signed(self) -> bool:
        """Whether any key sender signed its keys: the round then runs the consistency
        check (survivor_set -> add_survivor_signature -> signatures_for) before unmasking."""
        return bool(self._key_sigs)

    # ---- phase 2: shares

    def add_shares(self, client: int, ciphertexts: dict[int, bytes]) -> None:
        """A client's shares, one ciphertext per neighbour it accepts: at least t - 1 of
        them, else its self mask could not be removed."""
        graph = self._need_graph()
        if self._shares_closed:
            raise SecAggError("shares arrive after the share phase closed")
        u = self._member(client)
        if u not in graph:
            raise SecAggError(f"client {u} sent shares without having sent keys")
        if u in self._shares:
            raise SecAggError(f"client {u} sent shares twice")
        cts: dict[int, bytes] = {}
        for v, ct in _mapping(ciphertexts, "ciphertexts").items():
            v = _client_id(v, "share recipient")
            cts[v] = _bytes(ct, CIPHERTEXT_BYTES, f"client {u}'s ciphertext for {v}")
        stray = sorted(set(cts) - set(graph[u]))
        if stray or len(cts) < self._t - 1:
            raise SecAggError(f"client {u} must send shares to at least t-1={self._t - 1} of "
                              f"its neighbours {graph[u]} and no one else, got {sorted(cts)}")
        self._shares[u] = cts

    def share_senders(self) -> list[int]:
        return sorted(self._shares)

    def close_shares(self) -> dict[int, list[int]]:
        """Ends the share phase; -> per share sender the neighbours it is linked with (both
        sent each other shares), to hand to ClientSession.mask(values, share_senders), so
        that a client that sent keys but no shares, or that a neighbour refused, cannot
        spoil the round. A sender left with fewer than t - 1 links (its self mask could not
        be removed) is excluded, its links dropped, until every sender left has enough; it
        is sent an empty list, which it refuses. Optional when every key sender sent shares
        to all its neighbours."""
        self._need_graph()
        if self._shares_closed:
            raise SecAggError("the share phase is already closed")
        self._shares_closed = self._told = True
        linked = self._links()
        return {u: list(linked.get(u, [])) for u in self.share_senders()}

    def excluded(self) -> list[int]:
        """Share senders close_shares left out for lack of links."""
        return list(self._excluded)

    # ---- phase 3: masked inputs

    def add_input(self, members: list[int], packed: np.ndarray) -> None:
        """A client's masked vector, or a relay's pre-added sum of several."""
        self._need_graph()
        if self._survivors is not None:
            raise SecAggError("an input arrives after the survivors were fixed")
        ids = _id_list(members, "members")
        if not ids:
            raise SecAggError("an input must name at least one member")
        for u in ids:
            if u not in self._shares:
                raise SecAggError(f"input from client {u}, which sent no shares")
            if u in self._excluded:
                raise SecAggError(f"input from client {u}, excluded at masking")
            if u in self._inputs:
                raise SecAggError(f"client {u} is in two inputs")
        vec = unpack(packed, self.ring.ring_bits)
        if self._sum is not None and vec.shape != self._sum.shape:
            raise SecAggError(f"input of {vec.shape[0]} elements, expected {self._sum.shape[0]}")
        self._shares_closed = True  # a late share would change what clients masked with
        if self._sum is None:
            self._sum = vec
        else:
            _add_signed(self._sum, vec, 1)
        self._inputs.update(ids)

    def input_senders(self) -> list[int]:
        return sorted(self._inputs)

    # ---- phase 4: unmasking

    def unmask_requests(self) -> dict[int, dict]:
        """Fixes the survivors (input senders); -> per survivor
        {"survivors": [...] (itself included), "dropped": [...], "ciphertexts": {v: ct}}."""
        graph = self._need_graph()
        if self._survivors is not None:
            raise SecAggError("the survivors are already fixed")
        if not self._inputs:
            raise SecAggError("no masked input arrived")
        linked = self._links()
        alive = set(self._inputs)
        dropped = sorted(set(linked) - alive)
        unlinked = sorted(alive - set(linked))
        if unlinked:
            raise SecAggError(f"clients {unlinked} masked inputs but are linked to fewer "
                              f"than t-1={self._t - 1} neighbours")
        if not self._told:
            for u in sorted(alive):
                lost = sorted(set(graph[u]) - set(linked[u]))
                if lost:
                    raise SecAggError(
                        f"client {u} masked with neighbours {lost} that sent no shares, so "
                        f"their pairwise masks cannot be removed (use close_shares)")
        for u in sorted(alive):
            have = len(alive.intersection([u, *linked[u]]))
            if have < self._t:
                raise SecAggError(f"survivor {u} has {have} surviving holders, fewer than "
                                  f"t={self._t}: its self mask cannot be removed")
        # a dropped client whose neighbours all dropped left no term in the sum
        needed = [w for w in dropped if alive.intersection(linked[w])]
        for w in needed:
            have = len(alive.intersection(linked[w]))
            if have < self._t:
                raise SecAggError(f"dropped client {w} has {have} surviving holders, fewer "
                                  f"than t={self._t}: its pairwise masks cannot be removed")
        self._survivors, self._dropped, self._needed = sorted(alive), dropped, needed
        out: dict[int, dict] = {}
        for u in self._survivors:
            peers = linked[u]
            out[u] = {"survivors": [v for v in sorted([u, *peers]) if v in alive],
                      "dropped": [v for v in peers if v not in alive],
                      "ciphertexts": {v: self._shares[v][u] for v in peers}}
        return out

    def survivor_set(self) -> list[int]:
        """The round's survivors (fixed by unmask_requests), for each to sign."""
        if self._survivors is None:
            raise SecAggError("the survivors are not fixed yet (unmask_requests)")
        return list(self._survivors)

    def add_survivor_signature(self, client: int, sig: Any) -> None:
        """A survivor's signature over the survivor set (64 bytes, forwarded unverified:
        its holders verify it), before any reveal."""
        if self._survivors is None:
            raise SecAggError("a survivor signature arrives before the survivors were fixed")
        if self._reveals:
            raise SecAggError("a survivor signature arrives after reveals began")
        u = self._member(client)
        if u not in self._inputs:
            raise SecAggError(f"client {u} is not a survivor")
        if u in self._survivor_sigs:
            raise SecAggError(f"client {u} signed the survivor set twice")
        self._survivor_sigs[u] = _bytes(sig, SIGNATURE_BYTES,
                                        f"client {u}'s survivor-set signature")

    def signatures_for(self, client: int) -> dict[int, bytes]:
        """The survivor-set signatures of client's linked holders (itself included): what
        it needs to see before it reveals."""
        u = self._member(client)
        holders = {u, *self._links().get(u, [])}
        return {v: sig for v, sig in sorted(self._survivor_sigs.items()) if v in holders}

    def add_reveal(self, client: int, b: dict[int, bytes], s: dict[int, bytes]) -> None:
        if self._survivors is None:
            raise SecAggError("a reveal arrives before the survivors were fixed")
        if self._result is not None:
            raise SecAggError("a reveal arrives after the sum was unmasked")
        linked = self._links()
        u = self._member(client)
        if u not in self._inputs:
            raise SecAggError(f"client {u} is not a survivor")
        if u in self._reveals:
            raise SecAggError(f"client {u} revealed twice")
        holds = {u, *linked[u]}
        alive, gone = set(self._survivors), set(self._dropped)
        self._reveals[u] = (_revealed(u, b, "b", holds & alive, "a surviving"),
                            _revealed(u, s, "s", holds & gone, "a dropped"))

    def missing(self) -> list[str]:
        """What cannot be reconstructed yet; [] when unmask() can succeed."""
        if self._survivors is None:
            return ["the survivors are not fixed (unmask_requests not called)"]
        out = []
        for kind, owners in (("b", self._survivors), ("s", self._needed)):
            for w, shares in self._collect(kind, owners).items():
                if len(shares) < self._t:
                    out.append(f"{kind}_seed of client {w}: {len(shares)} of t={self._t} shares")
        return out

    def unmask(self) -> np.ndarray:
        """float64 [L]: the sum of the survivors' inputs.

        Each secret is rebuilt from its t lowest-numbered shares, and the unmasked sum must
        lie within what the inputs can add up to (survivors x the ring's range a value):
        a wrong share gives a wrong seed, whose mask leaves values spread over the whole
        ring. If it does not, every secret with more than t shares is checked for
        consistency (each share beyond t must lie on the polynomial of the first t), and a
        holder whose removal leaves every secret consistent and the sum within bounds is
        blamed (`blamed`), its shares are left out and the sum is rebuilt without them. A
        sum out of bounds with consistent shares (a malformed masked input) or whose liar
        cannot be singled out fails (SecAggError), unmasking nothing."""
        if self._result is not None:
            return self._result.copy()
        short = self.missing()
        if short:
            raise SecAggError(f"cannot unmask: {'; '.join(short)}")
        assert self._sum is not None and self._survivors is not None
        try:
            total = self._unmasked(set())
        except SecAggError:
            total = None
        if total is None or not self._within_bounds(total):
            total = self._unmask_blaming()
        else:
            self._blame_unused()
        self._result = decode(total, self.ring)
        return self._result.copy()

    def stats(self) -> dict:
        k = len(next(iter(self._graph.values()))) if self._graph else None
        return {"cohort": len(self.cohort), "keys": len(self._keys), "shares": len(self._shares),
                "inputs": len(self._inputs), "dropped": len(self._dropped),
                "reveals": len(self._reveals), "t": self._t or None, "neighbours": k,
                "ring_bits": self.ring.ring_bits, "frac_bits": self.ring.frac_bits,
                "quant_bound": quantisation_bound(self.ring, len(self._inputs)),
                "excluded": len(self._excluded), "blamed": dict(self.blamed),
                "unattributed": self.unattributed}

    # ---- internals

    def _member(self, client: Any) -> int:
        u = _client_id(client)
        if u not in self._cohort_set:
            raise SecAggError(f"client {u} is not in the cohort")
        return u

    def _need_graph(self) -> dict[int, list[int]]:
        if self._graph is None:
            raise SecAggError("the graph is not fixed yet (fix_graph)")
        return self._graph

    def _links(self) -> dict[int, list[int]]:
        """Share sender -> the neighbours it is linked with (each sent the other shares),
        senders with fewer than t - 1 links excluded one by one; fixed on first use (the
        share phase is then over)."""
        if self._linked is not None:
            return self._linked
        graph = self._need_graph()
        linked = {u: {v for v in graph[u] if v in self._shares and u in self._shares[v]
                      and v in self._shares[u]} for u in self._shares}
        excluded: list[int] = []
        while short := sorted(u for u, vs in linked.items() if len(vs) < self._t - 1):
            u = short[0]
            excluded.append(u)
            for v in linked.pop(u):
                linked[v].discard(u)
        self._excluded = excluded
        self._linked = {u: sorted(vs) for u, vs in linked.items()}
        return self._linked

    def _collect(self, kind: str, owners: Iterable[int], without: set[int] = frozenset()
                 ) -> dict[int, list[tuple[int, bytes]]]:
        """owner -> [(Shamir index, share)] revealed so far, by index, leaving out the
        shares of the holders in `without`. The index is the holder's place among all the
        owner's graph holders, as the owner split its secret."""
        graph = self._need_graph()
        slot = 0 if kind == "b" else 1
        out: dict[int, list[tuple[int, bytes]]] = {}
        for w in owners:
            holders = _holders(w, graph[w])
            out[w] = [(i + 1, self._reveals[h][slot][w]) for i, h in enumerate(holders)
                      if h in self._reveals and h not in without and w in self._reveals[h][slot]]
        return out

    def _combine(self, secrets: Mapping[tuple[str, int], list[tuple[int, bytes]]]
                 ) -> dict[tuple[str, int], bytes]:
        """key -> the secret rebuilt from its t lowest-indexed shares (for determinism).
        Secrets whose t shares sit at the same indices are rebuilt in one product with one
        cached set of Lagrange coefficients: with no holder dropout, all of them."""
        groups: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        for key, shares in secrets.items():
            if len(shares) < self._t:
                raise SecAggError(f"{key[0]}_seed of client {key[1]}: {len(shares)} of "
                                  f"t={self._t} shares")
            groups.setdefault(tuple(i for i, _ in shares[: self._t]), []).append(key)
        out: dict[tuple[str, int], bytes] = {}
        for indices, keys in groups.items():
            # [secrets x t, CHUNKS] -> [t, secrets, CHUNKS]: row j from the holder at indices[j]
            ys = _field_shares([y for key in keys for _, y in secrets[key][: self._t]])
            ys = ys.reshape(len(keys), len(indices), shamir.CHUNKS).transpose(1, 0, 2)
            try:
                rebuilt = shamir.combine([i - 1 for i in indices], ys)
            except ValueError as e:
                raise SecAggError(f"Shamir reconstruction failed: {e}") from None
            out.update(zip(keys, rebuilt))
        return out

    def _inconsistent(self, secrets: Mapping[tuple[str, int], list[tuple[int, bytes]]]
                      ) -> set[tuple[str, int]]:
        """The keys of the secrets with more than t shares of which some share beyond the
        first t does not lie on the polynomial through the first t (a wrong share), checked
        in one product per set of indices."""
        groups: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        for key, shares in secrets.items():
            if len(shares) > self._t:
                groups.setdefault(tuple(i for i, _ in shares), []).append(key)
        bad: set[tuple[str, int]] = set()
        for indices, keys in groups.items():
            ys = _field_shares([y for key in keys for _, y in secrets[key]])
            ys = ys.reshape(len(keys), len(indices), shamir.CHUNKS).transpose(1, 0, 2)
            ok = shamir.consistent([i - 1 for i in indices], ys, self._t)
            bad.update(key for key, good in zip(keys, ok) if not good)
        return bad

    def _secrets(self, without: set[int] = frozenset()
                 ) -> dict[tuple[str, int], list[tuple[int, bytes]]]:
        """(kind, owner) -> its revealed shares, for every survivor's b_seed and every
        needed dropped client's s_seed."""
        assert self._survivors is not None
        return {(kind, w): shares for kind, owners in (("b", self._survivors), ("s", self._needed))
                for w, shares in self._collect(kind, owners, without).items()}

    def _unmasked(self, without: set[int]) -> np.ndarray:
        """The ring sum with every mask removed, the shares of `without` left out."""
        self._need_graph()
        assert self._sum is not None and self._survivors is not None
        bits = self.ring.ring_bits
        # rebuild every secret before touching the sum, so a failure unmasks nothing
        seeds = self._combine(self._secrets(without))
        b_seeds = {u: seeds["b", u] for u in self._survivors}
        s_keys: dict[int, X25519PrivateKey] = {}
        for w in self._needed:
            key = _s_private_key(seeds["s", w])
            if _public_bytes(key) != self._keys[w][1]:
                raise SecAggError(f"the s-shares of dropped client {w} rebuild a key that "
                                  f"does not match its public key")
            s_keys[w] = key
        total = self._sum.copy()
        for u in self._survivors:
            _add_prg(total, b_seeds[u], _PRG_SELF_INFO + self.context, -1)
        alive = set(self._survivors)
        for w, key in s_keys.items():
            for v in self._links()[w]:
                if v in alive:
                    seed = _pairwise_seed(key, self._keys[v][1], v, self.context)
                    # v added sign(v, w) * PRG(s_vw); take it off
                    _add_prg(total, seed, _PRG_PAIR_INFO + self.context, -_sign(v, w))
        return _reduce(total, bits)

    def _within_bounds(self, total: np.ndarray) -> bool:
        """Whether a ring sum decodes to values the inputs can make: each input's values
        are clipped to the range before rounding, so |sum| <= inputs x ceil(range 2^f)."""
        top = len(self._inputs) * math.ceil(Fraction(self.ring.range) * 2**self.ring.frac_bits)
        bits = self.ring.ring_bits
        half = np.uint64(1 << (bits - 1)) if bits < 64 else np.uint64(1 << 63)
        v = _reduce(total.copy(), bits)
        # two's complement magnitude without overflow: |x| = x below half, 2^bits - x above
        mag = np.where(v < half, v, (np.uint64(0) - v) & np.uint64((1 << bits) - 1)
                       if bits < 64 else np.uint64(0) - v)
        return bool(np.all(mag <= np.uint64(top)))

    def _suspects(self, bad: set[tuple[str, int]]) -> list[int]:
        """The revealing holders that hold a share of every inconsistent secret (a liar
        does), sorted."""
        graph = self._need_graph()
        suspects = set(self._reveals)
        for _, w in bad:
            suspects &= set(_holders(w, graph[w]))
        return sorted(suspects)

    def _blame_unused(self) -> None:
        """The sum is in bounds, so the t shares each secret was rebuilt from agree with it;
        a wrong share beyond them changed nothing, but its holder lied all the same: every
        spare share is checked (one product per set of share indices), and the one holder
        whose removal leaves every secret consistent is blamed. Several candidates (one
        spare share of one secret: any of its holders could be the odd one) blame no one;
        the inconsistent secrets are counted (`unattributed`, the record's
        secagg.inconsistent)."""
        bad = self._inconsistent(self._secrets())
        if not bad:
            return
        liars = [h for h in self._suspects(bad)
                 if not self._inconsistent(self._secrets({h}))]
        if len(liars) != 1:
            self.unattributed = len(bad)
        else:
            self.blamed[liars[0]] = (
                f"revealed shares inconsistent with the other holders' of {len(bad)} "
                "secret(s) (spare shares: the sum did not need them)")

    def _unmask_blaming(self) -> np.ndarray:
        """The slow path of unmask: find the holder whose shares are wrong."""
        bad = self._inconsistent(self._secrets())
        if not bad:
            raise SpoiledSum("the unmasked sum is out of bounds and every revealed share is "
                              "consistent: a masked input is malformed (its sender cannot be "
                              "told from the sum)")
        suspects = self._suspects(bad)
        for h in suspects:
            without = {h}
            rest = self._secrets(without)
            if any(len(sh) < self._t for sh in rest.values()) or self._inconsistent(rest):
                continue
            try:
                total = self._unmasked(without)
            except SecAggError:
                continue
            if self._within_bounds(total):
                self.blamed[h] = (f"revealed shares inconsistent with the other holders' of "
                                  f"{len(bad)} secret(s)")
                return total
        raise SecAggError(f"revealed shares of {len(bad)} secret(s) are inconsistent and no "
                          f"single holder's removal explains it (suspects "
                          f"{sorted(suspects) or 'none'})")

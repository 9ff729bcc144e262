"""Shamir secret sharing of 16-byte seeds over a prime field, vectorised with numpy.

Why not GF(2^128) (pycryptodome's `Shamir`): one call splits one 16-byte secret with one
polynomial in pure Python, and a combine interpolates one secret at a time; at t = 22 a
split costs ~8 ms and a combine ~19 ms, and a secure-aggregation server combines one seed
per survivor. Here every secret is a column of one matrix:

  split:    Y = V @ A (mod p)     V: [holders, t] Vandermonde rows (1, x, x^2, ..., x^(t-1)) of
                                  the holders' points x; A: [t, secrets x chunks], row 0 the
                                  secrets' chunks, rows 1..t-1 uniform random coefficients
  combine:  s = lambda @ Y_T      lambda: [t] Lagrange coefficients at 0 of the t points the
                                  shares came from, computed once per set of points
                                  (`lagrange_at_zero`, cached), so all the survivors whose
                                  shares came from the same holders are one product

The field: p = 2^25 - 39, the largest prime below 2^25. Entries stay below p < 2^25, so a
product is below 2^50 and a dot product of up to 2^13 terms stays below 2^63: numpy's int64
matmul is exact for t <= MAX_THRESHOLD, reduced mod p once at the end. A 16-byte secret is
cut into CHUNKS = 6 chunks of 24 bits (each below p), and each chunk is shared with its own
independent polynomial of degree t - 1.

Secrecy (Shamir 1979): for any t - 1 points and any secret chunk, the map from the t - 1
random coefficients to those points' shares is a bijection of F_p^(t-1) (a Vandermonde
system in the non-zero points), so with uniform coefficients the t - 1 shares are uniform
and independent of the chunk; chunks use independent coefficients, so this holds for the
whole secret. Any t shares determine the polynomial, hence the secret (Lagrange). Points are
the holders' client ids + 1, distinct and non-zero mod p (ids below p - 1).
Coefficients come from `secrets` (the operating system's CSPRNG), never from a seeded
generator: a share's secrecy is only as good as its coefficients' unpredictability.

A share on the wire is CHUNKS little-endian uint32 values (24 bytes); `share_from_bytes`
refuses a wrong length or a value outside the field with a ValueError naming it.
"""
from __future__ import annotations

import secrets as _secrets
from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

P = (1 << 25) - 39  # prime (checked in tests)
CHUNK_BITS = 24
CHUNKS = 6  # 6 x 24 = 144 >= 128 bits
SECRET_BYTES = 16
SHARE_BYTES = 4 * CHUNKS
MAX_THRESHOLD = 1 << 13  # t * (p - 1)^2 < 2^63: int64 dot products are exact


def point(holder: int) -> int:
    """The field point at which `holder` (a client id) receives its share: never zero."""
    if not 0 <= holder < P - 1:
        raise ValueError(f"holder id {holder} is outside 0..{P - 2}")
    return holder + 1


def _check_t(t: int, n: int) -> None:
    if not 1 <= t <= n:
        raise ValueError(f"threshold t = {t} must lie in 1..{n} (the number of holders)")
    if t > MAX_THRESHOLD:
        raise ValueError(f"threshold t = {t} exceeds {MAX_THRESHOLD}")


def secrets_to_chunks(secrets: Sequence[bytes]) -> np.ndarray:
    """[S, CHUNKS] int64: each 16-byte secret as six 24-bit integers (little-endian)."""
    out = np.zeros((len(secrets), CHUNKS), dtype=np.int64)
    for i, s in enumerate(secrets):
        if not isinstance(s, (bytes, bytearray)) or len(s) != SECRET_BYTES:
            raise ValueError(f"secret {i} must be {SECRET_BYTES} bytes")
        v = int.from_bytes(s, "little")
        for c in range(CHUNKS):
            out[i, c] = (v >> (CHUNK_BITS * c)) & ((1 << CHUNK_BITS) - 1)
    return out


def chunks_to_secrets(chunks: np.ndarray) -> list[bytes]:
    """Inverse of secrets_to_chunks; a chunk that does not fit 24 bits, or bits beyond 128,
    mean the shares were not of one secret: ValueError."""
    out = []
    for row in np.asarray(chunks, dtype=np.int64):
        if (row < 0).any() or (row >> CHUNK_BITS).any():
            raise ValueError("the shares do not reconstruct a 16-byte secret "
                             "(a chunk outside 24 bits): some share is wrong")
        v = 0
        for c in range(CHUNKS - 1, -1, -1):
            v = (v << CHUNK_BITS) | int(row[c])
        if v >> (8 * SECRET_BYTES):
            raise ValueError("the shares do not reconstruct a 16-byte secret "
                             "(bits beyond 128): some share is wrong")
        out.append(v.to_bytes(SECRET_BYTES, "little"))
    return out


def _random_field(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform elements of F_p from the OS CSPRNG (rejection sampling of 25-bit words)."""
    n = int(np.prod(shape))
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        want = (n - out.size) * 9 // 8 + 16
        words = np.frombuffer(_secrets.token_bytes(4 * want), dtype="<u4").astype(np.int64)
        words &= (1 << 25) - 1
        out = np.concatenate([out, words[words < P]])
    return out[:n].reshape(shape)


@lru_cache(maxsize=256)
def _vandermonde(points: tuple[int, ...], t: int) -> np.ndarray:
    x = np.asarray(points, dtype=np.int64)
    v = np.ones((len(points), t), dtype=np.int64)
    for k in range(1, t):
        v[:, k] = v[:, k - 1] * x % P
    return v


def split(secrets: Sequence[bytes], t: int, holders: Sequence[int],
          coefficients: np.ndarray | None = None) -> np.ndarray:
    """Shares of every secret for every holder: [holders, S, CHUNKS] int64, row i the shares
    holder `holders[i]` receives. Any t of a secret's shares rebuild it; fewer reveal
    nothing. `coefficients` ([t - 1, S, CHUNKS], tests only) replaces the random ones."""
    holders = list(holders)
    if len(set(holders)) != len(holders):
        raise ValueError("holders must be distinct")
    _check_t(t, len(holders))
    chunks = secrets_to_chunks(secrets)  # [S, C]
    s = len(secrets)
    if coefficients is None:
        coefficients = _random_field((t - 1, s, CHUNKS))
    coefficients = np.asarray(coefficients, dtype=np.int64)
    if coefficients.shape != (t - 1, s, CHUNKS) or (coefficients < 0).any() or \
            (coefficients >= P).any():
        raise ValueError(f"coefficients must be field elements of shape {(t - 1, s, CHUNKS)}")
    a = np.concatenate([chunks[None], coefficients]).reshape(t, s * CHUNKS)
    v = _vandermonde(tuple(point(h) for h in holders), t)
    return ((v @ a) % P).reshape(len(holders), s, CHUNKS)


@lru_cache(maxsize=1024)
def lagrange_at_zero(holders: tuple[int, ...]) -> np.ndarray:
    """[t] int64: the weights w with f(0) = sum_j w_j f(x_j) for the holders' points, for
    every polynomial of degree < t = len(holders). Cached: one computation per set."""
    xs = [point(h) for h in holders]
    if len(set(xs)) != len(xs):
        raise ValueError("holders must be distinct")
    w = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % P
                den = den * (xm - xj) % P
        w.append(num * pow(den, -1, P) % P)
    return np.asarray(w, dtype=np.int64)


def combine(holders: Sequence[int], shares: np.ndarray) -> list[bytes]:
    """The secrets rebuilt from t holders' shares: `shares` [t, S, CHUNKS] (row j from
    holders[j]). Exactly t rows: with more, use `combine_checked`."""
    holders = tuple(holders)
    shares = np.asarray(shares, dtype=np.int64)
    if shares.ndim != 3 or shares.shape[0] != len(holders) or shares.shape[2] != CHUNKS:
        raise ValueError(f"shares must be [{len(holders)}, secrets, {CHUNKS}], "
                         f"not {list(shares.shape)}")
    if (shares < 0).any() or (shares >= P).any():
        raise ValueError("a share lies outside the field")
    w = lagrange_at_zero(holders)
    t, s, _ = shares.shape
    rebuilt = (w @ shares.reshape(t, s * CHUNKS)) % P
    return chunks_to_secrets(rebuilt.reshape(s, CHUNKS))


def consistent(holders: Sequence[int], shares: np.ndarray, t: int) -> np.ndarray:
    """[S] bool: whether each secret's shares from all the given holders (more than t) lie
    on one polynomial of degree < t; the polynomial through the first t is evaluated at
    the others. A False names a secret some holder's share of which is wrong."""
    holders = list(holders)
    shares = np.asarray(shares, dtype=np.int64)
    if len(holders) <= t:
        return np.ones(shares.shape[1], dtype=bool)
    base, rest = tuple(holders[:t]), holders[t:]
    ok = np.ones(shares.shape[1], dtype=bool)
    flat = shares.reshape(len(holders), -1)
    for i, h in enumerate(rest):
        w = _weights_at(base, point(h))
        predicted = (w @ flat[:t]) % P
        ok &= (predicted == flat[t + i]).reshape(shares.shape[1], CHUNKS).all(axis=1)
    return ok


@lru_cache(maxsize=1024)
def _weights_at(holders: tuple[int, ...], x: int) -> np.ndarray:
    """Lagrange weights evaluating, at point x, the polynomial through the holders' points."""
    xs = [point(h) for h in holders]
    w = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * (x - xm) % P
                den = den * (xj - xm) % P
        w.append(num * pow(den, -1, P) % P)
    return np.asarray(w, dtype=np.int64)


def share_bytes(share: np.ndarray) -> bytes:
    """One holder's share of one secret ([CHUNKS]) as 24 bytes."""
    return np.asarray(share, dtype="<u4").tobytes()


def shares_bytes(shares: np.ndarray) -> list[bytes]:
    """[S, CHUNKS] -> one 24-byte share per secret."""
    flat = np.ascontiguousarray(np.asarray(shares, dtype="<u4"))
    return [row.tobytes() for row in flat]


def share_from_bytes(data: bytes, what: str = "share") -> np.ndarray:
    if not isinstance(data, (bytes, bytearray)) or len(data) != SHARE_BYTES:
        raise ValueError(f"{what} must be {SHARE_BYTES} bytes")
    v = np.frombuffer(bytes(data), dtype="<u4").astype(np.int64)
    if (v >= P).any():
        raise ValueError(f"{what} holds a value outside the field")
    return v


def stack_shares(rows: Iterable[Sequence[bytes]]) -> np.ndarray:
    """[holders, S, CHUNKS] from each holder's list of S share byte strings."""
    return np.asarray([[share_from_bytes(b) for b in row] for row in rows], dtype=np.int64)

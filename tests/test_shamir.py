"""The prime-field Shamir sharing (node/privacy/shamir.py), checked against a plain-Python
reference written here (polynomial evaluation and Lagrange interpolation on Python
integers), for the threshold (any t shares rebuild; t - 1 are consistent with every
secret), and for what a wrong share or a malformed one does."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbus.node.privacy import shamir
from fedbus.node.privacy.shamir import CHUNKS, P

# --- the reference: one chunk, one polynomial, Python integers --------------------------

def ref_eval(coeffs: list[int], x: int) -> int:
    return sum(c * pow(x, k, P) for k, c in enumerate(coeffs)) % P


def ref_interpolate_at(points: list[tuple[int, int]], x: int) -> int:
    total = 0
    for j, (xj, yj) in enumerate(points):
        num, den = 1, 1
        for m, (xm, _) in enumerate(points):
            if m != j:
                num = num * (x - xm) % P
                den = den * (xj - xm) % P
        total = (total + yj * num * pow(den, -1, P)) % P
    return total


def ref_coefficients(points: list[tuple[int, int]]) -> list[int]:
    """The coefficients of the polynomial of degree < len(points) through them."""
    n = len(points)
    coeffs = [0] * n
    for j, (xj, yj) in enumerate(points):
        basis, den = [1], 1
        for m, (xm, _) in enumerate(points):
            if m == j:
                continue
            basis = [(a - xm * b) % P for a, b in zip([0] + basis, basis + [0])]
            den = den * (xj - xm) % P
        scale = yj * pow(den, -1, P) % P
        coeffs = [(c + scale * b) % P for c, b in zip(coeffs, basis)]
    return coeffs


def test_the_modulus_is_prime_and_the_int64_products_cannot_overflow():
    assert P < 1 << 25 and all(P % d for d in range(2, int(P ** 0.5) + 1))
    assert shamir.MAX_THRESHOLD * (P - 1) ** 2 < 2 ** 63
    assert (1 << shamir.CHUNK_BITS) <= P and CHUNKS * shamir.CHUNK_BITS >= 128


def test_shares_and_reconstruction_equal_the_reference():
    rng = np.random.default_rng(1)
    t, holders = 4, [0, 3, 5, 8, 11, 12]
    secrets = [os.urandom(16) for _ in range(3)]
    coeffs = rng.integers(0, P, size=(t - 1, 3, CHUNKS))
    shares = shamir.split(secrets, t, holders, coefficients=coeffs)
    chunks = shamir.secrets_to_chunks(secrets)
    for i, h in enumerate(holders):
        for s in range(3):
            for c in range(CHUNKS):
                poly = [int(chunks[s, c])] + [int(coeffs[k, s, c]) for k in range(t - 1)]
                assert shares[i, s, c] == ref_eval(poly, h + 1)
    pick = [5, 1, 3, 0]  # any t of them, in any order
    rebuilt = shamir.combine([holders[i] for i in pick], shares[pick])
    assert rebuilt == secrets
    for s in range(3):
        for c in range(CHUNKS):
            pts = [(holders[i] + 1, int(shares[i, s, c])) for i in pick]
            assert ref_interpolate_at(pts, 0) == chunks[s, c]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 8), st.randoms(use_true_random=False),
       st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=5))
def test_any_t_of_the_shares_rebuild_every_secret(t, extra, rnd, secrets):
    n = t + extra
    holders = rnd.sample(range(500), n)
    shares = shamir.split(secrets, t, holders)
    pick = rnd.sample(range(n), t)
    assert shamir.combine([holders[i] for i in pick], shares[pick]) == secrets
    assert shamir.consistent(holders, shares, t).all()


def test_t_minus_one_shares_fit_every_secret_equally_well():
    """For the t - 1 shares a coalition holds, and any other secret, exactly one choice of
    the random coefficients gives the same t - 1 shares for that secret (the polynomial
    through (0, other) and the t - 1 points): with uniform coefficients, what the
    coalition sees is distributed the same whatever the secret (Shamir's argument)."""
    t, holders = 5, [2, 7, 9, 20, 31, 40]
    secret, other = os.urandom(16), os.urandom(16)
    shares = shamir.split([secret], t, holders)
    seen = holders[:t - 1]
    chunks_other = shamir.secrets_to_chunks([other])[0]
    coeffs = np.zeros((t - 1, 1, CHUNKS), dtype=np.int64)
    for c in range(CHUNKS):
        pts = [(0, int(chunks_other[c]))] + [(h + 1, int(shares[i, 0, c]))
                                             for i, h in enumerate(seen)]
        poly = ref_coefficients(pts)
        assert poly[0] == chunks_other[c]
        coeffs[:, 0, c] = poly[1:]
    forged = shamir.split([other], t, holders, coefficients=coeffs)
    assert (forged[:t - 1] == shares[:t - 1]).all()  # the coalition's view: identical
    assert shamir.combine(holders[:t], forged[:t]) == [other]
    assert shamir.combine(holders[:t], shares[:t]) == [secret]


def test_fewer_than_t_shares_rebuild_something_else():
    """t - 1 shares interpolate a polynomial of lower degree: its value at 0 is not the
    secret (equal by chance with probability p^-6), and often not 16 bytes at all."""
    t, holders = 6, list(range(10))
    secret = os.urandom(16)
    shares = shamir.split([secret], t, holders)
    try:
        assert shamir.combine(holders[:t - 1], shares[:t - 1]) != [secret]
    except ValueError as err:
        assert "some share is wrong" in str(err)


def test_a_wrong_share_is_detected_when_more_than_t_shares_are_there():
    t, holders = 4, list(range(8))
    secrets = [os.urandom(16) for _ in range(5)]
    shares = shamir.split(secrets, t, holders)
    assert shamir.consistent(holders, shares, t).all()
    shares[6, 2, 3] = (shares[6, 2, 3] + 1) % P  # holder 6 lies about secret 2
    assert shamir.consistent(holders, shares, t).tolist() == [True, True, False, True, True]


def test_the_coefficients_are_field_elements_and_vary():
    draws = shamir._random_field((4, 3, CHUNKS))
    assert draws.min() >= 0 and draws.max() < P and len(np.unique(draws)) > 60
    a, b = shamir.split([bytes(16)], 3, [0, 1, 2]), shamir.split([bytes(16)], 3, [0, 1, 2])
    assert not (a == b).all()  # fresh coefficients each split


@pytest.mark.parametrize("secret", [bytes(16), b"\xff" * 16, bytes(range(16))])
def test_edge_secrets_round_trip_through_bytes(secret):
    holders = [0, 1, 2, 3]
    shares = shamir.split([secret], 3, holders)
    wire = [shamir.shares_bytes(shares[i]) for i in range(4)]
    assert all(len(w[0]) == shamir.SHARE_BYTES for w in wire)
    back = shamir.stack_shares([wire[i] for i in (3, 0, 2)])
    assert shamir.combine([3, 0, 2], back) == [secret]


def test_malformed_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="24 bytes"):
        shamir.share_from_bytes(b"\0" * 23)
    with pytest.raises(ValueError, match="outside the field"):
        shamir.share_from_bytes(np.full(CHUNKS, P, dtype="<u4").tobytes())
    with pytest.raises(ValueError, match="distinct"):
        shamir.split([bytes(16)], 2, [1, 1, 2])
    with pytest.raises(ValueError, match="threshold"):
        shamir.split([bytes(16)], 4, [1, 2, 3])
    with pytest.raises(ValueError, match="16 bytes"):
        shamir.split([b"short"], 1, [1])
    with pytest.raises(ValueError, match="outside"):
        shamir.point(P)
    shares = shamir.split([bytes(16)], 2, [0, 1, 2])
    with pytest.raises(ValueError, match=r"shares must be \[2"):
        shamir.combine([0, 1], shares)

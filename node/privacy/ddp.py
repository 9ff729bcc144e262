"""Distributed DP under secure aggregation (`privacy.dp = "client"`,
`privacy.secure_aggregation = true`, `privacy.dp_noise = "distributed"`): the clients add the
noise, in the integer ring secure aggregation masks in, so that the sum the server unmasks
already carries the full noise and no party ever holds the noiseless sum.

The mechanism: the distributed Skellam mechanism of Agarwal, Kairouz and Liu, "The Skellam
Mechanism for Differentially Private Federated Learning" (NeurIPS 2021, arXiv:2110.04995),
with the randomised Hadamard rotation and conditional randomised rounding of Kairouz, Liu
and Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning with Secure
Aggregation" (ICML 2021, arXiv:2102.06387). Each client, with its clipped sum form x
(||x||_2 <= C; client-level DP's weight delta, its weight 1 implied):

1. pads x with zeros to d = 2^k >= L values and rotates it: y = gamma H D x, H the
   orthonormal Walsh-Hadamard matrix, D a diagonal of random signs drawn from the round's
   public context (every client of a round and the server draw the same D: `rotation_signs`),
   gamma = `DDPParams.scale` a power of two;
2. rounds y to integers at random, each value up with probability its fractional part, and
   redraws until ||round(y)||_2 <= Delta2 (conditional rounding; Delta2 below, a redraw is
   needed with probability <= beta = 2^-20): its L2 sensitivity is then Delta2 whatever the
   draw, and its L1 sensitivity Delta1 = min(Delta2^2, sqrt(d) Delta2) (integer vectors);
3. adds Skellam noise Sk(lam, lam) = Poisson(lam) - Poisson(lam) per value, lam = mu /
   (2 n_min): variance mu / n_min, so any n_min survivors' noise sums to Sk with variance
   mu = (z Delta2)^2 exactly (a sum of independent Skellams is Skellam, variances adding);
4. hands the integers to secure aggregation, which masks them in Z_{2^b} (no clipping:
   secagg.ClientSession.mask(..., integers=True)).

The server unmasks sum_i (round(y_i) + noise_i) mod 2^b, reads it as a signed integer (the
ring holds it with overwhelming probability: `DDPParams.ring`), divides by gamma and undoes
the rotation (`server_decode`). It adds no noise of its own.

Accounting (per round; `round_rdp`): the sum of s survivors' noise is Sk with variance
mu_s = s mu / n_min, and releasing the survivors' sum plus it is the multi-dimensional
Skellam mechanism with sensitivities (Delta1, Delta2) for adding or removing one client.
Its RDP at integer order alpha > 1 is bounded (Agarwal, Kairouz, Liu 2021, the
multi-dimensional Skellam mechanism's RDP bound, Sec. 3 of arXiv:2110.04995) by

    eps(alpha) = alpha Delta2^2 / (2 mu_s)
                 + min(((2 alpha - 1) Delta2^2 + 6 Delta1) / (4 mu_s^2), 3 Delta1 / (2 mu_s)).

We could not read the paper's text here to quote its theorem number: the formula is the one
the authors' published accounting uses (google-research/federated,
distributed_dp/accounting_utils.py, `_skellam_rdp` with scale 1, i.e. in the integer
domain, which is where fedbus applies it). Poisson subsampling of clients (rate q =
federation.fraction, Engine._sample) amplifies it by Zhu and Wang, "Poisson Subsampled Renyi
Differential Privacy" (ICML 2019), Theorem 5 (the general upper bound for integer orders),
taking the smaller of the amplified and unamplified bounds per order as the authors'
accounting does. Rounds compose by adding RDP per order; the (epsilon, delta) conversion is
dp_accounting's (dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon).

Dropouts: each client's noise is calibrated for n_min = ceil((1 - secagg_dropout) x cohort)
survivors (the worst dropout the round tolerates). More survivors carry more noise than the
target; fewer carry less, and the epsilon charged is always the one for the survivors whose
sum was actually unmasked (`PrivacyLedger.charge_distributed`).

Assumptions: the clients follow the protocol (each adds its share of noise; noise of
clients colluding with the server is known to it and does not count: with c such clients of
s survivors the guarantee is that of variance (s - c) mu / n_min); the server sends the
parameters the run's config implies (clients recompute them: `DDPParams.check`); the
Poisson sampling of the cohort is hidden from the clients as under central client-level DP
(the server's secret seed) — the guarantee is against whoever sees the unmasked sums and
the models, the server included.
"""
from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

#: probability bound of one conditional-rounding redraw (Kairouz et al. 2021's beta)
BETA = 2.0 ** -20
#: per value and client, the noise exceeds the ring's per-client allowance with at most
#: this probability (`DDPParams.client_range`)
TAIL = 2.0 ** -64
#: RDP orders (integers: the Skellam bound and Zhu-Wang's Theorem 5 are for integer orders)
ORDERS = tuple(range(2, 65)) + (80, 96, 128, 192, 256)
#: gamma C >= SCALE_HEADROOM sqrt(d): rounding then inflates Delta2 by about 1 + 1e-3
SCALE_HEADROOM = 64.0


class DDPError(ValueError):
    pass


def padded_dim(length: int) -> int:
    """The smallest power of two >= length (>= 1)."""
    return 1 << max(0, int(length) - 1).bit_length()


def rotation_signs(context: bytes, d: int) -> np.ndarray:
    """d random signs (+-1.0) from the round's public context: the same for every client of
    the round and for the server (the rotation protects nothing secret; it spreads a
    vector's norm over its coordinates so that rounding and the ring's range bound it)."""
    key = hashlib.sha256(b"fedbus-ddp-rotation/" + bytes(context)).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(key, "little")))
    return rng.integers(0, 2, size=d).astype(np.float64) * 2.0 - 1.0


def hadamard(x: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of x (len a power of two): H x / sqrt(d),
    H symmetric, so the transform is its own inverse."""
    y = np.array(x, dtype=np.float64, copy=True)
    d = len(y)
    if d & (d - 1):
        raise DDPError(f"the Hadamard transform needs a power-of-two length, got {d}")
    h = 1
    while h < d:
        v = y.reshape(-1, 2, h)
        a, b = v[:, 0, :].copy(), v[:, 1, :]
        v[:, 0, :] += b
        v[:, 1, :] = a - b
        h *= 2
    return y / math.sqrt(d)


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """H D x (x padded with zeros to len(signs))."""
    padded = np.zeros(len(signs))
    padded[:len(x)] = x
    return hadamard(signs * padded)


def unrotate(y: np.ndarray, signs: np.ndarray, length: int) -> np.ndarray:
    """D H y, cut to `length`: the inverse of rotate."""
    return (signs * hadamard(y))[:length]


def poisson_tail(lam: float, p: float) -> float:
    """t with P(|Poisson(lam) - Poisson(lam)| >= t) <= p: |P1 - P2| >= t needs |Pi - lam|
    >= t/2 for one i, and a Poisson is sub-gamma (variance lam, scale 1/3), so each side
    is <= 2 exp(-(t/2)^2 / (2 (lam + t/6))) (Bernstein); t solves 4 exp(...) = p."""
    g = math.log(4.0 / p)
    a, b = 4.0 * g / 3.0, 8.0 * g * lam  # t^2 - a t - b >= 0
    return (a + math.sqrt(a * a + 4.0 * b)) / 2.0


@dataclass(frozen=True)
class DDPParams:
    """One round's distributed-DP parameters, which the server computes from the run's
    config and the round (its sum form's length, its cohort) and sends in each task."""

    clip: float  # C: the L2 bound of a client's sum form
    z: float  # the noise multiplier: total noise std z Delta2 (integer domain)
    length: int  # L: values of the sum form
    n_min: int  # each client's share is calibrated for this many survivors
    cohort: int  # sampled clients (the ring must hold that many inputs)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise DDPError(f"clip must be > 0, got {self.clip!r}")
        if not (math.isfinite(self.z) and self.z > 0):
            raise DDPError(f"noise multiplier must be > 0, got {self.z!r}")
        if int(self.length) < 1 or not 1 <= int(self.n_min) <= int(self.cohort):
            raise DDPError(f"need length >= 1 and 1 <= n_min <= cohort, got {self.length}, "
                           f"{self.n_min}, {self.cohort}")

    @classmethod
    def for_round(cls, privacy: Mapping[str, Any], length: int, cohort: int) -> DDPParams:
        n_min = max(1, math.ceil((1.0 - float(privacy["secagg_dropout"])) * cohort - 1e-9))
        return cls(float(privacy["dp_clip"]), float(privacy["dp_noise_multiplier"]),
                   int(length), min(n_min, cohort), int(cohort))

    # --- derived ---
    @property
    def dim(self) -> int:
        return padded_dim(self.length)

    @property
    def scale(self) -> float:
        """gamma: a power of two with gamma C >= SCALE_HEADROOM sqrt(d)."""
        return 2.0 ** math.ceil(math.log2(SCALE_HEADROOM * math.sqrt(self.dim) / self.clip))

    @property
    def delta2(self) -> float:
        """The L2 norm bound of a client's rounded vector (conditional rounding keeps it):
        min(gC + sqrt(d), sqrt((gC)^2 + d/4 + sqrt(2 ln(1/beta)) (gC + sqrt(d)/2)))
        (Kairouz, Liu, Steinke 2021, the conditional randomised rounding's norm bound)."""
        gc, d = self.scale * self.clip, self.dim
        b2 = math.sqrt(gc * gc + d / 4.0 + math.sqrt(2.0 * math.log(1.0 / BETA)) *
                       (gc + math.sqrt(d) / 2.0))
        return min(gc + math.sqrt(d), b2)

    @property
    def delta1(self) -> float:
        return min(self.delta2 ** 2, math.sqrt(self.dim) * self.delta2)

    @property
    def mu(self) -> float:
        """The target variance of the summed noise per value (integer domain)."""
        return (self.z * self.delta2) ** 2

    @property
    def lam(self) -> float:
        """Each client's Poisson rate: its noise Sk(lam, lam) has variance mu / n_min."""
        return self.mu / (2.0 * self.n_min)

    @property
    def client_range(self) -> int:
        """A bound on one client's integer value: |round(y)_i| <= Delta2, plus the noise's
        tail at TAIL (a value beyond it is not clipped; the ring just stops guaranteeing
        that the sum does not wrap)."""
        return math.ceil(self.delta2 + poisson_tail(self.lam, TAIL))

    def ring(self) -> Any:
        """The ring: cohort x client_range < 2^(bits-1), so the sum of the cohort's inputs
        does not wrap unless some value passed its allowance (probability <= cohort x d x
        TAIL)."""
        from fedbus.node.privacy.secagg import RingParams

        return RingParams.for_cohort(float(self.client_range), 0, self.cohort)

    def noise_std(self, survivors: int) -> float:
        """The std of the unmasked sum's noise per value, in the sum form's units."""
        return math.sqrt(survivors * self.mu / self.n_min) / self.scale

    def to_dict(self) -> dict[str, Any]:
        return {"clip": self.clip, "z": self.z, "length": int(self.length),
                "n_min": int(self.n_min), "cohort": int(self.cohort)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DDPParams:
        if not isinstance(d, Mapping) or set(d) != {"clip", "z", "length", "n_min", "cohort"}:
            raise DDPError(f"ddp must have keys clip, z, length, n_min, cohort, got {d!r}")
        return cls(float(d["clip"]), float(d["z"]), int(d["length"]), int(d["n_min"]),
                   int(d["cohort"]))

    def check(self, privacy: Mapping[str, Any]) -> None:
        """A client's check of the server's parameters against its own config: a server
        asking for less noise than the run's (a smaller z, a larger clip, a larger n_min
        than the dropout allows) is refused."""
        if self.z < float(privacy["dp_noise_multiplier"]) or \
                self.clip > float(privacy["dp_clip"]):
            raise DDPError(f"the server's distributed-DP parameters (z {self.z}, clip "
                           f"{self.clip}) ask for less noise than this run's config")
        most = math.ceil((1.0 - float(privacy["secagg_dropout"])) * self.cohort - 1e-9)
        if self.n_min > max(1, most):
            raise DDPError(f"n_min {self.n_min} exceeds what secagg_dropout allows "
                           f"({most} of {self.cohort})")


# --------------------------------------------------------------------------- clients

def conditional_round(y: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Randomised rounding of y (each value up with probability its fractional part:
    unbiased), redrawn until the L2 norm is <= bound (int64)."""
    lo = np.floor(y)
    frac = y - lo
    for _ in range(1000):
        r = lo + (rng.random(len(y)) < frac)
        if float(np.linalg.norm(r)) <= bound:
            return r.astype(np.int64)
    raise DDPError("conditional rounding failed 1000 times: the norm bound is wrong")


def skellam(lam: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sk(lam, lam) = Poisson(lam) - Poisson(lam), int64."""
    return rng.poisson(lam, size).astype(np.int64) - rng.poisson(lam, size).astype(np.int64)


def client_encode(vector: np.ndarray, params: DDPParams, context: bytes,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    """A client's sum form (float [L]) -> its noised integers (int64 [d]), to be masked:
    clipped to C (again: float rounding of an upstream clip must not pass it), rotated,
    scaled, rounded conditionally, its share of Skellam noise added. rng: a test's; None
    draws from the OS (secrets), so no one can recompute the noise."""
    x = np.asarray(vector, dtype=np.float64)
    if x.shape != (params.length,):
        raise DDPError(f"the sum form has {x.shape} values, the round {params.length}")
    if not np.all(np.isfinite(x)):
        raise DDPError("the sum form holds NaN or inf")
    norm = float(np.linalg.norm(x))
    if norm > params.clip:
        x = x * (params.clip / norm)
    if rng is None:
        rng = np.random.default_rng(secrets.randbits(128))
    y = params.scale * rotate(x, rotation_signs(context, params.dim))
    r = conditional_round(y, params.delta2, rng)
    return r + skellam(params.lam, params.dim, rng)


# --------------------------------------------------------------------------- server

def server_decode(summed: np.ndarray, params: DDPParams, context: bytes) -> np.ndarray:
    """The unmasked sum as signed integers (float64 [d], secagg.decode with frac_bits 0)
    -> the noised sum of the sum forms, float64 [L]: divided by gamma, rotated back."""
    v = np.asarray(summed, dtype=np.float64)
    if v.shape != (params.dim,):
        raise DDPError(f"the unmasked sum has {v.shape} values, the round {params.dim}")
    return unrotate(v / params.scale, rotation_signs(context, params.dim), params.length)


def sum_norm_bound(params: DDPParams, survivors: int) -> float:
    """A bound, in the sum form's units, on the L2 norm of an honest round's decoded noised
    sum: each survivor's rounded vector has norm <= Delta2, and every value of the summed
    noise (Sk with rate survivors x lam) is within its tail at TAIL (so the noise's norm is
    <= sqrt(d) x that). A larger sum was spoiled by some input (or wrapped)."""
    tail = poisson_tail(survivors * params.lam, TAIL)
    return (survivors * params.delta2 + math.sqrt(params.dim) * tail) / params.scale


def quantisation_bound(params: DDPParams, clients: int) -> float:
    """The L2 distance, in the sum form's units, between the sum of `clients` clients'
    decoded rounded vectors (no noise) and their exact sum: each rounding moves every
    value by < 1, so each client's error is < sqrt(d) / gamma (the rotation is
    orthonormal)."""
    return clients * math.sqrt(params.dim) / params.scale


def rounding_bias_bound(params: DDPParams) -> float:
    """A bound on |E[round(y)_i] - y_i| under conditional rounding: plain randomised
    rounding is unbiased, and conditioning on an event of probability >= 1 - beta moves
    each value's mean by at most beta / (1 - beta) (its error is within (-1, 1)); in the
    sum form's units, / gamma."""
    return BETA / (1.0 - BETA) / params.scale


# --------------------------------------------------------------------------- accounting

def skellam_rdp(alpha: int, delta1: float, delta2: float, mu: float) -> float:
    """The multi-dimensional Skellam mechanism's RDP at integer order alpha > 1, noise of
    variance mu per value, sensitivities Delta1, Delta2 (Agarwal, Kairouz, Liu 2021; see
    the module doc for the source of the formula)."""
    a = float(alpha)
    return a * delta2 ** 2 / (2.0 * mu) + min(
        ((2.0 * a - 1.0) * delta2 ** 2 + 6.0 * delta1) / (4.0 * mu ** 2),
        3.0 * delta1 / (2.0 * mu))


def subsampled_rdp(alpha: int, q: float, rdp) -> float:
    """Zhu and Wang (ICML 2019), Theorem 5: the RDP at integer order alpha >= 2 of a
    mechanism with RDP rdp(l) (l = 2..alpha) applied to a Poisson subsample of rate q:
    (1/(alpha-1)) log((1-q)^(alpha-1) (alpha q - q + 1) + C(alpha,2) q^2 (1-q)^(alpha-2)
    e^{rdp(2)} + 3 sum_{l=3}^{alpha} C(alpha,l) q^l (1-q)^(alpha-l) e^{(l-1) rdp(l)}).
    The smaller of it and rdp(alpha) is returned (both bound the RDP)."""
    from scipy.special import gammaln, logsumexp

    if q >= 1.0:
        return rdp(alpha)
    if q <= 0.0:
        return 0.0

    def log_comb(n: int, k: int) -> float:
        return float(gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1))

    lq, l1q = math.log(q), math.log1p(-q)
    ls = np.arange(3, alpha + 1)
    rest = (math.log(3.0) + gammaln(alpha + 1) - gammaln(ls + 1) - gammaln(alpha - ls + 1)
            + ls * lq + (alpha - ls) * l1q + (ls - 1) * np.array([rdp(int(l)) for l in ls]))
    terms = [(alpha - 1) * l1q + math.log(alpha * q - q + 1.0),
             log_comb(alpha, 2) + 2 * lq + (alpha - 2) * l1q + rdp(2), *rest.tolist()]
    return min(float(logsumexp(terms)) / (alpha - 1), rdp(alpha))


def round_rdp(params: DDPParams, survivors: int, q: float) -> np.ndarray:
    """The RDP (at ORDERS) of one round whose unmasked sum had `survivors` clients' noise,
    the cohort Poisson-sampled at rate q."""
    if survivors < 1:
        raise DDPError("a round with no survivor releases nothing to account")
    mu = survivors * params.mu / params.n_min
    d1, d2 = params.delta1, params.delta2
    cache: dict[int, float] = {}

    def rdp(a: int) -> float:
        if a not in cache:
            cache[a] = skellam_rdp(a, d1, d2, mu)
        return cache[a]

    return np.array([subsampled_rdp(a, q, rdp) for a in ORDERS])


def epsilon(rdp: np.ndarray, delta: float) -> float:
    """(epsilon, delta) from composed RDP at ORDERS (dp_accounting's conversion)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    if not np.any(rdp):
        return 0.0
    eps, _ = compute_epsilon(list(ORDERS), list(map(float, rdp)), float(delta))
    return float(eps)

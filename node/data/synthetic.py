"""FedProx's synthetic(alpha, beta) data (Li et al., MLSys 2020), as its
``generate_synthetic.py`` builds it, with a seeded numpy Generator.

For each of 30 users k (60 features, 10 classes):

    n_k      = int(lognormal(4, 2)) + 50                 samples of user k
    u_k      ~ N(0, alpha)         W_k ~ N(u_k, 1) [60, 10]    b_k ~ N(u_k, 1) [10]
    B_k      ~ N(0, beta)          v_k ~ N(B_k, 1) [60]
    x        ~ N(v_k, Sigma),      Sigma = diag(j^-1.2), j = 1..60
    y        = argmax(softmax(x W_k + b_k))

(``iid=True`` is FedProx's synthetic_iid: one global W, b ~ N(0, 1) and
v_k = B_k for every coordinate.) The natural partition is one user per client.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_USERS = 30
DIMENSION = 60
NUM_CLASSES = 10


@dataclass
class SyntheticData:
    """The users' data plus the latent parameters that generated it (for tests and study)."""

    x: list[np.ndarray]        # per user, float64 [n_k, 60]
    y: list[np.ndarray]        # per user, int64 [n_k]
    samples: np.ndarray        # int64 [users]
    mean_w: np.ndarray         # u_k [users] (mean of W_k and of b_k)
    B: np.ndarray              # B_k [users]
    mean_x: np.ndarray         # v_k [users, 60]
    W: list[np.ndarray]        # W_k [60, 10]
    b: list[np.ndarray]        # b_k [10]
    cov_diag: np.ndarray       # diag of Sigma [60]


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def generate_synthetic(alpha: float, beta: float, *, seed: int, iid: bool = False,
                       num_users: int = NUM_USERS, dimension: int = DIMENSION,
                       num_classes: int = NUM_CLASSES) -> SyntheticData:
    """FedProx's generate_synthetic(alpha, beta, iid), drawing from ``default_rng(seed)``."""
    if alpha < 0 or beta < 0:
        raise ValueError(f"synthetic: alpha and beta must be >= 0, got {alpha}, {beta}")
    rng = np.random.default_rng(seed)
    samples = rng.lognormal(4, 2, num_users).astype(np.int64) + 50
    mean_w = rng.normal(0, alpha, num_users)
    mean_b = mean_w
    B = rng.normal(0, beta, num_users)
    cov_diag = np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2)
    mean_x = np.zeros((num_users, dimension))
    for k in range(num_users):
        mean_x[k] = np.ones(dimension) * B[k] if iid else rng.normal(B[k], 1, dimension)
    if iid:
        w_global = rng.normal(0, 1, (dimension, num_classes))
        b_global = rng.normal(0, 1, num_classes)
    xs, ys, Ws, bs = [], [], [], []
    sd = np.sqrt(cov_diag)
    for k in range(num_users):
        W = rng.normal(mean_w[k], 1, (dimension, num_classes))
        b = rng.normal(mean_b[k], 1, num_classes)
        if iid:
            W, b = w_global, b_global
        # x ~ N(v_k, diag(Sigma)): Sigma is diagonal, so this is multivariate_normal exactly
        xx = mean_x[k] + rng.standard_normal((int(samples[k]), dimension)) * sd
        yy = np.argmax(softmax(xx @ W + b), axis=1).astype(np.int64)
        xs.append(xx)
        ys.append(yy)
        Ws.append(W)
        bs.append(b)
    return SyntheticData(xs, ys, samples, mean_w, B, mean_x, Ws, bs, cov_diag)

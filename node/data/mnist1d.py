"""MNIST-1D (Greydanus & Kobak, 2020/2024), generated offline with a seeded
numpy Generator, following the procedure of the paper and its reference code
(greydanus/mnist1d, ``make_dataset`` and ``transform``):

1. ten hand-made 12-point templates, one per digit, whitened, shifted to start
   at 0 and divided by 6;
2. per sample: pad with 36..60 zeros on the right, linearly resample to
   12 + 60 = 72 points, scale by 1 + 0.4 (u - 0.5), roll right by 0..47
   points, fill the zero (padding) region with Gaussian-filtered noise
   (sigma 2, scale 0.25), add iid noise (scale 0.02), shear by a linear ramp
   of slope 0.75 (u - 0.5), and resample to 40 points;
3. the whole set is centred and scaled to unit standard deviation.

Same seed -> the same samples; the reference's own 4,000/1,000 file came from
its global numpy seed 42, so the values differ but the distribution is the same.
"""
from __future__ import annotations

import numpy as np
from scipy.ndimage import gaussian_filter1d

TEMPLATE_LEN = 12
PADDING = (36, 60)
SCALE_COEFF = 0.4
MAX_TRANSLATION = 48
CORR_NOISE_SCALE = 0.25
IID_NOISE_SCALE = 2e-2
SHEAR_SCALE = 0.75
FINAL_SEQ_LENGTH = 40


def templates() -> np.ndarray:
    """The ten digit templates, [10, 12]."""
    d = np.asarray([
        [5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5],
        [5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5],
        [5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5],
        [5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5],
        [5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5],
        [5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5],
        [5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5],
        [5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5],
        [5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5],
        [5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5],
    ], dtype=np.float64)
    d -= d.mean(1, keepdims=True)
    d /= d.std(1, keepdims=True)
    d -= d[:, :1]
    return d / 6.0


def _resample(x: np.ndarray, n: int) -> np.ndarray:
    return np.interp(np.linspace(0, 1, n), np.linspace(0, 1, len(x)), x)


def transform(x: np.ndarray, rng: np.random.Generator, eps: float = 1e-8) -> np.ndarray:
    """One random MNIST-1D sample (length 40) from template ``x``."""
    low, high = PADDING
    p = low + int(rng.random() * (high - low + 1))
    new = np.concatenate([x + eps, np.zeros(p)])                       # pad
    new = _resample(new, TEMPLATE_LEN + high)                          # dilate
    new = new * (1 + SCALE_COEFF * (rng.random() - 0.5))               # scale
    k = int(rng.integers(MAX_TRANSLATION))
    new = np.roll(new, k)                                              # translate
    mask = new != 0
    corr = gaussian_filter1d(CORR_NOISE_SCALE * rng.standard_normal(new.shape), 2)
    new = np.where(mask, new, corr)                                    # correlated noise
    new = new + IID_NOISE_SCALE * rng.standard_normal(new.shape)       # iid noise
    coeff = SHEAR_SCALE * (rng.random() - 0.5)
    new = new - coeff * np.linspace(-0.5, 0.5, len(new))               # shear
    return _resample(new, FINAL_SEQ_LENGTH)                            # subsample


def make_mnist1d(num_samples: int = 5000, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``num_samples // 10`` samples per digit, shuffled and standardised:
    x float32 [N, 40] (mean 0, std 1 over the set), y int64 [N]."""
    if num_samples < 10:
        raise ValueError(f"mnist1d: num_samples must be >= 10, got {num_samples}")
    rng = np.random.default_rng(seed)
    t = templates()
    per_class = num_samples // 10
    xs = np.stack([transform(t[c], rng) for c in range(10) for _ in range(per_class)])
    ys = np.repeat(np.arange(10, dtype=np.int64), per_class)
    order = rng.permutation(len(ys))
    xs, ys = xs[order], ys[order]
    xs = (xs - xs.mean()) / xs.std()
    return xs.astype(np.float32), ys

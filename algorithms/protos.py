"""Prototype mathematics shared by the prototype algorithms, vectorised on the
device: per-class sums by index_add over features the loss already computed,
never a Python loop over samples."""
from __future__ import annotations

import numpy as np
import torch


def class_sums(features: torch.Tensor, labels: torch.Tensor,
               num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class feature sums [C, D] and counts [C] (int64)."""
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype,
                       device=features.device)
    sums.index_add_(0, labels, features)
    counts = torch.bincount(labels, minlength=num_classes)
    return sums, counts


def class_means(features: torch.Tensor, labels: torch.Tensor,
                num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean features [C, D] (zero rows for absent classes) and counts."""
    sums, counts = class_sums(features, labels, num_classes)
    means = sums / counts.clamp(min=1).unsqueeze(1).to(sums.dtype)
    return means, counts


@torch.no_grad()
def local_prototypes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     num_classes: int, batch: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Mean features per class over a client's data (model in eval mode),
    as ("protos" float32 [C, D], "counts" int64 [C]) for the wire."""
    was_training = model.training
    model.eval()
    sums, counts = None, None
    for i in range(0, len(y), batch):
        s, c = class_sums(model.features(x[i:i + batch]).float(), y[i:i + batch], num_classes)
        sums = s if sums is None else sums + s
        counts = c if counts is None else counts + c
    model.train(was_training)
    if sums is None:
        raise ValueError("no samples to compute prototypes from")
    means = sums / counts.clamp(min=1).unsqueeze(1).to(sums.dtype)
    return means.cpu().numpy().astype(np.float32), counts.cpu().numpy().astype(np.int64)


def nearest_prototype(features: torch.Tensor, protos: torch.Tensor,
                      allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Class of the nearest prototype by L2 distance. `allowed` is a bool mask
    [C]: classes outside it (e.g. without a global prototype) never win."""
    dist = torch.cdist(features.float(), protos.float())
    if allowed is not None:
        dist[:, ~allowed] = float("inf")
    return dist.argmin(dim=1)


@torch.no_grad()
def embeddings(model: torch.nn.Module, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """features(x) for every row of x, in eval mode, batched, as float32 on
    x's device ([0, feature_dim] when x is empty needs the caller's D)."""
    was_training = model.training
    model.eval()
    out = [model.features(x[i:i + batch]).float() for i in range(0, len(x), batch)]
    model.train(was_training)
    if not out:
        raise ValueError("no samples to embed")
    return torch.cat(out, 0)


def minmax_channels(protos: np.ndarray) -> np.ndarray:
    """Min-max normalise each prototype (last axis = channels) to [0, 1]:
    (p - min p) / (max p - min p); a constant prototype becomes zeros."""
    p = np.asarray(protos, dtype=np.float64)
    lo = p.min(axis=-1, keepdims=True)
    span = p.max(axis=-1, keepdims=True) - lo
    return np.where(span > 0, (p - lo) / np.where(span > 0, span, 1.0), 0.0)


def aggregate_prototypes(protos: np.ndarray, counts: np.ndarray,
                         weights: np.ndarray | None = None,
                         by_count: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per-class weighted mean of client prototypes (server side, float64 sums).

    protos [N, C, D] and counts [N, C] of N clients (count 0 = the client lacks
    the class; its row is ignored), weights [N] per client (e.g. the engine's
    staleness weight; default 1). Client i's prototype of class k weighs
    a_ik = w_i * counts_ik when `by_count` (FedProto eq. 6's |D_i,k| / N_k),
    else w_i * [counts_ik > 0] (the unweighted mean over the clients that have
    the class: Qiao et al.'s eq. 3, and FedProto's reference code).
    Returns (mean float32 [C, D], zero rows for classes nobody has;
    mass float64 [C] = sum_i a_ik, > 0 exactly where the class is present)."""
    p = np.asarray(protos, dtype=np.float64)
    n = np.asarray(counts, dtype=np.float64)
    if p.ndim != 3 or n.shape != p.shape[:2]:
        raise ValueError(f"protos [N, C, D] and counts [N, C] expected, got {p.shape}, {n.shape}")
    w = np.ones(p.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    a = np.where(n > 0, n if by_count else 1.0, 0.0) * w[:, None]
    mass = a.sum(axis=0)
    total = (a[:, :, None] * p).sum(axis=0)
    mean = np.where(mass[:, None] > 0, total / np.where(mass > 0, mass, 1.0)[:, None], 0.0)
    return mean.astype(np.float32), mass


def merge_prototypes(old: np.ndarray, old_has: np.ndarray, new: np.ndarray,
                     new_has: np.ndarray, keep_missing: bool = True
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Fold freshly aggregated prototypes into the global ones: classes in
    `new_has` take the new row; the others keep their old row (keep_missing)
    or are dropped (zero row, has False). Returns new arrays (float32, bool)."""
    new_has = np.asarray(new_has, dtype=bool)
    if keep_missing:
        has = new_has | np.asarray(old_has, dtype=bool)
        protos = np.where(new_has[:, None], new, old)
    else:
        has = new_has.copy()
        protos = np.where(new_has[:, None], new, 0.0)
    return np.asarray(protos, dtype=np.float32), has


@torch.no_grad()
def prototype_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                       protos: torch.Tensor, allowed: torch.Tensor | None = None,
                       batch: int = 512) -> float:
    """Accuracy of nearest-prototype inference (L2, over the `allowed` classes)
    on (x, y); nan without test samples or without any allowed prototype."""
    if len(y) == 0 or (allowed is not None and not bool(allowed.any())):
        return float("nan")
    h = embeddings(model, x, batch)
    pred = nearest_prototype(h, protos.to(h.device), None if allowed is None
                             else allowed.to(h.device))
    return float((pred == y).float().mean().item())

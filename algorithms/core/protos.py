"""Prototype mathematics shared by the prototype algorithms, vectorised on the
device: per-class sums by index_add over features the loss already computed,
never a Python loop over samples.

Dense (segmentation) data. When features are a map [B, D, h, w] (fedbus.models.segnet)
and labels are masks [B, H, W], every helper here works on pixels, as Michieli & Ozay do
for Pascal VOC ("class membership for the low-resolution feature map is obtained with
simple nearest neighbor downsampling of the full-resolution segmentation maps", S3.2):
the labels are downsampled to (h, w) by nearest neighbour (`downsample_labels`: feature
pixel (i, j) takes label pixel (floor(i H / h), floor(j W / w))), both are flattened to
samples (features [B h w, D], labels [B h w]) and the ignored pixels (label < 0, i.e. the
client's -100, or >= num_classes, e.g. VOC's 255) are dropped (`pixel_samples`). So a
class prototype is the mean feature over that class's pixels at feature resolution, and
"counts" [C] are pixel counts at feature resolution (the number of feature vectors each
mean is over: what a count-weighted aggregation must weigh). Classification inputs
([B, D] features, [B] labels) pass through unchanged.
Nearest-prototype inference on a map labels every feature pixel with its nearest
prototype's class; `prototype_metrics` scores that map at label resolution, upsampled
by nearest neighbour (each feature pixel's class covers its H/h x W/w block), against
the full-resolution masks: the same pixels and ground truth as the head's pixel accuracy
and mIoU (fedbus.algorithms.core.metrics.head_metrics), so "proto_acc"/"proto_miou" and
"acc"/"miou" compare like with like.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedbus.algorithms.core.handlers import ClientUpdate
from fedbus.algorithms.core.merge import PrototypeSums, weighted_sum
from fedbus.algorithms.core.metrics import HeadScores, confusion_matrix, dense_scores, head_metrics
from fedbus.algorithms.core.robust import Outcome, RobustRule, no_merged


def is_dense(labels: torch.Tensor) -> bool:
    """Per-pixel labels (masks [B, H, W]) rather than one label per sample."""
    return labels.dim() == 3


def downsample_labels(labels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Masks [B, H, W] at (h, w) by nearest neighbour: out[:, i, j] = labels[:, floor(i H /
    h), floor(j W / w)] (torch's "nearest" rule, on integers, so no label is blended)."""
    H, W = labels.shape[-2:]
    h, w = int(size[0]), int(size[1])
    if (h, w) == (H, W):
        return labels
    rows = torch.div(torch.arange(h, device=labels.device) * H, h, rounding_mode="floor")
    cols = torch.div(torch.arange(w, device=labels.device) * W, w, rounding_mode="floor")
    return labels[..., rows[:, None], cols[None, :]]


def pixel_samples(features: torch.Tensor, labels: torch.Tensor,
                  num_classes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [M, D], labels [M]): dense features [B, D, h, w] with masks [B, H, W]
    become one sample per feature pixel with a valid label (labels downsampled to (h, w),
    ignored pixels dropped: < 0, or >= num_classes when given); [B, D] features with [B]
    labels are returned as they are."""
    if features.dim() != 4:
        return features, labels
    d = features.shape[1]
    y = downsample_labels(labels, features.shape[2:]).reshape(-1)
    f = features.permute(0, 2, 3, 1).reshape(-1, d)
    keep = y >= 0
    if num_classes is not None:
        keep &= y < num_classes
    return f[keep], y[keep]


def class_counts(labels: torch.Tensor, num_classes: int,
                 size: tuple[int, int] | None = None) -> torch.Tensor:
    """int64 [C]: samples per class of labels [N], or for masks [N, H, W] valid pixels per
    class, at `size` (h, w) after nearest-neighbour downsampling when given (the feature
    resolution: what prototype counts count), else at label resolution."""
    if is_dense(labels):
        if size is not None:
            labels = downsample_labels(labels, size)
        labels = labels.reshape(-1)
        labels = labels[(labels >= 0) & (labels < num_classes)]
    return torch.bincount(labels, minlength=num_classes)[:num_classes]


def class_sums(features: torch.Tensor, labels: torch.Tensor,
               num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class feature sums [C, D] and counts [C] (int64); dense maps per pixel."""
    features, labels = pixel_samples(features, labels, num_classes)
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


@torch.inference_mode()
def local_prototypes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     num_classes: int, batch: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Mean features per class over a client's data (model in eval mode),
    as ("protos" float32 [C, D], "counts" int64 [C]) for the wire."""
    was_training = model.training
    model.eval()
    sums, counts = None, None
    if is_dense(y):
        batch = min(batch, 64)  # a dense network's activations are per pixel
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
    [C]: classes outside it (e.g. without a global prototype) never win.
    Features [N, D] -> [N]; a dense map [B, D, h, w] -> a class map [B, h, w]."""
    if features.dim() == 4:
        b, d, h, w = features.shape
        flat = features.permute(0, 2, 3, 1).reshape(-1, d)
        return nearest_prototype(flat, protos, allowed).reshape(b, h, w)
    dist = torch.cdist(features.float(), protos.float())
    if allowed is not None:
        dist[:, ~allowed] = float("inf")
    return dist.argmin(dim=1)


@torch.no_grad()
def embeddings(model: torch.nn.Module, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """features(x) for every row of x, in eval mode, batched, as float32 on
    x's device ([0, feature_dim] when x is empty needs the caller's D; dense
    networks give maps [N, D, h, w])."""
    was_training = model.training
    model.eval()
    out = [model.features(x[i:i + batch]).float() for i in range(0, len(x), batch)]
    model.train(was_training)
    if not out:
        raise ValueError("no samples to embed")
    return torch.cat(out, 0)


@torch.no_grad()
def labelled_embeddings(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                        batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [M, D], labels [M]) of (x, y): one row per sample, or for dense data
    one row per feature pixel with a valid label (`pixel_samples`)."""
    h = embeddings(model, x, min(batch, 64) if is_dense(y) else batch)
    return pixel_samples(h, y)


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
    return prototype_means((a[:, :, None] * p).sum(axis=0), mass), mass


def prototype_means(sums: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """float32 [C, D]: sums [C, D] / mass [C] per class, zero rows where mass is 0 (the
    division of aggregate_prototypes and of a merge rule's summed form alike)."""
    mass = np.asarray(mass, dtype=np.float64)
    mean = np.where(mass[:, None] > 0, sums / np.where(mass > 0, mass, 1.0)[:, None], 0.0)
    return mean.astype(np.float32)


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


def fold_prototypes(old: np.ndarray, old_has: np.ndarray, updates: list[ClientUpdate],
                    merge: PrototypeSums, params: Mapping[str, Any], key: str = "protos",
                    keep_missing: bool = True, robust: RobustRule | None = None,
                    outcome: Outcome | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One aggregation's per-class vectors folded into the global ones (FedProto's eq. 6,
    FD's per-class mean logits, FedAvg-proto's eq. 3). Returns (global float32 [C, D],
    has bool [C], received bool [C]: the classes this aggregation gave a value), new
    arrays (old and old_has are not written).

    `updates` (at least one) carry payload[key] [C, D] (client i's class means p_ik:
    "protos", FD's "logits") and payload["counts"] [C] (0 = class absent), or are merged
    (u.members: a relay's or secure aggregation's sum form of `merge`). Per class k:
    - robust None, single updates only: aggregate_prototypes over the payloads with the
      engine's staleness weights w_i, sum_i a_ik p_ik / sum_i a_ik in float64, a_ik = w_i
      |D_i,k| where `merge` weighs by count under `params` (params[merge.by_count_param]
      == merge.by_count_value, the option merge.lift reads: "aggregate" = "weighted"),
      else w_i [|D_i,k| > 0]; received where the mass sum_i a_ik > 0;
    - robust None, a merged update among them: prototype_means of weighted_sum(updates,
      merge, params), sum_e w_e (sums_e, mass_e) over merged payloads as they are and
      single ones lifted: the same mean up to float64 rounding ((a p) w against (a w) p;
      bit for bit where every w is 1);
    - robust a RobustRule: robust.per_class over the payloads of the clients that hold k
      (counts > 0), unweighted, `outcome` filled; a merged update raises (no_merged).
    The received classes then replace their global row; the others keep theirs
    (keep_missing) or are dropped (merge_prototypes)."""
    if not updates:
        raise ValueError("no update to fold into the global prototypes")
    if robust is not None:
        no_merged(updates, robust)
        new, received = robust.per_class(_stacked(updates, key),
                                         _stacked(updates, "counts") > 0, outcome)
    elif any(u.members for u in updates):
        total, _ = weighted_sum(updates, merge, params)
        new, received = prototype_means(total["sums"], total["mass"]), total["mass"] > 0
    else:
        by_count = params.get(merge.by_count_param) == merge.by_count_value
        new, mass = aggregate_prototypes(_stacked(updates, key), _stacked(updates, "counts"),
                                         np.array([u.weight for u in updates], dtype=np.float64),
                                         by_count=by_count)
        received = mass > 0
    protos, has = merge_prototypes(old, old_has, new, received, keep_missing)
    return protos, has, received


def _stacked(updates: list[ClientUpdate], key: str) -> np.ndarray:
    return np.stack([np.asarray(u.payload[key]) for u in updates])


@torch.inference_mode()
def prototype_metrics(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      protos: torch.Tensor, allowed: torch.Tensor | None = None,
                      batch: int = 512) -> dict[str, float]:
    """Nearest-prototype inference (L2, over the `allowed` classes) scored on (x, y):
    {"proto_acc"} for classification; for masks {"proto_acc" (pixel accuracy),
    "proto_miou"}, the class map upsampled to label resolution by nearest neighbour
    (module doc). nan without test samples or without any allowed prototype."""
    dense = is_dense(y)
    if len(y) == 0 or (allowed is not None and not bool(allowed.any())):
        return {"proto_acc": float("nan"), **({"proto_miou": float("nan")} if dense else {})}
    if not dense:
        h = embeddings(model, x, batch)
        pred = nearest_prototype(h, protos.to(h.device), None if allowed is None
                                 else allowed.to(h.device))
        return {"proto_acc": float((pred == y).float().mean().item())}
    num_classes = protos.shape[0]
    conf = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=y.device)
    was_training = model.training
    model.eval()
    batch = min(batch, 64)
    for i in range(0, len(y), batch):
        h = model.features(x[i:i + batch]).float()
        pred = nearest_prototype(h, protos.to(h.device), None if allowed is None
                                 else allowed.to(h.device))
        up = torch.nn.functional.interpolate(pred[:, None].float(), size=y.shape[-2:],
                                             mode="nearest")[:, 0].long()
        conf += confusion_matrix(up, y[i:i + batch], num_classes)
    model.train(was_training)
    acc, miou = dense_scores(conf)
    return {"proto_acc": acc, "proto_miou": miou}


@torch.inference_mode()
def prototype_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                       protos: torch.Tensor, allowed: torch.Tensor | None = None,
                       batch: int = 512) -> float:
    """Accuracy of nearest-prototype inference (L2, over the `allowed` classes)
    on (x, y) (pixel accuracy for masks); nan without test samples or without any
    allowed prototype."""
    return prototype_metrics(model, x, y, protos, allowed, batch)["proto_acc"]


def _forward_is_head_of_features(model: torch.nn.Module) -> bool:
    """Whether model(x) computes exactly head(features(x)): a fedbus ProtoNet whose
    forward is the base class's, with no hook on the whole network."""
    from fedbus.models.base import ProtoNet

    return (isinstance(model, ProtoNet) and type(model).forward is ProtoNet.forward
            and not model._forward_hooks and not model._forward_pre_hooks)


@torch.inference_mode()
def head_and_prototype_metrics(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                               protos: torch.Tensor, allowed: torch.Tensor | None = None,
                               batch: int = 512) -> dict[str, float]:
    """head_metrics(model, x, y, batch) updated with prototype_metrics(model, x, y, protos,
    allowed, batch), the same values bit for bit, from one feature pass over x instead of
    two: for per-sample labels the head is applied to the features the prototype
    inference uses (batch by batch, as model(x) would), when model(x) is head(features(x))
    (`_forward_is_head_of_features`). Otherwise (masks, other networks, no test sample,
    no allowed prototype) the two functions run as they are. The model is left in train
    mode, as head_metrics leaves it."""
    if (is_dense(y) or len(y) == 0 or (allowed is not None and not bool(allowed.any()))
            or not _forward_is_head_of_features(model)):
        out = head_metrics(model, x, y, batch)
        out.update(prototype_metrics(model, x, y, protos, allowed, batch))
        return out
    model.eval()
    scores = HeadScores()
    features = []
    for i in range(0, len(y), batch):
        h = model.features(x[i:i + batch])
        # kept before the head runs: a head may work in place on its input
        features.append(h.float().clone())
        scores.add(model.head(h), y[i:i + batch])
    model.train()
    h = torch.cat(features, 0)
    pred = nearest_prototype(h, protos.to(h.device), None if allowed is None
                             else allowed.to(h.device))
    return {**scores.result(), "proto_acc": float((pred == y).float().mean().item())}

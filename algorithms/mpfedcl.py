"""MP-FedCL: multi-prototype federated contrastive learning.

Yu Qiao, Md. Shirajum Munir, Apurba Adhikary, Huy Q. Le, Avi Deb Raha, Chaoning
Zhang, Choong Seon Hong, "MP-FedCL: Multiprototype Federated Contrastive Learning
for Edge Intelligence", IEEE Internet of Things Journal 2024, arXiv:2304.01950.

The paper's text was not reachable from this (offline) machine while this module
was written, so its equation numbers are not quoted; the references below are to
the parts of the method by name (Sec. "multi-prototype computation", "global
prototype pool", "local training"), and every choice the paper leaves open, or
that we could not check against it, is a PARAM with its default stated.

Method, per round (sync) or buffer (async)
------------------------------------------
Client i receives the global model weights and the global prototype pool.

1. Local training (paper: supervised loss + supervised contrastive learning
   against the pool). With z = features(x), y its label, the pool entries
   P = {p_{c,j}: mask[c, j]} (C classes, up to K entries each) and
   A(y) = {p_{y,j}: mask[y, j]} the entries of z's class,

       L = CE(head(z), y) + lam * L_con

       L_con = mean over samples with A(y) != {} of
               -1/|A(y)| * sum_{a in A(y)} log( exp(s(z, a)/tau)
                                                / sum_{p in P} exp(s(z, p)/tau) )

   the SupCon form (Khosla et al. 2020, L^sup_out) with the pool prototypes as
   the only anchors (as in FedPCL's prototype-wise contrastive loss, which
   MP-FedCL builds on); prototypes are constants (no gradient). s is the
   cosine similarity (PARAM sim="cosine", default) or the negative squared
   Euclidean distance (sim="l2"). tau = 0.07, lam = 1.0 by default. Samples
   whose class has no pool entry contribute only CE; before the first
   aggregation the pool is empty and the loss is plain CE.

2. Multi-prototype computation (paper: k-means, k centroids per class). After
   training, the client embeds its whole training set (eval mode) and, per
   class c present, runs k-means (scikit-learn KMeans, n_init = PARAM n_init,
   random_state derived from (ctx.seed, client, class)) on the raw embeddings:
   the k centroids are its k prototypes of class c. With fewer distinct
   embeddings than k, the distinct embeddings themselves are the prototypes
   and the remaining slots are marked missing (mask False).
   Variants by config:
   - SP-FedCL: k = 1 gives exactly the class means (no k-means is run).
   - DP-FedCL: cluster = "dbscan": DBSCAN(eps, min_samples) instead of
     k-means; each cluster's mean is a prototype, noise points are ignored,
     and only the k largest clusters are kept (ties: lower DBSCAN label
     first). A class whose embeddings are all noise falls back to its class
     mean as a single prototype (our choice: the class is not dropped).
   The update is {"protos": float32 [C, k, D], "mask": bool [C, k],
   "counts": int64 [C], "delta": {name: client weights - sent weights},
   "train_loss": float (only when a step ran: the wire refuses NaN)}.

3. Server (paper: FedAvg of the models + a global prototype pool).
   - Weights: global += sum_i w_i n_i delta_i / sum_i w_i n_i (FedAvg on
     deltas, w_i the staleness weight, n_i the client's sample count).
   - Pool, per class c, over the updates of this aggregation (sorted by
     client id, so arrival order does not matter):
       entries  U_c = union of the clients' valid prototypes of class c
                (valid: mask True and counts[c] > 0);
       weights  omega = w_i * n_{i,c} / m_{i,c} for each entry of client i
                (m_{i,c} = its number of valid slots of class c);
       average  avg_c = sum omega p / sum omega
                (= sum_i w_i n_ic mean_j p_icj / sum_i w_i n_ic: the
                count- and staleness-weighted class average);
       PARAM pool = "all" (default; the paper keeps every client's prototypes
                in the pool): U_c is kept whole;
                pool = "kmeans": if |U_c| > k, U_c is reduced to k entries by
                weighted k-means (sample_weight omega; random_state from the
                server seed, the aggregation count and c);
       padding  if |U_c| < k, the missing slots are filled with avg_c, so
                every class present has at least k entries;
       missing  a class no update has: with PARAM carry = True (default) it
                keeps its previous pool entries (so a partial round or a
                small async buffer does not wipe the pool), otherwise (or if
                it never had any) its pool is empty (mask all False).
     The task carries {"weights", "pool": float32 [C, K, D], "pool_mask":
     bool [C, K]} with K = k for pool="kmeans" and K = max(k, max_c |U_c|)
     for pool="all" (shorter classes are masked at the tail).
   Staleness: a stale update counts, with its weight w in the FedAvg part and
   in the averaged (padding) and server-k-means prototypes; in pool="all" its
   prototypes enter the pool as they are.

4. Inference ("proto_acc"): the class whose pool is nearest to the test
   embedding: min distance to any of its entries (PARAM infer="min", default)
   or mean distance to its entries (infer="mean"); the distance is
   1 - cosine (sim="cosine") or Euclidean (sim="l2"). Classes without pool
   entries never win. "acc"/"loss" score the global model's head; the global
   weights are swapped in for evaluation and the local ones put back
   (fedbus.algorithms.fedavg.swapped_weights).

The weight half (task weights, FedAvg of deltas, global-model evaluation, the
local SGD loop) is inherited from fedbus.algorithms.fedavg; this module adds the
pool to the task, the contrastive term to the batch loss, the prototypes to the
update and the pool merge to the aggregation.

Defaults we could not check against the paper: k = 3 (the paper studies
several k; 3 is our default), n_init = 5, sim = "cosine" (the SupCon/FedPCL
convention), pool = "all". Scale: with pool = "all" the task grows with the
number of clients holding a class (K up to clients x k entries per class, e.g.
1000 clients x 3 x 10 classes x 512 dims x 4 B = 61 MB, beyond the default
64 MiB frame cap with the weights); large federations should use
pool = "kmeans", whose task is a fixed [C, k, D].
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.base import (ClientUpdate, Failure, LocalRun, RoundInfo, head_metrics,
                                    to_tensor)
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer, swapped_weights
from fedbus.algorithms.local import opt
from fedbus.algorithms.protos import class_means, embeddings

PARAMS: dict[str, Any] = {
    "k": opt(3, "prototypes per class per client (k=1: SP-FedCL, class means)", min=1),
    "lam": opt(1.0, "weight of the prototype contrastive loss", min=0.0),
    "tau": opt(0.07, "contrastive temperature", min=1e-6),
    "sim": opt("cosine", "similarity in the contrastive loss and distance at inference",
               ("cosine", "l2")),
    "cluster": opt("kmeans", "client clustering: kmeans (MP-FedCL) or dbscan (DP-FedCL)",
                   ("kmeans", "dbscan")),
    "n_init": opt(5, "k-means restarts (client and server)", min=1),
    "eps": opt(0.5, "dbscan: neighbourhood radius on the raw embeddings", min=0.0),
    "min_samples": opt(5, "dbscan: points to form a core point", min=1),
    "pool": opt("all", "server pool per class: all = union of client prototypes (paper), "
                "kmeans = reduced to k by weighted k-means", ("all", "kmeans")),
    "carry": opt(True, "classes absent from an aggregation keep their previous pool"),
    "infer": opt("min", "nearest-pool inference: min or mean distance to a class's entries",
                 ("min", "mean")),
}


# --- prototype mathematics --------------------------------------------------------

def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def kmeans_centers(x: np.ndarray, k: int, seed: int, n_init: int,
                   sample_weight: np.ndarray | None = None) -> np.ndarray:
    """k centroids of the rows of x; with k or fewer distinct rows, those rows
    (np.unique order), so the result may have fewer than k rows."""
    from sklearn.cluster import KMeans

    x = np.asarray(x, dtype=np.float64)
    uniq = np.unique(x, axis=0)
    if len(uniq) <= k:
        return uniq
    km = KMeans(n_clusters=k, n_init=n_init, random_state=seed)
    km.fit(x, sample_weight=sample_weight)
    return km.cluster_centers_


def dbscan_centers(x: np.ndarray, k: int, eps: float, min_samples: int) -> np.ndarray:
    """Means of the (at most k) largest DBSCAN clusters; noise ignored; all
    noise -> the mean of x as the single centre."""
    from sklearn.cluster import DBSCAN

    x = np.asarray(x, dtype=np.float64)
    labels = DBSCAN(eps=eps, min_samples=min_samples).fit(x).labels_
    keep = labels >= 0
    if not keep.any():
        return x.mean(axis=0, keepdims=True)
    ids, sizes = np.unique(labels[keep], return_counts=True)
    order = np.lexsort((ids, -sizes))[:k]  # largest first, ties by label
    sums = np.zeros((len(ids), x.shape[1]))
    np.add.at(sums, np.searchsorted(ids, labels[keep]), x[keep])
    return (sums / sizes[:, None])[order]


def client_prototypes(features: torch.Tensor, labels: torch.Tensor, num_classes: int, k: int,
                      *, cluster: str = "kmeans", seed: int = 0, n_init: int = 5,
                      eps: float = 0.5, min_samples: int = 5
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(protos float32 [C, k, D], mask bool [C, k], counts int64 [C]).

    k = 1 with k-means gives exactly the class means (no clustering)."""
    d = features.shape[1]
    counts = torch.bincount(labels, minlength=num_classes).cpu().numpy().astype(np.int64)
    protos = np.zeros((num_classes, k, d), dtype=np.float32)
    mask = np.zeros((num_classes, k), dtype=bool)
    if k == 1 and cluster == "kmeans":
        means, _ = class_means(features.float(), labels, num_classes)
        protos[:, 0] = means.cpu().numpy()
        mask[:, 0] = counts > 0
        return protos, mask, counts
    feats = features.detach().float().cpu().numpy()
    labs = labels.cpu().numpy()
    order = np.argsort(labs, kind="stable")
    bounds = np.searchsorted(labs[order], np.arange(num_classes + 1))
    for c in np.flatnonzero(counts):  # a loop over classes, never over samples
        xc = feats[order[bounds[c]:bounds[c + 1]]]
        if cluster == "kmeans":
            cent = kmeans_centers(xc, k, _seed(seed, c), n_init)
        else:
            cent = dbscan_centers(xc, k, eps, min_samples)
        protos[c, :len(cent)] = cent
        mask[c, :len(cent)] = True
    return protos, mask, counts


def merge_pool(protos: Sequence[np.ndarray], masks: Sequence[np.ndarray],
               counts: Sequence[np.ndarray], weights: Sequence[float], k: int, *,
               mode: str = "all", prev_pool: np.ndarray | None = None,
               prev_mask: np.ndarray | None = None, carry: bool = True, seed: int = 0,
               n_init: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """The global prototype pool from the clients' prototypes (see the module
    docstring): union per class, optionally reduced to k by weighted k-means,
    padded to k with the weighted class average, absent classes carried over."""
    num_classes = (prev_pool.shape[0] if prev_pool is not None else protos[0].shape[0])
    d = prev_pool.shape[2] if prev_pool is not None else protos[0].shape[2]
    rows: list[np.ndarray | None] = []
    if protos:
        p = np.stack([np.asarray(x, dtype=np.float64) for x in protos])  # [U, C, k', D]
        m = np.stack([np.asarray(x, dtype=bool) for x in masks])  # [U, C, k']
        n = np.stack([np.asarray(x, dtype=np.float64) for x in counts])  # [U, C]
        m = m & (n > 0)[:, :, None]
        slots = m.sum(axis=2)  # [U, C]
        omega_uc = np.asarray(weights, dtype=np.float64)[:, None] * n / np.maximum(slots, 1)
    for c in range(num_classes):
        if not protos or not m[:, c].any():
            rows.append(None)
            continue
        entries = p[:, c][m[:, c]]  # client-major order
        omega = np.broadcast_to(omega_uc[:, c, None], m[:, c].shape)[m[:, c]]
        avg = (omega[:, None] * entries).sum(0) / omega.sum() if omega.sum() > 0 \
            else entries.mean(0)
        if mode == "kmeans" and len(entries) > k:
            entries = kmeans_centers(entries, k, _seed(seed, c), n_init,
                                     sample_weight=omega if omega.sum() > 0 else None)
        if len(entries) < k:
            entries = np.concatenate([entries, np.repeat(avg[None], k - len(entries), 0)])
        rows.append(entries)
    if carry and prev_pool is not None:
        for c in range(num_classes):
            if rows[c] is None and prev_mask[c].any():
                rows[c] = np.asarray(prev_pool[c], dtype=np.float64)[np.asarray(prev_mask[c])]
    width = max([k] + [len(r) for r in rows if r is not None])  # = k for mode "kmeans"
    pool = np.zeros((num_classes, width, d), dtype=np.float32)
    pmask = np.zeros((num_classes, width), dtype=bool)
    for c, r in enumerate(rows):
        if r is not None:
            pool[c, :len(r)] = r
            pmask[c, :len(r)] = True
    return pool, pmask


def _similarity(z: torch.Tensor, p: torch.Tensor, sim: str) -> torch.Tensor:
    """[B, P] similarities s(z_b, p_j)."""
    if sim == "cosine":
        return F.normalize(z, dim=1) @ F.normalize(p, dim=1).T
    return -torch.cdist(z, p).pow(2)


def pool_contrastive_loss(z: torch.Tensor, y: torch.Tensor, pool: torch.Tensor,
                          pool_mask: torch.Tensor, tau: float, sim: str = "cosine"
                          ) -> torch.Tensor:
    """L_con of the module docstring: SupCon over the pool's prototype anchors."""
    c, kk, d = pool.shape
    flat = pool.reshape(c * kk, d).to(z.dtype)
    valid = pool_mask.reshape(c * kk)
    owner = torch.arange(c, device=z.device).repeat_interleave(kk)
    logits = _similarity(z, flat, sim) / tau
    logits = logits.masked_fill(~valid[None], float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    pos = (owner[None] == y[:, None]) & valid[None]
    n_pos = pos.sum(1)
    rows = n_pos > 0
    if not rows.any():
        return z.sum() * 0.0
    per = -torch.where(pos, log_prob, torch.zeros_like(log_prob)).sum(1)[rows] / n_pos[rows]
    return per.mean()


def pool_distances(z: torch.Tensor, pool: torch.Tensor, pool_mask: torch.Tensor,
                   sim: str = "cosine", infer: str = "min") -> torch.Tensor:
    """[B, C] distance of each embedding to each class's pool (inf: no entries)."""
    c, kk, d = pool.shape
    flat = pool.reshape(c * kk, d).to(z.dtype)
    dist = (1.0 - _similarity(z, flat, "cosine")) if sim == "cosine" else torch.cdist(z, flat)
    dist = dist.reshape(len(z), c, kk)
    valid = pool_mask[None].expand_as(dist)
    if infer == "min":
        out = dist.masked_fill(~valid, float("inf")).min(dim=2).values
    else:
        n = pool_mask.sum(1).to(dist.dtype)
        out = torch.where(valid, dist, torch.zeros_like(dist)).sum(2) / n.clamp(min=1)
        out = out.masked_fill(~pool_mask.any(1)[None], float("inf"))
    return out


# --- handlers ---------------------------------------------------------------------

class MPFedCLServer(FedAvgServer):
    """FedAvg of the weights (inherited, staleness-weighted) + the prototype pool."""

    PARAMS = PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.p = {key: self.param(key) for key in PARAMS}
        k, c, d = int(self.p["k"]), ctx.num_classes, ctx.feature_dim
        self.pool = np.zeros((c, k, d), dtype=np.float32)
        self.pool_mask = np.zeros((c, k), dtype=bool)
        self.aggregations = 0

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"weights": self.weights, "pool": self.pool, "pool_mask": self.pool_mask}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return self.make_task(client, info)

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = super().aggregate(updates, failures, info)  # the FedAvg part
        if not updates:
            return metrics
        ups = sorted(updates, key=lambda u: (u.client, u.version))
        self.pool, self.pool_mask = merge_pool(
            [u.payload["protos"] for u in ups], [u.payload["mask"] for u in ups],
            [u.payload["counts"] for u in ups], [float(u.weight) for u in ups],
            int(self.p["k"]), mode=self.p["pool"], prev_pool=self.pool,
            prev_mask=self.pool_mask, carry=bool(self.p["carry"]),
            seed=_seed(self.ctx.seed, self.aggregations), n_init=int(self.p["n_init"]))
        self.aggregations += 1
        metrics.update(pool_entries=float(self.pool_mask.sum()),
                       pool_classes=float(self.pool_mask.any(1).sum()))
        return metrics

    def update_spec(self) -> dict[str, Any]:
        c, k, d = self.ctx.num_classes, int(self.p["k"]), self.ctx.feature_dim
        return {**super().update_spec(), "protos": ("float32", (c, k, d)),
                "mask": ("bool", (c, k)), "counts": ("int64", (c,))}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pool": self.pool.copy(),
                "pool_mask": self.pool_mask.copy(), "aggregations": int(self.aggregations)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.pool = np.array(state["pool"], dtype=np.float32, copy=True)
        self.pool_mask = np.array(state["pool_mask"], dtype=bool, copy=True)
        self.aggregations = int(state["aggregations"])


class MPFedCLClient(FedAvgClient):
    """FedAvg's local loop with the contrastive term added to each batch loss;
    the prototypes are computed after training."""

    PARAMS = PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.p = {key: self.param(key) for key in PARAMS}

    def _pool(self, task: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        return (to_tensor(task["pool"], dev, torch.float32),
                to_tensor(task["pool_mask"], dev, torch.bool))

    def begin_local(self, task: Mapping[str, Any]) -> None:
        self._pool_t, self._pool_m = self._pool(task)
        self._use_con = float(self.p["lam"]) > 0 and bool(self._pool_m.any())

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if self._use_con:
            loss = loss + float(self.p["lam"]) * pool_contrastive_loss(
                h, y, self._pool_t, self._pool_m, float(self.p["tau"]), self.p["sim"])
        return loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        out = super().train(task, run)  # load global, begin_local, run_local, delta
        ctx, p, k = self.ctx, self.p, int(self.p["k"])
        if len(ctx.train_y) == 0:
            protos = np.zeros((ctx.num_classes, k, ctx.feature_dim), dtype=np.float32)
            mask = np.zeros((ctx.num_classes, k), dtype=bool)
            counts = np.zeros(ctx.num_classes, dtype=np.int64)
        else:
            feats = embeddings(ctx.model, ctx.train_x)
            protos, mask, counts = client_prototypes(
                feats, ctx.train_y, ctx.num_classes, k, cluster=p["cluster"],
                seed=_seed(ctx.seed, ctx.client), n_init=int(p["n_init"]),
                eps=float(p["eps"]), min_samples=int(p["min_samples"]))
        out.update(protos=protos, mask=mask, counts=counts)
        if np.isfinite(self.last_loss):  # the wire rejects NaN
            out["train_loss"] = float(self.last_loss)
        return out

    @torch.no_grad()
    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """The global model (swapped in, local weights restored after): head
        metrics and nearest-pool "proto_acc"."""
        ctx = self.ctx
        with swapped_weights(ctx.model, task["weights"]):
            out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
            pool, pool_mask = self._pool(task)
            if len(ctx.test_y) == 0 or not bool(pool_mask.any()):
                out["proto_acc"] = float("nan")
                return out
            z = embeddings(ctx.model, ctx.test_x)
        dist = pool_distances(z, pool, pool_mask, self.p["sim"], self.p["infer"])
        out["proto_acc"] = float((dist.argmin(1) == ctx.test_y).float().mean())
        return out


ALGORITHM = Algorithm("mpfedcl", MPFedCLServer, MPFedCLClient,
                      "MP-FedCL (Qiao et al.): k-means multi-prototypes, global prototype "
                      "pool, prototype-anchored supervised contrastive loss, FedAvg weights")

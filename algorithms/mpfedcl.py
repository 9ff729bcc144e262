"""MP-FedCL: multi-prototype federated contrastive learning.

Yu Qiao, Md. Shirajum Munir, Apurba Adhikary, Huy Q. Le, Avi Deb Raha, Chaoning
Zhang, Choong Seon Hong, "MP-FedCL: Multiprototype Federated Contrastive Learning
for Edge Intelligence", IEEE Internet of Things Journal 2024, arXiv:2304.01950.
No reference code is public. Equation numbers below are the paper's; the
equation-by-equation audit is docs/FIDELITY.md (mpfedcl). Our copy of the paper
lost the bodies of its numbered equations, so each is read from its
where-clause, the prose and the algorithms as described (the audit says where
that leaves a choice). Every choice where fedbus departs from the paper, or
where the paper is silent, is a PARAM.

Method, per round (sync) or buffer (async)
------------------------------------------
Client i receives the global model weights and the global prototype pool P
(Sec. III-C, Algorithm 1 line 10) and trains from the global weights.

1. Local training (Sec. IV-C, Algorithm 1 lines 11-16). With r = features(x)
   (Eq. 6), y = c its label, P_c the pool's entries of class c (Eq. 8) and
   N(c) the other classes:

       L = L_S + lam * L_R                                           (Eq. 12)
       L_S = CE(head(r), c)                                          (Eq. 1)
       L_R = -1/|P_c| sum_{p in P_c} log( exp(s(r, p)/tau)
                      / sum_{a in P_c u P_N(c)} exp(s(r, a)/tau) )   (Eq. 11)

   averaged over the batch's samples whose class has pool entries. This is
   the supervised contrastive loss of [65] (Khosla et al., L^sup_out) with
   the pool's prototypes as the only anchors; prototypes are constants (no
   gradient). s, PARAM sim: Eq. 11's where-clause calls it "the inner (dot)
   product", in the words of [65], whose inner product is taken between
   L2-normalised embeddings (SupCon normalises to the unit hypersphere, and
   tau = 0.07 is a temperature for unit vectors). sim = "cosine" (default:
   <r/||r||, p/||p||>, that reading); "dot" (the raw inner product <r, p>:
   in fedbus's MNIST benchmark setting it collapses training, 21% head /
   40% prototype accuracy against 96% with "cosine", one seed); "l2"
   (-||r - p||^2). tau = 0.07 (Sec. V-B, Table IV). Eq. 12 has no weight on
   L_R (Table I lists none): lam = 1. Before the first aggregation the pool
   is empty and L = L_S.
   Learning rate (Sec. V-B, Table IV): eta = 0.01 decayed by 0.95 per global
   round: the client sets lr = train.lr * lr_decay ** t with t the task's
   round (PARAM lr_decay = 0.95; 1.0 switches the decay off). SGD momentum
   0.5, batch 32, 1 local epoch are [train] settings (examples/).

2. Multi-prototype computation (Sec. IV-A, Eq. 7, Algorithm 1 lines 17-19).
   After training, the client embeds its whole training set (eval mode) and,
   per class c present, clusters the raw embeddings with k-means: the k
   centroids are its k prototypes of class c. The paper's k-means starts
   from randomly chosen centroids and iterates to convergence: scikit-learn
   KMeans(init = PARAM kmeans_init = "random", n_init = PARAM n_init = 1,
   random_state from (seed, client, class)); "k-means++" and n_init > 1 are
   options. With fewer distinct embeddings than k, the distinct embeddings
   themselves are the prototypes and the remaining slots are marked missing
   (K_i^c < k, padded by the server, step 3). k: the paper picks it per
   dataset (Sec. V-C, Table IV): 2 for MNIST (the default here), 4 for
   Digit-5 and Office-10, 3 for DomainNet.
   Variants (Sec. V-D):
   - SP-FedCL: k = 1 gives exactly the class means (no k-means is run: "we do
     not use any clustering algorithm in Eq. 7, but instead take the mean").
   - DP-FedCL: cluster = "dbscan": DBSCAN(eps, min_samples) instead of
     k-means, each cluster's mean a prototype, noise points ignored. The paper
     gives no DBSCAN parameters (eps = 0.5, min_samples = 5 are scikit-learn's
     defaults). fedbus differs in one point: the wire carries fixed
     [C, k, D] arrays, so only the k largest clusters are kept (ties: lower
     DBSCAN label first); set k to the most clusters you allow. A class whose
     embeddings are all noise falls back to its class mean (our choice).
   The update is {"protos": float32 [C, k, D], "mask": bool [C, k],
   "counts": int64 [C], "delta": {name: client weights - sent weights},
   "train_loss": float (only when a step ran: the wire refuses NaN)}.

3. Server (Sec. III-C, IV-B, Algorithm 1 lines 3-10).
   - Weights (Algorithm 1 line 9): global += sum_i w_i n_i delta_i /
     sum_i w_i n_i: FedAvg on deltas, w_i the engine's staleness weight (1
     when fresh), n_i the client's sample count.
   - Pool, per class c, from the updates of this aggregation (sorted by
     client id, so arrival order does not matter). A client's real
     prototypes of class c are its slots with mask True and counts[c] > 0;
     K_i^c is their number.
       Eq. 8  P_c = the real prototypes of c of every client that has c.
       Eq. 9  p-bar_c = the mean of P_c's entries ("summing up all the
              prototypes ... and dividing by the total number of prototypes
              in that group"): PARAM avg = "mean" (default; each entry
              weighted by its client's staleness weight, so the plain mean
              when all are fresh); avg = "count" weights each entry by
              w_i * n_ic / K_i^c (the class-count-weighted average of fedbus's
              former default).
       Eq. 10 padding, PARAM padding:
              "client" (default, Eq. 10 as written): every client of the
                  aggregation contributes k prototypes of every class that
                  anyone has: its own k when K_i^c = k, else k copies of
                  p-bar_c (also when it lacks c: "fill in the missing
                  classes"). With cluster = "dbscan" a client's clusters are
                  kept whenever it has any (its count is variable by design,
                  Sec. V-D) and only a missing class is filled with k copies.
              "fill": keep the client's K_i^c < k prototypes and fill the
                  remaining k - K_i^c slots with p-bar_c;
              "pool" (fedbus's former behaviour): no per-client padding; the
                  union P_c is padded with p-bar_c only when it holds fewer
                  than k entries.
     PARAM pool = "all" (default, the paper: the pool keeps every client's
     prototypes); pool = "kmeans" (a fedbus extension for large
     federations, not in the paper): P_c is reduced to k entries by k-means
     weighted like avg (padding then only tops a short class up to k).
     PARAM carry = True (default): a class no update of this aggregation has
     keeps its previous pool entries (a partial round or a small async buffer
     does not wipe it); False = empty. The paper's full participation never
     meets the case; with it the two coincide.
     The task carries {"weights", "round": t, "pool": float32 [C, K, D],
     "pool_mask": bool [C, K]}; K = k for pool = "kmeans", else the longest
     class (n_updates x k with padding = "client"); shorter classes are
     masked at the tail. Staleness: a stale update counts with its weight in
     the FedAvg part and in p-bar_c; its prototypes enter the pool as they are.

4. Inference ("proto_acc", Sec. IV-D, Eq. 13, Algorithm 2): the class whose
   pool entries are nearest: y-hat = argmin_c min_{p in P_c} ||r - p||_2.
   PARAM infer_dist = "l2" (default, Eq. 13) or "cosine" (1 - cosine);
   PARAM infer = "min" (default, Algorithm 2 lines 4-9) or "mean" (mean
   distance to a class's entries). Classes without pool entries never win.
   Which model embeds the test data, PARAM eval_model:
     "local" (default): the client's own model as its last local training
         left it (Sec. III-C: "the clients can use their individual updated
         local representations to compare with the updated global prototype
         pool"; the paper is personalised FL, Sec. I);
     "global": the global weights are swapped in and the local ones put back
         (fedbus's former behaviour; FedAvg's metric).
   "acc"/"loss" score the same model's classifier head.

The weight half (task weights, FedAvg of deltas, the local SGD loop) is
inherited from fedbus.algorithms.fedavg; this module adds the pool, the round
and the learning-rate decay to the task, the contrastive term to the batch
loss, the prototypes to the update and the pool merge to the aggregation.

Prototype space: the paper's prototypes are the input of the decision layer
(256-d for its MLP: Table II counts 5,120 = 10 classes x k = 2 x 256 numbers
on MNIST; Sec. IV-D "the output before the decision-making layer"). Here they
are `features()` of the model; fedbus's "mlp-fedcl" splits after the 512-d
encoder (see docs/FIDELITY.md (mpfedcl)).

Scale: with pool = "all" the task grows with the clients of an aggregation
(padding = "client": n x k entries per class, e.g. 1000 clients x 2 x 10
classes x 512 dims x 4 B = 41 MB, near the default 64 MiB frame cap with the
weights); large federations should use pool = "kmeans", a fixed [C, k, D].
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import ClientUpdate, Failure, LocalRun, RoundInfo, to_tensor
from fedbus.algorithms.core.merge import DeltaSumsAndPool
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.protos import class_means, embeddings
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer, swapped_weights

PARAMS: dict[str, Any] = {
    "k": opt(2, "prototypes per class per client (paper Table IV: MNIST 2, Digit-5/Office-10 4, "
             "DomainNet 3; k=1: SP-FedCL, class means)", min=1),
    "lam": opt(1.0, "weight of the contrastive loss L_R (eq. 12 has none: 1)", min=0.0),
    "tau": opt(0.07, "contrastive temperature (Table IV)", min=1e-6),
    "sim": opt("cosine", "similarity in the contrastive loss: cosine = eq. 11's inner product "
               "of L2-normalised vectors (as SupCon [65]), dot = raw inner product, l2 = "
               "-squared distance", ("cosine", "dot", "l2")),
    "lr_decay": opt(0.95, "client learning rate x lr_decay^round (Table IV: 0.95; 1 = off)",
                    min=0.0, max=1.0),
    "cluster": opt("kmeans", "client clustering: kmeans (MP-FedCL) or dbscan (DP-FedCL)",
                   ("kmeans", "dbscan")),
    "kmeans_init": opt("random", "k-means initial centroids: random (Sec. IV-A) or k-means++",
                       ("random", "k-means++")),
    "n_init": opt(1, "k-means restarts, best inertia kept (client and server; paper: 1)", min=1),
    "eps": opt(0.5, "dbscan: neighbourhood radius on the raw embeddings", min=0.0),
    "min_samples": opt(5, "dbscan: points to form a core point", min=1),
    "avg": opt("mean", "eq. 9 class average for padding: mean over the pool's entries (paper) "
               "or count = weighted by the clients' class counts", ("mean", "count")),
    "padding": opt("client", "eq. 10: client = each client k prototypes per class, the average "
                   "when it has fewer (paper); fill = keep its own, fill the rest; pool = pad the "
                   "class's union to k only", ("client", "fill", "pool")),
    "pool": opt("all", "server pool per class: all = every client's prototypes (paper), "
                "kmeans = reduced to k by weighted k-means (fedbus, for scale)", ("all", "kmeans")),
    "carry": opt(True, "classes absent from an aggregation keep their previous pool"),
    "infer_dist": opt("l2", "inference distance: l2 (eq. 13) or cosine", ("l2", "cosine")),
    "infer": opt("min", "nearest-pool inference: min (eq. 13, Algorithm 2) or mean distance to "
                 "a class's entries", ("min", "mean")),
    "eval_model": opt("local", "model scored at evaluation: local = the client's own updated "
                      "model (paper), global = the global weights (FedAvg's metric)",
                      ("local", "global")),
}


# --- prototype mathematics --------------------------------------------------------

def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def kmeans_centers(x: np.ndarray, k: int, seed: int, n_init: int = 1,
                   sample_weight: np.ndarray | None = None, init: str = "random") -> np.ndarray:
    """k centroids of the rows of x (eq. 7); with k or fewer distinct rows, those
    rows (np.unique order), so the result may have fewer than k rows."""
    from sklearn.cluster import KMeans

    x = np.asarray(x, dtype=np.float64)
    uniq = np.unique(x, axis=0)
    if len(uniq) <= k:
        return uniq
    km = KMeans(n_clusters=k, init=init, n_init=n_init, random_state=seed)
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
                      *, cluster: str = "kmeans", seed: int = 0, n_init: int = 1,
                      init: str = "random", eps: float = 0.5, min_samples: int = 5
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(protos float32 [C, k, D], mask bool [C, k], counts int64 [C]).

    k = 1 with k-means gives exactly the class means (no clustering: SP-FedCL)."""
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
            cent = kmeans_centers(xc, k, _seed(seed, c), n_init, init=init)
        else:
            cent = dbscan_centers(xc, k, eps, min_samples)
        protos[c, :len(cent)] = cent
        mask[c, :len(cent)] = True
    return protos, mask, counts


def merge_pool(protos: Sequence[np.ndarray], masks: Sequence[np.ndarray],
               counts: Sequence[np.ndarray], weights: Sequence[float], k: int, *,
               mode: str = "all", padding: str = "client", avg: str = "mean",
               cluster: str = "kmeans", prev_pool: np.ndarray | None = None,
               prev_mask: np.ndarray | None = None, carry: bool = True, seed: int = 0,
               n_init: int = 1, init: str = "random") -> tuple[np.ndarray, np.ndarray]:
    """The global prototype pool (eqs. 8-10) from the clients' prototypes, in the
    order given (see the module docstring): per class the clients' real
    prototypes, their average (eq. 9) and the padding (eq. 10), optionally
    reduced to k by weighted k-means; absent classes carried over."""
    num_classes = (prev_pool.shape[0] if prev_pool is not None else protos[0].shape[0])
    d = prev_pool.shape[2] if prev_pool is not None else protos[0].shape[2]
    rows: list[np.ndarray | None] = []
    if protos:
        p = np.stack([np.asarray(x, dtype=np.float64) for x in protos])  # [U, C, k', D]
        m = np.stack([np.asarray(x, dtype=bool) for x in masks])  # [U, C, k']
        n = np.stack([np.asarray(x, dtype=np.float64) for x in counts])  # [U, C]
        m = m & (n > 0)[:, :, None]
        slots = m.sum(axis=2)  # [U, C] = K_i^c
        w = np.asarray(weights, dtype=np.float64)[:, None]
        omega_uc = w * n / np.maximum(slots, 1) if avg == "count" else np.repeat(w, n.shape[1], 1)
    for c in range(num_classes):
        if not protos or not m[:, c].any():
            rows.append(None)
            continue
        entries = p[:, c][m[:, c]]  # eq. 8, client-major order
        omega = np.broadcast_to(omega_uc[:, c, None], m[:, c].shape)[m[:, c]]
        mean = (omega[:, None] * entries).sum(0) / omega.sum() if omega.sum() > 0 \
            else entries.mean(0)  # eq. 9
        if mode == "kmeans" or padding == "pool":
            if mode == "kmeans" and len(entries) > k:
                entries = kmeans_centers(entries, k, _seed(seed, c), n_init,
                                         sample_weight=omega if omega.sum() > 0 else None,
                                         init=init)
            if len(entries) < k:
                entries = np.concatenate([entries, np.repeat(mean[None], k - len(entries), 0)])
            rows.append(entries)
            continue
        blocks = []  # eq. 10, client by client
        for i in range(len(p)):
            own = p[i, c][m[i, c]]
            if padding == "client" and cluster == "dbscan" and len(own) > 0:
                blocks.append(own)  # DBSCAN's variable count is kept
                continue
            if padding == "client" and len(own) < k:
                own = own[:0]  # eq. 10: K_i^c < k -> all k slots are p-bar_c
            blocks.append(own)
            if len(own) < k:
                blocks.append(np.repeat(mean[None], k - len(own), 0))
        rows.append(np.concatenate(blocks))
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
    """[B, P] similarities s(z_b, p_j): inner product, cosine or -squared L2."""
    if sim == "dot":
        return z @ p.T
    if sim == "cosine":
        return F.normalize(z, dim=1) @ F.normalize(p, dim=1).T
    return -torch.cdist(z, p).pow(2)


def pool_contrastive_loss(z: torch.Tensor, y: torch.Tensor, pool: torch.Tensor,
                          pool_mask: torch.Tensor, tau: float, sim: str = "cosine"
                          ) -> torch.Tensor:
    """L_R of eq. 11 (module docstring): SupCon over the pool's prototype
    anchors, averaged over the samples whose class has pool entries."""
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
                   dist: str = "l2", infer: str = "min") -> torch.Tensor:
    """[B, C] distance of each embedding to each class's pool (inf: no entries);
    eq. 13 is dist = "l2", infer = "min"."""
    c, kk, d = pool.shape
    flat = pool.reshape(c * kk, d).to(z.dtype)
    out = (1.0 - _similarity(z, flat, "cosine")) if dist == "cosine" else torch.cdist(z, flat)
    out = out.reshape(len(z), c, kk)
    valid = pool_mask[None].expand_as(out)
    if infer == "min":
        return out.masked_fill(~valid, float("inf")).min(dim=2).values
    n = pool_mask.sum(1).to(out.dtype)
    out = torch.where(valid, out, torch.zeros_like(out)).sum(2) / n.clamp(min=1)
    return out.masked_fill(~pool_mask.any(1)[None], float("inf"))


# --- handlers ---------------------------------------------------------------------

def _client_prototypes(updates: list[ClientUpdate]) -> list[ClientUpdate]:
    """One update per client with its own prototypes: a relay's merged update carries its
    members' rows in its "pool" (fedbus.algorithms.core.merge.DeltaSumsAndPool)."""
    out = []
    for u in updates:
        if not u.members:
            out.append(u)
            continue
        pool = u.payload["pool"]
        for j, client in enumerate(pool["clients"]):
            out.append(ClientUpdate(int(client), {"protos": pool["protos"][j],
                                                  "mask": pool["mask"][j],
                                                  "counts": pool["counts"][j]},
                                    0, u.work, u.version, u.staleness, u.weight))
    return out


class MPFedCLServer(FedAvgServer):
    """FedAvg of the weights (inherited, staleness-weighted) + the prototype pool."""

    PARAMS = PARAMS
    # the weights' half sums at a relay; the pool (eqs. 8-10) travels whole beside it
    MERGE = DeltaSumsAndPool()

    def __init__(self, ctx):
        super().__init__(ctx)
        self.p = {key: self.param(key) for key in PARAMS}
        k, c, d = int(self.p["k"]), ctx.num_classes, ctx.feature_dim
        self.pool = np.zeros((c, k, d), dtype=np.float32)
        self.pool_mask = np.zeros((c, k), dtype=bool)
        self.aggregations = 0

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"weights": self.weights, "round": int(info.round), "pool": self.pool,
                "pool_mask": self.pool_mask}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        task = {"pool": self.pool, "pool_mask": self.pool_mask}
        if self.p["eval_model"] == "global":
            task["weights"] = self.weights
        return task

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = super().aggregate(updates, failures, info)  # the FedAvg part
        if not updates:
            return metrics
        ups = sorted(_client_prototypes(updates), key=lambda u: (u.client, u.version))
        p = self.p
        self.pool, self.pool_mask = merge_pool(
            [u.payload["protos"] for u in ups], [u.payload["mask"] for u in ups],
            [u.payload["counts"] for u in ups], [float(u.weight) for u in ups],
            int(p["k"]), mode=p["pool"], padding=p["padding"], avg=p["avg"],
            cluster=p["cluster"], prev_pool=self.pool, prev_mask=self.pool_mask,
            carry=bool(p["carry"]), seed=_seed(self.ctx.seed, self.aggregations),
            n_init=int(p["n_init"]), init=p["kmeans_init"])
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
    """FedAvg's local loop with the contrastive term added to each batch loss and
    the learning rate decayed by round; the prototypes are computed after
    training."""

    PARAMS = PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.p = {key: self.param(key) for key in PARAMS}

    def _pool(self, task: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        return (to_tensor(task["pool"], dev, torch.float32),
                to_tensor(task["pool_mask"], dev, torch.bool))

    def round_lr(self, task: Mapping[str, Any]) -> float:
        """train.lr x lr_decay ** round (Table IV's per-round decay)."""
        return float(self.ctx.train["lr"]) * float(self.p["lr_decay"]) ** int(task.get("round", 0))

    def begin_local(self, task: Mapping[str, Any]) -> None:
        lr = self.round_lr(task)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
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
                init=p["kmeans_init"], eps=float(p["eps"]), min_samples=int(p["min_samples"]))
        out.update(protos=protos, mask=mask, counts=counts)
        if np.isfinite(self.last_loss):  # the wire rejects NaN
            out["train_loss"] = float(self.last_loss)
        return out

    @torch.no_grad()
    def _scores(self, pool: torch.Tensor, pool_mask: torch.Tensor) -> dict[str, float]:
        ctx = self.ctx
        out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        if len(ctx.test_y) == 0 or not bool(pool_mask.any()):
            out["proto_acc"] = float("nan")
            return out
        z = embeddings(ctx.model, ctx.test_x)
        dist = pool_distances(z, pool, pool_mask, self.p["infer_dist"], self.p["infer"])
        out["proto_acc"] = float((dist.argmin(1) == ctx.test_y).float().mean())
        return out

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """Head metrics and nearest-pool "proto_acc" (eq. 13) of the client's own
        model (eval_model = "local") or of the global weights, swapped in and the
        local ones restored after ("global")."""
        pool, pool_mask = self._pool(task)
        if self.p["eval_model"] == "global":
            with swapped_weights(self.ctx.model, task["weights"]):
                return self._scores(pool, pool_mask)
        return self._scores(pool, pool_mask)


ALGORITHM = Algorithm("mpfedcl", MPFedCLServer, MPFedCLClient,
                      "MP-FedCL (Qiao et al.): k-means multi-prototypes, global prototype "
                      "pool, prototype-anchored supervised contrastive loss, FedAvg weights")

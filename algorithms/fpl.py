"""FPL: federated prototype learning under domain shift (cluster and unbiased prototypes).

Huang, Ye, Shi, Li, Du, "Rethinking Federated Learning with Domain Shift: A Prototype View",
CVPR 2023 (full text in ../shared/papers/fpl-huang-cvpr2023.txt). Reference code:
github.com/WenkeHuang/RethinkFL at 74201b3 (models/fpl.py `proto_aggregation`,
`hierarchical_info_loss`, `calculate_infonce`, `_train_net`, `agg_func`; utils/finch.py
`FINCH`; models/utils/federated_model.py `aggregate_nets`; main.py's defaults). Equation
numbers are the paper's (1-12; it has no appendix). Defaults follow the paper; where the
reference code differs, its behaviour is a named option.

What travels: the global model, averaged FedAvg-style (Algorithm 1, server side: theta <-
sum_m |D_m|/|D| theta_m; the participants "agree on sharing a model with the same
architecture", Sec. 3.1, and the paper evaluates that one global model), and per class k
the cluster prototypes P^k (eq. 5) and the unbiased prototype U^k (eq. 6). Every client
runs one architecture (`needs_same_model`).

Client m, per task (Algorithm 1, LocalUpdating):
- starts from the global model the task carries ("Distribute global parameter"), trains
  with eq. 12 over run.batches():
      L = L_CE + w_cpcl * L_CPCL + w_upcr * L_UPCR                   (eq. 12: w = 1, 1)
      L_CE   = CE(g(z_i), y_i)                                        (eq. 11)
      L_CPCL = -log( sum_{c in P^k} exp(s(z_i, c))
                     / sum_{c in P} exp(s(z_i, c)) )                  (eq. 8, k = y_i)
      s(z, c) = (z . c / (||z|| ||c||)) / tau                         (eq. 7)
      L_UPCR = sum_{v=1}^{d} (z_{i,v} - U^k_v)^2                      (eq. 10)
  z_i = f(x_i) the features (`model.features`), P = every class's cluster prototypes, the
  negatives N^k = P - P^k the other classes' clusters. Each term is averaged over the
  minibatch of B samples; a sample whose class has no global prototype adds 0 to the two
  prototype terms and still counts in B (the code's `loss_InfoNCE / i`, i the batch size).
  Before the first aggregation P and U are empty: CE alone (the code's `0 * lossCE`; the
  paper does not say). PARAMS `temperature` tau = 0.02 (Sec. 4.2: "we choose tau = 0.02 by
  default", Fig. 4; the code's --infoNCET), `cpcl_weight` = 1 and `upcr_weight` = 1 (eq.
  12 adds the three terms unweighted; Algorithm 1 likewise; the code too).
  PARAM `align_loss` picks eq. 10's form:
    "sum"  (default; eq. 10): the squared Euclidean distance, summed over the d dimensions;
    "mean" (the code's `nn.MSELoss()(f_now, mean_f_pos)`): the same averaged over the d
           dimensions, i.e. eq. 10 divided by d (512 for the paper's ResNet-10).
  The contrastive term is computed as log-sum-exp differences (mathematically eq. 8; the
  code exponentiates directly, which at tau = 0.02 stays finite, |s| <= 50). Eq. 7 as
  printed, z . c / (||z|| x ||c|| / tau), would be the cosine times tau; it is read as the
  cosine over tau, the usual temperature, which the code computes
  (`cosine_similarity(...) / self.infoNCET`) and Sec. 4.2 implies (smaller tau, sharper
  and at tau = 0.01 numerically unstable, "L = NaN").
- then its local prototypes (eq. 2; Algorithm 1's last loop "Local prototypes"):
  c_m^k = mean of f_m(x) over its samples of class k. PARAM `proto_source`:
    "after"  (default; Algorithm 1: computed after the T local epochs with the trained
             f_m): one eval-mode pass over the training data;
    "during" (the code's `agg_protos_label` in `_train_net` + `agg_func`): the mean of the
             features the training steps of the last local epoch computed (train mode, no
             extra pass). A run cut short mid-epoch (time budget, partial work) uses its
             last complete epoch, or the partial one when none completed.
- upload: {"delta": its weights minus the task's, "protos": float32 [C, D] (c_m^k, zero
  rows for absent classes), "counts": int64 [C] (its class sizes |S_m^k|, 0 = absent)}.
  The counts only say which classes are present: no server step weighs by them.
- evaluate: the global model the eval task carries, its classifier head on the client's
  test split (Sec. 4.1: Top-1 accuracy of "the final global model theta^E" on each
  domain's test data); the client's own weights are put back (FedAvg's evaluate).

Server, per aggregation (Algorithm 1, server side):
- the global model: theta <- theta + sum_m c_m delta_m / sum_m c_m, c_m = s_m |D_m| (s_m
  the engine's staleness weight, 1 when fresh): Algorithm 1's sum_m |D_m|/|D| theta_m, and
  the code's `aggregate_nets` under its default --averaing weight (fedbus.algorithms.fedavg).
- per class k, over the updates that hold k (counts > 0):
  * FINCH (Sarfraz et al., CVPR 2019, the paper's ref. [63]; `finch` below) clusters the
    prototypes {c_m^k} with the cosine distance: each prototype's first neighbour v_m^k is
    the other prototype of largest cosine similarity, and the adjacency of eq. 4, A(m, n) =
    1 if n = v_m or m = v_n or v_m = v_n, gives the first partition as its connected
    components. FINCH then repeats the step on the clusters' means to give coarser
    partitions, until one cluster would remain or the count stops falling.
    PARAM `partition` picks which partition gives the cluster prototypes:
      "first" (default): the partition of eq. 4, which is all the paper specifies ("we
              select several representative prototypes ... based on the clustering
              results via Eq. (4)");
      "last"  (the code's `c[:, -1]`): the coarsest partition FINCH returns (more than
              one cluster, unless even the first partition has one).
    A class held by one update is its own single cluster (the code's `len(proto_list) > 1`
    test); two prototypes are each other's first neighbour: one cluster.
  * cluster prototypes (eq. 5): P^k = the means of the clusters' members; each member
    weighs its staleness weight s_m (1 when fresh: the plain mean of the paper and code).
  * unbiased prototype (eq. 6): U^k = 1/J sum_{c in P^k} c, the unweighted mean of the J
    cluster prototypes.
  PARAM `upcr_target` (default "unbiased", eq. 6) = "global" sends instead G^k = 1/N
  sum_m c_m^k (eq. 3, the plain mean of the clients' prototypes; each weighs its staleness
  weight) as the target of L_UPCR: Table 3's G ablation. With cpcl_weight = 0 it is the
  paper's "FedProto with parameter averaging" baseline (Table 2's FedProto row equals Table
  3's G row, 81.16) and, with align_loss = "mean" and proto_source = "during", the code's
  models/fedproto.py (MSE to the unweighted mean prototype, weights averaged).
  PARAM `keep_missing` (default True): a class nobody sent in this aggregation keeps its
  previous P^k and U^k. The paper (every participant in every round) does not say; the
  code rebuilds the whole set from each round's online clients (keep_missing = False),
  which with partial participation or asynchronous buffers forgets classes whose holders
  were not among them. With every client in every aggregation the two coincide.
  An aggregation without updates changes nothing.
  The task is {"weights", "clusters": float32 [J, D] (every class's cluster prototypes,
  class by class), "cluster_class": int64 [J] (each one's class), "unbiased": float32
  [C, D], "has": bool [C]}; the eval task {"weights"}.

Relays and secure aggregation: no merge rule (no MERGE). FINCH's clustering is no sum of
the updates, so a relay forwards every update as it is and privacy.secure_aggregation is
refused; the weights' half alone would be a sum, but the prototypes must reach the server
one by one. DP_LEVELS is empty (the upload is a weight delta beside prototypes). Async and
late ("fold") updates are accepted like any other: their delta is applied with their
staleness weight and their prototypes join the clustering (weighted as above).

The reference code's setting, all options at once: partition = "last", align_loss =
"mean", proto_source = "during", keep_missing = false. Not offered: the code's optimiser
(SGD, lr 0.01, momentum 0.9, weight decay 1e-5, batch 64: Sec. 4.1 and the code agree;
set them in [train]) and its sampling of online clients (the engine samples). FINCH's
`ensure_early_exit` and `req_clust` are not used by the code (False, None) and are not
offered.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             classification_only, load_weights, to_tensor,
                                             weight_delta)
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.protos import class_counts, class_sums, local_prototypes
from fedbus.algorithms.core.training import staleness_metrics
from fedbus.algorithms.core.weights import average_deltas
from fedbus.algorithms.fedavg import PARTIAL, FedAvgClient, FedAvgServer


# --- FINCH -------------------------------------------------------------------------------------

def first_neighbours(x: np.ndarray) -> np.ndarray:
    """Each row's first neighbour by cosine distance (1 - cosine similarity), itself
    excluded; ties go to the lowest index. A zero row has similarity 0 with everything."""
    x = np.asarray(x, dtype=np.float64)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    u = x / np.where(norm > 0, norm, 1.0)
    dist = 1.0 - u @ u.T
    np.fill_diagonal(dist, np.inf)
    return np.argmin(dist, axis=1)


def first_neighbour_partition(x: np.ndarray) -> np.ndarray:
    """Eq. 4: the connected components of A(m, n) = 1 if n = v_m or m = v_n or v_m = v_n
    (v the first neighbours), labelled 0, 1, ... in the order of their lowest member."""
    n = len(x)
    if n <= 1:
        return np.zeros(n, dtype=np.int64)
    v = first_neighbours(x)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # n = v_m or m = v_n: the edge (m, v_m); v_m = v_n: both joined to v_m already
    for m in range(n):
        a, b = root(m), root(int(v[m]))
        if a != b:
            parent[max(a, b)] = min(a, b)
    roots = [root(i) for i in range(n)]
    labels, seen = np.empty(n, dtype=np.int64), {}
    for i, r in enumerate(roots):
        labels[i] = seen.setdefault(r, len(seen))
    return labels


def finch(x: np.ndarray) -> list[np.ndarray]:
    """FINCH's partitions of the rows of x (Sarfraz et al. 2019; the code's `FINCH` with
    distance = "cosine", ensure_early_exit = False): the first is eq. 4's; each next one
    partitions the previous clusters' means (over the original rows) the same way and
    composes the labels. It stops before a partition of one cluster, or one that does not
    merge any cluster; the first partition is kept whatever its count. Each partition
    labels every row 0, 1, ... in the order of the clusters' lowest member."""
    x = np.asarray(x, dtype=np.float64)
    labels = first_neighbour_partition(x)
    out = [labels]
    while True:
        k = int(labels.max()) + 1 if len(labels) else 0
        if k <= 1:
            break
        means = np.stack([x[labels == j].mean(axis=0) for j in range(k)])
        merged = first_neighbour_partition(means)[labels]
        count = int(merged.max()) + 1
        if count == 1 or count >= k:
            break
        labels = merged
        out.append(labels)
    return out


def cluster_prototypes(protos: np.ndarray, weights: np.ndarray | None = None,
                       partition: str = "first") -> tuple[np.ndarray, np.ndarray]:
    """One class's cluster prototypes (eq. 5) and unbiased prototype (eq. 6) from its N
    client prototypes [N, D]: FINCH's first (or last) partition, each cluster's weighted
    mean of its members (weights [N], default 1), then the plain mean of the J cluster
    prototypes. Returns (P float64 [J, D] in cluster-label order, U float64 [D])."""
    p = np.asarray(protos, dtype=np.float64)
    w = np.ones(len(p)) if weights is None else np.asarray(weights, dtype=np.float64)
    parts = finch(p)
    labels = parts[0] if partition == "first" else parts[-1]
    clusters = np.stack([(w[labels == j, None] * p[labels == j]).sum(0) / w[labels == j].sum()
                         for j in range(int(labels.max()) + 1)])
    return clusters, clusters.mean(axis=0)


# --- server -----------------------------------------------------------------------------------

class FPLServer(FedAvgServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "temperature": opt(0.02, "temperature tau of the cosine similarity s(z, c), eq. 7 "
                           "(Sec. 4.2, Fig. 4: 0.02 by default; the code's --infoNCET)",
                           min=1e-6),
        "cpcl_weight": opt(1.0, "weight of the cluster prototypes contrastive loss L_CPCL "
                           "(eq. 8) in eq. 12 (the paper: 1, an unweighted sum)", min=0.0),
        "upcr_weight": opt(1.0, "weight of the unbiased prototypes consistency loss L_UPCR "
                           "(eq. 10) in eq. 12 (the paper: 1, an unweighted sum)", min=0.0),
        "align_loss": opt("sum", "L_UPCR: sum = eq. 10, the squared distance summed over the "
                          "d dimensions; mean = the code's nn.MSELoss, averaged over them "
                          "(eq. 10 / d)", choices=("sum", "mean")),
        "upcr_target": opt("unbiased", "what L_UPCR (eq. 10) pulls each feature to: unbiased "
                           "= U^k, the mean of the cluster prototypes (eq. 6); global = G^k, "
                           "the plain mean of the clients' prototypes (eq. 3, Table 3's G "
                           "ablation; with cpcl_weight 0 the paper's FedProto with parameter "
                           "averaging)", choices=("unbiased", "global")),
        "partition": opt("first", "FINCH partition giving the cluster prototypes: first = "
                         "eq. 4's first-neighbour partition; last = the code's c[:, -1], "
                         "the coarsest FINCH returns", choices=("first", "last")),
        "proto_source": opt("after", "local prototypes: after = Algorithm 1 / eq. 2 (an "
                            "eval-mode pass over the training data after training); during "
                            "= the code (mean of the last local epoch's training features)",
                            choices=("after", "during")),
        "keep_missing": opt(True, "a class nobody sent keeps its previous cluster and "
                            "unbiased prototypes (False = the code: the set is rebuilt from "
                            "each aggregation's updates)"),
        "partial": PARTIAL,
    }
    # FINCH is no sum of the updates: no merge rule (relays forward updates as they are,
    # secure aggregation is refused); FedAvgServer's DeltaSums is not inherited (merge_rule)
    DP_LEVELS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx):
        super().__init__(ctx)
        c, d = ctx.num_classes, ctx.feature_dim
        self.clusters = np.zeros((0, d), dtype=np.float32)  # P, class by class
        self.cluster_class = np.zeros(0, dtype=np.int64)
        self.unbiased = np.zeros((c, d), dtype=np.float32)  # U
        self.has = np.zeros(c, dtype=bool)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # aggregate() replaces these arrays, never writes them in place
        return {"weights": self.weights, "clusters": self.clusters,
                "cluster_class": self.cluster_class, "unbiased": self.unbiased,
                "has": self.has}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"weights": self.weights}

    def update_spec(self) -> dict[str, Any]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {**super().update_spec(), "protos": ("float32", (c, d)),
                "counts": ("int64", (c,))}

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, Any]:
        updates, failures = self.tolerated(updates, failures)
        metrics = staleness_metrics(updates, failures)
        if updates:
            self.weights = average_deltas(self.weights, [u.payload["delta"] for u in updates],
                                          self.coefficients(updates))
            received = self._prototypes(updates)
            metrics["classes_received"] = float(received.sum())
        metrics["classes"] = float(self.has.sum())
        metrics["clusters"] = float(len(self.cluster_class))
        return metrics

    def _prototypes(self, updates: list[ClientUpdate]) -> np.ndarray:
        """Eqs. 4-6 per class over the updates holding it; returns the classes received."""
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        protos = np.stack([np.asarray(u.payload["protos"], dtype=np.float64) for u in updates])
        held = np.stack([np.asarray(u.payload["counts"]) > 0 for u in updates])
        weights = np.array([float(u.weight) for u in updates])
        partition = self.param("partition")
        keep = bool(self.param("keep_missing"))
        global_target = self.param("upcr_target") == "global"
        received = held.any(axis=0)
        clusters, owners = [], []
        unbiased = self.unbiased.astype(np.float64)
        for k in range(c):
            if received[k]:
                members, w = protos[held[:, k], k], weights[held[:, k]]
                pk, uk = cluster_prototypes(members, w, partition)
                # eq. 3: G^k = 1/N sum_m c_m^k (each member weighs its staleness weight)
                unbiased[k] = (w[:, None] * members).sum(0) / w.sum() if global_target else uk
            elif keep and self.has[k]:
                pk = self.clusters[self.cluster_class == k]
            else:
                unbiased[k] = 0.0
                continue
            clusters.append(np.asarray(pk, dtype=np.float64))
            owners.append(np.full(len(pk), k, dtype=np.int64))
        self.clusters = (np.concatenate(clusters).astype(np.float32) if clusters
                         else np.zeros((0, d), dtype=np.float32))
        self.cluster_class = (np.concatenate(owners) if owners
                              else np.zeros(0, dtype=np.int64))
        self.has = received | (self.has if keep else False)
        self.unbiased = np.where(self.has[:, None], unbiased, 0.0).astype(np.float32)
        return received

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "clusters": self.clusters.copy(),
                "cluster_class": self.cluster_class.copy(), "unbiased": self.unbiased.copy(),
                "has": self.has.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        d = self.ctx.feature_dim
        self.clusters = np.array(state["clusters"], dtype=np.float32, copy=True).reshape(-1, d)
        self.cluster_class = np.array(state["cluster_class"], dtype=np.int64, copy=True)
        self.unbiased = np.array(state["unbiased"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)


# --- client -----------------------------------------------------------------------------------

def cpcl_term(z: torch.Tensor, y: torch.Tensor, clusters: torch.Tensor,
              cluster_class: torch.Tensor, has: torch.Tensor,
              temperature: float) -> torch.Tensor:
    """Eq. 8 averaged over the batch: 1/B sum_i [has_{y_i}] -log(sum_{c in P^{y_i}}
    exp(s(z_i, c)) / sum_{c in P} exp(s(z_i, c))), s the cosine similarity over tau
    (eq. 7)."""
    held = has[y]
    if len(y) == 0 or len(cluster_class) == 0 or not bool(held.any()):
        return z.sum() * 0.0
    s = F.normalize(z, dim=1, eps=1e-8) @ F.normalize(clusters.to(z.dtype), dim=1,
                                                      eps=1e-8).T / temperature
    pos = cluster_class.unsqueeze(0) == y.unsqueeze(1)  # [B, J]: c in P^{y_i}
    # a sample without prototypes of its class gets every cluster as "positive" (its term is
    # 0 and masked out below): no row is all -inf, whose gradient would be nan
    pos = pos | ~held.unsqueeze(1)
    per = torch.logsumexp(s, dim=1) - torch.logsumexp(s.masked_fill(~pos, float("-inf")), dim=1)
    return (per * held.to(per.dtype)).sum() / len(y)


def upcr_term(z: torch.Tensor, y: torch.Tensor, unbiased: torch.Tensor, has: torch.Tensor,
              form: str = "sum") -> torch.Tensor:
    """Eq. 10 averaged over the batch: 1/B sum_i [has_{y_i}] sum_v (z_iv - U^{y_i}_v)^2
    ("sum"), or each divided by d ("mean": the code's MSELoss)."""
    if len(y) == 0:
        return z.sum() * 0.0
    held = has[y]
    sq = ((z - unbiased[y].to(z.dtype)) ** 2).sum(dim=1)
    if form == "mean":
        sq = sq / z.shape[1]
    return (sq * held.to(sq.dtype)).sum() / len(y)


class FPLClient(FedAvgClient):
    """Eq. 12 (CE + CPCL + UPCR) from the task's global model, cluster and unbiased
    prototypes; uploads its weights' delta and its local prototypes (eq. 2)."""

    PARAMS: ClassVar[dict[str, Any]] = FPLServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        classification_only(ctx, "fpl")
        self.num_classes = ctx.num_classes
        self.temperature = float(self.param("temperature"))
        self.w_cpcl = float(self.param("cpcl_weight"))
        self.w_upcr = float(self.param("upcr_weight"))
        self.align = self.param("align_loss")
        self.proto_source = self.param("proto_source")
        self._clusters: torch.Tensor | None = None
        self._owner: torch.Tensor | None = None
        self._unbiased: torch.Tensor | None = None
        self._has: torch.Tensor | None = None
        self._reg = False
        # proto_source = "during": this epoch's class sums, the last complete epoch's
        self._sums = self._seen = None
        self._done: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step, self._epoch, self._per_epoch = 0, 0, 1

    def set_prototypes(self, task: Mapping[str, Any]) -> None:
        dev = self.ctx.device
        d = np.asarray(task["unbiased"]).shape[1]
        self._clusters = to_tensor(np.asarray(task["clusters"]).reshape(-1, d), dev,
                                   torch.float32)
        self._owner = to_tensor(task["cluster_class"], dev, torch.int64)
        self._unbiased = to_tensor(task["unbiased"], dev, torch.float32)
        self._has = to_tensor(task["has"], dev, torch.bool)
        self._reg = bool(self._has.any())

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        self.set_prototypes(task)
        self._sums = self._seen = self._done = None
        self._step, self._epoch, self._per_epoch = 0, 0, run.steps_per_epoch()
        try:
            load_weights(self.ctx.model, task["weights"])  # "Distribute global parameter"
            self.run_local(run)
        finally:
            self._clusters = self._owner = self._unbiased = self._has = None
            self._reg = False
        protos, counts = self.local_protos()
        return {"delta": weight_delta(self.ctx.model, task["weights"]),
                "protos": protos, "counts": counts}

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        z = model.features(x)
        loss = F.cross_entropy(model.head(z), y)
        if self._reg:
            if self.w_cpcl > 0:
                loss = loss + self.w_cpcl * cpcl_term(z, y, self._clusters, self._owner,
                                                      self._has, self.temperature)
            if self.w_upcr > 0:
                loss = loss + self.w_upcr * upcr_term(z, y, self._unbiased, self._has,
                                                      self.align)
        if self.proto_source == "during":
            self._collect(z, y)
        return loss

    def _collect(self, z: torch.Tensor, y: torch.Tensor) -> None:
        """proto_source = "during": one step's features into the current epoch's class sums
        (the code empties its collection at every local epoch: the last one counts)."""
        epoch = self._step // self._per_epoch
        if self._sums is None or epoch != self._epoch:
            if self._sums is not None:
                self._done = (self._sums, self._seen)
            self._sums = torch.zeros(self.num_classes, z.shape[1], device=z.device)
            self._seen = torch.zeros(self.num_classes, dtype=torch.int64, device=z.device)
            self._epoch = epoch
        s, n = class_sums(z.detach().float(), y, self.num_classes)
        self._sums += s
        self._seen += n
        self._step += 1

    def local_protos(self) -> tuple[np.ndarray, np.ndarray]:
        """(protos float32 [C, D], counts int64 [C]): eq. 2 over the training set."""
        ctx = self.ctx
        if len(ctx.train_y) == 0:
            return (np.zeros((self.num_classes, ctx.feature_dim), np.float32),
                    np.zeros(self.num_classes, np.int64))
        if self.proto_source == "during" and self._step > 0:
            sums, seen = self._sums, self._seen
            if self._step % self._per_epoch and self._done is not None:
                sums, seen = self._done  # cut mid-epoch: the last complete epoch
            protos = sums / seen.clamp(min=1).unsqueeze(1).float()
            full = class_counts(ctx.train_y, self.num_classes)
            counts = torch.where(seen > 0, full, torch.zeros_like(full))
            return (protos.cpu().numpy().astype(np.float32),
                    counts.cpu().numpy().astype(np.int64))
        return local_prototypes(ctx.model, ctx.train_x, ctx.train_y, self.num_classes)


ALGORITHM = Algorithm("fpl", FPLServer, FPLClient,
                      "FPL (Huang et al. 2023): FINCH cluster + unbiased prototypes, "
                      "contrastive and alignment losses, FedAvg weights")

"""Prototype-guided attention aggregation ("proto-attention").

Umberto Michieli, Mete Ozay, "Prototype Guided Federated Learning of Visual
Feature Representations", arXiv:2105.08982 (2021). The paper calls the method
FedProto; it is registered here as "proto-attention" to keep it apart from
Tan et al.'s FedProto ("fedproto"). Equation numbers below are the paper's;
the line-by-line audit against the paper is docs/FIDELITY.md (proto-attention).
Every default is the paper's where the paper is explicit; each other choice is
a PARAM, marked "non-paper" below.

The method (Algorithm 1), round t, sampled clients K^t
-------------------------------------------------------
Client k (ProtoAttentionClient.train):
  1. loads the global weights W^t and computes its prototypes with them (eq. 4):
     p[c] = mean of features(x) over its training samples of class c, with
     n[c] = how many ("protos_before"; one eval-mode pass over the local data);
  2. trains W^t -> W_k^{t+1} on its local loss (eq. 2: cross-entropy, SGD, the
     [train] step size), whatever part F' <= F of its epochs it gets through;
  3. computes its prototypes again with W_k^{t+1} ("protos", "counts");
  4. uploads delta = W_k^{t+1} - W^t and both raw prototype sets. The paper's
     client uploads its LPM instead of the before-prototypes; the server here
     computes the same LPM from the same numbers (prototype_margins).

Server (ProtoAttentionServer.aggregate):
  * Min-max normalisation (Sec. 3.1): p_hat = (p - min_j p_j) / (max_j p_j -
    min_j p_j) over the D channels of each prototype (a constant one -> 0).
    PARAM minmax = True (paper) | False (raw prototypes, non-paper).
  * Semantic prototype margin (Def. 3.1) of a set P_i against a reference set
    P_j, on C' = the classes both have (n_i[c] > 0 and n_j[c] > 0), d = L2:
        d+[c] = d(p_i[c], p_j[c])                                      (eq. 5)
        d-[c] = sum_{c' in C', c' != c} d(p_i[c], p_j[c']) / |C' \\ c|  (eq. 6)
        mu[c] = (d-[c] - d+[c]) / (d-[c] + d+[c])       in [-1, 1]     (eq. 7)
    PARAM dminus = "mean" (eq. 6) | "min" (nearest other class, non-paper).
    Where the paper is silent: mu[c] of a class outside C', or with C' = {c}
    (no other class for d-), counts as 0 (the sums below run over C'), and
    mu = 0 when d- = d+ = 0.
  * LPM (Def. 3.2, eq. 8): mu_loc,k[c] = mu(p_hat_before[c], p_hat_after), the
    client's normalised prototypes before vs after its local training.
  * APM (Def. 3.3, eq. 9): mu_agg,k[c] = mu(p_hat_after[c], p_hat_agg^{t-1}),
    against the previous aggregate prototypes (eq. 10):
        p_hat_agg^t[c] = sum_{k in K^t} n_k[c] / n_agg[c] * p_hat_k[c],
        n_agg[c] = sum_{k in K^t} n_k[c],  p_hat_agg^0 = 0 (no classes: every
    APM margin counts 0). A class that no client of an aggregation has is not
    in that aggregate (n_agg[c] = 0) and so not in the next APM's C'.
    PARAM carry = False (eq. 10) | True (keep such a class's previous
    aggregate prototype, non-paper).
  * Client deviations (eq. 11): v_i[k] = sigmoid(sum_c mu_i,k[c]), i in {loc, agg}.
    PARAM reduce = "sum" (eq. 11) | "mean" (mean over the client's classes,
    non-paper).
  * Local and aggregate attention (eq. 12): a_i[k] = v_i[k] / sum_{j in K^t} v_i[j].
    PARAM norm = "sigmoid" (eq. 11-12) |
      "softmax" (non-paper: a_i = exp(s_k / temp) / sum_j exp(s_j / temp) on
                 the summed margins s; PARAM temp, softmax only) |
      "sum"     (non-paper: each mu mapped to (1 + mu) / 2 in [0, 1] before
                 the reduce, a_i = s_k / sum_j s_j, uniform if all are 0).
  * Federated attention (eq. 13): a[k] = n_k / sum_{j in K^t} n_j at t = 0 (the
    first aggregation, whatever it holds), (a_agg[k] + a_loc[k]) / 2 at t > 0.
    PARAM round0 = "counts" (eq. 13) | "mix" (t = 0: (a_loc + n-share) / 2,
    non-paper). PARAM clues = "both" (eq. 13) | "lpm" | "apm" (a = a_loc or
    a_agg alone: the paper's Table 3 ablations "LPM only", "APM only").
  * Aggregation (eq. 14): W^{t+1} = sum_k a[k] W_k, applied as
    W <- W + sum_k c_k delta_k / sum_k c_k with c_k = a[k] x s_k, s_k the
    engine's staleness weight (1 for a fresh update: then exactly eq. 14,
    since the a[k] sum to 1). Late (folded) and asynchronous updates, which the
    paper does not have, are thereby down-weighted as in every fedbus method;
    eq. 10's aggregate weighs prototypes by s_k n_k[c] likewise.
  * Partial workload (Sec. 3): every update counts whatever epochs F' it ran;
    attention is positive for every client (sigmoid > 0), so partial work is
    tolerated by design. F' ~ U[0, F] is the engine's system.partial_work.

Metrics (per aggregation, into metrics.jsonl)
---------------------------------------------
agg.amm = the aggregate mean margin (eq. 15), mu_bar = 1/|C| sum_{c in C}
mu(p_agg[c], p_agg), on the raw (eq. 15 has no hat) count-weighted aggregate
prototypes of the aggregation just made. As printed it compares the aggregate
with itself: d+ = 0, so each aggregated class (with another one to measure
d- against) scores exactly 1 and amm = |C'| / |C|; it cannot produce the
paper's Table 4 values (0.34 to 8.68: a mean of mu in [-1, 1] cannot exceed
1). agg.amm_dist = 1/|C| sum_c (d-[c] - d+[c]) on the same prototypes, the
un-normalised (hypothesis) margin of refs. [10, 45], = the mean distance
between the aggregate's class prototypes here: our reading of what Table 4
reports, not a formula of the paper.
agg_extra.attention = {client id: a[k]} (eq. 13, before staleness weights;
they sum to 1; a client with two updates in one aggregation gets their sum);
agg.attn_max / attn_min, agg.lpm_mean / apm_mean (mean over the updates of
the summed margins sum_c mu[c], the sigmoid's argument).

Local training is plain cross-entropy on the received global model (the
paper changes only the aggregation); the weight half (task weights, delta
averaging, global-model evaluation with the local weights put back, the SGD
loop) is inherited from fedbus.algorithms.fedavg, with coefficients()
replaced. Update payload: {"delta", "protos" float32 [C, D] (raw, after
training), "protos_before" float32 [C, D] (raw, before training), "counts"
int64 [C], "train_loss" (only when a step ran)}; the server normalises.
Task payload: {"weights"}. "proto_acc" in evaluate: nearest prototype among
the client's own training-set prototypes under the evaluated (global) model.
Segmentation (Sec. 5.2, Pascal VOC with DeepLab-V3+): prototypes are per-class
means over feature pixels, labels downsampled by nearest neighbour (S3.2), and
counts n_k[c] are pixel counts at feature resolution (fedbus.algorithms.core.protos);
evaluate adds "miou" (the paper's segmentation metric) and "proto_miou".
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import ClientUpdate, Failure, LocalRun, RoundInfo, to_tensor
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.protos import local_prototypes, minmax_channels, prototype_metrics
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer, swapped_weights

PARAMS: dict[str, Any] = {
    "norm": opt("sigmoid", "client deviations -> attention: sigmoid (eq. 11-12: sigmoid of the "
                "summed margins, divided by the sum over clients); softmax, sum: non-paper",
                ("sigmoid", "softmax", "sum")),
    "temp": opt(1.0, "softmax temperature (norm = softmax only; non-paper)", min=1e-6),
    "reduce": opt("sum", "a client's deviation over its classes: sum (eq. 11) or mean "
                  "(non-paper) of margins", ("sum", "mean")),
    "dminus": opt("mean", "d- of a margin: mean distance to the other classes' prototypes "
                  "(eq. 6) or min, the nearest one (non-paper)", ("mean", "min")),
    "minmax": opt(True, "min-max normalise prototypes over channels before margins (Sec. 3.1)"),
    "clues": opt("both", "attention from both LPM and APM (eq. 13), or one alone (Table 3's "
                 "ablations)", ("both", "lpm", "apm")),
    "round0": opt("counts", "first aggregation: counts = sample-count weights (eq. 13), "
                  "mix = LPM attention averaged with them (non-paper)", ("counts", "mix")),
    "carry": opt(False, "classes absent from an aggregation keep their previous aggregate "
                 "prototype (non-paper; eq. 10 drops them)"),
}


# --- margin mathematics --------------------------------------------------------------

def _margin_parts(a: np.ndarray, b: np.ndarray, valid_a: np.ndarray, valid_b: np.ndarray,
                  dminus: str = "mean") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d+ [C], d- [C], defined [C]) of eq. 5-6 on C' = valid_a & valid_b;
    defined = c in C' and C' has another class."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    both = np.asarray(valid_a, bool) & np.asarray(valid_b, bool)  # C'
    dist = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))  # [C, C]: d(a_c, b_c')
    d_plus = np.diagonal(dist).copy()
    others = both[None, :] & ~np.eye(len(b), dtype=bool)  # c' in C', c' != c
    n_other = others.sum(axis=1)
    if dminus == "mean":
        d_minus = np.where(others, dist, 0.0).sum(axis=1) / np.maximum(n_other, 1)
    else:
        d_minus = np.where(others, dist, np.inf).min(axis=1)
    defined = both & (n_other > 0)
    return d_plus, np.where(defined, d_minus, np.nan), defined


def prototype_margins(a: np.ndarray, b: np.ndarray, valid_a: np.ndarray,
                      valid_b: np.ndarray, dminus: str = "mean") -> np.ndarray:
    """mu(a[c], b) of eq. 7 per class [C]: (d- - d+) / (d- + d+) on C' (eq. 5-6;
    0 where both distances are 0); NaN where undefined (c outside C', or no
    other class in C')."""
    d_plus, d_minus, ok = _margin_parts(a, b, valid_a, valid_b, dminus)
    den = np.where(ok, d_minus + d_plus, 1.0)
    mu = np.where(den > 0, (np.where(ok, d_minus, 0.0) - d_plus) / np.where(den > 0, den, 1.0),
                  0.0)
    return np.where(ok, mu, np.nan)


def client_score(mu: np.ndarray, present: np.ndarray, norm: str = "sigmoid",
                 reduce: str = "sum") -> float:
    """The argument of eq. 11's sigmoid: sum_c mu[c] over the client's classes
    (undefined margins count 0); reduce = "mean" divides by their number;
    norm = "sum" maps each mu to (1 + mu) / 2 first (non-paper)."""
    present = np.asarray(present, bool)
    m = np.where(np.isnan(mu), 0.0, mu)[present]
    if norm == "sum":
        m = (1.0 + m) / 2.0
    if len(m) == 0:
        return 0.0
    return float(m.sum() if reduce == "sum" else m.mean())


def normalise_scores(scores: Sequence[float], norm: str = "sigmoid",
                     temp: float = 1.0) -> np.ndarray:
    """One aggregation's client scores -> attention summing to 1.
    sigmoid: eq. 11-12, v_k = sigmoid(s_k), a_k = v_k / sum_j v_j (in log space,
    so that no sigmoid underflows); softmax: exp(s_k / temp) normalised; sum:
    s_k / sum_j s_j, uniform when the total is 0."""
    s = np.asarray(scores, dtype=np.float64)
    if norm == "sigmoid":
        log_v = -np.logaddexp(0.0, -s)  # log sigmoid(s)
        e = np.exp(log_v - log_v.max())
        return e / e.sum()
    if norm == "softmax":
        e = np.exp((s - s.max()) / temp)
        return e / e.sum()
    total = s.sum()
    return s / total if total > 0 else np.full(len(s), 1.0 / len(s))


def _prep(p: np.ndarray, minmax: bool) -> np.ndarray:
    return minmax_channels(p) if minmax else np.asarray(p, dtype=np.float64)


def attention_weights(updates: Sequence[Mapping[str, Any]], num_samples: Sequence[float],
                      aggregate: np.ndarray | None, aggregate_mask: np.ndarray | None,
                      p: Mapping[str, Any], first: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(attention a [U] (eq. 13), LPM scores [U], APM scores [U] or None at
    t = 0) for the update payloads of one aggregation. `first`: this is the
    first aggregation (t = 0). `aggregate` None (or an empty mask) = no
    aggregate prototypes yet (p_hat_agg = 0): every APM margin counts 0."""
    norm, reduce, dminus = p["norm"], p["reduce"], p.get("dminus", "mean")
    n = np.asarray(num_samples, dtype=np.float64)
    share = n / n.sum() if n.sum() > 0 else np.full(len(n), 1.0 / len(n))
    lpm, apm = [], []
    for u in updates:
        present = np.asarray(u["counts"]) > 0
        after = _prep(u["protos"], p["minmax"])
        before = _prep(u["protos_before"], p["minmax"])
        mu = prototype_margins(before, after, present, present, dminus)  # eq. 8
        lpm.append(client_score(mu, present, norm, reduce))
        if not first:
            if aggregate is None or aggregate_mask is None:
                ref, mask = np.zeros_like(after), np.zeros(len(present), bool)
            else:
                ref, mask = aggregate, aggregate_mask
            mu = prototype_margins(after, ref, present, mask, dminus)  # eq. 9
            apm.append(client_score(mu, present, norm, reduce))
    temp = float(p.get("temp", 1.0))
    local = normalise_scores(lpm, norm, temp)
    if first:
        att = share if p["round0"] == "counts" else (local + share) / 2.0
        return att, np.asarray(lpm), None
    agg = normalise_scores(apm, norm, temp)
    clues = p.get("clues", "both")
    att = (agg + local) / 2.0 if clues == "both" else (local if clues == "lpm" else agg)
    return att, np.asarray(lpm), np.asarray(apm)


def aggregate_mean_margin(protos: np.ndarray, mask: np.ndarray,
                          dminus: str = "mean") -> tuple[float, float]:
    """(AMM of eq. 15 as printed, its un-normalised counterpart) of one set of
    aggregate prototypes [C, D] with classes `mask` [C]:
    amm = 1/|C| sum_c mu(p[c], p) (eq. 7; undefined classes count 0; d+ = 0,
    so it is |C'|/|C| whenever C' has two classes or more), amm_dist = 1/|C|
    sum_c (d-[c] - d+[c]) (= the mean of eq. 6's d- over C', divided by |C|)."""
    c = len(mask)
    if c == 0:
        return 0.0, 0.0
    mu = prototype_margins(protos, protos, mask, mask, dminus)
    d_plus, d_minus, ok = _margin_parts(protos, protos, mask, mask, dminus)
    dist = np.where(ok, np.where(ok, d_minus, 0.0) - d_plus, 0.0)
    return float(np.nansum(mu) / c), float(dist.sum() / c)


# --- handlers -------------------------------------------------------------------------

class ProtoAttentionServer(FedAvgServer):
    """FedAvg's delta averaging with attention x staleness as coefficients."""

    PARAMS = PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.p = {key: self.param(key) for key in PARAMS}
        c, d = ctx.num_classes, ctx.feature_dim
        self.agg_protos = np.zeros((c, d), dtype=np.float32)  # p_hat_agg (eq. 10)
        self.agg_raw = np.zeros((c, d), dtype=np.float32)  # the same on raw prototypes (eq. 15)
        self.agg_mask = np.zeros(c, dtype=bool)
        self.aggregations = 0
        self._first = True
        self._att_metrics: dict[str, float] = {}
        self._attention: dict[str, float] = {}

    def coefficients(self, updates: list[ClientUpdate]) -> list[float]:
        """c_k = a[k] x s_k (eq. 13-14 with the staleness weight s_k) instead of
        FedAvg's n_k x s_k."""
        has_agg = bool(self.agg_mask.any())
        att, lpm, apm = attention_weights(
            [u.payload for u in updates], [u.num_samples for u in updates],
            self.agg_protos.astype(np.float64) if has_agg else None,
            self.agg_mask if has_agg else None, self.p, first=self._first)
        self._att_metrics = {"attn_max": float(att.max()), "attn_min": float(att.min()),
                             "lpm_mean": float(lpm.mean())}
        if apm is not None:
            self._att_metrics["apm_mean"] = float(apm.mean())
        self._attention = {}
        for a, u in zip(att, updates):
            key = str(u.client)
            self._attention[key] = self._attention.get(key, 0.0) + float(a)
        return [float(a) * float(u.weight) for a, u in zip(att, updates)]

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, Any]:
        self._first = info.round == 0  # eq. 13's t = 0
        metrics: dict[str, Any] = dict(super().aggregate(updates, failures, info))
        if not updates:  # calls coefficients() only when there are updates
            return metrics
        self._update_aggregate(sorted(updates, key=lambda u: (u.client, u.version)))
        self.aggregations += 1
        amm, amm_dist = aggregate_mean_margin(self.agg_raw.astype(np.float64), self.agg_mask,
                                              self.p["dminus"])
        metrics.update(self._att_metrics, amm=amm, amm_dist=amm_dist)
        metrics["attention"] = dict(self._attention)  # a dict: the record's agg_extra
        return metrics

    def _update_aggregate(self, ups: Sequence[ClientUpdate]) -> None:
        """Eq. 10 (count- and staleness-weighted) on normalised and on raw prototypes."""
        raw = np.stack([np.asarray(u.payload["protos"], dtype=np.float64) for u in ups])  # [U,C,D]
        protos = np.stack([_prep(r, self.p["minmax"]) for r in raw])
        n = np.stack([np.asarray(u.payload["counts"], dtype=np.float64) for u in ups])  # [U,C]
        coef = np.asarray([float(u.weight) for u in ups])[:, None] * n
        total = coef.sum(0)
        seen = total > 0
        scale = np.where(seen, total, 1.0)[:, None]
        keep = self.agg_mask & ~seen if self.p["carry"] else np.zeros_like(seen)

        def fold(values: np.ndarray, previous: np.ndarray) -> np.ndarray:
            new = (coef[:, :, None] * values).sum(0) / scale
            return np.where(seen[:, None], new,
                            np.where(keep[:, None], previous, 0.0)).astype(np.float32)

        self.agg_protos = fold(protos, self.agg_protos)
        self.agg_raw = fold(raw, self.agg_raw)
        self.agg_mask = seen | keep

    def update_spec(self) -> dict[str, Any]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {**super().update_spec(), "protos": ("float32", (c, d)),
                "protos_before": ("float32", (c, d)), "counts": ("int64", (c,))}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "agg_protos": self.agg_protos.copy(),
                "agg_raw": self.agg_raw.copy(), "agg_mask": self.agg_mask.copy(),
                "aggregations": int(self.aggregations)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.agg_protos = np.array(state["agg_protos"], dtype=np.float32, copy=True)
        raw = state.get("agg_raw")  # absent from checkpoints written before it existed
        self.agg_raw = (np.zeros_like(self.agg_protos) if raw is None
                        else np.array(raw, dtype=np.float32, copy=True))
        self.agg_mask = np.array(state["agg_mask"], dtype=bool, copy=True)
        self.aggregations = int(state["aggregations"])


class ProtoAttentionClient(FedAvgClient):
    """FedAvg's local cross-entropy loop; prototypes before and after it."""

    PARAMS = PARAMS

    def _protos(self) -> tuple[np.ndarray, np.ndarray]:
        ctx = self.ctx
        if len(ctx.train_y) == 0:
            return (np.zeros((ctx.num_classes, ctx.feature_dim), dtype=np.float32),
                    np.zeros(ctx.num_classes, dtype=np.int64))
        return local_prototypes(ctx.model, ctx.train_x, ctx.train_y, ctx.num_classes)

    def begin_local(self, task: Mapping[str, Any]) -> None:
        self._before, _ = self._protos()  # the received global model on local data

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        out = super().train(task, run)  # load global, begin_local, run_local, delta
        after, counts = self._protos()
        out.update(protos=after, protos_before=self._before, counts=counts)
        if np.isfinite(self.last_loss):  # the wire rejects NaN
            out["train_loss"] = float(self.last_loss)
        return out

    def functional_loss(self) -> Any:
        """Cohort hook: FedAvg's cross-entropy loop (the prototypes around it are this
        class's train(), run as it is)."""
        return super().functional_loss()

    @torch.no_grad()
    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """The global model (swapped in, local weights restored after): head
        metrics, and "proto_acc" = nearest prototype among this client's own
        training-set prototypes under the global model."""
        ctx = self.ctx
        with swapped_weights(ctx.model, task["weights"]):
            out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
            protos, counts = self._protos()
            out.update(prototype_metrics(ctx.model, ctx.test_x, ctx.test_y,
                                         to_tensor(protos, ctx.device),
                                         to_tensor(counts > 0, ctx.device)))
        return out


ALGORITHM = Algorithm("proto-attention", ProtoAttentionServer, ProtoAttentionClient,
                      "Michieli & Ozay: prototype-margin (LPM/APM) attention weights for "
                      "model aggregation")

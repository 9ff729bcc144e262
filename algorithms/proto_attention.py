"""Prototype-guided attention aggregation ("proto-attention").

Umberto Michieli, Mete Ozay, "Prototype Guided Federated Learning of Visual
Feature Representations", arXiv:2105.08982 (2021). The paper calls the method
FedProto; it is registered here as "proto-attention" to keep it apart from
Tan et al.'s FedProto ("fedproto").

The paper's text was not reachable from this (offline) machine while this module
was written, so equation numbers are not quoted; every point we could not pin
down against the paper is a PARAM with its default stated below.

Definitions implemented
-----------------------
Prototypes. p_c = mean of features(x) over a client's training samples of
class c (eval mode, the whole local training set). With PARAM minmax = True
(default) every prototype is min-max normalised over its channels before any
distance is taken: p <- (p - min_j p_j) / (max_j p_j - min_j p_j) (a constant
prototype becomes 0).

Semantic prototype margin between a set A (the client's prototypes) and a
reference set B, for a class c present in both:

    d+_c = || a_c - b_c ||_2                 (the matching-class prototypes)
    d-_c = min_{j != c, b_j exists} || a_c - b_j ||_2
                                             (the nearest other-class reference)
    mu_c = (d-_c - d+_c) / (d-_c + d+_c)     in [-1, 1]   (0 if both are 0)

mu_c -> 1 when a_c sits on its own class's reference, -> -1 when it sits on
another class's. A class the client has but for which mu is undefined (B lacks
c, or B has no other class, e.g. a one-class client's LPM) counts as mu = 0.

- LPM (local prototype margin): A = the client's prototypes after local
  training, B = its prototypes before training, computed with the received
  global model on the same data ("protos" vs "protos_before" in the update).
- APM (aggregate prototype margin): A = the client's prototypes after
  training, B = the previous aggregate prototypes: the server's count- and
  staleness-weighted average of clients' (normalised) after-training
  prototypes, G_c = sum_i w_i n_ic p_ic / sum_i w_i n_ic over the updates of
  an aggregation; a class absent from an aggregation keeps its previous G_c.

Client deviation and attention. Per client i, s_i = reduce_c mu_c over the
classes it has (PARAM reduce = "sum" (default) | "mean"), once for LPM and
once for APM; sigma turns the scores of the updates in one aggregation into
weights that sum to 1:
    norm = "softmax" (default): sigma(s)_i = exp(s_i/temp) / sum_j exp(s_j/temp)
    norm = "sum": per-class margins mapped to (1 + mu_c)/2 in [0, 1] before the
                  reduce, then sigma(s)_i = s_i / sum_j s_j (uniform if all 0)
The paper only says the deviations are normalised (its sigma), hence the PARAM.
We read a larger margin (prototypes that stayed well separated and close to
their reference) as a more trustworthy client, so attention grows with it.

    attention_i = (sigma(LPM)_i + sigma(APM)_i) / 2

Before any aggregate exists (round 0) there is no APM: with PARAM round0 =
"counts" (default) the attention is the sample-count share n_i / sum_j n_j
(so round 0 is exactly FedAvg); with round0 = "mix" sigma(APM) alone is
replaced by that share.

Server update: global += sum_i c_i delta_i / sum_i c_i with c_i = attention_i
x w_i (w_i the engine's staleness weight), instead of FedAvg's n_i x w_i.
Every update counts whatever work F' it did: attention is positive for every
client under "softmax" (and under "sum" unless every margin of the client is
-1), so partial work is tolerated by design.

Local training is plain cross-entropy on the received global model (the
paper changes only the aggregation); the weight half (task weights, delta
averaging, global-model evaluation with the local weights put back, the SGD
loop) is inherited from fedbus.algorithms.fedavg, with coefficients()
replaced. Update payload: {"delta", "protos" float32 [C, D] (raw, after
training), "protos_before" float32 [C, D] (raw, before training), "counts"
int64 [C], "train_loss" (only when a step ran)}; the server normalises.
Both prototype sets come from an extra eval-mode pass over the local data
(fedbus.algorithms.protos.local_prototypes), so they describe one fixed model
each rather than a model changing during the epoch.
Task payload: {"weights"}. "proto_acc" in evaluate: nearest prototype among
the client's own training-set prototypes under the evaluated (global) model.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.base import (ClientUpdate, Failure, LocalRun, RoundInfo, head_metrics,
                                    to_tensor)
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer, swapped_weights
from fedbus.algorithms.local import opt
from fedbus.algorithms.protos import (embeddings, local_prototypes, minmax_channels,
                                      nearest_prototype)

PARAMS: dict[str, Any] = {
    "norm": opt("softmax", "sigma over clients' margin scores: softmax or sum "
                "(margins mapped to [0,1], divided by the total)", ("softmax", "sum")),
    "temp": opt(1.0, "softmax temperature of sigma", min=1e-6),
    "reduce": opt("sum", "a client's score over its classes: sum or mean of margins",
                  ("sum", "mean")),
    "minmax": opt(True, "min-max normalise prototypes over channels before margins"),
    "round0": opt("counts", "before any aggregate: counts = sample-count weights (FedAvg), "
                  "mix = LPM attention averaged with sample-count weights", ("counts", "mix")),
    "carry": opt(True, "classes absent from an aggregation keep their aggregate prototype"),
}


# --- margin mathematics --------------------------------------------------------------

def prototype_margins(a: np.ndarray, b: np.ndarray, valid_a: np.ndarray,
                      valid_b: np.ndarray) -> np.ndarray:
    """mu_c = (d-_c - d+_c) / (d-_c + d+_c) per class [C]; NaN where undefined
    (c missing from a or b, or b has no other class)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    va, vb = np.asarray(valid_a, bool), np.asarray(valid_b, bool)
    dist = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))  # [C, C]
    d_plus = np.diagonal(dist)
    other = np.where(vb[None, :] & ~np.eye(len(b), dtype=bool), dist, np.inf)
    d_minus = other.min(axis=1)
    ok = va & vb & np.isfinite(d_minus)
    den = d_minus + d_plus
    with np.errstate(invalid="ignore", divide="ignore"):
        mu = np.where(den > 0, (d_minus - d_plus) / np.where(den > 0, den, 1.0), 0.0)
    return np.where(ok, mu, np.nan)


def client_score(mu: np.ndarray, present: np.ndarray, norm: str = "softmax",
                 reduce: str = "sum") -> float:
    """A client's deviation score from its per-class margins: undefined margins
    of classes it has count as 0; "sum" norm maps mu to (1 + mu)/2 first."""
    present = np.asarray(present, bool)
    m = np.where(np.isnan(mu), 0.0, mu)[present]
    if norm == "sum":
        m = (1.0 + m) / 2.0
    if len(m) == 0:
        return 0.0
    return float(m.sum() if reduce == "sum" else m.mean())


def normalise_scores(scores: Sequence[float], norm: str = "softmax",
                     temp: float = 1.0) -> np.ndarray:
    """sigma: scores of one aggregation's clients -> weights summing to 1."""
    s = np.asarray(scores, dtype=np.float64)
    if norm == "softmax":
        e = np.exp((s - s.max()) / temp)
        return e / e.sum()
    total = s.sum()
    return s / total if total > 0 else np.full(len(s), 1.0 / len(s))


def _prep(p: np.ndarray, minmax: bool) -> np.ndarray:
    return minmax_channels(p) if minmax else np.asarray(p, dtype=np.float64)


def attention_weights(updates: Sequence[Mapping[str, Any]], num_samples: Sequence[float],
                      aggregate: np.ndarray | None, aggregate_mask: np.ndarray | None,
                      p: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(attention [U], LPM scores [U], APM scores [U] or None) for the update
    payloads of one aggregation; `aggregate` None = no aggregate yet."""
    lpm, apm = [], []
    for u in updates:
        present = np.asarray(u["counts"]) > 0
        after = _prep(u["protos"], p["minmax"])
        before = _prep(u["protos_before"], p["minmax"])
        mu = prototype_margins(after, before, present, present)
        lpm.append(client_score(mu, present, p["norm"], p["reduce"]))
        if aggregate is not None:
            mu = prototype_margins(after, aggregate, present, aggregate_mask)
            apm.append(client_score(mu, present, p["norm"], p["reduce"]))
    n = np.asarray(num_samples, dtype=np.float64)
    share = n / n.sum() if n.sum() > 0 else np.full(len(n), 1.0 / len(n))
    local = normalise_scores(lpm, p["norm"], float(p["temp"]))
    if aggregate is None:
        att = share if p["round0"] == "counts" else (local + share) / 2.0
        return att, np.asarray(lpm), None
    att = (local + normalise_scores(apm, p["norm"], float(p["temp"]))) / 2.0
    return att, np.asarray(lpm), np.asarray(apm)


# --- handlers -------------------------------------------------------------------------

class ProtoAttentionServer(FedAvgServer):
    """FedAvg's delta averaging with attention x staleness as coefficients."""

    PARAMS = PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.p = {key: self.param(key) for key in PARAMS}
        self.agg_protos = np.zeros((ctx.num_classes, ctx.feature_dim), dtype=np.float32)
        self.agg_mask = np.zeros(ctx.num_classes, dtype=bool)
        self.aggregations = 0
        self._att_metrics: dict[str, float] = {}

    def coefficients(self, updates: list[ClientUpdate]) -> list[float]:
        """c_i = attention_i x w_i (instead of FedAvg's n_i x w_i)."""
        has_agg = bool(self.agg_mask.any())
        att, lpm, apm = attention_weights(
            [u.payload for u in updates], [u.num_samples for u in updates],
            self.agg_protos.astype(np.float64) if has_agg else None, self.agg_mask, self.p)
        self._att_metrics = {"attn_max": float(att.max()), "attn_min": float(att.min()),
                             "lpm_mean": float(lpm.mean())}
        if apm is not None:
            self._att_metrics["apm_mean"] = float(apm.mean())
        return [float(a) * float(u.weight) for a, u in zip(att, updates)]

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = super().aggregate(updates, failures, info)  # calls coefficients()
        if not updates:
            return metrics
        self._update_aggregate(sorted(updates, key=lambda u: (u.client, u.version)))
        self.aggregations += 1
        metrics.update(self._att_metrics)
        return metrics

    def _update_aggregate(self, ups: Sequence[ClientUpdate]) -> None:
        protos = np.stack([_prep(u.payload["protos"], self.p["minmax"]) for u in ups])  # [U,C,D]
        n = np.stack([np.asarray(u.payload["counts"], dtype=np.float64) for u in ups])  # [U,C]
        coef = np.asarray([float(u.weight) for u in ups])[:, None] * n
        total = coef.sum(0)
        seen = total > 0
        new = (coef[:, :, None] * protos).sum(0) / np.where(seen, total, 1.0)[:, None]
        keep = self.agg_mask & ~seen if self.p["carry"] else np.zeros_like(seen)
        self.agg_protos = np.where(seen[:, None], new,
                                   np.where(keep[:, None], self.agg_protos, 0.0)).astype(np.float32)
        self.agg_mask = seen | keep

    def update_spec(self) -> dict[str, Any]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {**super().update_spec(), "protos": ("float32", (c, d)),
                "protos_before": ("float32", (c, d)), "counts": ("int64", (c,))}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "agg_protos": self.agg_protos.copy(),
                "agg_mask": self.agg_mask.copy(), "aggregations": int(self.aggregations)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.agg_protos = np.array(state["agg_protos"], dtype=np.float32, copy=True)
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

    @torch.no_grad()
    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """The global model (swapped in, local weights restored after): head
        metrics, and "proto_acc" = nearest prototype among this client's own
        training-set prototypes under the global model."""
        ctx = self.ctx
        with swapped_weights(ctx.model, task["weights"]):
            out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
            protos, counts = self._protos()
            if len(ctx.test_y) == 0 or not (counts > 0).any():
                out["proto_acc"] = float("nan")
                return out
            z = embeddings(ctx.model, ctx.test_x)
        pred = nearest_prototype(z, to_tensor(protos, z.device), to_tensor(counts > 0, z.device))
        out["proto_acc"] = float((pred == ctx.test_y).float().mean())
        return out


ALGORITHM = Algorithm("proto-attention", ProtoAttentionServer, ProtoAttentionClient,
                      "Michieli & Ozay: prototype-margin (LPM/APM) attention weights for "
                      "model aggregation")

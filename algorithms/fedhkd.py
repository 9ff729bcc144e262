"""FedHKD: federated hyper-knowledge distillation (a global model and personalised ones).

Chen, Wang, Vikalo, "The Best of Both Worlds: Accurate Global and Personalized Models
through Federated Learning with Data-Free Hyper-Knowledge Distillation", ICLR 2023
(arXiv:2301.08968; full text in ../shared/papers/fedhkd-chen-iclr2023.txt). Reference
code: github.com/CityChan/Federated-Hyper-Knowledge-Distillation at 8a930f4
(Client/ClientFedHKD.py `update_weights_HKD`, `generate_knowledge`,
`local_knowledge_aggregation`; Server/ServerFedHKD.py `train`,
`global_knowledge_aggregation`; utils.py `soft_predict`, `average_weights`; option.py).
Equation numbers are the paper's (main text 1-15, appendix 16-41); the
equation-by-equation audit is docs/FIDELITY.md (fedhkd). Defaults follow the paper;
where the reference code differs, its behaviour is a named option.

What travels: the global model (FedAvg, eq. 1) and, per class j, the "hyper-knowledge"
K^j = (H^j, Q^j): a mean representation and a mean soft prediction (Sec. 3.2-3.3).
Every client runs one architecture (`needs_same_model`: the weights are averaged).

Client i, per task (Algorithm 1, LocalUpdate):
- starts from the global model the task carries (line 15; Sec. 3.5), trains with eq. 11
  (line 17) over run.batches():
      L = 1/B sum_k CE(G(R(x_k)), y_k)
          + lam   * 1/n sum_j ||Q(G(H^j), T) - Q^j||_2          (the classifier term)
          + gamma * 1/B sum_k ||R(x_k) - H^{y_k}||_2              (the feature term)
  R the feature extractor (`model.features`), G the classifier (`model.head`), Q(z, T)
  = softmax(z / T) (eq. 2), n the number of classes, B the minibatch. The paper's
  ||.||_2 is the Euclidean norm ("we use Euclidean distance because it is non-negative
  and convex", Sec. 3.4), unsquared. A class without global knowledge (K^j empty: in the
  first round, or nobody shared it) adds 0 to either sum, which still divides by n and
  by B (the paper's 1/n and 1/B over all classes and samples). PARAMS `lam` = 0.05,
  `gamma` = 0.05, `temperature` = 0.5 (App. A.1; FedHKD* of Tables 1-2 is gamma = 0).
  PARAM `kd_loss` picks the classifier term:
    "paper" (default): as above;
    "kl"    (the code's `self.kld(Q_help.log(), Q_global)`, nn.KLDivLoss with its default
            reduction): KL(Q^j || Q(G(H^j), T)) averaged over the n' x n entries of the
            n' classes that have global knowledge.
  PARAM `feature_loss` picks the feature term:
    "paper" (default): as above;
    "mse"   (the code's `self.mse(F, target_features)`): nn.MSELoss between the batch's
            representations and, row by row, H^{y_k} (a sample whose class has no global
            representation keeps its own, detached: it adds 0 and still counts in the
            mean over B x D entries).
  PARAM `clip_grad` (default 0: none, the paper says nothing): the code clips the
  gradient norm at 1.1 before every step of its knowledge-aided rounds
  (`update_weights_HKD`; its first round, `update_weights`, does not clip). clip_grad =
  1.1 reproduces it: the steps of a task that carries global knowledge are clipped.
- then computes its local hyper-knowledge (line 19; eq. 4; App. A.3, Fig. 4) with the
  model it trained, in one eval-mode pass over its training data:
      h-bar^j = 1/N^j sum_k R(x_k^j),   q-bar^j = 1/N^j sum_k Q(G(R(x_k^j)), T)
  and protects the mean representation with the Gaussian mechanism (eqs. 6-8, Lemma 1):
      h~^j(l) = h-bar^j(l) + chi^j(l),  chi^j(l) ~ N(0, (S^j)^2 sigma^2),  S^j = 2 zeta / N^j
  drawn independently per class j and coordinate l. The soft predictions travel
  without noise (eq. 9 aggregates q-bar, not a noised q; Fig. 4 step 3 noises the
  representations only). PARAMS `sigma` = 7 (App. A.1; Sec. 4.3), `zeta` = 3 (Sec.
  4.3: the extractors end with BatchNorm, so |h(l)| <= 3 with probability 99.73 %).
  Lemma 1 needs |h(l)| <= zeta; the paper assumes it of its networks and clips nothing.
  PARAM `clip_features` (default False, the paper): True clamps every coordinate to
  [-zeta, zeta] before the class means (not the soft predictions), so that the bound,
  and with it the (eps, delta) guarantee of Theorem 1, holds for any network.
  PARAM `noise`:
    "paper" (default): as above;
    "code"  (`local_knowledge_aggregation`): one vector N(0, sigma^2 I_D), drawn once per
            task and added to every class's mean, not scaled by the sensitivity (the
            code's --std is 2: set sigma = 2 to match it).
  The noise is drawn from a torch.Generator seeded with the task's seed (run.seed), so
  the same task gives the same upload (fedbus replay).
  The sharing threshold nu (Sec. 3.2): a class j is shared only when its fraction of the
  client's training set N^j / N_i is at least nu ("if the fraction of samples with label
  j ... is below nu, client i is not allowed to share"); the others travel as count 0
  with zero rows. PARAM `nu` = 0.25 (App. A.1; Sec. 4.3's N^j > nu N_i = 256 of 1024).
  The code has no threshold and shares every class the client holds: nu = 0.
- upload: {"delta": its weights minus the task's (FedAvg), "protos": float32 [C, D] (the
  noisy h~^j), "soft": float32 [C, C] (q-bar^j), "counts": int64 [C] (N^j of the shared
  classes, 0 for the others)}.
- evaluate (Sec. 4.1: "the average local test accuracy of the trained local models as
  well as the global test accuracy of the global model"): "acc"/"loss" are the client's
  own model as it trained (its personalised model, what the code's `test_accuracy`
  scores after local training) on its test split; "global_acc"/"global_loss" the global
  model the eval task carries, on the same split (the client's weights are put back).
  The paper scores the global model on the whole (class-balanced) test set; the
  sample-weighted mean of "global_acc" over the clients is the global model's accuracy
  on the union of their test splits.

Server, per aggregation (Algorithm 1 lines 9-10):
- the global model, eq. 1 / eq. 21: w <- w + sum_i c_i delta_i / sum_i c_i, c_i = s_i
  |D_i| (s_i the engine's staleness weight, 1 when fresh: FedAvg's rule, fedbus.algorithms
  .fedavg). PARAM `weights_aggregate`: "weighted" (default, eq. 1) or "mean" (c_i = s_i:
  the code's `average_weights`, the plain mean; the paper's clients hold equally many
  samples, Sec. 4.1, where the two coincide).
- the global hyper-knowledge, eq. 9: per class j,
      H^j = sum_i p_i h~^j_i,   Q^j = sum_i p_i q-bar^j_i,   p_i = N^j_i / N^j
  over the clients that shared j, each weight also multiplied by s_i. PARAM `aggregate`:
    "weighted" (default): eq. 9;
    "mean"     the unweighted mean over the clients that shared j (s_i only): the code's
               `global_knowledge_aggregation`, which its server defines and never calls;
    "last"     what the code's server does (`global_features.update(local_features)`):
               each class takes the values of the last update that holds it, in the
               order the aggregation lists them (fedbus: fresh updates by client id,
               then the late ones folded in; the code: its random sampling order);
               staleness weights play no part.
  PARAM `keep_missing` (default False): "If there is no participating client sharing
  hyper-knowledge for class j, the server sets K^j = empty" (Sec. 3.2), so the global
  knowledge is rebuilt from each aggregation's updates; True keeps a class's previous
  value when nobody sent it: the code's dictionaries persist across rounds.
  An aggregation without updates changes nothing.
  The task is {"weights", "protos": float32 [C, D] (H), "soft": float32 [C, C] (Q),
  "has": bool [C]}; the eval task {"weights"}. Before the first aggregation K is empty
  (App. A.4: "global hyper-knowledge is initialized to an empty set and thus in round 1
  each client trains its local model without global hyper-knowledge"): CE alone.

Relays and secure aggregation (MERGE, HyperKnowledgeSums): eq. 1 and eq. 9 are weighted
sums, sum_i c_i delta_i / sum_i c_i and, per class, sum_i a_ij v_ij / sum_i a_ij (a_ij =
N^j_i or [N^j_i > 0]), so a relay pre-adds them and secure aggregation reveals only the
totals; the server divides as it does over single updates (up to float64 rounding). With
aggregate = "last" the server step is no sum: `merges` is False (relays forward updates as
they are, secure aggregation is refused). DP_LEVELS is empty: the upload is a weight delta
beside prototypes and soft predictions, which neither fedbus DP mechanism covers (FedHKD's
own Gaussian mechanism is the `sigma` above).

The reference code's setting, all options at once: aggregate = "last", keep_missing =
true, nu = 0, noise = "code", sigma = 2, kd_loss = "kl", feature_loss = "mse", clip_grad =
1.1, weights_aggregate = "mean". Not offered: the paper's and the code's optimiser (Adam,
lr 1e-3, halved every 10 rounds): fedbus clients step with the [train] SGD, as for every
algorithm.
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
from fedbus.algorithms.core.merge import DeltaSums, PrototypeSums, weighted_sum
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import opt, resolved_params
from fedbus.algorithms.core.protos import class_sums, fold_prototypes, merge_prototypes
from fedbus.algorithms.core.training import staleness_metrics
from fedbus.algorithms.core.weights import apply_delta, average_deltas
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer, swapped_weights

AGGREGATES = ("weighted", "mean", "last")


# --- merge rule -----------------------------------------------------------------------------

class _KnowledgeHalf(PrototypeSums):
    """One half of eq. 9 in sum form: payload[key] [C, K] (the noisy mean representations
    "protos", or the mean soft predictions "soft") with "counts", lifted as PrototypeSums
    does (a_ij = N^j_i under aggregate = "weighted", else [N^j_i > 0]); a merged payload
    carries it as payload[part]."""

    def __init__(self, key: str, part: str):
        super().__init__("aggregate", "weighted")
        self.key, self.part = key, part

    def lift(self, payload, num_samples, work, params, client=-1):
        return super().lift({"protos": payload[self.key], "counts": payload["counts"]},
                            num_samples, work, params, client)

    def form_of(self, payload):
        return payload[self.part]

    def spec(self, handler):
        c = handler.ctx.num_classes
        width = handler.ctx.feature_dim if self.key == "protos" else c
        return {"sums": ("float64", (c, width)), "mass": ("float64", (c,))}


class HyperKnowledgeSums(DeltaSums):
    """FedHKD's server step in sum form: eq. 1's weights as DeltaSums ("delta_sum", "mass"
    = [sum_i c_i], c_i = |D_i|, or 1 under weights_aggregate = "mean") and eq. 9's two
    per-class sums beside them: "feature_sums" (the representations H) and "soft_sums"
    (the soft predictions Q), each {"sums", "mass"} as PrototypeSums."""

    name = "delta-sums+hyper-knowledge-sums"
    features = _KnowledgeHalf("protos", "feature_sums")
    soft = _KnowledgeHalf("soft", "soft_sums")

    def lift(self, payload, num_samples, work, params, client=-1):
        n = float(num_samples) if params.get("weights_aggregate", "weighted") == "weighted" \
            else 1.0
        return {"delta_sum": {k: np.asarray(v, dtype=np.float64) * n
                              for k, v in payload["delta"].items()},
                "mass": np.array([n]),  # [1], not 0-d: the wire sends 0-d as a number
                "feature_sums": self.features.lift(payload, num_samples, work, params, client),
                "soft_sums": self.soft.lift(payload, num_samples, work, params, client)}

    def spec(self, handler):
        return {**super().spec(handler), "feature_sums": self.features.spec(handler),
                "soft_sums": self.soft.spec(handler)}

    def form_of(self, payload):
        return {k: payload[k] for k in ("delta_sum", "mass", "feature_sums", "soft_sums")}

    def check(self, payload, members):
        # the server's check of "mass" covers the weights' half; each knowledge half's
        # per-class mass is a sum of counts (weighted) or of indicators (mean)
        limit = max(sum(int(m[2]) for m in members), len(members))
        for part in ("feature_sums", "soft_sums"):
            mass = np.asarray(payload[part]["mass"], dtype=np.float64)
            if mass.size and float(mass.min()) < 0:
                return f"the {part} mass is negative"
            if mass.size and float(mass.max()) > limit * (1 + 1e-9):
                return (f"the {part} mass {float(mass.max()):.6g} is more than the members' "
                        f"samples allow ({limit})")
        return None


# --- server -----------------------------------------------------------------------------------

class FedHKDServer(FedAvgServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "lam": opt(0.05, "weight lambda of the classifier term of eq. 11 (App. A.1)", min=0.0),
        "gamma": opt(0.05, "weight gamma of the feature term of eq. 11 (App. A.1; 0 = the "
                     "paper's FedHKD*)", min=0.0),
        "temperature": opt(0.5, "temperature T of the soft predictions Q(z, T), eq. 2 "
                           "(App. A.1)", min=1e-6),
        "sigma": opt(7.0, "sigma of the Gaussian mechanism on the mean representations, "
                     "eqs. 6-7 (App. A.1; Sec. 4.3); 0 = no noise", min=0.0),
        "zeta": opt(3.0, "bound zeta on |h(l)| in the sensitivity 2 zeta / N^j of Lemma 1 "
                    "(Sec. 4.3: the extractor's final BatchNorm)", min=0.0),
        "nu": opt(0.25, "sharing threshold: a class is shared only if its fraction of the "
                  "client's training set is at least nu (Sec. 3.2, App. A.1); 0 = share "
                  "every class held (the reference code)", min=0.0, max=1.0),
        "clip_features": opt(False, "clamp each representation coordinate to [-zeta, zeta] "
                             "before the class means, so Lemma 1's bound holds (the paper "
                             "assumes it of its networks and clips nothing)"),
        "noise": opt("paper", "paper = independent N(0, (2 zeta sigma / N^j)^2) per class "
                     "and coordinate (eq. 7, Lemma 1); code = one N(0, sigma^2 I) vector "
                     "added to every class (the code's local_knowledge_aggregation)",
                     choices=("paper", "code")),
        "aggregate": opt("weighted", "global hyper-knowledge per class: weighted = eq. 9 (by "
                         "class counts); mean = unweighted (the code's unused "
                         "global_knowledge_aggregation); last = the last update holding the "
                         "class (what the code's server does)", choices=AGGREGATES),
        "keep_missing": opt(False, "a class nobody shared keeps its previous global "
                            "knowledge (the code's persistent dicts); False = the paper, "
                            "K^j is empty (Sec. 3.2)"),
        "kd_loss": opt("paper", "classifier term of eq. 11: paper = Euclidean distance "
                       "between Q(G(H^j), T) and Q^j, 1/n over the classes; kl = the code's "
                       "KLDivLoss", choices=("paper", "kl")),
        "feature_loss": opt("paper", "feature term of eq. 11: paper = Euclidean distance "
                            "between R(x) and H^y, 1/B over the batch; mse = the code's "
                            "MSELoss", choices=("paper", "mse")),
        "clip_grad": opt(0.0, "clip the gradient norm at this value in knowledge-aided steps "
                         "(0 = none, the paper; the code clips at 1.1)", min=0.0),
        "weights_aggregate": opt("weighted", "global model: weighted = eq. 1 (by |D_i|); "
                                 "mean = unweighted (the code's average_weights)",
                                 choices=("weighted", "mean")),
    }
    # eq. 1 and eq. 9 are weighted sums: a relay pre-aggregates them and secure aggregation
    # sums them (fedbus.algorithms.core.merge), unless aggregate = "last" (`merges`)
    MERGE = HyperKnowledgeSums()
    # the upload is a weight delta beside prototypes and soft predictions: neither fedbus DP
    # mechanism covers it (FedAvg's "client" level, which this class would otherwise appear
    # to inherit, sums the delta alone)
    DP_LEVELS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def merges(cls, params: Mapping[str, Any]) -> bool:
        """The last client's values per class are no sum."""
        return resolved_params(cls, params)["aggregate"] != "last"

    def __init__(self, ctx):
        super().__init__(ctx)
        c, d = ctx.num_classes, ctx.feature_dim
        self.protos = np.zeros((c, d), dtype=np.float32)  # H^j
        self.soft = np.zeros((c, c), dtype=np.float32)  # Q^j
        self.has = np.zeros(c, dtype=bool)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # aggregate() replaces these arrays, never writes them in place
        return {"weights": self.weights, "protos": self.protos, "soft": self.soft,
                "has": self.has}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"weights": self.weights}

    def update_spec(self) -> dict[str, Any]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {**super().update_spec(), "protos": ("float32", (c, d)),
                "soft": ("float32", (c, c)), "counts": ("int64", (c,))}

    # -- aggregation -------------------------------------------------------------------
    def coefficients(self, updates: list[ClientUpdate]) -> list[float]:
        """c_i = s_i |D_i| (eq. 1), or s_i under weights_aggregate = "mean"."""
        by_size = self.param("weights_aggregate") == "weighted"
        return [float(u.weight) * (float(u.num_samples) if by_size else 1.0) for u in updates]

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, Any]:
        metrics = staleness_metrics(updates, failures)
        if not updates:
            metrics["classes"] = float(self.has.sum())
            return metrics
        params = self.resolved_params()
        if any(u.members for u in updates):  # a relay's or secure aggregation's sums
            total, _ = weighted_sum(updates, self.MERGE, params)
            mass = float(total["mass"][0])
            if mass > 0:
                self.weights = apply_delta(self.weights, {k: v / mass for k, v in
                                                          total["delta_sum"].items()})
        else:
            self.weights = average_deltas(self.weights, [u.payload["delta"] for u in updates],
                                          self.coefficients(updates))
        keep = bool(self.param("keep_missing"))
        if self.param("aggregate") == "last":
            new_h, new_q, received = self._last_values(updates)
            old_has = self.has
            self.protos, self.has = merge_prototypes(self.protos, old_has, new_h, received, keep)
            self.soft, _ = merge_prototypes(self.soft, old_has, new_q, received, keep)
        else:  # eq. 9 (or its unweighted mean), staleness weights included
            old_has = self.has
            self.protos, self.has, received = fold_prototypes(
                self.protos, old_has, updates, self.MERGE.features, params, key="protos",
                keep_missing=keep)
            self.soft, _, _ = fold_prototypes(self.soft, old_has, updates, self.MERGE.soft,
                                              params, key="soft", keep_missing=keep)
        metrics["classes_received"] = float(received.sum())
        metrics["classes"] = float(self.has.sum())
        return metrics

    def _last_values(self, updates: list[ClientUpdate]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The code's dict.update: per class, the values of the last update holding it."""
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        h, q = np.zeros((c, d), np.float32), np.zeros((c, c), np.float32)
        received = np.zeros(c, dtype=bool)
        for u in updates:
            held = np.asarray(u.payload["counts"]) > 0
            h[held] = np.asarray(u.payload["protos"], dtype=np.float32)[held]
            q[held] = np.asarray(u.payload["soft"], dtype=np.float32)[held]
            received |= held
        return h, q, received

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "protos": self.protos.copy(), "soft": self.soft.copy(),
                "has": self.has.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.protos = np.array(state["protos"], dtype=np.float32, copy=True)
        self.soft = np.array(state["soft"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)


# --- client -----------------------------------------------------------------------------------

def soft_predictions(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """Q(z, T) = softmax(z / T) row by row (eq. 2)."""
    return F.softmax(z / temperature, dim=1)


def classifier_term(head, H: torch.Tensor, Q: torch.Tensor, has: torch.Tensor,
                    temperature: float, form: str = "paper") -> torch.Tensor:
    """Eq. 11's second term, before lam: "paper" = 1/n sum_{j in has} ||Q(G(H^j), T) -
    Q^j||_2 (n = all classes); "kl" = nn.KLDivLoss()(log Q(G(H^j), T), Q^j) over the
    classes in has (mean over their n' x n entries)."""
    z = head(H[has])
    if form == "kl":
        # nn.KLDivLoss()'s "mean" reduction, written out (torch warns that it will change)
        target = Q[has]
        pointwise = torch.special.xlogy(target, target) - target * F.log_softmax(
            z / temperature, dim=1)
        return pointwise.sum() / max(pointwise.numel(), 1)
    dist = torch.linalg.vector_norm(soft_predictions(z, temperature) - Q[has], dim=1)
    return dist.sum() / H.shape[0]


def feature_term(h: torch.Tensor, y: torch.Tensor, H: torch.Tensor, has: torch.Tensor,
                 form: str = "paper") -> torch.Tensor:
    """Eq. 11's third term, before gamma: "paper" = 1/B sum_k [has_{y_k}] ||h_k -
    H^{y_k}||_2; "mse" = MSELoss(h, target), target_k = H^{y_k} where has_{y_k}, else
    h_k detached (the code's target_features)."""
    held = has[y]
    if form == "mse":
        target = torch.where(held.unsqueeze(1), H[y].to(h.dtype), h.detach())
        return F.mse_loss(h, target)
    dist = torch.linalg.vector_norm(h - H[y].to(h.dtype), dim=1)
    return (dist * held.to(dist.dtype)).sum() / max(len(y), 1)


class FedHKDClient(FedAvgClient):
    """Eq. 11 over the task's global model and hyper-knowledge; uploads its weights'
    delta and its noisy local hyper-knowledge (eqs. 4, 7) for the classes above nu."""

    PARAMS: ClassVar[dict[str, Any]] = FedHKDServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        classification_only(ctx, "fedhkd")
        self.num_classes = ctx.num_classes
        self.lam = float(self.param("lam"))
        self.gamma = float(self.param("gamma"))
        self.temperature = float(self.param("temperature"))
        self.kd_loss = self.param("kd_loss")
        self.feature_loss = self.param("feature_loss")
        self._H: torch.Tensor | None = None
        self._Q: torch.Tensor | None = None
        self._has: torch.Tensor | None = None
        self._knowledge = False  # this task carries global hyper-knowledge

    # -- training ------------------------------------------------------------------------
    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        dev = self.ctx.device
        self._H = to_tensor(task["protos"], dev, torch.float32)
        self._Q = to_tensor(task["soft"], dev, torch.float32)
        self._has = to_tensor(task["has"], dev, torch.bool)
        self._knowledge = bool(self._has.any())
        try:
            load_weights(self.ctx.model, task["weights"])  # line 15: the global model
            self.run_local(run)
        finally:
            self._H = self._Q = self._has = None
            self._knowledge = False
        payload = {"delta": weight_delta(self.ctx.model, task["weights"])}
        payload.update(self.hyper_knowledge(run.seed))
        return payload

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if self._knowledge:
            if self.lam > 0:
                loss = loss + self.lam * classifier_term(model.head, self._H, self._Q,
                                                         self._has, self.temperature,
                                                         self.kd_loss)
            if self.gamma > 0:
                loss = loss + self.gamma * feature_term(h, y, self._H, self._has,
                                                        self.feature_loss)
        return loss

    def clip_gradients(self) -> None:
        """The gradient norm clipped at clip_grad before each step of a knowledge-aided
        task (the code's update_weights_HKD; its first round, update_weights, does not)."""
        clip = float(self.param("clip_grad"))
        if clip > 0 and self._knowledge:
            torch.nn.utils.clip_grad_norm_(self.ctx.model.parameters(), max_norm=clip)

    @torch.no_grad()
    def hyper_knowledge(self, seed: int, batch: int = 512) -> dict[str, np.ndarray]:
        """Eq. 4 over the training set with the model as it is now (eval mode), the mean
        representations noised by eq. 7, the classes below nu withheld: {"protos" float32
        [C, D], "soft" float32 [C, C], "counts" int64 [C]}."""
        ctx, c = self.ctx, self.num_classes
        zeta, sigma = float(self.param("zeta")), float(self.param("sigma"))
        clip = bool(self.param("clip_features"))
        model = ctx.model
        was_training = model.training
        model.eval()
        sums_h = sums_q = counts = None
        for i in range(0, len(ctx.train_y), batch):
            x, y = ctx.train_x[i:i + batch], ctx.train_y[i:i + batch]
            h = model.features(x).float()
            q = soft_predictions(model.head(h).float(), self.temperature)
            sh, n = class_sums(h.clamp(-zeta, zeta) if clip else h, y, c)
            sq, _ = class_sums(q, y, c)
            sums_h = sh if sums_h is None else sums_h + sh
            sums_q = sq if sums_q is None else sums_q + sq
            counts = n if counts is None else counts + n
        model.train(was_training)
        d = ctx.feature_dim if sums_h is None else sums_h.shape[1]
        if sums_h is None:  # no training data: nothing to share
            return {"protos": np.zeros((c, d), np.float32), "soft": np.zeros((c, c), np.float32),
                    "counts": np.zeros(c, np.int64)}
        counts = counts.cpu()
        per = counts.clamp(min=1).unsqueeze(1).to(torch.float64)
        mean_h = sums_h.cpu().double() / per
        mean_q = sums_q.cpu().double() / per
        # eq. 7: the Gaussian mechanism, from a generator of this task's own
        gen = torch.Generator().manual_seed(_noise_seed(seed))
        if self.param("noise") == "paper":  # Lemma 1: S^j = 2 zeta / N^j, per class
            std = sigma * 2.0 * zeta / per
            noise = torch.randn(c, d, generator=gen, dtype=torch.float64) * std
        else:  # the code: one unscaled vector for every class
            noise = (sigma * torch.randn(d, generator=gen, dtype=torch.float64)).expand(c, d)
        # the threshold nu of Sec. 3.2: N^j / N_i >= nu (and the class present)
        share = (counts > 0) & (counts.double() / len(ctx.train_y) >= float(self.param("nu")))
        keep = share.unsqueeze(1)
        protos = torch.where(keep, mean_h + noise, torch.zeros_like(mean_h))
        soft = torch.where(keep, mean_q, torch.zeros_like(mean_q))
        return {"protos": protos.numpy().astype(np.float32),
                "soft": soft.numpy().astype(np.float32),
                "counts": torch.where(share, counts, torch.zeros_like(counts)).numpy()
                .astype(np.int64)}

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """The personalised model ("acc", "loss": the client's own, as it trained) and the
        global model of the eval task ("global_acc", "global_loss"), on the test split."""
        ctx = self.ctx
        out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        with swapped_weights(ctx.model, task["weights"]):
            glob = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        out["global_acc"] = glob["acc"]
        out["global_loss"] = glob["loss"]
        return out


def _noise_seed(seed: int) -> int:
    """The noise generator's seed: derived from the task's seed, apart from the batch
    order's generator (LocalRun seeds that with the task's seed itself)."""
    return int(np.random.SeedSequence([int(seed) & (2**63 - 1), 0x484B44])
               .generate_state(1, dtype=np.uint64)[0] >> 1)


ALGORITHM = Algorithm("fedhkd", FedHKDServer, FedHKDClient,
                      "FedHKD (Chen et al., ICLR 2023): FedAvg + noisy per-class mean "
                      "representations and soft predictions distilled data-free")

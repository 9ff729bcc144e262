"""FedPAC: feature alignment to global prototypes and classifier collaboration by a small QP.

Xu, Tong, Huang, "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration", ICLR 2023 (OpenReview SXZr8aDKia, arXiv:2306.11867). Only the abstract is
here (../shared/papers/fedpac-xu-iclr2023.txt), so its equations and their numbers are not:
the authors' code is the specification, github.com/JianXu95/FedPAC @ 5770f4f (no licence;
read, not copied): methods/fedpac.py (`LocalUpdate_FedPAC.statistics_extraction`,
`.local_training`, `.get_local_protos`), running.py (`train_round_fedpac`), tools.py
(`average_weights_weighted`, `protos_aggregation`, `get_head_agg_weight`,
`agg_classifier_weighted_p`) and options.py (the defaults). Each choice below names the
function it follows ("code"); the audit, code | fedbus: docs/FIDELITY.md (fedpac).

The split is FedPer's (fedbus.algorithms.fedper): the body (feature extractor, every weight
outside the network's `head_module`, buffers included) is shared and averaged; the head is
each client's own, and the server mixes participants' heads per client.

Client i, per task (code, `train_round_fedpac` then `local_training`):
1. loads the task's global body, and its personal head if the task carries one made from
   its latest upload (below);
2. statistics before training (code, `statistics_extraction`), one eval-mode pass over its
   training set with the model as loaded, in float64: p_k = n_k / n (its label
   distribution), mu_k = mean feature of class k, h_ref[k] = p_k mu_k ([C, D], zero rows for
   absent classes) and the scalar
       v = (1/n) sum_k [ p_k * (1/n_k) sum_{x in k} ||f(x)||^2 - p_k^2 ||mu_k||^2 ];
3. head phase: PARAM `head_epochs` epochs (default 1: the code's epoch_classifier) of SGD
   on the cross-entropy, body frozen, at PARAM `head_lr` (default 0.1: the code's lr_g) with
   [train]'s momentum and weight decay;
4. body phase: train.epochs epochs (the engine's run: partial work, budgets, deadlines) of
   SGD on the body, head frozen, at train.lr, loss
       CE(head(f(x)), y) + lam * MSE(f(x), c_y),
   MSE the mean over batch and dimensions (nn.MSELoss), c_y the global prototype of y, or
   the client's own pre-training class mean mu_y where the server has none for y (code);
   no alignment term while the server has no global prototype at all (the code's round 0).
   PARAM `lam` (default 1.0: options.py --lam). The code's optimisers are SGD momentum 0.5,
   weight decay 5e-4 for both phases, lr 0.01 (options.py; 0.02 for CIFAR in
   federated_main.py), built anew each round: set [train] momentum = 0.5, weight_decay =
   5e-4, lr and optimizer_state = "fresh" (the default) to match. Each phase has its own
   optimiser over its own parameters (the code builds each over the trainable part only),
   so the frozen part never moves. The phases are FedRep's (fedbus.algorithms.fedrep): the
   head phase is a LocalRun of its own, scaled like the engine's under partial work, on
   the same clock and budget;
5. uploads "delta" (its body minus the body sent), "head" (its trained head, the whole
   weights: they are mixed, not averaged as steps), "protos" float32 [C, D] with "counts"
   int64 [C] (post-training class means, eval mode; code, `get_local_protos`), "h_ref"
   float32 [C, D] and "v" float64 [1] (step 2).

Server, per aggregation, over the updates in it (the engine's staleness weight w_k, 1 when
fresh; PARAM `partial` as FedAvg's):
- body: theta <- theta + sum_k w_k n_k delta_k / sum_k w_k n_k (code,
  `average_weights_weighted` over the data sizes);
- global prototypes: per class c, sum_k w_k n_kc mu_kc / sum_k w_k n_kc (code,
  `protos_aggregation`, weighted by the label counts). Classes no update holds are dropped
  (the code rebuilds its dict each round) unless PARAM `keep_missing` (default False; True
  keeps their last prototype, which async buffers of a few clients may want);
- heads (code, `get_head_agg_weight` + `agg_classifier_weighted_p`), PARAM
  `combine_heads` (default True; False = the code's --agg_g 0: every client keeps its own
  head): the participants j = 1..m are the clients with an update here (a client's latest
  one if it has several). For each participant i,
      P = diag(v_1..v_m) + D,  D[j, l] = sum_c (h_i[c] - h_j[c]) . (h_i[c] - h_l[c]),
      alpha = argmin alpha^T P alpha  s.t.  sum_j alpha_j = 1, alpha >= 0,
  solved in float64 by scipy's SLSQP on P / max|P| (`head_weights`; the code uses cvxpy);
  weights <= PARAM `weight_floor` (default 1e-3: the code's eps) are zeroed and the rest
  renormalised (the code divides by their sum in agg_classifier_weighted_p); the new head
  of i is sum_j alpha_j head_j. P is a Gram matrix plus a non-negative diagonal, so it is
  PSD but for rounding; where it is not (an eigenvalue below -1e-10 x the largest
  magnitude: the code tests >= 0 on float32), it is rebuilt from the eigenpairs with an
  eigenvalue >= PARAM `psd_floor` (default 0.01, the code's), and where none is left i keeps
  its own head (the code's alpha = None). The staleness weights do not enter the QP (it
  weighs heads by their statistics, not by their freshness).
  The head goes to i in its next task (and eval task) with "head_from" = the version of the
  update it was made from; the client adopts it only if that is its latest training
  (head_from >= the version of its last task), so a straggler whose newer head the server
  has not seen yet keeps that one. A client never combined keeps its own head.

Evaluation, PARAM `eval_model`: "personal" (default: the global body with the client's
personal head: the model it starts its next round from; the code's acc before local
training, `local_test` at the start of `local_training`) or "local" (the client's model
after its last local training: the code's acc after).

Relays and secure aggregation: no merge rule (no MERGE). The head QP needs each
participant's h_ref, v and head one by one, so a relay forwards every update as it is and
privacy.secure_aggregation is refused (the body and prototype halves alone would be sums).
DP_LEVELS is empty (the upload is a delta beside statistics and a head). Every client runs
one architecture (`needs_same_model`: the body is averaged weight by weight).
Classification only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import minimize

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             classification_only, to_tensor)
from fedbus.algorithms.core.merge import PrototypeSums
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.protos import class_sums, embeddings, fold_prototypes, \
    local_prototypes
from fedbus.algorithms.core.training import staleness_metrics
from fedbus.algorithms.core.weights import average_deltas, fedavg_coefs, weights_spec
from fedbus.algorithms.fedavg import PARTIAL
from fedbus.algorithms.fedper import (head_map, load_part, part_delta, part_weights,
                                      swapped_part)
from fedbus.algorithms.fedrep import FedRepClient, FedRepServer, head_seed

#: the global prototypes weighted by class counts (code, protos_aggregation)
BY_COUNT = {"aggregate": "weighted"}


# --- the head-combination QP (code, get_head_agg_weight) ----------------------------------------

def qp_matrix(v: np.ndarray, h_ref: np.ndarray, i: int) -> np.ndarray:
    """P = diag(v) + D for reference client i: v [m], h_ref [m, C, D];
    D[j, l] = sum_c (h_i[c] - h_j[c]) . (h_i[c] - h_l[c]), a Gram matrix. float64 [m, m]
    (einsum: no BLAS, so no thread-count-dependent rounding)."""
    h = np.asarray(h_ref, dtype=np.float64)
    r = (h[i] - h).reshape(len(h), -1)
    return np.diag(np.asarray(v, dtype=np.float64)) + np.einsum("jk,lk->jl", r, r)


def solve_simplex_qp(p: np.ndarray) -> np.ndarray:
    """argmin a^T P a s.t. sum a = 1, a >= 0 for a PSD P [m, m]: SLSQP from the uniform point
    on P / max|P| (the minimiser does not change with a positive scale; the tolerance is
    absolute on the objective)."""
    p = np.asarray(p, dtype=np.float64)
    m = len(p)
    scale = float(np.abs(p).max())
    if m == 1 or scale == 0.0:
        return np.full(m, 1.0 / m)
    q = (p + p.T) / (2.0 * scale)
    ones = np.ones(m)
    res = minimize(lambda a: float(a @ q @ a), np.full(m, 1.0 / m), jac=lambda a: 2.0 * q @ a,
                   method="SLSQP", bounds=[(0.0, 1.0)] * m,
                   constraints=[{"type": "eq", "fun": lambda a: float(a.sum() - 1.0),
                                 "jac": lambda a: ones}],
                   options={"ftol": 1e-15, "maxiter": 1000})
    return np.clip(np.asarray(res.x, dtype=np.float64), 0.0, None)


def psd_or_repaired(p: np.ndarray, psd_floor: float) -> np.ndarray | None:
    """P where it is PSD up to rounding; else P rebuilt from its eigenpairs whose eigenvalue
    is >= psd_floor (the code's repair); None where none is (the client keeps its own head)."""
    p = (np.asarray(p, dtype=np.float64) + np.asarray(p, dtype=np.float64).T) / 2.0
    lam, vec = np.linalg.eigh(p)
    if lam.min() >= -1e-10 * max(float(np.abs(lam).max()), 1e-300):
        return p
    keep = lam >= psd_floor
    if not keep.any():
        return None
    return np.einsum("jk,k,lk->jl", vec[:, keep], lam[keep], vec[:, keep])


def head_weights(v: np.ndarray, h_ref: np.ndarray, i: int, weight_floor: float = 1e-3,
                 psd_floor: float = 0.01) -> np.ndarray | None:
    """Client i's combination weights alpha [m] over the m participants (module doc), weights
    <= weight_floor zeroed and the rest renormalised; None = keep its own head."""
    p = psd_or_repaired(qp_matrix(v, h_ref, i), psd_floor)
    if p is None:
        return None
    alpha = solve_simplex_qp(p)
    alpha = np.where(alpha > weight_floor, alpha, 0.0)
    total = alpha.sum()
    if total <= 0:  # every weight below the floor: only possible with m > 1 / floor
        return None
    return alpha / total


def mix_heads(heads: list[Mapping[str, Any]], alpha: np.ndarray) -> dict[str, np.ndarray]:
    """sum_j alpha_j head_j per weight, in float64, cast to each weight's dtype."""
    out = {}
    for name in heads[0]:
        acc = sum(float(a) * np.asarray(h[name], dtype=np.float64)
                  for a, h in zip(alpha, heads) if a > 0)
        out[name] = np.asarray(acc, dtype=np.asarray(heads[0][name]).dtype)
    return out


# --- server ----------------------------------------------------------------------------------

class FedPACServer(FedRepServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "partial": PARTIAL,
        "lam": opt(1.0, "weight of the feature-alignment term lam * MSE(f(x), c_y) in the body "
                   "epochs (the code's --lam 1.0)", min=0.0),
        "head_epochs": opt(1, "head-only epochs (body frozen) before the train.epochs body "
                           "epochs (the code's epoch_classifier = 1)", min=0),
        "head_lr": opt(0.1, "learning rate of the head epochs (the code's lr_g = 0.1); the "
                       "body epochs use train.lr", min=0.0),
        "combine_heads": opt(True, "mix each participant's head from the participants' heads "
                             "by the QP's weights; false = every client keeps its own head "
                             "(the code's --agg_g 0)"),
        "weight_floor": opt(1e-3, "QP weights at or below this are zeroed, the rest "
                            "renormalised (the code's eps = 1e-3)", min=0.0, max=1.0),
        "psd_floor": opt(0.01, "a QP matrix that is not PSD is rebuilt from its eigenpairs "
                         "with an eigenvalue at least this (the code's 0.01); none left: the "
                         "client keeps its own head", min=0.0),
        "keep_missing": opt(False, "a class no update of an aggregation holds keeps its last "
                            "global prototype; false = it has none until one comes (the code "
                            "rebuilds the prototypes from each round's clients)"),
        "eval_model": opt("personal", "personal = the global body with the client's personal "
                          "head (the model its next round starts from); local = its model "
                          "after its last local training", choices=("personal", "local")),
    }
    needs_same_model: ClassVar[bool] = True  # the body is averaged weight by weight
    # no MERGE: the head QP needs every participant's statistics and head (module doc)

    def __init__(self, ctx):
        super().__init__(ctx)
        model = ctx.make_model(0)
        head = head_map(model)
        self._head_spec = weights_spec(part_weights(model, head))
        c, d = ctx.num_classes, ctx.feature_dim
        self.protos = np.zeros((c, d), np.float32)
        self.has = np.zeros(c, bool)
        # client -> its personal head ({relative name: array}) and the version of the update
        # it was made from; a client absent has never been combined
        self.heads: dict[int, dict[str, np.ndarray]] = {}
        self.head_from: dict[int, int] = {}

    def _personal(self, client: int) -> dict[str, Any]:
        if client not in self.heads:
            return {}
        return {"head": self.heads[client], "head_from": int(self.head_from[client])}

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # aggregate() builds new arrays, never writes these in place
        return {"weights": self.weights, "protos": self.protos, "has": self.has,
                "round": int(info.round), **self._personal(client)}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"weights": self.weights, **self._personal(client)}

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, Any]:
        updates, failures = self.tolerated(updates, failures)
        metrics: dict[str, Any] = staleness_metrics(updates, failures)
        if not updates:
            return metrics
        self.weights = average_deltas(self.weights, [u.payload["delta"] for u in updates],
                                      fedavg_coefs(updates))
        self.protos, self.has, received = fold_prototypes(
            self.protos, self.has, updates, PrototypeSums(), BY_COUNT,
            keep_missing=bool(self.param("keep_missing")))
        metrics["classes_received"] = float(received.sum())
        if self.param("combine_heads"):
            metrics.update(self.combine_heads(updates))
        return metrics

    def combine_heads(self, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Each participant's new head from the QP over this aggregation's participants;
        returns the metrics (fallbacks, mean own weight, and every alpha as agg_extra)."""
        latest: dict[int, ClientUpdate] = {}
        for u in updates:
            if u.client not in latest or u.version >= latest[u.client].version:
                latest[u.client] = u
        clients = sorted(latest)
        ups = [latest[c] for c in clients]
        v = np.array([float(np.asarray(u.payload["v"]).reshape(-1)[0]) for u in ups])
        h_ref = np.stack([np.asarray(u.payload["h_ref"], dtype=np.float64) for u in ups])
        heads = [u.payload["head"] for u in ups]
        fallbacks, own, table = 0, [], {}
        for i, (client, u) in enumerate(zip(clients, ups)):
            alpha = head_weights(v, h_ref, i, float(self.param("weight_floor")),
                                 float(self.param("psd_floor")))
            if alpha is None:
                fallbacks += 1
                alpha = np.eye(len(ups))[i]
            self.heads[client] = mix_heads(heads, alpha)
            self.head_from[client] = int(u.version)
            own.append(float(alpha[i]))
            table[str(client)] = {str(c): round(float(a), 6) for c, a in zip(clients, alpha)
                                  if a > 0}
        return {"head_fallbacks": float(fallbacks), "head_own_weight": float(np.mean(own)),
                "head_weights": table}

    def update_spec(self) -> dict[str, Any]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {"delta": dict(self._weights_spec), "head": dict(self._head_spec),
                "protos": ("float32", (c, d)), "counts": ("int64", (c,)),
                "h_ref": ("float32", (c, d)), "v": ("float64", (1,))}

    # -- checkpoint: heads stacked per weight, head_from -1 where a client has none ----------
    def state_dict(self) -> dict[str, Any]:
        k = self.ctx.clients
        heads = {name: np.zeros((k, *shape), dtype) for name, (dtype, shape)
                 in self._head_spec.items()}
        head_from = np.full(k, -1, np.int64)
        for client, head in self.heads.items():
            head_from[client] = self.head_from[client]
            for name, value in head.items():
                heads[name][client] = value
        return {"weights": {n: w.copy() for n, w in self.weights.items()},
                "protos": self.protos.copy(), "has": self.has.copy(), "heads": heads,
                "head_from": head_from}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.weights = {n: np.array(w, copy=True) for n, w in state["weights"].items()}
        self.protos = np.array(state["protos"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)
        head_from = np.asarray(state["head_from"])
        self.heads = {int(c): {n: np.array(w[c], copy=True) for n, w in state["heads"].items()}
                      for c in np.nonzero(head_from >= 0)[0]}
        self.head_from = {int(c): int(head_from[c]) for c in np.nonzero(head_from >= 0)[0]}


# --- client ----------------------------------------------------------------------------------

class FedPACClient(FedRepClient):
    """Statistics, then FedRep's head and body phases with the alignment term in the body
    phase; uploads the body delta, its head, prototypes and statistics (module doc)."""

    PARAMS: ClassVar[dict[str, Any]] = FedPACServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)  # self.optimizer: the body's; self.head_optimizer: the head's
        classification_only(ctx, "FedPAC")
        for group in self.head_optimizer.param_groups:
            group["lr"] = float(self.param("head_lr"))
        self.head = head_map(ctx.model)
        self.head_version = -1  # the version of the task the current head was trained in
        self._targets: torch.Tensor | None = None  # c_y per class, or None: no alignment
        self._aligning = False

    # -- step 2: statistics ---------------------------------------------------------------
    @torch.no_grad()
    def statistics(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(v, h_ref [C, D], mu [C, D]) of the model as it is, float64 (module doc, step 2;
        code, statistics_extraction)."""
        ctx = self.ctx
        c = ctx.num_classes
        if len(ctx.train_y) == 0:
            zeros = torch.zeros(c, ctx.feature_dim, dtype=torch.float64, device=ctx.device)
            return 0.0, zeros, zeros
        f = embeddings(ctx.model, ctx.train_x).double()
        sums, counts = class_sums(f, ctx.train_y, c)
        sq, _ = class_sums((f * f).sum(1, keepdim=True), ctx.train_y, c)
        n_k = counts.clamp(min=1).to(torch.float64)
        mu = sums / n_k[:, None]
        p = counts.to(torch.float64) / len(ctx.train_y)
        v = (p * sq[:, 0] / n_k - p * p * (mu * mu).sum(1)).sum() / len(ctx.train_y)
        return float(v), p[:, None] * mu, mu

    # -- steps 3 and 4: the two phases ------------------------------------------------------
    def head_run(self, run: LocalRun) -> LocalRun:
        epochs = int(self.param("head_epochs"))
        return LocalRun(self.ctx, epochs=epochs, seed=head_seed(run.seed),
                        epochs_to_run=epochs * run.epochs_to_run / max(run.epochs, 1),
                        budget_s=run.budget_s, slow_factor=run.slow_factor, clock=run.clock,
                        lr_factor=run.lr_factor)

    def body_phase(self, run: LocalRun) -> None:
        self._aligning = self._targets is not None
        try:
            super().body_phase(run)
        finally:
            self._aligning = False

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if self._aligning:
            loss = loss + float(self.param("lam")) * F.mse_loss(h, self._targets[y])
        return loss

    def alignment_targets(self, task: Mapping[str, Any], mu: torch.Tensor) -> torch.Tensor | None:
        """c_y per class: the global prototype where the server has one, else the client's
        pre-training class mean; None while the server has none at all."""
        has = np.asarray(task.get("has", ()), dtype=bool)
        if not has.any():
            return None
        ctx = self.ctx
        glob = to_tensor(task["protos"], ctx.device, torch.float32)
        return torch.where(to_tensor(has, ctx.device)[:, None], glob, mu.float())

    # -- the task -----------------------------------------------------------------------------
    def offered_head(self, task: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The task's personal head if it was made from this client's latest training."""
        if "head" in task and int(task.get("head_from", -1)) >= self.head_version:
            return task["head"]
        return None

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        ctx = self.ctx
        load_part(ctx.model, self.part, task["weights"])
        head = self.offered_head(task)
        if head is not None:
            load_part(ctx.model, self.head, head)
        v, h_ref, mu = self.statistics()
        self._targets = self.alignment_targets(task, mu)
        try:
            self.local_update(run)
        finally:
            self._targets = None
        self.head_version = int(task.get("round", 0))
        if len(ctx.train_y):
            protos, counts = local_prototypes(ctx.model, ctx.train_x, ctx.train_y,
                                              ctx.num_classes)
        else:
            protos = np.zeros((ctx.num_classes, ctx.feature_dim), np.float32)
            counts = np.zeros(ctx.num_classes, np.int64)
        return {"delta": part_delta(ctx.model, self.part, task["weights"]),
                "head": part_weights(ctx.model, self.head), "protos": protos,
                "counts": counts, "h_ref": h_ref.float().cpu().numpy(),
                "v": np.array([v], np.float64)}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        if self.param("eval_model") == "local":
            return head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        head = self.offered_head(task)
        with swapped_part(ctx.model, self.part, task["weights"]):
            if head is None:
                return head_metrics(ctx.model, ctx.test_x, ctx.test_y)
            with swapped_part(ctx.model, self.head, head):
                return head_metrics(ctx.model, ctx.test_x, ctx.test_y)

    # -- state ----------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "head_version": self.head_version}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        super().load_extra_state(state)
        self.head_version = int(state.get("head_version", -1))


ALGORITHM = Algorithm("fedpac", FedPACServer, FedPACClient,
                      "FedPAC (Xu et al. 2023): averaged body aligned to global prototypes, "
                      "personal heads mixed by a per-client QP")

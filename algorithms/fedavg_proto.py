"""FedAvg-proto: FedAvg training, prototype inference after the last round.

Qiao, Park, Kang, Hong, "Prototype Helps Federated Learning: Towards Faster
Convergence" (arXiv:2303.12296, 2023), Algorithm 1 ("ProtoFed") and eqs. 1-4.
No reference code is published; the equation-by-equation audit, with the
paper's settings and numbers, is docs/FIDELITY.md (fedavg-proto).

Training is plain FedAvg (eq. 1, inherited from `FedAvgServer` /
`FedAvgClient`: sample-count-weighted averaging, staleness weights included).
Only the last global iteration t = T changes (Algorithm 1 lines 5-7): after
its local update each client also computes its local prototypes (eq. 2, the
per-class mean features y~_i,j of its training data D_i,j, FedProto's
definition) and sends them with its model update; the server averages the
weights as usual and the prototypes per class (eq. 3), and sends both back;
each client then classifies a test sample x by the nearest aggregated
prototype (eq. 4, Algorithm 1 lines 13-19):
    y^ = argmin_j || f_e(w_e; x) - y-bar_j ||_2   over the classes j in {y-bar}.

PARAMS (defaults = the paper):
- `aggregate` (eq. 3): "mean" (default): y-bar_j is the plain average of the
  prototypes of the clients that have class j ("average the prototypes from
  those clients with j-th class"; eq. 3 as printed divides by |phi|, the number
  of all clients, which the sentence after it corrects), each weighed only by
  the engine's staleness weight (1 when fresh); "weighted": weighed by the
  clients' class counts |D_i,j| as well (FedProto's eq. 6; fedbus's default
  before the audit).
- `proto_model` (eq. 2): which model's features f_e(w_e; x) the client's prototypes
  average. "global" (default): the global model the task carries, the one the client
  received for this round (before its local update). Eq. 2 writes f_e(w_e; x) with the
  shared model's w of Sec. II-A ("the model parameters of the global model"), without a
  client index, and eq. 4 classifies with that same f_e(w_e; .): read literally, one
  global feature space for the prototypes and the queries. The prototypes travel with the
  round's update (Fig. 1, step 1), so the global model a client has when it computes them
  is the one it received; inference (`infer_model = "global"`) uses the model aggregated
  from that round, one FedAvg step later. "local": the client's own model after the
  round's local update (Sec. II-B's "update their own local model parameters as usual,
  but also calculate their own prototypes" read as "then"; fedbus before issue 25), whose
  features a client's skewed local training moves away from the global model's that
  classifies with them.
- `infer_model` (eq. 4): "global" (default; Sec. II-B: "the aggregated
  prototypes and the latest model parameters are then sent back to local
  clients for model inferences", and f_e(w_e; .) is the shared model of
  Sec. II-A): the features of the aggregated global model, the one the eval
  task carries; "local": the client's own post-training model (with
  `proto_model = "local"`, the one that computed its prototypes).
- `every_round` (default False: prototypes are computed, uploaded and
  aggregated in the last round only, Algorithm 1 lines 5-9). True does it every
  round, for the per-round proto-accuracy curves of the paper's figures
  ("we perform prototype-based model inference in each round during training",
  Sec. III-C).
- `robust` (default "none": eq. 1's weighted mean of the weights and eq. 3's mean of the
  prototypes): "median", "trimmed_mean" (`robust_trim`) or "krum" (`robust_f`,
  `robust_m`) replace both, the weights' step by the rule over the deltas and each class's
  prototype by the rule over its holders' prototypes (fedbus.algorithms.core.robust): a defence
  against in-range poison, not the paper's; each update then counts once.

On the bus:
- task: {"weights": ..., "send_protos": bool};
- update: {"delta": ...} plus, when asked, {"protos": float32 [C, D],
  "counts": int64 [C]}: one eval-mode pass over the training data with the model
  `proto_model` names (the received global model, before local training; or the
  client's post-training model);
- eval: {"weights", "protos": float32 [C, D], "has": bool [C]}. "acc" is the
  global model's head (as FedAvg), "proto_acc" is eq. 4 with the model
  `infer_model` names, nan before any prototype exists. Segmentation: per-pixel
  prototypes and inference (fedbus.algorithms.core.protos; "proto_miou" beside
  "proto_acc", "miou" beside "acc").
Relays and secure aggregation (fedbus.algorithms.core.merge, DeltaAndPrototypeSums): eq. 1 and
eq. 3 are weighted sums, sum_i n_i delta_i / sum_i n_i and, per class, sum_i a_ij y~_i,j /
sum_i a_ij, so a relay pre-adds both and secure aggregation reveals only their totals;
the server divides as it does over single updates (up to float64 rounding). A sum form
has fixed shapes, so this holds where every update carries prototypes: with `every_round`
True and `robust` "none" (`merges`); otherwise relays forward updates as they are and
secure aggregation is refused.
Global prototypes persist across aggregations; a class nobody sent keeps its
previous prototype (only matters with `every_round` and partial participation:
the paper has every client in its last round).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import ClientUpdate, Failure, LocalRun, RoundInfo, to_tensor
from fedbus.algorithms.core.merge import DeltaAndPrototypeSums
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import opt, resolved_params
from fedbus.algorithms.core.protos import (
    fold_prototypes,
    head_and_prototype_metrics,
    local_prototypes,
    prototype_metrics,
)
from fedbus.algorithms.core.robust import ROBUST_PARAMS, Outcome, report
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer, swapped_weights


class FedAvgProtoServer(FedAvgServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "every_round": opt(False, "upload and evaluate prototypes every round (the paper's "
                           "curves), not only in the last round (Algorithm 1)"),
        "aggregate": opt("mean", "per-class prototype aggregation: mean = eq. 3 (plain average "
                         "over the clients with the class); weighted = by class counts "
                         "|D_i,j| (FedProto's eq. 6)", choices=("mean", "weighted")),
        "proto_model": opt("global", "whose features eq. 2 averages into the client's "
                           "prototypes: global = the global model the task carries (eq. 2's "
                           "shared w_e, before local training); local = the client's model "
                           "after its local update", choices=("global", "local")),
        "infer_model": opt("global", "whose features eq. 4 compares with the prototypes: "
                           "global = the latest aggregated model (Sec. II-B); local = the "
                           "client's own post-training model", choices=("global", "local")),
        **ROBUST_PARAMS,
    }
    # eq. 1 and eq. 3 are both weighted sums: a relay pre-aggregates them and secure
    # aggregation sums them (fedbus.algorithms.core.merge), where every round's updates carry
    # prototypes (`merges`: every_round, and no robust rule)
    MERGE = DeltaAndPrototypeSums()

    @classmethod
    def merges(cls, params: Mapping[str, Any]) -> bool:
        """A sum form has fixed shapes, and without `every_round` only the last round's
        updates carry prototypes: the others have no prototype half to sum (its shape
        [C, D] is not in them), so such a run forwards every update as it is."""
        return super().merges(params) and bool(resolved_params(cls, params)["every_round"])

    def __init__(self, ctx):
        super().__init__(ctx)
        self.protos = np.zeros((ctx.num_classes, ctx.feature_dim), dtype=np.float32)
        self.has = np.zeros(ctx.num_classes, dtype=bool)

    def wants_protos(self, info: RoundInfo) -> bool:
        return bool(self.param("every_round")) or info.last

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {**super().make_task(client, info), "send_protos": self.wants_protos(info)}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {**super().make_eval(client, info), "protos": self.protos, "has": self.has}

    def _valid_protos(self, u: ClientUpdate) -> bool:
        # Prototypes are optional in this algorithm's updates, so update_spec()
        # cannot require them; check their shapes here instead.
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        p, n = u.payload.get("protos"), u.payload.get("counts")
        return (p is not None and n is not None and np.shape(p) == (c, d)
                and np.shape(n) == (c,))

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = super().aggregate(updates, failures, info)
        rule = self.robust_rule()
        # eq. 3 over the updates with prototypes, a merged update's "proto_sums" among them
        # (merged updates come only without a robust rule), or per class the robust rule
        with_protos = [u for u in updates
                       if (u.members and rule is None) or self._valid_protos(u)]
        if with_protos:
            out = Outcome()
            self.protos, self.has, _ = fold_prototypes(
                self.protos, self.has, with_protos, self.MERGE.protos, self.resolved_params(),
                robust=rule, outcome=out)
            metrics["proto_updates"] = float(sum(len(u.members) or 1 for u in with_protos))
            if rule is not None:
                report(metrics, rule, out, [u.client for u in with_protos], prefix="proto_")
        metrics["classes"] = float(self.has.sum())
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "protos": self.protos.copy(), "has": self.has.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.protos = np.array(state["protos"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)


class FedAvgProtoClient(FedAvgClient):
    PARAMS: ClassVar[dict[str, Any]] = FedAvgProtoServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self._protos: tuple[np.ndarray, np.ndarray] | None = None

    def prototypes(self) -> tuple[np.ndarray, np.ndarray]:
        """Eq. 2 over the client's training data with the model as it is now."""
        ctx = self.ctx
        if not len(ctx.train_y):
            return (np.zeros((ctx.num_classes, ctx.feature_dim), np.float32),
                    np.zeros(ctx.num_classes, np.int64))
        return local_prototypes(ctx.model, ctx.train_x, ctx.train_y, ctx.num_classes)

    def begin_local(self, task: Mapping[str, Any]) -> None:
        # the task's global weights are loaded and no step has been taken: eq. 2's w_e
        self._protos = None
        if task.get("send_protos") and self.param("proto_model") == "global":
            self._protos = self.prototypes()

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        payload = super().train(task, run)
        if task.get("send_protos"):
            protos, counts = self._protos if self._protos is not None else self.prototypes()
            self._protos = None
            payload.update(protos=protos, counts=counts)
        return payload

    def functional_loss(self) -> Any:
        """Cohort hook: FedAvg's cross-entropy loop (the prototypes around it are this
        class's train(), run as it is)."""
        return super().functional_loss()

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """The global model's head ("acc") and eq. 4 ("proto_acc") with the model
        PARAM infer_model names; the client's own weights are restored."""
        ctx = self.ctx
        protos = to_tensor(task["protos"], ctx.device, torch.float32)
        has = to_tensor(task["has"], ctx.device, torch.bool)
        on_global = self.param("infer_model") == "global"
        with swapped_weights(ctx.model, task["weights"]):
            if on_global:  # one feature pass for both scores
                return head_and_prototype_metrics(ctx.model, ctx.test_x, ctx.test_y, protos,
                                                  has)
            out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        if not on_global:
            out.update(prototype_metrics(ctx.model, ctx.test_x, ctx.test_y, protos, has))
        return out


ALGORITHM = Algorithm("fedavg-proto", FedAvgProtoServer, FedAvgProtoClient,
                      "FedAvg + prototype inference after the last round (Qiao et al. 2023)")

"""FedProto: federated prototype learning.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, "FedProto: Federated Prototype
Learning across Heterogeneous Clients", AAAI 2022 (arXiv:2105.00243).
Reference code: github.com/yuetan031/FedProto (lib/update.py
`update_weights_het`, `test_inference_new_het_lt`; lib/utils.py `agg_func`,
`proto_aggregation`). The equation-by-equation audit, with the paper's
settings and numbers: docs/FIDELITY.md (fedproto).

Only class prototypes travel; every client keeps its own network, so clients
may run different architectures as long as `features()` has one dimension D.
Defaults follow the paper; where the reference code differs, its behaviour is
a named option. Equation numbers are the main text's:

Client i, per task:
- local loss (eq. 7): CE(head(f(x)), y) + lam * L_R, PARAM `lam` (default 1.0:
  the paper's best for MNIST and FEMNIST, 0.1 for CIFAR-10; the code's `--ld`).
  L_R, PARAM `proto_loss`. The paper does not fix d: eq. 8 sums "d(C_i^(j),
  C-bar_i^(j))" (over i, with j free) for "a variety of forms, such as L1
  distance, L2 distance, and earth mover's distance"; its appendix (App. B eq. 1)
  writes the loss out as lam * ||f_i(phi_i; x) - C-bar||_2^2 per sample; and its
  lam values (1 for MNIST and FEMNIST, 0.1 for CIFAR-10) were grid-searched with
  its code's MSE. The two readings:
    "mse"  (default; App. B eq. 1 and the reference code): nn.MSELoss between the
           batch's features and, row by row, the global prototype of each
           sample's class: the appendix's per-sample squared L2, averaged over
           the batch and divided by D (the code's normalisation, the one the
           paper's lam values were tuned with). Samples whose class has no global
           prototype keep their own feature as target (they add 0 but still count
           in the mean over B x D elements, as the code's `proto_new` copy does).
    "eq8"  (eq. 8 read literally with the unsquared L2 and Algorithm 1 LocalUpdate
           lines 3-4, "compute local prototype by eq. 3, compute loss by eq. 7
           using local prototypes"): the sum, over the classes k of the minibatch
           that have a global prototype, of ||C_i,k - C-bar_k||_2, C_i,k the
           minibatch's mean feature of class k (gradients flow through the mean).
    "eq8_mean" (FedProto as FedTGP's paper states it, its eq. 4: lam E_{c ~ C_i}
           phi(P_i^c, P-bar^c), phi the Euclidean distance): the same distances as
           "eq8", averaged over the minibatch's classes instead of summed; exactly
           fedtgp's eq. 11 regulariser (`proto_loss = "paper"`) with FedProto's
           aggregated prototypes in place of FedTGP's trained ones, so the two
           algorithms can be compared at one regulariser form and lam (the
           `fedtgp-hetero` recipe's "FedProto, FedTGP's eq. 4 regulariser" row).
  "eq8" was the default until it was measured (docs/RESULTS.md, docs/FIDELITY.md
  (fedproto)): at the paper's lam = 1 its pull, of norm lam per class in the batch
  whatever the distance, overwhelms the cross-entropy when a client holds many
  classes: on the five-domain feature-skew set (10 classes a client) every seed
  collapsed to chance (10.2 %, head and prototypes alike), and on Tan et al.'s
  Table 1 setting (about 3 classes a client) one seed of three fell to 58.8 %.
  Before any global prototype exists (round 0) L_R = 0, as in the code (the
  paper's Algorithm 1 line 1 initialises the global set without saying how).
- local prototypes (eq. 3): C_i,k = mean of f_i(x) over the client's training
  samples D_i,k of class k. PARAM `proto_source`:
    "after"  (default; eq. 3 over the whole D_i,k with the model the task
             returns, Algorithm 1 LocalUpdate line 8): one extra pass over the
             training data after local training, eval mode;
    "during" (the reference code's `agg_protos_label` + `agg_func`): the mean of
             the features the training steps of the *last* local epoch computed
             (train mode, no extra pass; the code resets its collection at
             every epoch). A run cut short mid-epoch (time budget, partial
             work) uses its last complete epoch, or the partial one when no
             epoch completed.
  The update is {"protos": float32 [C, D], "counts": int64 [C]}; counts are the
  client's training-set class sizes |D_i,k| (0 = class absent, zero row).
- inference (eq. 4): the class of the nearest global prototype by L2 (the code
  ranks by the MSE, which orders identically). PARAM `infer_classes`:
    "all" (default; eq. 4's argmin over the classes, PFLlib, FedTGP): every
          class with a global prototype;
    "own" (the reference code's `test_inference_new_het_lt`): only the classes
          in the client's own training set (this uses the client's label set
          at test time: a one-class client scores 100%).
  Inference uses the client's own (post-training) model, as the paper and the
  code. evaluate() returns acc (the head), proto_acc (eq. 4), loss (head
  cross-entropy), num_test.
Segmentation (dense features [B, D, h, w], masks [B, H, W]; the paper is about
classification): every feature pixel is a sample with its nearest-neighbour
downsampled label (fedbus.algorithms.core.protos), so prototypes are per-class pixel
means, counts are pixel counts at feature resolution, the "mse" regulariser pulls
each pixel's feature to its class's global prototype (ignored pixels excluded),
and inference labels each feature pixel (scored upsampled: proto_acc = pixel
accuracy, proto_miou; head: acc = pixel accuracy, miou).

Server, per aggregation (eq. 6): for each class k, a weighted mean over the
clients that sent it, each weighed by the engine's staleness weight s_i
(1 when fresh) times, PARAM `aggregate`:
    "weighted" (default; eq. 6, and the objective's eq. 5 weights): |D_i,k|/N_k,
               the count-weighted mean. Eq. 6 as printed also carries a factor
               1/|N_j| in front of the sum; with weights |D_i,k|/N_k that
               already sum to 1 (appendix eq. 2-3: sum_i q_i = 1) that factor
               would shrink every prototype towards 0, so it is read as a typo;
    "mean"     (the reference code's `proto_aggregation`): 1, the unweighted
               mean over the clients that have the class.
PARAM `robust` (default "none": eq. 6 as above; fedbus.algorithms.core.robust): "median",
"trimmed_mean" (PARAM `robust_trim`) or "krum" (PARAMS `robust_f`, `robust_m`) replace the
weighted mean of each class by that rule over the prototypes of the clients that hold the
class (count > 0): a defence against in-range poison, not the paper's. Every prototype then
counts once: the |D_i,k| weights (self-reported) and the staleness weights are dropped, and
relays forward updates unmerged (no sum form).
PARAM `keep_missing` (default True): a class nobody sent in this aggregation
keeps its previous global prototype. The paper (full participation) does not
say; the code replaces the whole set with what it received each round
(keep_missing = False), which with partial participation or asynchronous
buffers forgets classes whose holders were not sampled. With every client in
every round (the paper's setting) the two coincide.
The task is {"protos": float32 [C, D], "has": bool [C]}.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             ServerHandler, to_tensor)
from fedbus.algorithms.core.merge import PrototypeSums
from fedbus.algorithms.core.params import Params, opt
from fedbus.algorithms.core.protos import (class_counts, class_means, class_sums, fold_prototypes,
                                      head_and_prototype_metrics, local_prototypes,
                                      pixel_samples)
from fedbus.algorithms.core.robust import ROBUST_PARAMS, Outcome, Robust, report
from fedbus.algorithms.core.training import LocalClient, staleness_metrics

# FedProto's PARAMS entries for the client's two readings, declared apart so that the tests
# can check their defaults on their own.
PROTO_LOSS = opt("mse", "client regulariser: mse = App. B eq. 1 and the reference code "
                 "(per-sample MSE to the class's global prototype); eq8 = eq. 8 read literally "
                 "(sum over classes of the L2 distance between batch class means and global "
                 "prototypes); eq8_mean = the same L2 distances averaged over the classes "
                 "(FedProto as FedTGP's eq. 4 states it; fedtgp's proto_loss = paper)",
                 choices=("mse", "eq8", "eq8_mean"))
INFER_CLASSES = opt("all", "nearest-prototype inference over all classes with a global "
                    "prototype, or only the client's own training classes (reference code)",
                    choices=("all", "own"))


class FedProtoServer(Robust, Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {
        "lam": opt(1.0, "weight lambda of the prototype regulariser, eq. 7 (the paper's best "
                   "for MNIST/FEMNIST; 0.1 for CIFAR-10; the code's --ld)", min=0.0),
        "proto_loss": PROTO_LOSS,
        "aggregate": opt("weighted", "per-class mean over clients: weighted = eq. 6 (by class "
                         "counts |D_i,k|/N_k); mean = reference code (unweighted)",
                         choices=("weighted", "mean")),
        "keep_missing": opt(True, "classes nobody sent keep their previous global prototype "
                            "(False = the code: replace the set every round)"),
        "infer_classes": INFER_CLASSES,
        "proto_source": opt("after", "local prototypes: after = eq. 3 (extra eval-mode pass "
                            "over the training data after training); during = reference code "
                            "(mean of the last local epoch's training-step features)",
                            choices=("after", "during")),
        **ROBUST_PARAMS,
    }

    # eq. 6 is a per-class weighted sum: a relay pre-aggregates it (fedbus.algorithms.core.merge),
    # unless a robust rule replaces it (merge_rule() is then None)
    MERGE = PrototypeSums()
    # the upload is {protos, counts} only (either proto_source): record-level DP replaces it
    DP_LEVELS: ClassVar[tuple[str, ...]] = ("record",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.protos = np.zeros((ctx.num_classes, ctx.feature_dim), dtype=np.float32)
        self.has = np.zeros(ctx.num_classes, dtype=bool)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # aggregate() replaces these arrays, never writes them in place.
        return {"protos": self.protos, "has": self.has}

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        if updates:
            # eq. 6 over the updates (or a relay's pre-aggregated sums among them), or per
            # class the robust rule over its holders' prototypes
            rule, out = self.robust_rule(), Outcome()
            self.protos, self.has, received = fold_prototypes(
                self.protos, self.has, updates, self.MERGE, self.resolved_params(),
                keep_missing=bool(self.param("keep_missing")), robust=rule, outcome=out)
            metrics["classes_received"] = float(received.sum())
            if rule is not None:
                report(metrics, rule, out, [u.client for u in updates])
        metrics["classes"] = float(self.has.sum())
        return metrics

    def update_spec(self) -> dict[str, tuple[str, tuple[int | None, ...]]]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {"protos": ("float32", (c, d)), "counts": ("int64", (c,))}

    def state_dict(self) -> dict[str, Any]:
        return {"protos": self.protos.copy(), "has": self.has.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.protos = np.array(state["protos"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)


class FedProtoClient(LocalClient):
    """CE + lam * prototype regulariser (eq. 7); uploads per-class mean features (eq. 3)
    with the class counts eq. 6 weighs by; nearest-prototype inference (eq. 4)."""

    PARAMS: ClassVar[dict[str, Any]] = FedProtoServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.num_classes = ctx.num_classes
        self.train_counts = class_counts(ctx.train_y, ctx.num_classes)
        self.own = self.train_counts > 0
        self._feature_size: tuple[int, int] | None = None  # dense features: (h, w)
        self._global: torch.Tensor | None = None
        self._has: torch.Tensor | None = None
        self._reg = False
        self._sums, self._seen = self._zero_sums()
        self._done: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step, self._epoch, self._per_epoch = 0, 0, 1
        self.lam = float(self.param("lam"))
        self.proto_loss = self.param("proto_loss")
        self.proto_source = self.param("proto_source")
        self.infer_own = self.param("infer_classes") == "own"

    # -- training ------------------------------------------------------------------
    def global_protos(self, task: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        return (to_tensor(task["protos"], dev, torch.float32),
                to_tensor(task["has"], dev, torch.bool))

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        self._global, self._has = self.global_protos(task)
        self._reg = self.lam > 0 and bool(self._has.any())
        # proto_source = "during": running class sums of the current local epoch,
        # the sums of the last completed one, and where the run is.
        self._sums, self._seen = self._zero_sums()
        self._done = None
        self._step, self._epoch, self._per_epoch = 0, 0, run.steps_per_epoch()
        try:
            self.run_local(run)
            protos, counts = self.local_protos()
        finally:
            self._global = self._has = None
        return {"protos": protos, "counts": counts}

    def _zero_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self._global.shape[1] if self._global is not None else self.ctx.feature_dim
        return (torch.zeros(self.num_classes, d, device=self.ctx.device),
                torch.zeros(self.num_classes, dtype=torch.int64, device=self.ctx.device))

    def _collect(self, h: torch.Tensor, y: torch.Tensor) -> None:
        """proto_source = "during": add one training step's features to the current
        epoch's class sums. The code (update.py `update_weights_het`) empties its
        collection at the start of every local epoch, so only the last epoch counts."""
        epoch = self._step // self._per_epoch
        if epoch != self._epoch:  # a new epoch begins: the one before it completed
            self._done = (self._sums, self._seen)
            self._sums, self._seen = self._zero_sums()
            self._epoch = epoch
        if h.dim() == 4:
            self._feature_size = tuple(h.shape[2:])
        s, n = class_sums(h.detach().float(), y, self.num_classes)
        self._sums += s
        self._seen += n
        self._step += 1

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if self._reg:
            loss = loss + self.lam * self.proto_reg(h, y)
        if self.proto_source == "during":
            self._collect(h, y)
        return loss

    def proto_reg(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self._global.to(h.dtype)
        # dense maps: one sample per feature pixel (labels downsampled, ignored dropped)
        h, y = pixel_samples(h, y, self.num_classes)
        if len(y) == 0:
            return h.sum() * 0.0
        if self.proto_loss == "mse":
            # The code's proto_new: each row replaced by its class's global
            # prototype when there is one, else left equal to the feature.
            target = torch.where(self._has[y].unsqueeze(1), g[y], h.detach())
            return F.mse_loss(h, target)
        means, n = class_means(h, y, self.num_classes)
        sel = (n > 0) & self._has
        if not bool(sel.any()):
            return h.sum() * 0.0
        distances = torch.linalg.vector_norm(means[sel] - g[sel], dim=1)
        return distances.sum() if self.proto_loss == "eq8" else distances.mean()

    def functional_loss(self) -> Any:
        """Cohort hook (fedbus.algorithms.core.cohort): eq. 7 in its proto_loss form with the
        task's global prototypes as the client's constants; none for proto_source =
        "during" (its running class sums are a side effect of every step)."""
        from fedbus.algorithms.core.cohort import CE, FunctionalLoss, proto_loss

        if self.proto_source == "during":
            return "proto_source = during collects features at every step"
        if not self._reg:
            return CE
        return FunctionalLoss(
            functools.partial(proto_loss, lam=self.lam, form=self.proto_loss),
            {"g": self._global, "has": self._has}, ("fedproto", self.lam, self.proto_loss))

    def local_protos(self) -> tuple[np.ndarray, np.ndarray]:
        """(protos float32 [C, D], counts int64 [C]) of this client's training set."""
        ctx = self.ctx
        d = self._global.shape[1] if self._global is not None else ctx.feature_dim
        if len(ctx.train_y) == 0:
            return (np.zeros((self.num_classes, d), np.float32),
                    np.zeros(self.num_classes, np.int64))
        if self.proto_source == "during" and self._step > 0:
            sums, seen = self._sums, self._seen
            if self._step % self._per_epoch and self._done is not None:
                sums, seen = self._done  # cut mid-epoch: the last complete epoch
            protos = sums / seen.clamp(min=1).unsqueeze(1).float()
            # |D_i,k|; for dense data the class's pixels at feature resolution, the unit
            # the "after" prototypes count in (fedbus.algorithms.core.protos)
            full = (self.train_counts if self._feature_size is None else
                    class_counts(ctx.train_y, self.num_classes, self._feature_size))
            counts = torch.where(seen > 0, full, torch.zeros_like(full))
            return (protos.cpu().numpy().astype(np.float32),
                    counts.cpu().numpy().astype(np.int64))
        # "after", or "during" when the run made no step (nothing seen): eq. 3.
        return local_prototypes(ctx.model, ctx.train_x, ctx.train_y, self.num_classes)

    # -- evaluation ----------------------------------------------------------------
    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        g, has = self.global_protos(task)
        allowed = has & self.own if self.infer_own else has
        # head and prototype scores from one feature pass over the test split
        return head_and_prototype_metrics(ctx.model, ctx.test_x, ctx.test_y, g, allowed)


ALGORITHM = Algorithm("fedproto", FedProtoServer, FedProtoClient,
                      "FedProto (Tan et al. 2022): prototype regularisation and aggregation")

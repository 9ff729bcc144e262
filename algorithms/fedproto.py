"""FedProto: federated prototype learning.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, "FedProto: Federated Prototype
Learning across Heterogeneous Clients", AAAI 2022 (arXiv:2105.00243).
Reference code: github.com/yuetan031/FedProto (lib/update.py
`update_weights_het`, lib/utils.py `agg_func` / `proto_aggregation`,
`test_inference_new_het_lt`).

Only class prototypes travel; every client keeps its own network, so clients
may run different architectures as long as `features()` has one dimension D.

Client i, per task (equation numbers as in the paper):
- local objective (eq. 8): CE(head(f(x)), y) + lam * R, where R pulls the
  embeddings towards the global prototypes C-bar of their classes. Two forms,
  PARAM `proto_loss`:
    "mse"   (default; the reference code): nn.MSELoss between the batch's
            features and, row by row, the global prototype of each sample's
            class; samples whose class has no global prototype keep their own
            feature as target (they add 0 but still count in the mean over
            B x D elements, exactly as the code's `proto_new` copy does);
    "paper" (eq. 8 as written): the sum over the classes k in the batch that
            have a global prototype of ||C_i,k - C-bar_k||_2, where C_i,k is
            the batch's mean feature of class k.
  Before any global prototype exists (round 0) R = 0, as in the code.
- local prototypes (eq. 5): C_i,k = mean of f(x) over the client's training
  samples of class k. PARAM `proto_source`:
    "after"  (default; eq. 5, and PFLlib/FedTGP's `collect_protos`): one extra
             pass over the training data after local training, eval mode;
    "during" (the reference code): the mean of the features the training
             steps computed (all local epochs, train mode), with no extra pass.
  The update is {"protos": float32 [C, D], "counts": int64 [C]}; counts are the
  client's training-set class sizes |D_i,k| (0 = class absent, zero row).
- inference: the class of the nearest global prototype by L2 (the code uses the
  MSE, which ranks identically). PARAM `infer_classes`:
    "all" (default; the paper's rule, PFLlib, FedTGP): over every class with a
          global prototype;
    "own" (the reference code's `test_inference_new_het_lt`): only over the
          classes in the client's own training set.
  "all" is the default because "own" uses the client's label set at test time
  (a one-class client scores 100%) and makes proto_acc incomparable with the
  other prototype methods here. evaluate() returns acc (the head), proto_acc,
  loss (head cross-entropy), num_test.

Server, per aggregation (eq. 6): for each class k, a weighted mean over the
clients that have it, each weighed by the engine's staleness weight s_i times
    "mean"     (default; the reference code's `proto_aggregation`): 1;
    "weighted" (eq. 6): |D_i,k| / N_k, i.e. the count-weighted mean;
PARAM `aggregate`. The code's unweighted mean is the default: it is what the
published numbers were produced with, and on the n-way k-shot partitions of
the paper (similar shots per class) the two barely differ.
PARAM `keep_missing` (default True): a class nobody sent in this aggregation
keeps its previous global prototype. The reference code instead replaces the
whole set with what it received each round (keep_missing = False), which with
partial participation or asynchronous buffers forgets classes whose holders
were not sampled; with full participation the two coincide.
The task is {"protos": float32 [C, D], "has": bool [C]}.

PARAM `lam` (default 1.0, the code's `--ld`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.base import (ClientUpdate, Failure, LocalRun, RoundInfo, ServerHandler,
                                    head_metrics, to_tensor)
from fedbus.algorithms.local import LocalClient, Params, opt, staleness_metrics
from fedbus.algorithms.protos import (aggregate_prototypes, class_means, class_sums,
                                      local_prototypes, merge_prototypes, prototype_accuracy)

PROTO_LOSS = opt("mse", "client regulariser: mse = reference code (per-sample MSE to the "
                 "class's global prototype); paper = eq. 8 (sum over classes of the L2 distance "
                 "between batch class means and global prototypes)", choices=("mse", "paper"))
INFER_CLASSES = opt("all", "nearest-prototype inference over all classes with a global "
                    "prototype, or only the client's own training classes (reference code)",
                    choices=("all", "own"))


class FedProtoServer(Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {
        "lam": opt(1.0, "weight of the prototype regulariser (the code's --ld)", min=0.0),
        "proto_loss": PROTO_LOSS,
        "aggregate": opt("mean", "per-class mean over clients: mean = reference code "
                         "(unweighted), weighted = eq. 6 (by class counts |D_i,k|)",
                         choices=("mean", "weighted")),
        "keep_missing": opt(True, "classes nobody sent keep their previous global prototype "
                            "(False = the code: replace the set every round)"),
        "infer_classes": INFER_CLASSES,
        "proto_source": opt("after", "local prototypes: after = eq. 5 (extra pass after "
                            "training), during = reference code (mean of the training-step "
                            "features)", choices=("after", "during")),
    }

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
            mean, mass = aggregate_prototypes(
                np.stack([np.asarray(u.payload["protos"]) for u in updates]),
                np.stack([np.asarray(u.payload["counts"]) for u in updates]),
                np.array([u.weight for u in updates], dtype=np.float64),
                by_count=self.param("aggregate") == "weighted")
            self.protos, self.has = merge_prototypes(self.protos, self.has, mean, mass > 0,
                                                     bool(self.param("keep_missing")))
            metrics["classes_received"] = float((mass > 0).sum())
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
    """CE + lam * prototype regulariser; uploads per-class mean features.
    Subclasses (FedTGP) override `configure` and `update_payload`."""

    PARAMS: ClassVar[dict[str, Any]] = FedProtoServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.num_classes = ctx.num_classes
        self.train_counts = torch.bincount(ctx.train_y, minlength=ctx.num_classes)
        self.own = self.train_counts > 0
        self._global: torch.Tensor | None = None
        self._has: torch.Tensor | None = None
        self._reg = False
        self.configure()

    def configure(self) -> None:
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
        c, d = self.num_classes, self._global.shape[1]
        self._sums = torch.zeros(c, d, device=self.ctx.device)
        self._seen = torch.zeros(c, dtype=torch.int64, device=self.ctx.device)
        try:
            self.run_local(run)
            protos, counts = self.local_protos()
        finally:
            self._global = self._has = None
        return self.update_payload(protos, counts)

    def update_payload(self, protos: np.ndarray, counts: np.ndarray) -> dict[str, Any]:
        return {"protos": protos, "counts": counts}

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if self._reg:
            loss = loss + self.lam * self.proto_reg(h, y)
        if self.proto_source == "during":
            s, n = class_sums(h.detach().float(), y, self.num_classes)
            self._sums += s
            self._seen += n
        return loss

    def proto_reg(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self._global.to(h.dtype)
        if self.proto_loss == "mse":
            # The code's proto_new: each row replaced by its class's global
            # prototype when there is one, else left equal to the feature.
            target = torch.where(self._has[y].unsqueeze(1), g[y], h.detach())
            return F.mse_loss(h, target)
        means, n = class_means(h, y, self.num_classes)
        sel = (n > 0) & self._has
        if not bool(sel.any()):
            return h.sum() * 0.0
        return torch.linalg.vector_norm(means[sel] - g[sel], dim=1).sum()

    def local_protos(self) -> tuple[np.ndarray, np.ndarray]:
        """(protos float32 [C, D], counts int64 [C]) of this client's training set."""
        ctx = self.ctx
        d = self._global.shape[1] if self._global is not None else ctx.feature_dim
        if len(ctx.train_y) == 0:
            return (np.zeros((self.num_classes, d), np.float32),
                    np.zeros(self.num_classes, np.int64))
        if self.proto_source == "during" and bool((self._seen > 0).any()):
            seen = self._seen > 0
            protos = self._sums / self._seen.clamp(min=1).unsqueeze(1).float()
            counts = torch.where(seen, self.train_counts, torch.zeros_like(self.train_counts))
            return (protos.cpu().numpy().astype(np.float32),
                    counts.cpu().numpy().astype(np.int64))
        # "after", or "during" when the run made no step (nothing seen): eq. 5.
        return local_prototypes(ctx.model, ctx.train_x, ctx.train_y, self.num_classes)

    # -- evaluation ----------------------------------------------------------------
    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        g, has = self.global_protos(task)
        allowed = has & self.own if self.infer_own else has
        out["proto_acc"] = prototype_accuracy(ctx.model, ctx.test_x, ctx.test_y, g, allowed)
        return out


ALGORITHM = Algorithm("fedproto", FedProtoServer, FedProtoClient,
                      "FedProto (Tan et al. 2022): prototype regularisation and aggregation")

"""FD (FedDistill): federated distillation of per-class average logits.

Jeong, Oh, Kim, Park, Bennis, Kim, "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data", NeurIPS 2018
Workshop on Machine Learning on the Phone and other Consumer Devices
(arXiv:1811.11479). Reference code as a heterogeneous-model baseline: TsingZ0/HtFLlib
system/flcore/clients/clientfd.py and system/flcore/servers/serverfd.py (FedTGP's
FedDistill); PFLlib's clientfd.py is HtFLlib's first version of it.

Only per-class output vectors travel, so every client keeps its own network and model
groups are supported (needs_same_model False): they need only the same classes C.

Client i, per task:
- local loss: CE(z, y) + gamma * psi(z, g_y), z = the network's output for x, g_y the
  global vector of the sample's class. PARAM `gamma` = 1 (FedTGP's appendix: "For
  FedDistill (Jeong et al. 2018), we set gamma = 1"; HtFLlib's -lam default 1.0).
  Before the first aggregation (no global vector) the loss is CE alone, as the code.
  PARAM `distill_loss` chooses psi and what the uploaded vectors are:
    "paper"   (default): the paper calls a model output "a set of logit values
              normalized via a softmax function" a logit vector; the vectors are
              softmax(z), clients average them per class, the server averages those,
              and psi is the cross-entropy against the global vector as a soft label,
              -sum_j g_y,j log softmax(z)_j, over the samples whose class has a global
              vector (a batch mean over all B samples; the others add 0);
    "softmax" (PFLlib's clientfd, HtFLlib's first version 17f851e): the vectors are
              the raw logits z; psi = -sum_j softmax(g_y)_j log softmax(z)_j, as above
              (the code also sends the other samples through the CE with their own
              detached softmax as target: same gradient, 0; only the loss value
              differs);
    "raw"     (HtFLlib HEAD, clientfd.py since ca3e29a): the vectors are raw logits;
              psi = nn.CrossEntropyLoss()(z, t) with t_b = g_{y_b} (raw logits as
              "probabilities") where y_b has a global vector, else z_b.detach(), mean
              over the batch: the code's `logit_new` exactly, gradients of the rows
              without a global vector included.
  None of these is an MSE between logits: neither reference code uses one.
- upload: {"logits": float32 [C, C], "counts": int64 [C]}, row c the mean vector of
  class c and counts[c] how many outputs it averages (0: the client has no sample of c,
  zero row). PARAM `collect`:
    "during" (default; HtFLlib's clientfd collects every training output of every
             local epoch; the paper's devices "store per-label mean logit vectors"
             and upload them periodically): the outputs the training steps
             computed (train mode, no extra pass); counts = samples seen, epochs
             included. A run cut short (deadline, budget, partial work) averages what
             it ran;
    "after"  one pass over the training set after training, eval mode, with the model
             the update returns; counts = the class sizes.
- evaluate: the client's own network and its head (acc, loss), what FD deploys.

Server, per aggregation: for each class c, the mean of the received vectors of c over
the clients that sent it, each weighted by its engine staleness weight s_i
(1/sqrt(1+staleness)) times, PARAM `aggregate`:
    "mean"     (default; the paper: "the uploaded local-average logit vectors from all
               devices are averaged", and serverfd's proto_aggregation, a plain mean
               over the clients that hold the class): 1;
    "weighted" counts[c] of the client (a per-sample mean).
PARAM `keep_missing` (default True): a class nobody sent in this aggregation keeps its
previous global vector; False replaces the whole set by what was received, as serverfd
does every round (with partial participation or asynchronous buffers this forgets the
classes of the clients not heard from; with every client every round they coincide).
The task is {"logits": float32 [C, C], "has": bool [C]}.
That mean is a weighted sum per class, sum_i a_ic z_ic / sum_i a_ic (a_ic = s_i counts[c]
or s_i [counts[c] > 0]), so the server declares it as its merge rule (LogitSums,
fedbus.algorithms.core.merge: FedProto's PrototypeSums on "logits"): a relay pre-adds the
sums and masses of its clients, secure aggregation reveals only their total, and the
server divides, as it does over single updates (up to float64 rounding). Every option
keeps it a sum: `collect` changes only what the counts count, `aggregate` the a_ic, and
`keep_missing` acts after the division.

What was checked against what: both reference codes were read line by line; the
paper's full text was not at hand, and its wording quoted here ("a set of logit values
normalized via a softmax function", "the uploaded local-average logit vectors from all
devices are averaged", the per-label mean logit vectors) comes from its description of
FD. The form of its distillation regulariser (cross-entropy to the global vector, the
"paper" default) and whether its server hands each device the average of the *other*
devices' vectors (its "global average" without the device's own) are unverified; the
latter is not offered: every client receives the same global vectors, as in both codes.

The server draws no random numbers; its state is the global vectors and their mask.
"""
from __future__ import annotations

import math

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             ServerHandler, to_tensor)
from fedbus.algorithms.core.merge import LogitSums
from fedbus.algorithms.core.params import Params, opt
from fedbus.algorithms.core.protos import class_sums, fold_prototypes
from fedbus.algorithms.core.training import LocalClient, staleness_metrics

DISTILL_LOSSES = ("paper", "softmax", "raw")


def output_vectors(z: torch.Tensor, form: str) -> torch.Tensor:
    """What a client averages per class: softmax(z) ("paper"), else the raw logits."""
    return F.softmax(z, dim=1) if form == "paper" else z


def distillation_loss(z: torch.Tensor, y: torch.Tensor, g: torch.Tensor, has: torch.Tensor,
                      form: str = "paper") -> torch.Tensor:
    """psi on one minibatch (outputs z [B, C], labels y, global vectors g [C, C] and
    their mask has [C]); see the module docstring."""
    logp = F.log_softmax(z, dim=1)
    g = g.to(z.dtype)
    if form == "raw":
        target = torch.where(has[y].unsqueeze(1), g[y], z.detach())
        return -(target * logp).sum(dim=1).mean()
    target = g[y] if form == "paper" else F.softmax(g[y], dim=1)
    rows = -(target * logp).sum(dim=1)
    return (rows * has[y].to(rows.dtype)).sum() / max(len(y), 1)


@torch.no_grad()
def class_outputs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                  form: str, batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums [C, C] of the output vectors over (x, y), eval mode, and counts."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(num_classes, num_classes, device=y.device)
    counts = torch.zeros(num_classes, dtype=torch.int64, device=y.device)
    for i in range(0, len(y), batch):
        s, c = class_sums(output_vectors(model(x[i:i + batch]).float(), form), y[i:i + batch],
                          num_classes)
        sums += s
        counts += c
    model.train(was_training)
    return sums, counts


class FDServer(Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {
        "gamma": opt(1.0, "weight gamma of the distillation term (FedTGP's appendix: 1; "
                     "HtFLlib's -lam default)", min=0.0),
        "distill_loss": opt("paper", "paper = softmax vectors, cross-entropy to the global "
                            "vector as soft label; softmax = raw logits, CE to their softmax "
                            "(PFLlib); raw = raw logits as CE targets (HtFLlib HEAD)",
                            choices=DISTILL_LOSSES),
        "collect": opt("during", "per-class mean vectors from the training steps' outputs "
                       "(paper, HtFLlib) or from one eval-mode pass after training",
                       choices=("during", "after")),
        "aggregate": opt("mean", "per-class mean over the clients that sent the class: mean = "
                         "paper and HtFLlib (unweighted); weighted = by the clients' counts",
                         choices=("mean", "weighted")),
        "keep_missing": opt(True, "classes nobody sent keep their previous global vector "
                            "(False: replaced by what was received, as serverfd)"),
    }
    # the per-class mean is a weighted sum, as FedProto's eq. 6: a relay pre-aggregates it
    # and secure aggregation sums it (fedbus.algorithms.core.merge), under every option
    MERGE = LogitSums()

    def __init__(self, ctx):
        super().__init__(ctx)
        c = ctx.num_classes
        self.logits = np.zeros((c, c), dtype=np.float32)
        self.has = np.zeros(c, dtype=bool)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"logits": self.logits, "has": self.has}

    def count_epochs(self) -> int:
        # "during" counts every training output, epochs included
        if self.param("collect") == "during":
            return max(1, math.ceil(float(self.ctx.train.get("epochs", 1))))
        return 1

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        if updates:  # single updates, or a relay's (or secure aggregation's) sums among them
            self.logits, self.has, received = fold_prototypes(
                self.logits, self.has, updates, self.MERGE, self.resolved_params(), key="logits",
                keep_missing=bool(self.param("keep_missing")))
            metrics["classes_received"] = float(received.sum())
        metrics["global_classes"] = float(self.has.sum())
        return metrics

    def update_spec(self) -> dict[str, tuple[str, tuple[int | None, ...]]]:
        c = self.ctx.num_classes
        return {"logits": ("float32", (c, c)), "counts": ("int64", (c,))}

    def state_dict(self) -> dict[str, Any]:
        return {"logits": self.logits.copy(), "has": self.has.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.logits = np.array(state["logits"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)


class FDClient(LocalClient):
    """CE + gamma * psi toward the global per-class vectors; uploads its own per-class
    mean vectors."""

    PARAMS: ClassVar[dict[str, Any]] = FDServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.num_classes = ctx.num_classes
        self.gamma = float(self.param("gamma"))
        self.form = self.param("distill_loss")
        self.collect = self.param("collect")
        self._global: torch.Tensor | None = None
        self._has: torch.Tensor | None = None
        self._distill = False
        self._sums: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.ctx.model(x)
        loss = F.cross_entropy(z, y)
        if self._distill:
            loss = loss + self.gamma * distillation_loss(z, y, self._global, self._has, self.form)
        if self._sums is not None:
            s, c = class_sums(output_vectors(z.detach().float(), self.form), y, self.num_classes)
            self._sums += s
            self._counts += c
        return loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        ctx, c = self.ctx, self.num_classes
        self._global = to_tensor(task["logits"], ctx.device, torch.float32)
        self._has = to_tensor(task["has"], ctx.device, torch.bool)
        self._distill = self.gamma > 0 and bool(self._has.any())
        if self.collect == "during":
            self._sums = torch.zeros(c, c, device=ctx.device)
            self._counts = torch.zeros(c, dtype=torch.int64, device=ctx.device)
        try:
            self.run_local(run)
            if self.collect == "during":
                sums, counts = self._sums, self._counts
            else:
                sums, counts = class_outputs(ctx.model, ctx.train_x, ctx.train_y, c, self.form)
        finally:
            self._global = self._has = self._sums = self._counts = None
            self._distill = False
        means = sums / counts.clamp(min=1).unsqueeze(1).to(sums.dtype)
        return {"logits": means.cpu().numpy().astype(np.float32),
                "counts": counts.cpu().numpy().astype(np.int64)}


ALGORITHM = Algorithm("fd", FDServer, FDClient,
                      "FD / FedDistill (Jeong et al. 2018): per-class average logits, "
                      "distilled into every client's own model")

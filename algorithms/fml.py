"""FML: Federated Mutual Learning.

Shen, Wang, Lv, Zheng, Wu, Xiao, Liu, "Federated Mutual Learning",
arXiv:2006.16765, 2020. Reference code: TsingZ0/HtFLlib
system/flcore/clients/clientfml.py, system/flcore/servers/serverfml.py.

Each client k keeps its private "local" model (ctx.model; any architecture of
the model group) and a copy of the shared "meme" model (the auxiliary model of
fedbus.algorithms.aux_model: PARAM `shared_arch`, by default the smallest
architecture of the federation, as FedTGP's appendix chose for FML). On every
minibatch both models step (deep mutual learning; the paper's L_local and
L_meme):

    L_local = alpha * CE(y, p_local) + (1 - alpha) * KL(p_meme || p_local)
    L_meme  = beta  * CE(y, p_meme)  + (1 - beta)  * KL(p_local || p_meme)

p = softmax of the logits. In each KL the other model's distribution is the
target and is detached, so L_local trains only the local model and L_meme only
the meme model (deep mutual learning's alternating updates, made simultaneous;
the reference code does not detach, so its backward of L_local also pushes the
meme model toward the local one and vice versa). Two optimisers with the
[train] settings (the reference: two SGDs at the client learning rate); one
step of each per minibatch.

PARAMS:
- alpha = 0.5, beta = 0.5: FedTGP's appendix ("we set its knowledge distillation
  hyperparameters alpha = 0.5 and beta = 0.5", following the FML paper); HtFLlib's
  main.py defaults are alpha = beta = 1.0 (pure cross-entropy, no mutual
  distillation): pass 1.0 to reproduce them.
- kl = "batchmean" (default; the KL divergence per sample, averaged, as the paper
  writes it) or "mean" (the reference code's nn.KLDivLoss() default, averaged over
  batch x classes: the KL term is C times smaller).
- clip_grad = 0 (off; the paper does not clip); the reference code clips each
  model's gradient norm at 10 ("prevent divergency"): clip_grad = 10.
- shared_arch = "smallest" (see fedbus.algorithms.aux_model).

Communication:
- task (down): {"weights": {name: array}}, the global meme model's full state dict
  (float32 weights, integer buffers as they are);
- update (up): {"delta": {name: array}}, the trained meme model minus the weights
  of the task it answered (same names, dtypes and shapes); the local model never
  leaves the client.
Server: the meme model's FedAvg, w <- w + sum_k s_k n_k delta_k / sum_k s_k n_k
(s_k the engine's staleness weight, n_k the client's training-set size;
fedbus.algorithms.weights). The reference averages uniformly over the uploaded
clients (1/|S|); with equal-sized clients and no staleness the two agree, and
the sample weighting is FedAvg's, which FML builds on. An empty aggregation
keeps the meme model. Partial work (fewer steps than asked) uploads its delta
like any other: every step trained both models.

Evaluation: the local model's head ("acc", "loss": the model FML personalises
and the papers score), plus "aux_acc"/"aux_loss" for the global meme model of
the eval task on the same test split.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.aux_model import CLIP_GRAD, KL, SHARED_ARCH, AuxClient, AuxServer, kl_div
from fedbus.algorithms.base import LocalRun, head_metrics, load_weights, weight_delta
from fedbus.algorithms.local import opt


def fml_losses(logits_local: torch.Tensor, logits_meme: torch.Tensor, y: torch.Tensor,
               alpha: float, beta: float, kl: str = "batchmean"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_local, L_meme) of one minibatch; each KL's target (the other model) detached."""
    logp_l = F.log_softmax(logits_local, dim=1)
    logp_m = F.log_softmax(logits_meme, dim=1)
    loss_local = (alpha * F.cross_entropy(logits_local, y)
                  + (1 - alpha) * kl_div(logp_l, logp_m.detach(), kl))
    loss_meme = (beta * F.cross_entropy(logits_meme, y)
                 + (1 - beta) * kl_div(logp_m, logp_l.detach(), kl))
    return loss_local, loss_meme


class FMLServer(AuxServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "alpha": opt(0.5, "weight of the local model's cross-entropy; 1 - alpha weights its "
                     "KL to the meme model (FedTGP/FML: 0.5; HtFLlib's default 1.0)",
                     min=0.0, max=1.0),
        "beta": opt(0.5, "weight of the meme model's cross-entropy; 1 - beta weights its KL "
                    "to the local model (FedTGP/FML: 0.5; HtFLlib's default 1.0)",
                    min=0.0, max=1.0),
        "shared_arch": SHARED_ARCH,
        "kl": KL,
        "clip_grad": CLIP_GRAD,
    }
    algorithm: ClassVar[str] = "fml"


class FMLClient(AuxClient):
    PARAMS: ClassVar[dict[str, Any]] = FMLServer.PARAMS
    algorithm: ClassVar[str] = "fml"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.alpha = float(self.param("alpha"))
        self.beta = float(self.param("beta"))

    def run_mutual(self, run: LocalRun) -> float:
        """One step of each model per minibatch; returns the mean L_local + L_meme."""
        model, meme = self.ctx.model, self.aux
        model.train()
        meme.train()
        total, steps = 0.0, 0
        for x, y in run.batches():
            self.optimizer.zero_grad(set_to_none=True)
            self.aux_optimizer.zero_grad(set_to_none=True)
            loss_l, loss_m = fml_losses(model.head(model.features(x)),
                                        meme.head(meme.features(x)), y,
                                        self.alpha, self.beta, self.kl)
            # the detached targets keep the two graphs apart: one backward serves both
            (loss_l + loss_m).backward()
            self.clip_grads(model, meme)
            self.optimizer.step()
            self.aux_optimizer.step()
            total += loss_l.item() + loss_m.item()
            steps += 1
        self.last_loss = total / steps if steps else float("nan")
        return self.last_loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        load_weights(self.aux, task["weights"])
        self.run_mutual(run)
        return {"delta": weight_delta(self.aux, task["weights"])}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        out.update(self.aux_metrics(task["weights"]))
        return out


ALGORITHM = Algorithm("fml", FMLServer, FMLClient,
                      "FML (Shen et al. 2020): mutual learning with a shared averaged meme model")

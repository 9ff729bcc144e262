"""FedProx: FedAvg with a proximal term in the local objective.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020, Algorithm 2 / eq. (2): client k
approximately minimises

    h_k(w; w_t) = F_k(w) + (mu / 2) ||w - w_t||^2

starting from the global weights w_t; the server averages as FedAvg does (the
rule is inherited from `FedAvgServer`, staleness weights included). Partial
work (gamma-inexact solutions) is the engine's business: a straggler's
`run.batches()` simply ends early and its update still counts.

Paper vs code: the authors' TensorFlow code (flearn/optimizer/pgd.py,
`PerturbedGradientDescent`; PFLlib does the same) adds mu (w - w_t) to the
gradient inside the optimiser instead of adding the term to the loss. For
plain SGD both give the same step; we add it to the loss, so whatever
optimiser [train] configures (momentum, weight decay) sees it as part of the
gradient. The term covers the trainable parameters only (buffers such as
BatchNorm statistics are averaged but not regularised, as in the reference
code). No option: the two agree mathematically.

PARAMS: mu (default 0.01; the paper sweeps {0.001, 0.01, 0.1, 1}); robust (default "none",
the weighted mean; "median", "trimmed_mean", "krum" as in FedAvg: fedbus.algorithms.core.robust).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.merge import DeltaSums
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.robust import ROBUST_PARAMS
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer


class FedProxServer(FedAvgServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "mu": opt(0.01, "FedProx proximal coefficient mu (eq. 2)", min=0.0),
        **ROBUST_PARAMS,
    }
    MERGE = DeltaSums()  # FedAvg's aggregation, inherited unchanged (none under a robust rule)
    DP_LEVELS: ClassVar[tuple[str, ...]] = ("client",)  # FedAvg's {delta} upload, DeltaSums


class FedProxClient(FedAvgClient):
    PARAMS: ClassVar[dict[str, Any]] = FedProxServer.PARAMS

    def begin_local(self, task: Mapping[str, Any]) -> None:
        self.mu = float(self.param("mu"))
        self._anchor = [(p, p.detach().clone()) for p in self.ctx.model.parameters()
                        if p.requires_grad]

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().batch_loss(x, y)
        if self.mu > 0:
            prox = sum(((p - w0) ** 2).sum() for p, w0 in self._anchor)
            loss = loss + 0.5 * self.mu * prox
        return loss

    def functional_loss(self) -> Any:
        """Cohort hook: CE + mu/2 sum_p ||p - p_t||^2 over the trainable parameters, the
        anchor p_t (the task's global weights) a per-client constant."""
        from fedbus.algorithms.core.cohort import CE, FunctionalLoss, prox_loss

        if self.mu <= 0:
            return CE
        names = [n for n, p in self.ctx.model.named_parameters() if p.requires_grad]
        anchor = dict(zip(names, (w0 for _, w0 in self._anchor)))
        return FunctionalLoss(functools.partial(prox_loss, mu=self.mu), {"anchor": anchor},
                              ("fedprox", self.mu))


ALGORITHM = Algorithm("fedprox", FedProxServer, FedProxClient,
                      "FedProx (Li et al. 2020): FedAvg + proximal term mu/2 ||w - w_t||^2")

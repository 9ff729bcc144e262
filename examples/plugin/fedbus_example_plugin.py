"""example-proto: a small prototype algorithm, as a fedbus plugin (the template of
fedbus's docs/PLUGINS.md). A teaching example built from fedbus's helpers, not a
published method.

Client i, per task (a ClientHandler built on LocalClient, the training loop):
- local loss: cross-entropy + lam x the mean squared distance between each sample's
  feature and its class's global prototype, for classes that have one (PARAM `lam`);
- upload: its class prototypes (mean feature per class over its training set, after
  training: protos.local_prototypes) and class counts, smoothed over its rounds:
  p_i,k <- momentum x p_i,k(last upload) + (1 - momentum) x p_i,k(now) for every class it
  uploaded before (PARAM `momentum`; 0 = no smoothing). The last upload is client state:
  extra_state() returns it so that an evicted or resumed client continues the same
  average (without it, a resumed run silently restarts the smoothing);
- evaluation: the head's accuracy and nearest-global-prototype accuracy, from one pass.

Server (a ServerHandler): per class, the count-weighted mean of the prototypes received
(`aggregate = "weighted"`; "mean": unweighted), each also weighed by the engine's
staleness weight (1 in sync runs; 1/sqrt(1 + staleness) in async ones); classes nobody
sent keep their prototype (protos.fold_prototypes). That step is a per-class weighted
sum, so the class declares MERGE = PrototypeSums(): relays pre-add updates and secure
aggregation sums them, and fold_prototypes takes those merged sums as they come.

Wire payloads follow fedbus's conventions, so the server's validation checks them:
task {"protos": float32 [C, D], "has": bool [C]}, update {"protos": float32 [C, D],
"counts": int64 [C]}.
"""
from __future__ import annotations

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
from fedbus.algorithms.core.protos import (fold_prototypes, head_and_prototype_metrics,
                                          local_prototypes, pixel_samples)
from fedbus.algorithms.core.training import LocalClient, staleness_metrics


class ExampleProtoServer(Params, ServerHandler):
    # Every [algorithm] key this algorithm accepts: the config layer validates a run's
    # values against these (choices, bounds) and `fedbus algorithms example-proto` lists
    # them. The client reads the same dict.
    PARAMS: ClassVar[dict[str, Any]] = {
        "lam": opt(1.0, "weight of the pull of each feature towards its class's global "
                   "prototype", min=0.0),
        "momentum": opt(0.5, "weight of a client's last uploaded prototype of a class in "
                        "the one it uploads next (0 = this round's alone)", min=0.0, max=0.99),
        # read by PrototypeSums too (its by_count_param), so relays weigh as the server does
        "aggregate": opt("weighted", "per-class mean over clients: weighted by class counts, "
                         "or unweighted", choices=("weighted", "mean")),
    }
    # the server step is a per-class weighted sum: relays and secure aggregation may sum it
    MERGE = PrototypeSums()

    def __init__(self, ctx):
        super().__init__(ctx)
        self.protos = np.zeros((ctx.num_classes, ctx.feature_dim), dtype=np.float32)
        self.has = np.zeros(ctx.num_classes, dtype=bool)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # the arrays are replaced by aggregate(), never written in place: safe to share
        return {"protos": self.protos, "has": self.has}

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        if updates:
            self.protos, self.has, received = fold_prototypes(
                self.protos, self.has, updates, self.MERGE, self.resolved_params())
            metrics["classes_received"] = float(received.sum())
        metrics["classes"] = float(self.has.sum())
        return metrics

    def update_spec(self) -> dict[str, tuple[str, tuple[int | None, ...]]]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {"protos": ("float32", (c, d)), "counts": ("int64", (c,))}

    # the server's checkpoint (`fedbus server --resume`, `fedbus replay`'s resume records)
    def state_dict(self) -> dict[str, Any]:
        return {"protos": self.protos.copy(), "has": self.has.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.protos = np.array(state["protos"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)


class ExampleProtoClient(LocalClient):
    PARAMS: ClassVar[dict[str, Any]] = ExampleProtoServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.lam = float(self.param("lam"))
        self.momentum = float(self.param("momentum"))
        self._global: torch.Tensor | None = None  # this task's global prototypes [C, D]
        self._has: torch.Tensor | None = None
        # client state beyond model and optimiser: the prototypes it uploaded last, and
        # which classes they hold (tensors: a node saves client state with torch.save and
        # loads it with weights_only=True, which refuses numpy arrays)
        self.last = torch.zeros(ctx.num_classes, ctx.feature_dim)
        self.last_has = torch.zeros(ctx.num_classes, dtype=torch.bool)

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if self._global is not None and self.lam > 0:
            # one sample per feature vector (a dense map's pixels too), ignored labels out
            h, y = pixel_samples(h, y, self.ctx.num_classes)
            known = self._has[y]
            if bool(known.any()):
                loss = loss + self.lam * F.mse_loss(h[known], self._global[y[known]])
        return loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        dev = self.ctx.device
        self._global = to_tensor(task["protos"], dev, torch.float32)
        self._has = to_tensor(task["has"], dev, torch.bool)
        try:
            self.run_local(run)  # one optimiser step per minibatch run.batches() yields
        finally:
            self._global = self._has = None
        ctx = self.ctx
        protos, counts = local_prototypes(ctx.model, ctx.train_x, ctx.train_y,
                                          ctx.num_classes)
        now = torch.from_numpy(protos)
        present = torch.from_numpy(counts > 0)
        smooth = (present & self.last_has)[:, None]
        mixed = torch.where(smooth, self.momentum * self.last + (1 - self.momentum) * now, now)
        self.last = torch.where(present[:, None], mixed, self.last)
        self.last_has = self.last_has | present
        return {"protos": mixed.numpy().astype(np.float32), "counts": counts}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        protos = to_tensor(task["protos"], ctx.device, torch.float32)
        has = to_tensor(task["has"], ctx.device, torch.bool)
        return head_and_prototype_metrics(ctx.model, ctx.test_x, ctx.test_y, protos, has)

    # saved with the model and optimiser (ClientHandler.state_dict) whenever the node
    # evicts the client or checkpoints it for a resume
    def extra_state(self) -> dict[str, Any]:
        return {"last": self.last.clone(), "last_has": self.last_has.clone()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.last = state["last"].clone().float()
        self.last_has = state["last_has"].clone().bool()


# The entry point's value: `example-proto = "fedbus_example_plugin:ALGORITHM"` in
# pyproject.toml. The entry point's name and Algorithm.name must be the same.
ALGORITHM = Algorithm("example-proto", ExampleProtoServer, ExampleProtoClient,
                      "example plugin: prototype pull + count-weighted prototype mean, "
                      "client prototypes smoothed over rounds")

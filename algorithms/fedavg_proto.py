"""FedAvg-proto: FedAvg training, prototype inference after the last round.

Qiao, Park, Kang, Hong, "Prototype Helps Federated Learning: Towards Faster
Convergence" (arXiv:2303.12296, 2023). Training is plain FedAvg (inherited
from `FedAvgServer` / `FedAvgClient`, staleness weights included). Only the
last global iteration changes: after local training each client also computes
its local prototypes, the per-class mean features of its training data (the
paper's local-prototype definition, the same as FedProto's eq. 5); the server
aggregates them per class, weighted by the clients' class counts (times the
engine's staleness weight), and sends the global prototypes back; each client
then classifies a test sample by the nearest global prototype (L2) in the
feature space of its own model.

On the bus:
- task: {"weights": ..., "send_protos": bool}; send_protos is True in the last
  round (RoundInfo.last), or every round with PARAM `every_round` = True (the
  per-round proto-accuracy curves of the paper's figures);
- update: {"delta": ...} plus, when asked, {"protos": float32 [C, D],
  "counts": int64 [C]} computed after local training (one eval-mode pass);
- eval: {"weights", "protos": float32 [C, D], "has": bool [C]}. "acc" is the
  global model's head (as FedAvg), "proto_acc" is nearest-global-prototype
  inference with the client's own post-training model (the model that made its
  prototypes, as in the paper), nan before any prototype exists.
Global prototypes persist across aggregations; a class nobody sent keeps its
previous prototype.

PARAMS: every_round (default False: upload prototypes in the last round only).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.base import ClientUpdate, Failure, LocalRun, RoundInfo, to_tensor
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedbus.algorithms.local import opt
from fedbus.algorithms.protos import (aggregate_prototypes, local_prototypes, merge_prototypes,
                                      prototype_accuracy)


class FedAvgProtoServer(FedAvgServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "every_round": opt(False, "upload and evaluate prototypes every round (the paper's "
                           "curves), not only in the last round"),
    }

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
        with_protos = [u for u in updates if self._valid_protos(u)]
        if with_protos:
            mean, mass = aggregate_prototypes(
                np.stack([np.asarray(u.payload["protos"]) for u in with_protos]),
                np.stack([np.asarray(u.payload["counts"]) for u in with_protos]),
                np.array([u.weight for u in with_protos], dtype=np.float64), by_count=True)
            self.protos, self.has = merge_prototypes(self.protos, self.has, mean, mass > 0, True)
            metrics["proto_updates"] = float(len(with_protos))
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

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        payload = super().train(task, run)
        if task.get("send_protos"):
            ctx = self.ctx
            if len(ctx.train_y):
                protos, counts = local_prototypes(ctx.model, ctx.train_x, ctx.train_y,
                                                  ctx.num_classes)
            else:
                protos = np.zeros((ctx.num_classes, ctx.feature_dim), np.float32)
                counts = np.zeros(ctx.num_classes, np.int64)
            payload.update(protos=protos, counts=counts)
        return payload

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        out = super().evaluate(task)  # the global model's head; local weights restored
        ctx = self.ctx
        out["proto_acc"] = prototype_accuracy(
            ctx.model, ctx.test_x, ctx.test_y, to_tensor(task["protos"], ctx.device, torch.float32),
            to_tensor(task["has"], ctx.device, torch.bool))
        return out


ALGORITHM = Algorithm("fedavg-proto", FedAvgProtoServer, FedAvgProtoClient,
                      "FedAvg + prototype inference after the last round (Qiao et al. 2023)")

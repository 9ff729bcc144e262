"""The local training loop every built-in client handler builds on.

- `LocalClient`: cross-entropy training over `run.batches()`, one optimiser step per
  minibatch, with a `batch_loss(x, y)` hook that FedProx, FedProto and FedTGP extend
  with their regularisers (DP-SGD instead when privacy.dp = "sgd");
- `LocalServer`: a server that sends an empty task and folds nothing;
- `staleness_metrics`: the scalars every aggregation reports.

The `local` algorithm (fedbus.algorithms.local) is exactly this pair.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedbus.algorithms.core.handlers import (ClientHandler, ClientUpdate, Failure, LocalRun,
                                             RoundInfo, ServerHandler)
from fedbus.algorithms.core.merge import members_of
from fedbus.algorithms.core.params import Params


def staleness_metrics(updates: list[ClientUpdate], failures: list[Failure]) -> dict[str, float]:
    """Scalar metrics every aggregation reports."""
    clients = members_of(updates)  # a relay's merged update: its members
    out: dict[str, float] = {"updates": float(len(clients)), "failures": float(len(failures))}
    if clients:
        out["mean_staleness"] = sum(u.staleness for u in clients) / len(clients)
    return out


class LocalServer(Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {}

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {}

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        return staleness_metrics(updates, failures)


class LocalClient(Params, ClientHandler):
    """Cross-entropy training over `run.batches()`. Subclasses add terms to the
    loss by overriding `batch_loss` (it sees the features h the head consumed,
    so prototype regularisers and running prototype sums cost no extra pass)."""

    PARAMS: ClassVar[dict[str, Any]] = LocalServer.PARAMS
    # Set by fedbus.algorithms.core.cohort while it trains this client in a cohort: run_local
    # hands the run to it (None: run_local trains, as always).
    _cohort_run: Any = None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.last_loss = float("nan")  # mean training loss of the last task

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        return F.cross_entropy(model.head(model.features(x)), y)

    def functional_loss(self) -> Any:
        """The cohort hook (fedbus.algorithms.core.cohort, train.cohort): this client's
        local loss as a pure `FunctionalLoss` that the cohort vectorises over clients, a
        str saying why this configuration has none, or None (not declared). Called where
        run_local would begin (task loaded, per-task state set). A class declares it for
        its own train()/batch_loss(): a subclass that changes either (or run_local,
        begin_local, clip_gradients) trains one by one until it declares its own.
        Here: cross-entropy, batch_loss's."""
        from fedbus.algorithms.core.cohort import CE

        return CE

    def clip_gradients(self) -> None:
        """Between a step's backward pass and its optimizer step: a handler's gradient
        clipping (FedNH's, FedHKD's); nothing by default. (DP-SGD clips per sample and
        does not come here.)"""

    def run_local(self, run: LocalRun) -> float:
        """One optimiser step per minibatch the engine hands out; returns the
        mean loss (nan when the run yielded no batch). A batch_loss of None takes no step
        and does not count (a handler whose loss has no term yet: FedPCL's first round)."""
        if self._cohort_run is not None:  # trained in a cohort (fedbus.algorithms.core.cohort)
            return self._cohort_run(self, run)
        # privacy.dp = "sgd", or "record" over a DP-SGD extractor: DP-SGD steps (Opacus)
        # over Poisson batches (fedbus.algorithms.core.dp_sgd)
        privacy = self.ctx.extra.get("privacy") or {}
        if privacy.get("dp") == "sgd" or (privacy.get("dp") == "record"
                                          and privacy.get("dp_extractor") == "sgd"):
            from fedbus.algorithms.core.dp_sgd import run_dp_sgd

            self.last_loss = run_dp_sgd(self, run)
            return self.last_loss
        self.ctx.model.train()
        total, steps = 0.0, 0
        for x, y in run.batches():
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.batch_loss(x, y)
            if loss is None:
                continue
            loss.backward()
            self.clip_gradients()
            self.optimizer.step()
            total += loss.item()
            steps += 1
        self.last_loss = total / steps if steps else float("nan")
        return self.last_loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        self.run_local(run)
        return {}

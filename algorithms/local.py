"""Local training only: the no-communication baseline.

Every client trains its own network with cross-entropy on its own data and is
scored with its own classifier head; the server sends an empty task and folds
nothing. It is the lower bound every federated method should beat (the
"Local" row of the FedProto and FedTGP tables).

This module also holds what the other built-in algorithms share:

- `opt()`: a parameter declaration, a `fedbus.algorithms.params.Opt` (choices,
  bounds, help) that the config layer (fedbus.node.config) validates against;
- `LocalClient`: the local training loop (`run.batches()`, one optimiser step
  per minibatch) with a `batch_loss(x, y)` hook that FedProx, FedProto and
  FedTGP extend with their regularisers;
- `Params`: the `param(key)` mixin, which reads an `[algorithm]` key with the
  declared default as fallback.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.base import (ClientHandler, ClientUpdate, Failure, LocalRun, RoundInfo,
                                    ServerHandler)
from fedbus.algorithms.merge import members_of
from fedbus.algorithms.params import Opt


def opt(default: Any, help: str = "", choices: tuple | None = None,
        min: float | None = None, max: float | None = None) -> Any:
    """Declare an [algorithm] parameter: an `Opt` (the config layer validates its
    choices and bounds)."""
    return Opt(default, help, choices, min, max)


def default_of(declared: Any) -> Any:
    """The default value of a PARAMS entry (an Opt or a plain value)."""
    return getattr(declared, "default", declared)


class Params:
    """Mixin for handlers: `param(key)` reads the [algorithm] section and falls
    back to the declared default, so a handler built from a partial params
    mapping (tests, notebooks) still sees every key."""

    PARAMS: ClassVar[dict[str, Any]] = {}
    params: Mapping[str, Any]

    def param(self, key: str) -> Any:
        if key in self.params:
            return self.params[key]
        return default_of(self.PARAMS[key])

    def resolved_params(self) -> dict[str, Any]:
        """Every declared key with its value: what a relay's MergeRule is given."""
        return resolved_params(type(self), self.params)


def resolved_params(handler_cls: type, section: Mapping[str, Any]) -> dict[str, Any]:
    """A handler class's declared PARAMS with their defaults, overridden by `section` (the
    [algorithm] table): the values its handler's param() would read."""
    out = {k: default_of(v) for k, v in getattr(handler_cls, "PARAMS", {}).items()}
    out.update(section)
    return out


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

    def __init__(self, ctx):
        super().__init__(ctx)
        self.last_loss = float("nan")  # mean training loss of the last task

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        return F.cross_entropy(model.head(model.features(x)), y)

    def run_local(self, run: LocalRun) -> float:
        """One optimiser step per minibatch the engine hands out; returns the
        mean loss (nan when the run yielded no batch)."""
        # privacy.dp = "sgd": DP-SGD steps (Opacus) over Poisson batches, fedbus.algorithms.dp_sgd
        if (self.ctx.extra.get("privacy") or {}).get("dp") == "sgd":
            from fedbus.algorithms.dp_sgd import run_dp_sgd

            self.last_loss = run_dp_sgd(self, run)
            return self.last_loss
        self.ctx.model.train()
        total, steps = 0.0, 0
        for x, y in run.batches():
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.batch_loss(x, y)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
            steps += 1
        self.last_loss = total / steps if steps else float("nan")
        return self.last_loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        self.run_local(run)
        return {}


ALGORITHM = Algorithm("local", LocalServer, LocalClient,
                      "local training only, no communication (lower bound)")

"""Central training: one model trained on every client's training data pooled.

The reference of Michieli & Ozay ("Prototype Guided Federated Learning of Visual
Feature Representations", arXiv:2105.08982, Sec. 5.1: "we train a model M_C on the
same dataset without any distributed setting"; Table 4's "Centralized" row; the FFD of
eq. 16-17, fedbus.analysis.ffd), and the usual upper bound for federated accuracy.

**A simulation-only baseline.** The server's handler holds the one model and the union
of every client's training split (ServerContext.pooled_train: the server builds the
same partition as the nodes, fedbus.node.setup.pooled_train). No real deployment can
do this; it exists to be compared with.

How it fits fedbus's process model
----------------------------------
* Each aggregation ("round" r) the server trains the model for `train.epochs` epochs
  of minibatch SGD over the pooled data, with the [train] settings (batch_size, lr,
  momentum, weight_decay), reshuffled every epoch from a seed of (federation.seed, r).
  The optimizer (its momentum) persists across rounds: R rounds are R x epochs epochs
  of one continuous training run. The initial weights are client 0's seeded network,
  the ones FedAvg starts from.
* Clients train nothing: the task is empty, the update is empty and reports no work
  asked (Work.epochs_asked = 0, so the record counts no partial work). They evaluate
  the central model on their own test splits exactly as FedAvg clients evaluate the
  global model (the eval task carries its weights), so acc_mean / acc_weighted,
  summary.json and `fedbus plot` read as for any other run. Which clients a round
  samples (federation.fraction) and which fail changes nothing in the training.
* checkpoint.fbk holds {"weights": the central model, "momentum": SGD buffers}; the
  `log.ffd_reference` of another run loads "weights" from it (fedbus.analysis.ffd).
* The training runs in the server process, on its CPU and one thread like all of the
  server's mathematics, so `fedbus replay` re-trains it bit for bit and --resume
  continues it. It suits the offline data sets; its time counts in the round's
  round_s and, with federation.deadline_s set, against the evaluation's wait.
* Every client must run one architecture (needs_same_model): they evaluate it.

agg metrics: train_loss (mean minibatch loss of this round's training), steps,
samples (the pooled training-set size). PARAMS: none.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             load_weights, model_weights)
from fedbus.algorithms.core.training import staleness_metrics
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer


class CentralServer(FedAvgServer):
    PARAMS: ClassVar[dict[str, Any]] = {}

    def __init__(self, ctx):
        super().__init__(ctx)  # self.weights: client 0's seeded initial network
        if ctx.pooled_train is None:
            raise ValueError("algorithm 'central' trains on every client's data pooled at the "
                             "server (a simulation-only baseline): this server was built "
                             "without data")
        self.model = ctx.make_model(0)
        load_weights(self.model, self.weights)
        t = ctx.train
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=t["lr"],
                                         momentum=t["momentum"],
                                         weight_decay=t["weight_decay"])
        x, y = ctx.pooled_train()
        self.x = torch.as_tensor(np.asarray(x), dtype=torch.float32)
        self.y = torch.as_tensor(np.asarray(y), dtype=torch.int64)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {}  # clients train nothing; make_eval (inherited) sends the weights

    def update_spec(self) -> dict[str, Any]:
        return {}

    def train_round(self, round_: int) -> dict[str, float]:
        """train.epochs epochs of SGD over the pooled data; the batch order is a function
        of (federation.seed, round) only."""
        n, bs, epochs = len(self.y), int(self.ctx.train["batch_size"]), \
            int(self.ctx.train["epochs"])
        seed = int(np.random.SeedSequence([self.ctx.seed, 0xCE17, round_]).generate_state(1)[0])
        gen = torch.Generator().manual_seed(seed)
        total, steps = 0.0, 0
        self.model.train()
        with torch.random.fork_rng(devices=[]):  # dropout draws from a seeded stream
            torch.manual_seed(seed)
            for _ in range(epochs if n else 0):
                order = torch.randperm(n, generator=gen)
                for i in range(0, n, bs):
                    idx = order[i:i + bs]
                    self.optimizer.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(self.model(self.x[idx]), self.y[idx])
                    loss.backward()
                    self.optimizer.step()
                    total += loss.item()
                    steps += 1
        self.weights = model_weights(self.model)
        out = {"steps": float(steps), "samples": float(n)}
        if steps:
            out["train_loss"] = total / steps
        return out

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        return {**staleness_metrics(updates, failures), **self.train_round(info.round)}

    # -- checkpoint: the model and the optimizer's momentum ------------------------------
    def state_dict(self) -> dict[str, Any]:
        names = {id(p): k for k, p in self.model.named_parameters()}
        momentum = {names[id(p)]: s["momentum_buffer"].detach().numpy().copy()
                    for p, s in self.optimizer.state.items()
                    if s.get("momentum_buffer") is not None}
        return {"weights": {k: v.copy() for k, v in self.weights.items()},
                "momentum": momentum}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        load_weights(self.model, self.weights)
        params = dict(self.model.named_parameters())
        for k, buf in (state.get("momentum") or {}).items():
            self.optimizer.state[params[k]]["momentum_buffer"] = \
                torch.from_numpy(np.array(buf, copy=True))


class CentralClient(FedAvgClient):
    """Evaluates the central model (FedAvgClient.evaluate); trains nothing."""

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        run.work.epochs_asked = 0  # no local work is asked of a client: not "partial"
        return {}


ALGORITHM = Algorithm("central", CentralServer, CentralClient,
                      "central training on every client's data pooled at the server "
                      "(simulation-only reference, Michieli & Ozay's M_C)")

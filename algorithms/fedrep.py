"""FedRep: a shared representation with local heads, trained in alternation.

Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021 (arXiv:2102.07078). Reference code:
github.com/lgcollins/FedRep (models/Update.py `LocalUpdate.train`, main_fedrep.py,
scripts/FedRep_*.sh).

The split is FedPer's (fedbus.algorithms.fedper): the representation phi is the body
(every weight outside the network's head module, buffers included), averaged by the
server; the head h_i is client i's own and never travels. Algorithm 1, client i, per
round, starting from the global representation phi^t and its own head:

1. head update: several steps of SGD on h_i with phi^t fixed;
2. representation update: steps of SGD on phi with the new h_i fixed;

and the server averages the representations (FedAvg's sample weights). On the
wire, as FedPer: task/eval {"weights": {name: array}} (the global body), update
{"delta": {name: array}} (body minus the body sent), aggregated by FedAvg's rule
body += sum_k s_k n_k delta_k / sum_k s_k n_k (s_k the engine's staleness weight): a
weighted sum, merged by DeltaSums at a relay and under secure aggregation, as FedPer's.

Epochs and the engine: train.epochs (the engine's LocalRun) counts the *representation*
epochs, so partial work, deadlines and time budgets are accounted for as for every
other method. The head phase runs first, as a LocalRun of its own with PARAM
`head_epochs` epochs (scaled like the engine's run when it asks for partial work:
head_epochs * epochs_to_run / epochs), the same time budget and slow factor, and a
seed derived from the task's. The engine's run was created before training began, so
its clock, and its budget, cover the head phase too: a head phase that spends the
whole budget leaves no representation step (a zero delta, still a valid update).
With train.epochs = 0 no head phase runs either.

PARAM head_epochs: 10. Source: the authors' run scripts, where head epochs =
local_ep - local_rep_ep is 10 in all seven released FedRep scripts (e.g.
scripts/FedRep_cifar10_2shards.sh: --local_ep 11 --local_rep_ep 1; FedRep_femnist.sh
and the CIFAR-100 ones: --local_ep 15 --local_rep_ep 5); options.py's defaults
(local_ep 5, local_rep_ep 1) are not what the experiments ran. The representation
epochs are train.epochs (the scripts: 5, or 1 for CIFAR-10 with 2 shards per user).

Frozen means frozen: the two phases use two optimisers (train.lr, momentum and weight
decay each), one over the head's parameters and one over the body's, so neither a
momentum buffer nor weight decay moves the frozen part. The reference code toggles
requires_grad under one SGD (momentum 0.5, weight decay 1e-4 on weights); with the
PyTorch of its time net.zero_grad() zeroed gradients rather than clearing them, so the
head, frozen for the representation epochs, still moved by its momentum buffer and
weight decay. The frozen part also has requires_grad off during the other phase, so no
gradient is computed through it. Both optimisers start each phase empty (the code
builds a fresh one per round) or carry their momentum over from the last task, as every
fedbus client's optimisers do (train.optimizer_state: "fresh", default, or "persist");
the head optimiser's state is part of the client's state_dict. The network stays in
train mode in both phases, as in the code: BatchNorm running statistics in the body
keep updating while the head trains (its parameters do not).

Evaluation (as FedPer, and the paper's personalised accuracy): the global
representation with the client's own head. Every client runs one architecture
(`needs_same_model`). PARAM partial as FedAvg (tolerate, default, or drop).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import LocalRun
from fedbus.algorithms.core.merge import DeltaSums
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.split import body_parameters, head_parameters
from fedbus.algorithms.fedper import SharedPartClient, SharedPartServer


@contextmanager
def frozen(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """requires_grad off for `params` inside the block, restored after."""
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)


def head_seed(seed: int) -> int:
    """The head phase's shuffling seed, distinct from the representation phase's."""
    return (int(seed) * 2654435761 + 40503) % (2 ** 63)


class FedRepServer(SharedPartServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        **SharedPartServer.PARAMS,
        "head_epochs": opt(10, "local epochs of the head (body frozen) before the train.epochs "
                           "epochs of the representation (head frozen); the authors' scripts: "
                           "local_ep - local_rep_ep = 10", min=0),
    }
    # the representation's FedAvg rule is FedPer's weighted sum (not inherited: declared)
    MERGE = DeltaSums()


class FedRepClient(SharedPartClient):
    PARAMS: ClassVar[dict[str, Any]] = FedRepServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.head_params = head_parameters(ctx.model)
        self.body_params = body_parameters(ctx.model)
        # self.optimizer (the one the engine's run and state_dict use) moves the body only.
        self.optimizer = ctx.make_optimizer(self.body_params)
        self.head_optimizer = ctx.make_optimizer(self.head_params)
        self.head_loss = float("nan")

    def head_run(self, run: LocalRun) -> LocalRun:
        epochs = int(self.param("head_epochs"))
        return LocalRun(self.ctx, epochs=epochs, seed=head_seed(run.seed),
                        epochs_to_run=epochs * run.epochs_to_run / max(run.epochs, 1),
                        budget_s=run.budget_s, slow_factor=run.slow_factor,
                        clock=run.clock,  # one clock for both phases (tests use a fake one)
                        lr_factor=run.lr_factor)  # this round's train.lr_decay, as the body's

    def _run_with(self, optimizer: torch.optim.Optimizer, run: LocalRun) -> float:
        saved, self.optimizer = self.optimizer, optimizer
        try:
            return self.run_local(run)
        finally:
            self.optimizer = saved

    def head_phase(self, head_run: LocalRun) -> None:
        """Head epochs, the body frozen (its parameters get no gradient and no step)."""
        with frozen(self.body_params):
            self.head_loss = self._run_with(self.head_optimizer, head_run)

    def body_phase(self, run: LocalRun) -> None:
        """Representation epochs (the engine's run), the head frozen."""
        with frozen(self.head_params):
            self.run_local(run)

    def local_update(self, run: LocalRun) -> None:
        if run.epochs > 0 and int(self.param("head_epochs")) > 0:
            self.head_phase(self.head_run(run))
        self.body_phase(run)

    def extra_state(self) -> dict[str, Any]:
        return {"head_optimizer": self.head_optimizer.state_dict()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if "head_optimizer" in state:
            self.head_optimizer.load_state_dict(state["head_optimizer"])


ALGORITHM = Algorithm("fedrep", FedRepServer, FedRepClient,
                      "FedRep (Collins et al. 2021): shared body, local heads, head-then-body "
                      "local epochs")

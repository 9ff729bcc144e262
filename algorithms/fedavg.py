"""FedAvg: federated averaging of model weights.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", AISTATS 2017, Algorithm 1
(FederatedAveraging): each sampled client k starts from the global weights w_t,
runs E local epochs of minibatch SGD on its data, and the server sets
w_{t+1} = sum_k (n_k / n) w_{t+1}^k over the clients that reported.

On the bus a client uploads "delta" = w^k - w_t (its weights minus the global
weights of the task it answered) and the server applies

    w <- w + sum_k s_k n_k delta_k / sum_k s_k n_k

(s_k the engine's staleness weight 1/sqrt(1+staleness), n_k the client's
training-set size; fedbus.algorithms.core.weights). With every update fresh and
made from one global version this is exactly Algorithm 1's weighted mean (up to
float64 rounding); a late or asynchronous update, made from an older version,
still applies as a step, down-weighted by its staleness.

Evaluation scores the *global* model: the eval task carries the global weights,
the client loads them, scores its test split with the classifier head, and puts
its own (post-training) weights back, so nothing local is lost.

The whole global state dict travels, buffers included (BatchNorm running
statistics are averaged like weights; integer counters are averaged and
rounded). Every client must run the same architecture (`needs_same_model`).
`FedAvgServer`/`FedAvgClient` are the base classes of FedProx and FedAvg-proto:
the averaging rule is written once, here and in fedbus.algorithms.core.weights.

PARAMS: partial = "tolerate" (default) aggregates a partial update (a client that
ran fewer epochs than asked: system.partial_work, a deadline) like any other, as
fedbus treats partial work everywhere; "drop" counts it as a failure (reason
"partial"), the FedAvg that Michieli & Ozay (Table 3, row "FedAvg" against "FedAvg +
toleration") and FedProx's paper (Sec. 5.2, "drop the stragglers") compare against.
robust = "none" (default: Algorithm 1's weighted mean above); "median", "trimmed_mean"
(robust_trim) or "krum" (robust_f, robust_m) step by that rule over the deltas instead,
w <- w + rule(delta_1, ..., delta_n) (fedbus.algorithms.core.robust): a defence against in-range
poison, not the paper's. Each delta then counts once (the self-reported n_k and the
staleness weights are dropped), partial updates are first dropped or tolerated as
`partial` says, and relays forward updates unmerged. Subclasses that declare their own
PARAMS without these keys (FedAtt, FedPer, ...) keep the weighted mean.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             ServerHandler, load_weights, model_weights,
                                             weight_delta)
from fedbus.algorithms.core.merge import DeltaSums, weighted_sum
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import Params, opt
from fedbus.algorithms.core.robust import ROBUST_PARAMS, Outcome, Robust, no_merged, report
from fedbus.algorithms.core.training import LocalClient, staleness_metrics
from fedbus.algorithms.core.weights import apply_delta, average_deltas, fedavg_coefs, weights_spec

PARTIAL = opt("tolerate", "a partial update (fewer epochs than asked): tolerate = aggregate "
              "it; drop = count it as a failure (Michieli & Ozay's plain FedAvg, Table 3)",
              ("tolerate", "drop"))


def drop_partial(updates: list[ClientUpdate],
                 failures: list[Failure]) -> tuple[list[ClientUpdate], list[Failure]]:
    """The complete updates, and the failures with every partial one added. A merged
    update is kept whole: its sum holds no partial work (DeltaSums.lift keeps such an update
    apart at a relay, and under secure aggregation a partial client masks zeros), and its
    partial members are counted as failed."""
    kept = [u for u in updates if u.members or u.work.fraction >= 1.0]
    dropped = [Failure(m.client, "partial") for u in updates for m in (u.members or (u,))
               if m.work.fraction < 1.0]
    return kept, [*failures, *dropped]


class FedAvgServer(Robust, Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {"partial": PARTIAL, **ROBUST_PARAMS}
    needs_same_model: ClassVar[bool] = True
    # Algorithm 1's weighted mean is a sum: a relay pre-aggregates it (algorithms.merge),
    # unless a robust rule replaces it (merge_rule() is then None)
    MERGE = DeltaSums()
    # the upload is {delta} summed by DeltaSums: client-level DP (not inherited: subclasses
    # that upload more, or aggregate otherwise, declare their own)
    DP_LEVELS: ClassVar[tuple[str, ...]] = ("client",)

    def __init__(self, ctx):
        super().__init__(ctx)
        # Client 0's seeded initial network: every client built from the same
        # seed starts from these weights too.
        self.weights: dict[str, np.ndarray] = model_weights(ctx.make_model(0))
        self._weights_spec = weights_spec(self.weights)

    # -- tasks ------------------------------------------------------------------
    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # The arrays are never written in place (aggregate builds new ones), so a
        # payload already handed to the engine stays what it was.
        return {"weights": self.weights}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"weights": self.weights}

    # -- aggregation -------------------------------------------------------------
    def coefficients(self, updates: list[ClientUpdate]) -> list[float]:
        """c_k = staleness weight x training-set size."""
        return fedavg_coefs(updates)

    def tolerated(self, updates: list[ClientUpdate],
                  failures: list[Failure]) -> tuple[list[ClientUpdate], list[Failure]]:
        """The updates this aggregation uses: all, unless the handler declares the
        `partial` option and it says drop. Subclasses with their own PARAMS (FedProx,
        attention) tolerate partial work by design."""
        if "partial" in self.PARAMS and self.param("partial") == "drop":
            return drop_partial(updates, failures)
        return updates, failures

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        updates, failures = self.tolerated(updates, failures)
        metrics = staleness_metrics(updates, failures)
        rule = self.robust_rule()
        if rule is not None:
            if updates:
                no_merged(updates, rule)
                out = Outcome()
                step = rule.trees([u.payload["delta"] for u in updates], out)
                self.weights = apply_delta(self.weights, step)
                report(metrics, rule, out, [u.client for u in updates])
        elif any(u.members for u in updates):  # a relay's pre-aggregated sums among them
            total, _ = weighted_sum(updates, DeltaSums(), self.resolved_params())
            mass = float(total["mass"][0])
            if mass > 0:
                self.weights = apply_delta(self.weights, {k: v / mass for k, v in
                                                          total["delta_sum"].items()})
        elif updates:
            self.weights = average_deltas(self.weights, [u.payload["delta"] for u in updates],
                                          self.coefficients(updates))
        return metrics

    def global_weights(self) -> dict[str, np.ndarray]:
        return self.weights

    def update_spec(self) -> dict[str, Any]:
        # A nested dict mirrors the nested payload: "delta" -> {name: (dtype, shape)}.
        return {"delta": dict(self._weights_spec)}

    # -- checkpoint --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"weights": {k: v.copy() for k, v in self.weights.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.weights = {k: np.array(v, copy=True) for k, v in state["weights"].items()}


@contextmanager
def swapped_weights(model: torch.nn.Module, weights: Mapping[str, Any]) -> Iterator[None]:
    """Run a block with `weights` loaded into `model`, then put its own back."""
    backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
    load_weights(model, weights)
    try:
        yield
    finally:
        model.load_state_dict(backup)


class FedAvgClient(LocalClient):
    PARAMS: ClassVar[dict[str, Any]] = FedAvgServer.PARAMS

    def begin_local(self, task: Mapping[str, Any]) -> None:
        """Hook after the global weights are loaded, before the first step."""

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        load_weights(self.ctx.model, task["weights"])
        self.begin_local(task)
        self.run_local(run)
        return {"delta": weight_delta(self.ctx.model, task["weights"])}

    def functional_loss(self) -> Any:
        """Cohort hook (LocalClient.functional_loss): FedAvg's local loss is the
        cross-entropy; declared here for this class's train()."""
        return super().functional_loss()

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """The global model's head on this client's test split."""
        with swapped_weights(self.ctx.model, task["weights"]):
            return head_metrics(self.ctx.model, self.ctx.test_x, self.ctx.test_y)


ALGORITHM = Algorithm("fedavg", FedAvgServer, FedAvgClient,
                      "FedAvg (McMahan et al. 2017): sample-weighted weight averaging")

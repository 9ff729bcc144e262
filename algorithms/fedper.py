"""FedPer: federated learning with personalization layers.

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization
Layers", arXiv:1912.00818, 2019: a network is split into base layers W_B, shared by
every client and averaged by the server as FedAvg averages a whole model, and
personalization layers W_P^j, client j's own, never sent. Each round client j starts
from the global base and its own personalization layers, runs E local epochs of SGD on
both jointly, and uploads its base layers only; the server sets
W_B = sum_j (n_j / n) W_B^j.

Here the personalization layers are the network's head (fedbus.algorithms.core.split: the
sub-module named by `head_module`: one FC layer in most fedbus networks, two in
MP-FedCL's MLP; the paper varies the number of personalization layers, fedbus fixes
them to the head) and the base is everything else, buffers included (BatchNorm statistics are
averaged like FedAvg's). On the wire:

- task and eval: {"weights": {state-dict name: array}} of the base (body) only;
- update: {"delta": {name: array}} = the client's body minus the body it was sent, so
  a late or asynchronous update applies cleanly. The server applies FedAvg's rule
  (fedbus.algorithms.core.weights): body += sum_k s_k n_k delta_k / sum_k s_k n_k, s_k the
  engine's staleness weight 1/sqrt(1+staleness), n_k the client's training-set size.
  That is a weighted sum, so FedPerServer declares DeltaSums as its merge rule
  (fedbus.algorithms.core.merge): a relay pre-adds sum_k n_k delta_k and sum_k n_k, and secure
  aggregation reveals only that sum; FedAvgServer.aggregate steps by the sums of merged
  updates exactly as by the single ones (up to float64 rounding).

Evaluation scores what FedPer's clients deploy: the *global* base with the client's
*own* personalization layers (the eval task carries the global body, swapped in for
the duration of the evaluation; the client's trained body is put back after).

Every client must run one architecture (`needs_same_model`): the base is averaged
weight by weight. Partial work (a deadline, a time budget) is tolerated like FedAvg's:
PARAM partial = "tolerate" (default) or "drop" (as fedbus.algorithms.fedavg).

The parts shared with LG-FedAvg (which shares the head and keeps the body: the mirror
image) and FedRep (FedPer's split with alternating local phases) live here:
`SharedPartServer` (FedAvg's rule on one part of the weights) and `SharedPartClient`
(load the shared part, train, upload its delta, evaluate with the global part).

`global_weights()` (read by analysis metrics such as FFD, which look at features only)
is the global body with client 0's initial head: the head is never global.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import LocalRun, model_weights, to_tensor
from fedbus.algorithms.core.merge import DeltaSums
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.split import body_names, head_names, head_prefix
from fedbus.algorithms.core.training import LocalClient
from fedbus.algorithms.core.weights import weights_spec
from fedbus.algorithms.fedavg import PARTIAL, FedAvgServer

# A part of a network: {wire name: state-dict name}.
PartMap = dict[str, str]


def body_map(model: torch.nn.Module) -> PartMap:
    """The feature extractor's weights under their own state-dict names."""
    return {n: n for n in body_names(model)}


def head_map(model: torch.nn.Module) -> PartMap:
    """The head's weights under names relative to the head module ("weight", "bias"):
    networks of a model group name their head differently ("fc", "fc2") but share
    its shape, and the relative names are what fedbus.node.setup.check_models
    compares."""
    prefix = head_prefix(model)
    return {n[len(prefix):]: n for n in head_names(model)}


def part_weights(model: torch.nn.Module, part: PartMap) -> dict[str, np.ndarray]:
    state = model.state_dict()
    return {w: state[n].detach().cpu().numpy().copy() for w, n in part.items()}


def load_part(model: torch.nn.Module, part: PartMap, weights: Mapping[str, Any]) -> None:
    missing = set(part) - set(weights)
    if missing:
        raise ValueError(f"shared weights lack {sorted(missing)[:3]}...")
    state = model.state_dict()
    model.load_state_dict({n: to_tensor(weights[w], state[n].device, state[n].dtype)
                           for w, n in part.items()}, strict=False)


def part_delta(model: torch.nn.Module, part: PartMap,
               base: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The part's current weights minus `base`, in each weight's dtype."""
    state = model.state_dict()
    out = {}
    for w, n in part.items():
        cur = state[n].detach().cpu().numpy()
        out[w] = (cur - np.asarray(base[w], dtype=cur.dtype)).astype(cur.dtype, copy=False)
    return out


@contextmanager
def swapped_part(model: torch.nn.Module, part: PartMap,
                 weights: Mapping[str, Any]) -> Iterator[None]:
    """Run a block with `weights` loaded into the part, then put the model's own back."""
    names = set(part.values())
    backup = {n: t.detach().clone() for n, t in model.state_dict().items() if n in names}
    load_part(model, part, weights)
    try:
        yield
    finally:
        model.load_state_dict(backup, strict=False)


class SharedPartServer(FedAvgServer):
    """FedAvg's averaging rule (staleness weight x samples, deltas, `partial`) over one
    part of the network, the part `part_map` names; the rest stays on the clients."""

    PARAMS: ClassVar[dict[str, Any]] = {"partial": PARTIAL}
    needs_same_model: ClassVar[bool] = True
    part_map: ClassVar[Callable[[torch.nn.Module], PartMap]] = staticmethod(body_map)

    def __init__(self, ctx):
        super().__init__(ctx)
        model = ctx.make_model(0)
        self._initial = model_weights(model)
        self.weights = part_weights(model, self.part_map(model))
        self._weights_spec = weights_spec(self.weights)

    def global_weights(self) -> dict[str, np.ndarray] | None:
        return {**self._initial, **self.weights}


class SharedPartClient(LocalClient):
    """Loads the task's shared part, trains (`local_update`), uploads the part's delta;
    evaluates with the global part swapped in."""

    PARAMS: ClassVar[dict[str, Any]] = SharedPartServer.PARAMS
    part_map: ClassVar[Callable[[torch.nn.Module], PartMap]] = staticmethod(body_map)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.part = self.part_map(ctx.model)

    def local_update(self, run: LocalRun) -> None:
        self.run_local(run)

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        load_part(self.ctx.model, self.part, task["weights"])
        self.local_update(run)
        return {"delta": part_delta(self.ctx.model, self.part, task["weights"])}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        with swapped_part(self.ctx.model, self.part, task["weights"]):
            return head_metrics(self.ctx.model, self.ctx.test_x, self.ctx.test_y)


class FedPerServer(SharedPartServer):
    # the body's FedAvg rule is a weighted sum: a relay pre-aggregates it and secure
    # aggregation sums it (fedbus.algorithms.core.merge); partial = drop keeps a partial update
    # apart (DeltaSums.lift), as the flat path counts it a failure
    MERGE = DeltaSums()


class FedPerClient(SharedPartClient):
    PARAMS: ClassVar[dict[str, Any]] = FedPerServer.PARAMS


ALGORITHM = Algorithm("fedper", FedPerServer, FedPerClient,
                      "FedPer (Arivazhagan et al. 2019): FedAvg of the body, personal heads")

"""LG-FedAvg: local representations, a global head.

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523,
2020. Reference code as a heterogeneous-model baseline: TsingZ0/HtFLlib
system/flcore/clients/clientlg.py, system/flcore/servers/serverlg.py (FedTGP's
LG-FedAvg, which "has no additional hyperparameters").

Each client keeps its own feature extractor (the local representation; clients of a
model group may run different extractors) and shares the head (the global model; the
sub-module named by the network's `head_module`, fedbus.algorithms.core.split). Per task:

- the task carries {"weights": {name: array}}: the global head, its weights named
  relative to the head module ("weight", "bias"), so networks of a group whose heads
  are called "fc" and "fc2" exchange one head;
- the client loads them into its head, trains its whole network (extractor and head)
  with cross-entropy for the engine's epochs (clientlg.train), and uploads
  {"delta": {name: array}}: its head minus the head it was sent, so a late or
  asynchronous update applies cleanly;
- the server applies FedAvg's rule to the head (serverlg.aggregate_parameters weights
  clients by training-set size): head += sum_k s_k n_k delta_k / sum_k s_k n_k, s_k the
  engine's staleness weight 1/sqrt(1+staleness), n_k the client's training-set size
  (fedbus.algorithms.core.weights). With fresh updates from one version this is the code's
  sum_k (n_k / n) head_k.

The initial global head is client 0's seeded initial head (serverlg: the first client's
model.head). Evaluation scores the client's own extractor with the *global* head (the
eval task carries it; the client's own trained head is put back after), what HtFLlib's
evaluate() scores after set_parameters().

Model groups: needs_same_model is False; the heads must agree in their relative names
and shapes (needs_same_head: fedbus.node.setup.check_models rejects a group whose heads
differ at start-up, and update_spec() rejects a mismatched update). The federation's
common feature_dim makes a one-layer head Linear(feature_dim, C) the same everywhere.

PARAMS: partial = "tolerate" (default) aggregates a partial update like any other;
"drop" counts it as a failure (as fedbus.algorithms.fedavg). No other parameter.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from fedbus.algorithms import Algorithm
from fedbus.algorithms.fedper import PartMap, SharedPartClient, SharedPartServer, head_map


class LGFedAvgServer(SharedPartServer):
    needs_same_model: ClassVar[bool] = False
    needs_same_head: ClassVar[bool] = True
    part_map: ClassVar[Callable[[torch.nn.Module], PartMap]] = staticmethod(head_map)

    def global_weights(self) -> dict[str, np.ndarray] | None:
        return None  # the feature extractors, what analysis metrics look at, are local


class LGFedAvgClient(SharedPartClient):
    PARAMS: ClassVar[dict[str, Any]] = LGFedAvgServer.PARAMS
    part_map: ClassVar[Callable[[torch.nn.Module], PartMap]] = staticmethod(head_map)


ALGORITHM = Algorithm("lg-fedavg", LGFedAvgServer, LGFedAvgClient,
                      "LG-FedAvg (Liang et al. 2020): local feature extractors, FedAvg of "
                      "the head")

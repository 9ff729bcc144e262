"""Local training only: the no-communication baseline.

Every client trains its own network with cross-entropy on its own data and is
scored with its own classifier head; the server sends an empty task and folds
nothing. It is the lower bound every federated method should beat (the
"Local" row of the FedProto and FedTGP tables).

The training loop itself, which the other built-in algorithms share, is
fedbus.algorithms.core.training; parameter declarations (`opt`, `Params`) are
fedbus.algorithms.core.params.
"""
from __future__ import annotations

from fedbus.algorithms import Algorithm
# Params, opt, default_of, resolved_params, staleness_metrics: imported here too, their
# home before fedbus.algorithms.core (plugins written then import them from this module)
from fedbus.algorithms.core.params import Params, default_of, opt, resolved_params  # noqa: F401
from fedbus.algorithms.core.training import (LocalClient, LocalServer,  # noqa: F401
                                             staleness_metrics)


ALGORITHM = Algorithm("local", LocalServer, LocalClient,
                      "local training only, no communication (lower bound)")

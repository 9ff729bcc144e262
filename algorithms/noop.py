"""No-op: no training, a fixed-size payload each way.

For measuring what the framework itself costs per round (sampling, tasks,
routing, encoding, logging, aggregation bookkeeping) without the cost of
learning: `fedbus bench rounds` uses it, and so can anyone sizing a
deployment. PARAMS `payload`: "prototypes" (10 x 512 float32, 20 KiB, what a
prototype method sends) or "resnet18" (11.2 M float32 parameters, 45 MiB,
what a weight-sharing method sends for a ResNet-18).
"""
from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import ClientHandler, ServerHandler
from fedbus.algorithms.core.merge import ArraySums, members_of

SIZES = {"prototypes": (10, 512), "resnet18": (11_181_642,)}


def _payload(kind: str) -> np.ndarray:
    return np.zeros(SIZES[kind], dtype=np.float32)


class NoopServer(ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {"payload": "prototypes"}
    MERGE = ArraySums()  # so `fedbus bench rounds --relays` measures pre-aggregation

    def __init__(self, ctx):
        super().__init__(ctx)
        if self.params["payload"] not in SIZES:
            raise ValueError(f"algorithm.payload must be one of {', '.join(SIZES)}")
        self.state = _payload(self.params["payload"])
        self.updates_seen = 0

    def make_task(self, client, info):
        return {"state": self.state}

    def make_eval(self, client, info):
        return {}

    def aggregate(self, updates, failures, info):
        self.updates_seen += len(members_of(updates))
        return {"updates_seen": float(self.updates_seen)}

    def update_spec(self):
        return {"state": ("float32", SIZES[self.params["payload"]])}

    def state_dict(self):
        return {"updates_seen": self.updates_seen}

    def load_state_dict(self, state):
        self.updates_seen = int(state["updates_seen"])


class NoopClient(ClientHandler):
    def train(self, task, run):
        return {"state": np.asarray(task["state"])}

    def evaluate(self, task):
        return {"acc": 0.0, "loss": 0.0, "num_test": 0}


ALGORITHM = Algorithm("noop", NoopServer, NoopClient, "no training; measures framework overhead")

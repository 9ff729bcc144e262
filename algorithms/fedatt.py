"""FedAtt: layer-wise attentive aggregation of client models.

Shaoxiong Ji, Shirui Pan, Guodong Long, Xue Li, Jing Jiang, Zi Huang, "Learning
Private Neural Language Modeling with Attentive Aggregation", IJCNN 2019
(arXiv:1812.07108), Sec. III, Algorithm 1 (attentive federated aggregation); the
weight-based attention baseline of Michieli & Ozay ([22] in arXiv:2105.08982).
Reference code: github.com/shaoxiongji/fed-att, src/agg/aggregate.py.

Server, one aggregation over the updates K^t, for every layer l (every entry of the
state dict on its own: each weight, bias and buffer, as the reference code does):

    s_k^l     = || w^l - w_k^l ||                        attention score: the distance
    alpha_k^l = exp(s_k^l) / sum_j exp(s_j^l)            softmax over the clients
    w^l      <- w^l - epsilon sum_k alpha_k^l (w^l - w_k^l)   (+ beta N(0, 1) if dp > 0)

the last line being one gradient step of size epsilon on the attention-weighted
distance 1/2 sum_k alpha_k^l ||w^l - w_k^l||^2 (alpha held fixed). With epsilon = 1 it
is the attention-weighted average of the client models. The softmax gives the larger
weight to the client *farther* from the server, as in the paper and its code.

fedbus specifics (the paper has only fresh, synchronous updates):
* clients upload delta_k = w_k - w_t (fedbus's weight convention), so w - w_k =
  -delta_k and the step is w <- w + epsilon sum_k s_k alpha_k^l delta_k^l, s_k the
  engine's staleness weight 1/sqrt(1 + staleness): 1 for a fresh update (then exactly
  the rule above); a late or asynchronous update only shrinks its own step (alpha is
  not renormalised) and applies from the version it was made from.
* ||.|| is the L2 norm of the flattened difference (Frobenius for a matrix), the
  paper's p = 2. The reference code calls scipy.linalg.norm(ord=2), which on a 2-D
  weight is the spectral norm and rejects a conv kernel; we use the flattened L2 norm
  for every shape.
* dp = beta: Gaussian noise of that std added to every float weight after the step
  (the paper's randomised variant; the reference code's --dp, default 0.001 there).
  Default 0 here (off); the noise is seeded by (federation.seed, round), so a run
  replays. Integer buffers (num_batches_tracked) take the step rounded, no noise.

PARAMS: epsilon (server step size, default 1.0 as the reference code's --epsilon),
dp (noise std beta, default 0.0), partial (tolerate, default, or drop: as FedAvg's,
fedbus.algorithms.fedavg). Clients are FedAvg's (cross-entropy SGD from the
global weights; evaluation of the global model). Metrics: agg_extra.attention =
{client: alpha_k^l averaged over the layers} (they sum to 1), agg.attn_max/attn_min.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import ClientUpdate, Failure, RoundInfo
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.training import staleness_metrics
from fedbus.algorithms.core.weights import apply_delta
from fedbus.algorithms.fedavg import PARTIAL, FedAvgClient, FedAvgServer


def attentive_step(deltas: Sequence[Mapping[str, Any]], scale: Sequence[float],
                   epsilon: float) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the step to add to the server weights {name: float64 array}, the attention of
    each update averaged over the layers [U]). deltas[k] = w_k - w (the uploads), scale
    the staleness weights s_k."""
    step: dict[str, np.ndarray] = {}
    att = np.zeros(len(deltas))
    for name in deltas[0]:
        d = [np.asarray(u[name], dtype=np.float64) for u in deltas]
        s = np.array([np.sqrt((x * x).sum()) for x in d])  # s_k^l = ||w^l - w_k^l||
        a = np.exp(s - s.max())
        a /= a.sum()  # alpha_k^l, softmax over the clients
        att += a
        step[name] = epsilon * sum(ak * float(sk) * x for ak, sk, x in zip(a, scale, d))
    return step, att / max(len(step), 1)


class FedAttServer(FedAvgServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "epsilon": opt(1.0, "FedAtt server step size epsilon (1 = attention-weighted "
                       "average of the client models)", min=0.0),
        "dp": opt(0.0, "std beta of Gaussian noise added to the new global weights "
                  "(the paper's randomised variant; 0 = off)", min=0.0),
        "partial": PARTIAL,
    }

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, Any]:
        updates, failures = self.tolerated(updates, failures)
        metrics: dict[str, Any] = staleness_metrics(updates, failures)
        if not updates:
            return metrics
        step, att = attentive_step([u.payload["delta"] for u in updates],
                                   [u.weight for u in updates], float(self.param("epsilon")))
        self.weights = apply_delta(self.weights, step)
        beta = float(self.param("dp"))
        if beta > 0:
            rng = np.random.default_rng(np.random.SeedSequence([self.ctx.seed, 0xA77,
                                                                info.round]))
            for k, w in self.weights.items():
                if w.dtype.kind == "f":
                    self.weights[k] = (w + rng.normal(0.0, beta, w.shape)).astype(w.dtype)
        per_client: dict[str, float] = {}
        for u, a in zip(updates, att):
            per_client[str(u.client)] = per_client.get(str(u.client), 0.0) + float(a)
        metrics.update(attn_max=float(att.max()), attn_min=float(att.min()),
                       attention=per_client)
        return metrics


class FedAttClient(FedAvgClient):
    PARAMS: ClassVar[dict[str, Any]] = FedAttServer.PARAMS


ALGORITHM = Algorithm("fedatt", FedAttServer, FedAttClient,
                      "FedAtt (Ji et al. 2019): layer-wise softmax attention on the distance "
                      "between server and client weights, server step epsilon")

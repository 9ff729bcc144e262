"""FedTGP: trainable global prototypes with adaptive-margin contrastive learning.

Zhang, Liu, Hua, Cao, "FedTGP: Trainable Global Prototypes with
Adaptive-Margin-Enhanced Contrastive Learning for Data and Model Heterogeneity
in Federated Learning", AAAI 2024 (arXiv:2401.03230). Reference code:
github.com/TsingZ0/FedTGP (system/flcore/servers/servertgp.py,
system/flcore/clients/clienttgp.py, system/main.py, system/run_me.sh), also in
TsingZ0/HtFLlib.

Clients are FedProto clients (fedbus.algorithms.fedproto): loss = CE + lam * R
with R the reference code's per-sample MSE to the global prototype of each
sample's class (PARAM `proto_loss`, "mse" default, "paper" = FedProto's
per-class L2 form), local prototypes computed after training in eval mode (the
code's `collect_protos`), inference by the nearest global prototype over every
class (the code's `test_metrics` ranks by MSE, which orders like L2; PARAM
`infer_classes`, default "all"). A client uploads {"protos": float32 [C, D]}
only: the server needs no class counts. Absent classes are zero rows; the
server reads presence from an optional "counts" [C] (> 0) when one is sent
with a positive sum, else from the non-zero rows (a present class whose mean
feature is exactly zero would be taken as absent; with any non-degenerate
feature extractor that does not happen).

Server (the paper's sections on Trainable Global Prototypes (TGP) and
Adaptive-margin-enhanced Contrastive Learning (ACL)):
- trainable prototypes (the code's `Trainable_prototypes`): a learnable
  embedding per class, nn.Embedding(C, D), fed through
  Linear(D, H) -> ReLU -> Linear(H, D); the generated P-hat_c are the global
  prototypes. The module persists across rounds; H = PARAM `server_hidden`
  (0 = D, the code's `server_hidden_dim = feature_dim`).
- each aggregation trains it for S = PARAM `server_epochs` epochs of SGD
  (lr PARAM `server_lr`, a fresh optimiser without momentum every round, as the
  code) over the client prototypes received in this aggregation, minibatches of
  PARAM `server_batch_size`, shuffled by the server's own seeded generator. The
  loss (the adaptive-margin-enhanced contrastive loss) for a client prototype
  P_i^c of class c is
      CE(-(d(P_i^c, P-hat_.) + delta(t) * onehot(c)), c)
  with d the Euclidean distance (not squared: the code expands
  ||p||^2 - 2 p.g + ||g||^2 and takes the square root; we use torch.cdist
  without the matmul shortcut, the same quantity with a safe gradient at 0).
  Each prototype's CE is weighted by the engine's staleness weight of its
  client (sum w CE / sum w; the plain batch mean when all are fresh).
- the adaptive margin, exactly as the code's `receive_protos` computes `gap`:
  Q_c = mean over the clients that sent class c of their prototypes (the code's
  `proto_cluster`; we weight by staleness, which is the plain mean when all are
  fresh); gap_c = min over the other received classes c' of ||Q_c - Q_c'||_2
  (class-wise minimum distance); delta(t) = min(max_c gap_c, tau), tau = PARAM
  `margin_threshold`. Note: the maximum over classes of each class's *nearest*
  other centre, not the largest pairwise distance. With fewer than two classes
  received the code's gaps stay at 1e9, so delta(t) = tau; so here.
- after training the generated prototypes of all C classes (one no-grad pass)
  are the new global prototypes; the task carries {"protos": [C, D],
  "has": bool [C]} (all True after the first aggregation, as the code sends
  every class; all False before, when clients train with CE only).

Defaults and where they come from: lam = 10 (run_me.sh `-lam 10`; main.py's
argparse default is 1.0); server_epochs = 100 (run_me.sh `-se 100`; argparse
default 1000); margin_threshold tau = 100 (`-mart 100`, also the argparse
default); server_lr = 0.01 (the code uses the clients' learning rate,
run_me.sh `-lr 0.01`); server_batch_size = 10 (the code uses the clients'
batch size, `-lbs 10`).

lam and the feature dimension: the regulariser is nn.MSELoss's mean over the
batch's B x D feature entries, so its pull on each entry scales as lam / D. The
reference's lam = 10 goes with HtFLlib's feature_dim = 512; at D = 64 the same
pull per entry is lam = 1.25. The server's adaptive margin grows with the
spread of the client prototypes it receives, and clients pulled hard toward the
spread-out global prototypes spread further: a feedback that tau bounds. In
fedbus's MNIST benchmark (docs/RESULTS.md) lam = 10 at D = 64 drove the margin
to tau within 10-14 rounds and several clients' models to NaN.

Determinism: the prototype generator is initialised from the server seed by
its own torch.Generator (the PyTorch default initialisations, drawn from that
generator; the global RNG is never touched) and the same generator shuffles the
server epochs, so the server's outputs are a function of its seed and inputs
(replay). The generator's state is part of state_dict().
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbus.algorithms import Algorithm
from fedbus.algorithms.base import ClientUpdate, Failure, RoundInfo, ServerHandler
from fedbus.algorithms.fedproto import INFER_CLASSES, PROTO_LOSS, FedProtoClient
from fedbus.algorithms.local import Params, opt, staleness_metrics
from fedbus.algorithms.protos import aggregate_prototypes


class TrainablePrototypes(nn.Module):
    """nn.Embedding(C, D) -> Linear(D, H) -> ReLU -> Linear(H, D), initialised
    like PyTorch's defaults but from `generator` (the global RNG is untouched)."""

    def __init__(self, num_classes: int, feature_dim: int, hidden: int,
                 generator: torch.Generator):
        super().__init__()
        self.embeddings = nn.Embedding(num_classes, feature_dim,
                                       _weight=torch.empty(num_classes, feature_dim))
        self.middle = nn.Sequential(nn.utils.skip_init(nn.Linear, feature_dim, hidden),
                                    nn.ReLU())
        self.fc = nn.utils.skip_init(nn.Linear, hidden, feature_dim)
        with torch.no_grad():
            nn.init.normal_(self.embeddings.weight, generator=generator)
            for lin in (self.middle[0], self.fc):
                nn.init.kaiming_uniform_(lin.weight, a=math.sqrt(5), generator=generator)
                bound = 1.0 / math.sqrt(lin.in_features) if lin.in_features > 0 else 0.0
                nn.init.uniform_(lin.bias, -bound, bound, generator=generator)

    def forward(self, class_ids: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.embeddings.weight if class_ids is None else self.embeddings(class_ids)
        return self.fc(self.middle(emb))


def adaptive_margin(centres: np.ndarray, present: np.ndarray, tau: float) -> float:
    """delta(t) = min(max_c min_{c' != c} ||Q_c - Q_c'||_2, tau) over the present
    classes (the code's `gap`); tau when fewer than two classes are present."""
    q = torch.as_tensor(np.asarray(centres, dtype=np.float64)[np.asarray(present, dtype=bool)])
    if len(q) < 2:
        return float(tau)
    d = torch.cdist(q, q, compute_mode="donot_use_mm_for_euclid_dist")
    d.fill_diagonal_(float("inf"))
    return float(min(d.min(dim=1).values.max().item(), tau))


def presence(protos: np.ndarray, counts: Any = None) -> np.ndarray:
    """Which rows of a client's [C, D] prototypes are real: counts > 0 when
    counts are sent (with a positive sum), else the non-zero rows."""
    if counts is not None:
        n = np.asarray(counts)
        if n.shape == (len(protos),) and n.sum() > 0:
            return n > 0
    return np.any(np.asarray(protos) != 0, axis=1)


class FedTGPServer(Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {
        "lam": opt(10.0, "weight of the clients' prototype regulariser (run_me.sh -lam 10)",
                   min=0.0),
        "proto_loss": PROTO_LOSS,
        "infer_classes": INFER_CLASSES,
        "server_epochs": opt(100, "server epochs S over the received prototypes per round",
                             min=0),
        "server_lr": opt(0.01, "server SGD learning rate", min=0.0),
        "server_batch_size": opt(10, "server minibatch of client prototypes", min=1),
        "server_hidden": opt(0, "hidden width of the prototype generator (0 = feature_dim)",
                             min=0),
        "margin_threshold": opt(100.0, "tau, the cap of the adaptive margin delta(t)",
                                min=0.0),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        c, d = ctx.num_classes, ctx.feature_dim
        self.gen = torch.Generator().manual_seed(int(ctx.seed))
        self.net = TrainablePrototypes(c, d, int(self.param("server_hidden")) or d, self.gen)
        self.protos = np.zeros((c, d), dtype=np.float32)
        self.has = np.zeros(c, dtype=bool)
        self.margin = float("nan")

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"protos": self.protos, "has": self.has}

    # -- the ACL loss --------------------------------------------------------------
    def batch_loss(self, protos: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                   margin: float) -> torch.Tensor:
        """Staleness-weighted CE of -(distance to every generated prototype
        + margin on the own class)."""
        gen = self.net()
        dist = torch.cdist(protos, gen, compute_mode="donot_use_mm_for_euclid_dist")
        dist = dist + margin * F.one_hot(labels, gen.shape[0]).to(dist.dtype)
        ce = F.cross_entropy(-dist, labels, reduction="none")
        return (weights * ce).sum() / weights.sum()

    def train_generator(self, protos: torch.Tensor, labels: torch.Tensor,
                        weights: torch.Tensor, margin: float) -> float:
        """S epochs of SGD on the received prototypes; returns the last loss."""
        epochs = int(self.param("server_epochs"))
        bs = int(self.param("server_batch_size"))
        optimizer = torch.optim.SGD(self.net.parameters(), lr=float(self.param("server_lr")))
        self.net.train()
        last = float("nan")
        m = len(labels)
        for _ in range(epochs):
            order = torch.randperm(m, generator=self.gen)
            for i in range(0, m, bs):
                idx = order[i:i + bs]
                loss = self.batch_loss(protos[idx], labels[idx], weights[idx], margin)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                last = loss.item()
        return last

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        c = self.ctx.num_classes
        stacks, masks, weights = [], [], []
        for u in updates:
            p = np.asarray(u.payload["protos"], dtype=np.float32)
            stacks.append(p)
            masks.append(presence(p, u.payload.get("counts")))
            weights.append(float(u.weight))
        if not stacks or not np.any(masks):
            metrics["classes"] = float(self.has.sum())
            return metrics
        p_all = np.stack(stacks)  # [N, C, D]
        m_all = np.stack(masks)  # [N, C]
        w_all = np.array(weights, dtype=np.float64)
        centres, mass = aggregate_prototypes(p_all, m_all.astype(np.int64), w_all, by_count=False)
        self.margin = adaptive_margin(centres, mass > 0, float(self.param("margin_threshold")))

        client_idx, class_idx = np.nonzero(m_all)  # row-major: client by client, class order
        protos = torch.from_numpy(p_all[client_idx, class_idx].copy())
        labels = torch.from_numpy(class_idx.astype(np.int64))
        wts = torch.from_numpy(w_all[client_idx].astype(np.float32))
        loss = self.train_generator(protos, labels, wts, self.margin)

        self.net.eval()
        with torch.no_grad():
            self.protos = self.net().detach().cpu().numpy().astype(np.float32)
        self.has = np.ones(c, dtype=bool)
        metrics.update(server_loss=loss, margin=self.margin,
                       classes_received=float((mass > 0).sum()), classes=float(c))
        return metrics

    def update_spec(self) -> dict[str, tuple[str, tuple[int | None, ...]]]:
        return {"protos": ("float32", (self.ctx.num_classes, self.ctx.feature_dim))}

    # -- checkpoint ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"net": {k: v.detach().cpu().numpy().copy()
                        for k, v in self.net.state_dict().items()},
                "generator": self.gen.get_state().numpy().copy(),
                "protos": self.protos.copy(), "has": self.has.copy(),
                "margin": float(self.margin)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict({k: torch.from_numpy(np.array(v, copy=True))
                                  for k, v in state["net"].items()})
        self.gen.set_state(torch.from_numpy(np.array(state["generator"], dtype=np.uint8,
                                                     copy=True)))
        self.protos = np.array(state["protos"], dtype=np.float32, copy=True)
        self.has = np.array(state["has"], dtype=bool, copy=True)
        self.margin = float(state["margin"])


class FedTGPClient(FedProtoClient):
    """FedProto's client with the prototypes-only upload of the code."""

    PARAMS: ClassVar[dict[str, Any]] = FedTGPServer.PARAMS

    def configure(self) -> None:
        self.lam = float(self.param("lam"))
        self.proto_loss = self.param("proto_loss")
        self.proto_source = "after"  # the code's collect_protos: eval-mode pass after training
        self.infer_own = self.param("infer_classes") == "own"

    def update_payload(self, protos: np.ndarray, counts: np.ndarray) -> dict[str, Any]:
        return {"protos": protos}


ALGORITHM = Algorithm("fedtgp", FedTGPServer, FedTGPClient,
                      "FedTGP (Zhang et al. 2024): trainable global prototypes, adaptive margin")

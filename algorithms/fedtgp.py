"""FedTGP: trainable global prototypes with adaptive-margin contrastive learning.

Zhang, Liu, Hua, Cao, "FedTGP: Trainable Global Prototypes with
Adaptive-Margin-Enhanced Contrastive Learning for Data and Model Heterogeneity
in Federated Learning", AAAI 2024 (arXiv:2401.03230). Reference code:
github.com/TsingZ0/FedTGP (system/flcore/servers/servertgp.py,
system/flcore/clients/clienttgp.py, system/main.py, system/run_me.sh; the same
two files in TsingZ0/HtFLlib). Equation numbers are the paper's; the
equation-by-equation audit is docs/FIDELITY.md (fedtgp). Defaults follow the
paper; where the reference code differs, its behaviour is a named option.

Client i (Algorithm 1 lines 6-9):
- local loss (eq. 11): CE(h_i(f_i(x)), y) + lam * R. PARAM `proto_loss`:
    "paper" (default; eq. 11 as written): R = E_{c ~ C_i} phi(P_i^c, P-hat^c),
            phi the Euclidean distance, estimated on the minibatch: the mean,
            over the batch's classes c that have a global prototype, of
            ||mean of f(x) over the batch's samples of c - P-hat^c||_2
            (gradients flow through the mean);
    "mse"   (the reference code's clienttgp.train, "following FedProto's
            official implementation"): nn.MSELoss between the batch's features
            and, row by row, the global prototype of each sample's class (a
            mean over B x D entries: the pull per entry scales as lam / D).
  PARAM `lam`: 0.1 (the paper, main text and appendix: "lambda = 0.1 (the same
  as FedProto)"); the reference run script uses -lam 10 with the "mse" form.
  Before any global prototype exists (round 0) R = 0, as in the code.
- local prototypes (eq. 2): P_i^c = mean of f_i(x) over the client's training
  samples of class c, one pass after local training in eval mode (the code's
  `collect_protos`). The update is {"protos": float32 [C, D]} only: FedTGP
  uploads no class counts (Sec. "FedTGP Framework"). Absent classes are zero
  rows; the server reads presence from an optional "counts" [C] (> 0) when one
  is sent with a positive sum, else from the non-zero rows (a present class
  whose mean feature is exactly zero would be taken as absent; with any
  non-degenerate feature extractor that does not happen).
- inference (Sec. "FedTGP Framework"): the class of the nearest global
  prototype by phi over every class (the code's `test_metrics` ranks by MSE,
  which orders like L2). PARAM `infer_classes` = "all" (default; paper and
  code) or "own" (only the client's training classes). The client's own model
  is scored (acc: its head; proto_acc: the nearest global prototype).

Server (Algorithm 1 lines 10-11):
- trainable global prototypes (Sec. "Trainable Global Prototypes", Fig. 3):
  a trainable vector P-acute^c in R^K per class (nn.Embedding(C, K), the
  code's `Trainable_Global_Prototypes`), randomly initialised, fed through F =
  two FC layers with a ReLU between, Linear(K, H) -> ReLU -> Linear(H, K);
  P-hat^c = F(P-acute^c). H = PARAM `server_hidden` (0 = K: the code's
  `server_hidden_dim = feature_dim`; the paper gives no width). PARAM
  `generator` = "mlp" (default, with F) or "none" (Tab. 6's "w/o F": the
  vectors P-acute^c are the prototypes). The module persists across rounds.
- each aggregation trains it for S = PARAM `server_epochs` = 100 epochs
  (paper) of SGD without momentum, a fresh optimiser every round (as the
  code), over the client prototypes received in this aggregation, shuffled
  minibatches by the server's own seeded generator. The paper gives neither
  the server learning rate nor the minibatch: PARAM `server_lr` (0 = the
  clients' train.lr, the code's `server_learning_rate =
  args.local_learning_rate`) and PARAM `server_batch_size` (0 = the clients'
  train.batch_size, the code's `self.batch_size = args.batch_size`).
- the ACL loss (eqs. 5, 10) for a client prototype P_i^c of class c:
      -log( e^{-(phi(P_i^c, P-hat^c) + delta(t))}
            / (e^{-(phi(P_i^c, P-hat^c) + delta(t))} + sum_{c' != c} e^{-phi(P_i^c, P-hat^c')}) )
  = CE(-(d(P_i^c, P-hat_.) + delta(t) * onehot(c)), c), d the Euclidean
  distance (torch.cdist without the matmul shortcut: the code's expanded
  sqrt(||p||^2 - 2 p.g + ||g||^2) with a safe gradient). Eq. 5 sums it over
  the clients and classes; a minibatch takes the mean (as the code; the sum
  only rescales the unstated learning rate). Each prototype's term is weighted
  by the engine's staleness weight of its client (sum w CE / sum w; the plain
  batch mean when all are fresh).
- the margin delta(t), PARAM `margin`:
    "max"     (default; eq. 9 as written): delta(t) = min(max_{c != c'}
              ||Q_t^c - Q_t^c'||_2, tau), the largest distance between two
              class centres;
    "max_min" (the reference code's `receive_protos`: `gap`, `max_gap`):
              min(max_c min_{c' != c} ||Q_t^c - Q_t^c'||_2, tau), the largest
              class-wise *minimum* distance (each class's margin as Fig. 1
              defines it), never larger than "max";
    "fixed"   (Tab. 6's "FM", eq. 7): delta = tau, every round;
    "none"    (Tab. 6's "SCL", eq. 6): delta = 0.
  Q_t^c = the plain mean of the received prototypes of class c (eq. 9; we
  weight by staleness, the plain mean when all are fresh). tau = PARAM
  `margin_threshold` = 100 (paper). With fewer than two classes received the
  code's gaps stay at 1e9, so delta(t) = tau; so here for "max" and "max_min".
- PARAM `robust` (default "none": the server trains on the client prototypes as they
  came, as above): "median", "trimmed_mean" (`robust_trim`) or "krum" (`robust_f`,
  `robust_m`) first replace every received prototype of class c by that rule over the
  prototypes of class c received in this aggregation (fedbus.algorithms.core.robust), so an
  attacker's rows cannot pull the generator further than the rule allows; Q_t^c is then
  that robust value too. The rows, their number per class (the steps per epoch) and their
  staleness weights stay as they were; only their values change. A defence against
  in-range poison, not the paper's.
- after training, the generated prototypes of all C classes (one no-grad
  pass) are the new global prototypes; the task carries {"protos": [C, D],
  "has": bool [C]} (all True after the first aggregation, as the code sends
  every class; all False before, when clients train with CE only).

lam and the feature dimension (the "mse" form): nn.MSELoss averages over the
B x D feature entries, so its pull on each entry scales as lam / D; the code's
lam = 10 goes with its feature_dim = 512. The "paper" form is an L2 norm per
class, whose pull does not shrink with D. The server's adaptive margin grows
with the spread of the client prototypes, and clients pulled toward
spread-out global prototypes spread further: a feedback that tau bounds
(docs/RESULTS.md: "mse" with lam = 10 at D = 64 drove delta to tau and some
clients to NaN).

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
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             ServerHandler, to_tensor)
from fedbus.algorithms.core.params import Params, opt
from fedbus.algorithms.core.protos import (
    aggregate_prototypes,
    class_counts,
    class_means,
    head_and_prototype_metrics,
    local_prototypes,
    pixel_samples,
)
from fedbus.algorithms.core.robust import ROBUST_PARAMS, Outcome, Robust, report
from fedbus.algorithms.core.training import LocalClient, staleness_metrics
from fedbus.algorithms.fedgh import server_batch_size, server_training_params

MARGINS = ("max", "max_min", "fixed", "none")


class TrainablePrototypes(nn.Module):
    """nn.Embedding(C, D) -> Linear(D, H) -> ReLU -> Linear(H, D) (generator
    "mlp"), or the embeddings alone ("none"); initialised like PyTorch's
    defaults but from `generator` (the global RNG is untouched)."""

    def __init__(self, num_classes: int, feature_dim: int, hidden: int,
                 generator: torch.Generator, use_f: bool = True):
        super().__init__()
        self.use_f = bool(use_f)
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
        if not self.use_f:  # Tab. 6 "w/o F": F is not part of the model
            for p in (*self.middle.parameters(), *self.fc.parameters()):
                p.requires_grad_(False)

    def forward(self, class_ids: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.embeddings.weight if class_ids is None else self.embeddings(class_ids)
        return self.fc(self.middle(emb)) if self.use_f else emb


def adaptive_margin(centres: np.ndarray, present: np.ndarray, tau: float,
                    rule: str = "max") -> float:
    """delta(t) over the present classes' centres Q (see the module docstring):
    "max" = eq. 9, min(max_{c != c'} ||Q_c - Q_c'||, tau); "max_min" = the code,
    min(max_c min_{c' != c} ||Q_c - Q_c'||, tau); "fixed" = tau; "none" = 0.
    "max"/"max_min" with fewer than two classes present: tau (the code's gaps
    stay at 1e9)."""
    if rule == "none":
        return 0.0
    if rule == "fixed":
        return float(tau)
    q = torch.as_tensor(np.asarray(centres, dtype=np.float64)[np.asarray(present, dtype=bool)])
    if len(q) < 2:
        return float(tau)
    d = torch.cdist(q, q, compute_mode="donot_use_mm_for_euclid_dist")
    if rule == "max":
        return float(min(d.max().item(), tau))
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


def prototype_regulariser(h: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                          has: torch.Tensor, form: str = "paper") -> torch.Tensor:
    """R of eq. 11 on one minibatch (features h [B, D], labels y, global
    prototypes [C, D] and their presence [C]):
    "paper": mean over the batch's classes c with a global prototype of
             ||mean(h[y == c]) - protos[c]||_2;
    "mse":   nn.MSELoss(h, target), target row b = protos[y_b] when y_b has a
             global prototype, else h_b itself (the code's `proto_new`).
    Dense maps (segmentation): one sample per feature pixel (fedbus.algorithms.core.protos)."""
    g = protos.to(h.dtype)
    h, y = pixel_samples(h, y, len(g))
    if len(y) == 0:
        return h.sum() * 0.0
    if form == "mse":
        target = torch.where(has[y].unsqueeze(1), g[y], h.detach())
        return F.mse_loss(h, target)
    means, n = class_means(h, y, len(g))
    sel = (n > 0) & has
    if not bool(sel.any()):
        return h.sum() * 0.0
    return torch.linalg.vector_norm(means[sel] - g[sel], dim=1).mean()


class FedTGPServer(Robust, Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {
        "lam": opt(0.1, "weight lambda of the clients' prototype loss, eq. 11 (paper 0.1; the "
                   "code's run_me.sh uses 10 with proto_loss = mse)", min=0.0),
        "proto_loss": opt("paper", "client loss R: paper = eq. 11 (mean over the batch's classes "
                          "of the L2 distance between the batch class mean and the global "
                          "prototype); mse = reference code (nn.MSELoss of each feature to its "
                          "class's global prototype)", choices=("paper", "mse")),
        "infer_classes": opt("all", "nearest-prototype inference over all classes (paper, code) "
                             "or only the client's own training classes",
                             choices=("all", "own")),
        **server_training_params(
            "client prototypes", epochs=(100, "S; paper: 100"), batch_size=(0, "as the code"),
            lr=(0.0, "0 = train.lr, as the code; the paper gives none")),
        "server_hidden": opt(0, "hidden width of F (0 = feature_dim, as the code)", min=0),
        "generator": opt("mlp", "trainable prototypes: mlp = vectors through F (paper); none = "
                         "the vectors alone (Tab. 6 'w/o F')", choices=("mlp", "none")),
        "margin": opt("max", "delta(t): max = eq. 9 (largest distance between class centres); "
                      "max_min = reference code (largest class-wise minimum distance); fixed = "
                      "margin_threshold (Tab. 6 'FM', eq. 7); none = 0 (Tab. 6 'SCL', eq. 6)",
                      choices=MARGINS),
        "margin_threshold": opt(100.0, "tau, the cap of the adaptive margin (paper: 100)",
                                min=0.0),
        **ROBUST_PARAMS,
    }
    # the upload is class-mean {protos} (presence from an optional counts, `presence`):
    # record-level DP replaces it with {protos, counts as 0/1 flags}
    DP_LEVELS: ClassVar[tuple[str, ...]] = ("record",)

    def __init__(self, ctx):
        super().__init__(ctx)
        c, d = ctx.num_classes, ctx.feature_dim
        self.gen = torch.Generator().manual_seed(int(ctx.seed))
        self.net = TrainablePrototypes(c, d, int(self.param("server_hidden")) or d, self.gen,
                                       use_f=self.param("generator") == "mlp")
        self.protos = np.zeros((c, d), dtype=np.float32)
        self.has = np.zeros(c, dtype=bool)
        self.margin = float("nan")

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"protos": self.protos, "has": self.has}

    # -- the ACL loss --------------------------------------------------------------
    def batch_loss(self, protos: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                   margin: float) -> torch.Tensor:
        """Staleness-weighted CE of -(distance to every generated prototype
        + margin on the own class): eq. 10 per prototype."""
        gen = self.net()
        dist = torch.cdist(protos, gen, compute_mode="donot_use_mm_for_euclid_dist")
        dist = dist + margin * F.one_hot(labels, gen.shape[0]).to(dist.dtype)
        ce = F.cross_entropy(-dist, labels, reduction="none")
        return (weights * ce).sum() / weights.sum()

    def train_generator(self, protos: torch.Tensor, labels: torch.Tensor,
                        weights: torch.Tensor, margin: float) -> float:
        """S epochs of SGD on the received prototypes; returns the last loss."""
        epochs = int(self.param("server_epochs"))
        bs = server_batch_size(self)
        lr = float(self.param("server_lr") or self.ctx.train["lr"])  # 0 = the clients' lr
        params = [p for p in self.net.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=lr)
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
        rule = self.robust_rule()
        if rule is not None:  # every held row takes its class's robust value
            out = Outcome()
            centres, present = rule.per_class(p_all, m_all, out)
            p_all = np.where(m_all[:, :, None], centres[None], p_all)
            mass = present.astype(np.float64)
            report(metrics, rule, out, [u.client for u in updates])
        else:
            centres, mass = aggregate_prototypes(p_all, m_all.astype(np.int64), w_all,
                                                 by_count=False)
        self.margin = adaptive_margin(centres, mass > 0, float(self.param("margin_threshold")),
                                      self.param("margin"))

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


class FedTGPClient(LocalClient):
    """CE + lam * R (eq. 11) against the global prototypes; uploads the class
    means of its training set (eq. 2) after training; nearest-prototype
    inference."""

    PARAMS: ClassVar[dict[str, Any]] = FedTGPServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.num_classes = ctx.num_classes
        self.own = class_counts(ctx.train_y, ctx.num_classes) > 0
        self.lam = float(self.param("lam"))
        self.proto_loss = self.param("proto_loss")
        self.infer_own = self.param("infer_classes") == "own"
        self._global: torch.Tensor | None = None
        self._has: torch.Tensor | None = None
        self._reg = False

    def global_protos(self, task: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        return (to_tensor(task["protos"], dev, torch.float32),
                to_tensor(task["has"], dev, torch.bool))

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        loss = F.cross_entropy(model.head(h), y)
        if self._reg:
            loss = loss + self.lam * prototype_regulariser(h, y, self._global, self._has,
                                                           self.proto_loss)
        return loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        self._global, self._has = self.global_protos(task)
        self._reg = self.lam > 0 and bool(self._has.any())
        d = self._global.shape[1]
        try:
            self.run_local(run)
        finally:
            self._global = self._has = None
            self._reg = False
        ctx = self.ctx
        if len(ctx.train_y) == 0:
            return {"protos": np.zeros((self.num_classes, d), np.float32)}
        protos, _ = local_prototypes(ctx.model, ctx.train_x, ctx.train_y, self.num_classes)
        return {"protos": protos}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        g, has = self.global_protos(task)
        allowed = has & self.own.to(has.device) if self.infer_own else has
        # head and prototype scores from one feature pass over the test split
        return head_and_prototype_metrics(ctx.model, ctx.test_x, ctx.test_y, g, allowed)


ALGORITHM = Algorithm("fedtgp", FedTGPServer, FedTGPClient,
                      "FedTGP (Zhang et al. 2024): trainable global prototypes, adaptive margin")

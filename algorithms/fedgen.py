"""FedGen: data-free knowledge distillation through a server-side generator.

Zhu, Hong, Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning", ICML 2021 (arXiv:2105.10056). Reference codes: the authors'
github.com/zhuangdizhu/FedGen (FLAlgorithms/servers/serverpFedGen.py,
FLAlgorithms/users/userpFedGen.py, FLAlgorithms/trainmodel/generator.py,
utils/model_config.py) and the heterogeneous-model version this module follows,
TsingZ0/HtFLlib (system/flcore/servers/servergen.py, clients/clientgen.py), where the
feature extractors differ between clients and only the head (the last FC layer) and
the generator are shared: the setting of FedTGP's comparison (its appendix,
"Hyperparameter settings" and "Model heterogeneity"). The paper's text is not among
the repository's copies (/work/shared/papers), so no equation numbers are quoted.

Shapes: C classes, D = ctx.feature_dim. The header is the sub-module named by each
network's `head_module` (fedbus.algorithms.core.split), with the same weights' names and
shapes on every client (a Linear(D, C) in every fedbus network but MP-FedCL's MLP);
names travel without the module prefix (fedbus.algorithms.fedgh.header_weights).

The generator G(eps, y) -> R^D (the code's `Generator`): eps ~ U[0, 1)^noise_dim (both
codes draw torch.rand, whatever their comment says), concatenated with one_hot(y),
Linear(noise_dim + C, H) -> BatchNorm1d(H) -> ReLU -> Linear(H, D). PARAM
`noise_dim` = 32 and PARAM `hidden_dim` = 0 (= D) follow FedTGP's appendix (HtFLlib's
defaults: 512 and 512; the authors' MNIST config: 32 and 256).

Down (task): {"head": {name: float32} the global header, "generator": {name: array}
the generator's state dict (BatchNorm statistics included), "label_dist": float64 [C]
the label prior p(y), "ready": bool (a generator has been trained)}.
Up (update): {"head": {name: float32} the client's header after local training,
"counts": int64 [C] its training-label counts}.

Client (HtFLlib's clientgen.train): replace the header with the global one, then on
every minibatch (x, y)
    loss = CE(head(f(x)), y) + PARAM `gen_weight` * CE(head(G(eps, y')), y'),
y' ~ p(y), as many as the real minibatch, G in eval mode (the authors' code), no
gradient into G. The regulariser is off until the server has trained a generator
(the authors' `regularization = glob_iter > 0`; HtFLlib regularises with the untrained
generator from round 0). gen_weight = 1 (the paper's and HtFLlib's plain sum); the
authors' code weighs it by generative_alpha = 10 decayed 0.98 per round and adds a
latent-matching term (generative_beta), neither of which is implemented here.
Client-side sampling draws from a torch.Generator seeded with the run's seed.

Server, each aggregation (HtFLlib's train_generator, then aggregate_parameters):
- p(y): proportional to the label counts of every client heard from so far (its
  latest counts; HtFLlib's `qualified_labels` over all clients). The generator is
  trained on the labels present in this aggregation's updates.
- PARAM `server_epochs` = 100 (FedTGP's appendix; HtFLlib -se 100) Adam steps
  (betas 0.9, 0.999, no weight decay, a fresh optimiser per aggregation as HtFLlib;
  the authors keep one with weight decay 1e-2 and an lr decay 0.98 per round) at PARAM
  `generator_lr` = 0.1 (FedTGP's appendix; HtFLlib -glr 0.005; the authors' MNIST
  3e-4), each on B = PARAM `server_batch_size` (0 = train.batch_size, as HtFLlib; at
  least 2 for BatchNorm) labels y ~ p(y) restricted to the present labels, eps ~ U.
- the teacher: the received heads, each client k's logits weighted per label by
  a_{y,k} = s_k n_k[y] / sum_j s_j n_j[y] (n_k[y] its count of label y, s_k the engine's
  staleness weight; the authors' `get_label_weights`, staleness added). PARAM
  `teacher`:
    "ensemble" (default; the form of the paper's generator objective and HtFLlib's,
               a CE of the ensemble of the heads' logits, which the paper averages
               with 1/K and HtFLlib weighs by training-set sizes; the per-label
               weights a are the authors' code's):
               CE(sum_k a_{y,k} head_k(G(eps, y)), y);
    "clients"  (the authors' code): sum_k mean_b a_{y_b,k} CE(head_k(G(eps_b, y_b)), y_b).
- plus PARAM `diversity_weight` (default 1, the authors' ensemble_eta; 0 = HtFLlib,
  which has none) times the authors' diversity loss
      exp(-mean_{i,j} mean_d (eps_i - eps_j)^2 * mean_d |G_i - G_j|).
- the global header: the weighted mean of the received heads, sum_k s_k N_k head_k /
  sum_k s_k N_k (N_k the training-set size; HtFLlib's aggregate_parameters, LG-FedAvg
  style), after the generator was trained against the individual heads.
HtFLlib's train_generator trains a copy of the generator it loaded and never saves
it, so its clients always regularise with the initial generator; here the trained
generator is the one that travels (what the method describes).
An aggregation with no update keeps everything (header, generator, p(y), RNG).
Partial work: a client that ran fewer epochs uploads its header as it stands.

Evaluation: both codes evaluate right after sending the global parameters: each
client's own extractor with the global header (HtFLlib) / the global model (the
authors, homogeneous). evaluate() reports "global_head_acc"/"global_head_loss" (the
eval task's header swapped in) and "local_head_acc"/"local_head_loss" (the model as
trained); PARAM `eval_head` = "global" (default, both codes) or "local" picks "acc".

Determinism: the generator's initial weights, the server's labels and noise come from
the server's own torch.Generator seeded with ctx.seed (never the global RNG); its
state, the generator, the header, p(y)'s counts and the ready flag are state_dict().
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
from fedbus.algorithms.core.training import LocalClient, staleness_metrics
from fedbus.algorithms.fedgh import (head_module, header_weights, load_header, score_both_heads,
                                    server_batch_size, server_training_params)


class Generator(nn.Module):
    """G(eps, y): [eps, one_hot(y)] -> Linear -> BatchNorm1d -> ReLU -> Linear -> R^D,
    initialised like PyTorch's defaults but from `generator` when one is given."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, feature_dim: int,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.noise_dim, self.num_classes = int(noise_dim), int(num_classes)
        self.fc1 = nn.Sequential(nn.utils.skip_init(nn.Linear, noise_dim + num_classes, hidden),
                                 nn.BatchNorm1d(hidden), nn.ReLU())
        self.fc = nn.utils.skip_init(nn.Linear, hidden, feature_dim)
        with torch.no_grad():
            for lin in (self.fc1[0], self.fc):
                nn.init.kaiming_uniform_(lin.weight, a=math.sqrt(5), generator=generator)
                bound = 1.0 / math.sqrt(lin.in_features)
                nn.init.uniform_(lin.bias, -bound, bound, generator=generator)

    def forward(self, labels: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        y = F.one_hot(labels, self.num_classes).to(eps.dtype)
        return self.fc(self.fc1(torch.cat((eps, y), dim=1)))


def diversity_loss(eps: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The authors' DiversityLoss('l1'): exp(-mean_ij l2(eps_i, eps_j) * l1(G_i, G_j)),
    l2 the mean squared, l1 the mean absolute difference over the last axis."""
    noise = (eps.unsqueeze(0) - eps.unsqueeze(1)).pow(2).mean(dim=2)
    layer = (out.unsqueeze(0) - out.unsqueeze(1)).abs().mean(dim=2)
    return torch.exp(torch.mean(-noise * layer))


def label_weights(counts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """a [C, K]: a_{y,k} = s_k n_k[y] / sum_j s_j n_j[y] (rows of absent labels: 0).
    counts [K, C], weights s [K]."""
    m = np.asarray(counts, np.float64).T * np.asarray(weights, np.float64)[None, :]
    total = m.sum(axis=1, keepdims=True)
    return np.where(total > 0, m / np.where(total > 0, total, 1.0), 0.0)


def _state(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def _load(module: nn.Module, state: Mapping[str, Any]) -> None:
    own = module.state_dict()
    module.load_state_dict({k: to_tensor(state[k], v.device, v.dtype) for k, v in own.items()})


class FedGenServer(Params, ServerHandler):
    needs_same_head: ClassVar[bool] = True  # the heads are averaged across the group
    PARAMS: ClassVar[dict[str, Any]] = {
        "noise_dim": opt(32, "generator noise dimension (FedTGP's appendix; HtFLlib 512)", min=1),
        "hidden_dim": opt(0, "generator hidden width (0 = feature_dim, FedTGP's appendix)",
                          min=0),
        "generator_lr": opt(0.1, "generator Adam learning rate (FedTGP's appendix; HtFLlib "
                            "0.005)", min=0.0),
        **server_training_params("labels", epochs=(100, "FedTGP's appendix, HtFLlib"),
                                 batch_size=(0, "as HtFLlib; at least 2"), sampled=True),
        "teacher": opt("ensemble", "generator loss: ensemble = CE of the label-weighted "
                       "ensemble of the heads' logits (paper, HtFLlib); clients = sum of "
                       "the heads' label-weighted CEs (authors' code)",
                       choices=("ensemble", "clients")),
        "diversity_weight": opt(1.0, "weight of the diversity loss (authors' code 1; HtFLlib "
                                "0)", min=0.0),
        "gen_weight": opt(1.0, "weight of the clients' CE on generated features (paper, "
                          "HtFLlib: 1)", min=0.0),
        "eval_head": opt("global", "acc scores: global = own extractor with the global header "
                         "(both codes); local = the model as trained",
                         choices=("global", "local")),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        c, d = ctx.num_classes, ctx.feature_dim
        self.gen = torch.Generator().manual_seed(int(ctx.seed))
        self.generator = Generator(int(self.param("noise_dim")), c,
                                   int(self.param("hidden_dim")) or d, d, self.gen)
        template = head_module(ctx.make_model(0))
        self.header = header_weights(template)
        self._head_module = template.cpu().float().eval()  # the teacher heads' vessel
        self.client_counts: dict[int, np.ndarray] = {}
        self.ready = False
        self._gen_state = _state(self.generator)

    def label_dist(self) -> np.ndarray:
        if not self.client_counts:
            return np.full(self.ctx.num_classes, 1.0 / self.ctx.num_classes)
        total = np.sum(list(self.client_counts.values()), axis=0).astype(np.float64)
        return total / total.sum() if total.sum() > 0 else \
            np.full(self.ctx.num_classes, 1.0 / self.ctx.num_classes)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"head": self.header, "generator": self._gen_state,
                "label_dist": self.label_dist(), "ready": self.ready}

    # -- the generator -------------------------------------------------------------------
    def teacher_logits(self, z: torch.Tensor,
                       heads: list[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """[K, B, C]: every received head applied to z (gradients flow to z only)."""
        return torch.stack([torch.func.functional_call(self._head_module, dict(h), (z,))
                            for h in heads])

    def generator_loss(self, labels: torch.Tensor, eps: torch.Tensor,
                       heads: list[Mapping[str, torch.Tensor]],
                       weights: torch.Tensor) -> torch.Tensor:
        """Teacher loss + diversity_weight * diversity loss on one batch; weights [C, K]."""
        z = self.generator(labels, eps)
        logits = self.teacher_logits(z, heads)  # [K, B, C]
        a = weights[labels].T.unsqueeze(2)  # [K, B, 1]
        if self.param("teacher") == "ensemble":
            loss = F.cross_entropy((a * logits).sum(0), labels)
        else:
            ce = torch.stack([F.cross_entropy(lg, labels, reduction="none") for lg in logits])
            loss = (a.squeeze(2) * ce).mean(dim=1).sum()
        eta = float(self.param("diversity_weight"))
        if eta > 0:
            loss = loss + eta * diversity_loss(eps, z)
        return loss

    def train_generator(self, heads: list[Mapping[str, Any]], weights: np.ndarray,
                        present: np.ndarray) -> float:
        """server_epochs Adam steps of the generator against the received heads (wire
        arrays, {name: array}); weights [C, K] = label_weights; returns the last loss."""
        heads = [{k: torch.tensor(np.asarray(v), dtype=torch.float32) for k, v in h.items()}
                 for h in heads]
        steps = int(self.param("server_epochs"))
        bs = max(2, server_batch_size(self))
        p = torch.from_numpy(self.label_dist() * present)
        if float(p.sum()) <= 0:  # labels known only from these updates' counts
            p = torch.from_numpy(present.astype(np.float64))
        w = torch.from_numpy(weights.astype(np.float32))
        optimizer = torch.optim.Adam(self.generator.parameters(),
                                     lr=float(self.param("generator_lr")), betas=(0.9, 0.999))
        self.generator.train()
        last = float("nan")
        for _ in range(steps):
            labels = torch.multinomial(p, bs, replacement=True, generator=self.gen)
            eps = torch.rand(bs, self.generator.noise_dim, generator=self.gen)
            loss = self.generator_loss(labels, eps, heads, w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            last = loss.item()
        self.generator.eval()
        return last

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        if not updates:
            return metrics
        counts = np.stack([np.asarray(u.payload["counts"], np.int64) for u in updates])
        for u, n in zip(updates, counts):
            self.client_counts[int(u.client)] = n.copy()
        s = np.array([float(u.weight) for u in updates])
        heads = [u.payload["head"] for u in updates]
        present = counts.sum(axis=0) > 0
        if present.any() and int(self.param("server_epochs")) > 0:
            metrics["generator_loss"] = self.train_generator(heads, label_weights(counts, s),
                                                             present.astype(np.float64))
            self._gen_state = _state(self.generator)
            self.ready = True
        coefs = s * np.array([float(u.num_samples) for u in updates])
        if coefs.sum() > 0:
            self.header = {k: (sum(c * np.asarray(h[k], np.float64) for c, h in zip(coefs, heads))
                               / coefs.sum()).astype(np.asarray(self.header[k]).dtype)
                           for k in self.header}
        metrics["classes_received"] = float(present.sum())
        return metrics

    def update_spec(self) -> dict[str, Any]:
        return {"head": {k: (np.asarray(v).dtype.name, tuple(np.shape(v)))
                         for k, v in self.header.items()},
                "counts": ("int64", (self.ctx.num_classes,))}

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"head": {k: np.array(v, copy=True) for k, v in self.header.items()},
                "generator": {k: v.copy() for k, v in self._gen_state.items()},
                "rng": self.gen.get_state().numpy().copy(),
                "client_counts": {str(k): v.copy() for k, v in self.client_counts.items()},
                "ready": bool(self.ready)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.header = {k: np.array(v, copy=True) for k, v in state["head"].items()}
        _load(self.generator, state["generator"])
        self._gen_state = _state(self.generator)
        self.gen.set_state(torch.from_numpy(np.array(state["rng"], dtype=np.uint8, copy=True)))
        self.client_counts = {int(k): np.array(v, dtype=np.int64, copy=True)
                              for k, v in state["client_counts"].items()}
        self.ready = bool(state["ready"])


class FedGenClient(LocalClient):
    """CE + gen_weight * CE of the head on generated features; uploads its header and
    its label counts."""

    PARAMS: ClassVar[dict[str, Any]] = FedGenServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        c, d = ctx.num_classes, ctx.feature_dim
        self.generator = Generator(int(self.param("noise_dim")), c,
                                   int(self.param("hidden_dim")) or d, d).to(ctx.device).eval()
        for p in self.generator.parameters():
            p.requires_grad_(False)
        self.counts = torch.bincount(ctx.train_y.cpu(), minlength=c).numpy().astype(np.int64)
        self.gen_weight = float(self.param("gen_weight"))
        self.eval_global = self.param("eval_head") == "global"
        self._reg = False
        self._p: torch.Tensor | None = None
        self._rng: torch.Generator | None = None

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        loss = F.cross_entropy(model.head(model.features(x)), y)
        if self._reg:
            labels = torch.multinomial(self._p, len(y), replacement=True, generator=self._rng)
            eps = torch.rand(len(y), self.generator.noise_dim, generator=self._rng)
            labels, eps = labels.to(self.ctx.device), eps.to(self.ctx.device)
            with torch.no_grad():
                z = self.generator(labels, eps)
            loss = loss + self.gen_weight * F.cross_entropy(model.head(z), labels)
        return loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        load_header(head_module(self.ctx.model), task["head"])
        _load(self.generator, task["generator"])
        self.generator.eval()
        self._p = to_tensor(task["label_dist"], "cpu", torch.float64)
        self._reg = bool(task["ready"]) and self.gen_weight > 0 and float(self._p.sum()) > 0
        self._rng = torch.Generator().manual_seed(int(run.seed) + 1)
        try:
            self.run_local(run)
        finally:
            self._reg, self._p, self._rng = False, None, None
        head = {k: v.astype(np.float32) if v.dtype == np.float64 else v
                for k, v in header_weights(head_module(self.ctx.model)).items()}
        return {"head": head, "counts": self.counts.copy()}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        return score_both_heads(self.ctx, task["head"], self.eval_global)


ALGORITHM = Algorithm("fedgen", FedGenServer, FedGenClient,
                      "FedGen (Zhu et al. 2021): a server generator distils the clients' heads "
                      "into features; heads averaged")

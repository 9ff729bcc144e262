"""FML: Federated Mutual Learning.

Shen, Wang, Lv, Zheng, Wu, Xiao, Liu, "Federated Mutual Learning",
arXiv:2006.16765, 2020. Reference code: TsingZ0/HtFLlib
system/flcore/clients/clientfml.py, system/flcore/servers/serverfml.py.

Each client k keeps its private "local" model (ctx.model; any architecture of
the model group) and a copy of the shared "meme" model (the auxiliary model of
the section below: PARAM `shared_arch`, by default the smallest
architecture of the federation, as FedTGP's appendix chose for FML). On every
minibatch both models step (deep mutual learning; the paper's L_local and
L_meme):

    L_local = alpha * CE(y, p_local) + (1 - alpha) * KL(p_meme || p_local)
    L_meme  = beta  * CE(y, p_meme)  + (1 - beta)  * KL(p_local || p_meme)

p = softmax of the logits. In each KL the other model's distribution is the
target and is detached, so L_local trains only the local model and L_meme only
the meme model (deep mutual learning's alternating updates, made simultaneous;
the reference code does not detach, so its backward of L_local also pushes the
meme model toward the local one and vice versa). Two optimisers with the
[train] settings (the reference: two SGDs at the client learning rate); one
step of each per minibatch. Both are built by ctx.make_optimizer, so both start every
task empty (train.optimizer_state = "fresh", default) or carry their momentum over
("persist"); HtFLlib's clientFML builds its SGDs once but without momentum, so they hold
no state between rounds: "fresh" is its behaviour at any momentum.

PARAMS:
- alpha = 0.5, beta = 0.5: FedTGP's appendix ("we set its knowledge distillation
  hyperparameters alpha = 0.5 and beta = 0.5", following the FML paper); HtFLlib's
  main.py defaults are alpha = beta = 1.0 (pure cross-entropy, no mutual
  distillation): pass 1.0 to reproduce them.
- kl = "batchmean" (default; the KL divergence per sample, averaged, as the paper
  writes it) or "mean" (the reference code's nn.KLDivLoss() default, averaged over
  batch x classes: the KL term is C times smaller).
- clip_grad = 0 (off; the paper does not clip); the reference code clips each
  model's gradient norm at 10 ("prevent divergency"): clip_grad = 10.
- shared_arch = "smallest" (see below).

Communication:
- task (down): {"weights": {name: array}}, the global meme model's full state dict
  (float32 weights, integer buffers as they are);
- update (up): {"delta": {name: array}}, the trained meme model minus the weights
  of the task it answered (same names, dtypes and shapes); the local model never
  leaves the client.
Server: the meme model's FedAvg, w <- w + sum_k s_k n_k delta_k / sum_k s_k n_k
(s_k the engine's staleness weight, n_k the client's training-set size;
fedbus.algorithms.core.weights). The reference averages uniformly over the uploaded
clients (1/|S|); with equal-sized clients and no staleness the two agree, and
the sample weighting is FedAvg's, which FML builds on. An empty aggregation
keeps the meme model. Partial work (fewer steps than asked) uploads its delta
like any other: every step trained both models.

Evaluation: the local model's head ("acc", "loss": the model FML personalises
and the papers score), plus "aux_acc"/"aux_loss" for the global meme model of
the eval task on the same test split.

The auxiliary model, shared with FedKD (fedbus.algorithms.fedkd imports it from here)
------------------------------------------------------------------------------------
FML's "meme" model and FedKD's "mentee" (student) are one network that every
client trains beside its own (possibly heterogeneous) model and that the server
averages. Which network: FedTGP's appendix ("Model heterogeneity"): "we choose
the smallest model in any given model group to be the auxiliary model for FedKD
and FML" (HtFLlib's default `global_model` is the 4-layer CNN, fedbus "cnn4").

PARAM `shared_arch`:
    "smallest" (default; FedTGP): the member of ctx.archs (the federation's distinct
               architectures, client order) with the fewest trainable parameters,
               ties to the first;
    an arch name of the registry ("cnn4", "cnn:18", "resnet8", ...): that network,
               whether or not a client runs it.
The network comes from ctx.build_arch(arch): this federation's input shape,
classes and common feature dim, seeded with the federation seed, so the server
and every client build bit-identical initial weights without sending them.
Handlers built by hand (unit tests) must supply `archs` and `build_arch` in
their contexts: a client cannot rebuild the server's network from its own model
when the federation is heterogeneous, so there is no silent fallback.

Also here: the KL term both methods distil with (PARAM `kl`), the optional
gradient clipping of the reference code (PARAM `clip_grad`), `AuxServer` (the
sample- and staleness-weighted average of auxiliary-model deltas, FML's whole
server and FedKD's base) and `AuxClient` (the auxiliary model, its optimiser and
its checkpoint beside the client's own).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (LocalRun, RoundInfo, ServerHandler, load_weights,
                                             model_weights, weight_delta)
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.training import LocalClient
from fedbus.algorithms.core.weights import weights_spec
from fedbus.algorithms.fedavg import FedAvgServer, swapped_weights

SHARED_ARCH = opt("smallest", "the auxiliary (shared) model: smallest = the federation's "
                  "architecture with the fewest trainable parameters (FedTGP's appendix), or "
                  "a registry arch name (cnn4 = HtFLlib's default global_model)")
KL = opt("batchmean", "KL reduction: batchmean = the per-sample KL divergence averaged over "
         "the batch (the papers' KL); mean = nn.KLDivLoss()'s default in the reference code "
         "(averaged over batch x classes, i.e. batchmean / C)", ("batchmean", "mean"))
CLIP_GRAD = opt(0.0, "clip each model's gradient norm to this before its step (0 = off, the "
                "papers; HtFLlib clips at 10)", min=0.0)


def count_trainable(build: Callable[[str], torch.nn.Module], arch: str) -> int:
    """Trainable parameters of build(arch), built on the meta device (no memory, no
    initialisation cost) where the constructor allows, else on the CPU."""
    try:
        with torch.device("meta"):
            model = build(arch)
    except (NotImplementedError, RuntimeError, TypeError, ValueError):  # needs real tensors
        model = build(arch)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def choose_arch(choice: str, archs: tuple[str, ...] | list[str],
                build: Callable[[str], torch.nn.Module]) -> str:
    """The auxiliary model's arch: `choice` itself (checked against the registry), or for
    "smallest" the member of `archs` with the fewest trainable parameters (ties: the first)."""
    if choice != "smallest":
        from fedbus.models.registry import parse_arch

        try:
            parse_arch(choice)
        except (TypeError, ValueError) as err:
            raise ValueError(f"algorithm.shared_arch = {choice!r}: {err}") from None
        return choice
    if not archs:
        raise ValueError("shared_arch = 'smallest' needs the federation's architectures "
                         "(ctx.archs is empty)")
    best, best_n = None, None
    for arch in archs:
        n = count_trainable(build, arch)
        if best_n is None or n < best_n:
            best, best_n = arch, n
    return best


def build_aux(ctx: Any, choice: str, algorithm: str) -> tuple[str, torch.nn.Module]:
    """(arch, network) of the auxiliary model for a server or client context, on the CPU."""
    if ctx.build_arch is None:
        raise ValueError(f"{algorithm} trains a shared auxiliary model and needs the context's "
                         f"build_arch (and archs for shared_arch = 'smallest'); the node "
                         f"provides them, a hand-built context must pass archs= and "
                         f"build_arch=")
    arch = choose_arch(choice, tuple(ctx.archs), ctx.build_arch)
    return arch, ctx.build_arch(arch)


def kl_div(log_p: torch.Tensor, log_q_target: torch.Tensor, reduction: str) -> torch.Tensor:
    """KL(q || p) from log-probabilities, the target q as given (detach it first to
    make it a fixed teacher): "batchmean" = sum over classes, mean over samples;
    "mean" = mean over all entries (nn.KLDivLoss()'s default)."""
    kl = F.kl_div(log_p, log_q_target, reduction="batchmean", log_target=True)
    if reduction == "mean":  # batch x classes; computed so, PyTorch's "mean" is deprecated
        return kl / log_p.shape[1]
    if reduction != "batchmean":
        raise ValueError(f"kl reduction {reduction!r}: batchmean or mean")
    return kl


class AuxServer(FedAvgServer):
    """FedAvg over the auxiliary model only: the global auxiliary weights, w <- w + sum_k
    c_k delta_k / sum_k c_k, c_k = staleness weight x training-set size (FedAvgServer's
    rule, task, spec and checkpoint). The clients' own networks may differ."""

    PARAMS: ClassVar[dict[str, Any]] = {}
    needs_same_model: ClassVar[bool] = False
    algorithm: ClassVar[str] = "aux"

    def __init__(self, ctx):
        # Not FedAvgServer.__init__: its weights would be client 0's network.
        ServerHandler.__init__(self, ctx)
        self.arch, model = build_aux(ctx, self.param("shared_arch"), self.algorithm)
        self.weights: dict[str, np.ndarray] = model_weights(model)
        self._weights_spec = weights_spec(self.weights)

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return self.make_task(client, info)  # FedKD's task is its compressed downlink

    def global_weights(self) -> None:
        """None: the global model FFD would read is the clients' own architecture, and the
        auxiliary model is another network."""
        return None


class AuxClient(LocalClient):
    """A client's own model (ctx.model, self.optimizer) plus the auxiliary model
    (self.aux, self.aux_optimizer, the [train] optimiser settings at `aux_lr`)."""

    PARAMS: ClassVar[dict[str, Any]] = {}
    algorithm: ClassVar[str] = "aux"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.arch, aux = build_aux(ctx, self.param("shared_arch"), self.algorithm)
        self.aux = aux.to(ctx.device)
        self.aux_optimizer = ctx.make_optimizer(self.aux.parameters())
        aux_lr = self.aux_lr()
        if aux_lr:
            for group in self.aux_optimizer.param_groups:
                group["lr"] = float(aux_lr)
        self.kl = self.param("kl")
        self.clip = float(self.param("clip_grad"))

    def aux_lr(self) -> float | None:
        """The auxiliary model's learning rate; None = train.lr."""
        return None

    def clip_grads(self, *modules: torch.nn.Module) -> None:
        if self.clip > 0:
            for m in modules:
                torch.nn.utils.clip_grad_norm_(m.parameters(), self.clip)

    def aux_metrics(self, weights: Mapping[str, Any]) -> dict[str, float]:
        """aux_acc / aux_loss of the auxiliary model with `weights` on the test split."""
        ctx = self.ctx
        with swapped_weights(self.aux, weights):
            m = head_metrics(self.aux, ctx.test_x, ctx.test_y)
        return {"aux_acc": m["acc"], "aux_loss": m["loss"]}

    def extra_state(self) -> dict[str, Any]:
        return {"aux": self.aux.state_dict(), "aux_optimizer": self.aux_optimizer.state_dict()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.aux.load_state_dict(state["aux"])
        self.aux_optimizer.load_state_dict(state["aux_optimizer"])



def fml_losses(logits_local: torch.Tensor, logits_meme: torch.Tensor, y: torch.Tensor,
               alpha: float, beta: float, kl: str = "batchmean"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_local, L_meme) of one minibatch; each KL's target (the other model) detached."""
    logp_l = F.log_softmax(logits_local, dim=1)
    logp_m = F.log_softmax(logits_meme, dim=1)
    loss_local = (alpha * F.cross_entropy(logits_local, y)
                  + (1 - alpha) * kl_div(logp_l, logp_m.detach(), kl))
    loss_meme = (beta * F.cross_entropy(logits_meme, y)
                 + (1 - beta) * kl_div(logp_m, logp_l.detach(), kl))
    return loss_local, loss_meme


class FMLServer(AuxServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "alpha": opt(0.5, "weight of the local model's cross-entropy; 1 - alpha weights its "
                     "KL to the meme model (FedTGP/FML: 0.5; HtFLlib's default 1.0)",
                     min=0.0, max=1.0),
        "beta": opt(0.5, "weight of the meme model's cross-entropy; 1 - beta weights its KL "
                    "to the local model (FedTGP/FML: 0.5; HtFLlib's default 1.0)",
                    min=0.0, max=1.0),
        "shared_arch": SHARED_ARCH,
        "kl": KL,
        "clip_grad": CLIP_GRAD,
    }
    algorithm: ClassVar[str] = "fml"


class FMLClient(AuxClient):
    PARAMS: ClassVar[dict[str, Any]] = FMLServer.PARAMS
    algorithm: ClassVar[str] = "fml"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.alpha = float(self.param("alpha"))
        self.beta = float(self.param("beta"))

    def run_mutual(self, run: LocalRun) -> float:
        """One step of each model per minibatch; returns the mean L_local + L_meme."""
        model, meme = self.ctx.model, self.aux
        model.train()
        meme.train()
        total, steps = 0.0, 0
        for x, y in run.batches():
            self.optimizer.zero_grad(set_to_none=True)
            self.aux_optimizer.zero_grad(set_to_none=True)
            loss_l, loss_m = fml_losses(model.head(model.features(x)),
                                        meme.head(meme.features(x)), y,
                                        self.alpha, self.beta, self.kl)
            # the detached targets keep the two graphs apart: one backward serves both
            (loss_l + loss_m).backward()
            self.clip_grads(model, meme)
            self.optimizer.step()
            self.aux_optimizer.step()
            total += loss_l.item() + loss_m.item()
            steps += 1
        self.last_loss = total / steps if steps else float("nan")
        return self.last_loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        load_weights(self.aux, task["weights"])
        self.run_mutual(run)
        return {"delta": weight_delta(self.aux, task["weights"])}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        out.update(self.aux_metrics(task["weights"]))
        return out


ALGORITHM = Algorithm("fml", FMLServer, FMLClient,
                      "FML (Shen et al. 2020): mutual learning with a shared averaged meme model")

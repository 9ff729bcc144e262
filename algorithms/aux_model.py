"""The small shared auxiliary model of FML and FedKD, and what the two share.

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

from fedbus.algorithms.base import RoundInfo, ServerHandler, head_metrics, model_weights
from fedbus.algorithms.fedavg import FedAvgServer, swapped_weights
from fedbus.algorithms.local import LocalClient, opt
from fedbus.algorithms.weights import weights_spec

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

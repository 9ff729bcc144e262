"""DP-SGD for local training (privacy.dp = "sgd"), with Opacus.

What is protected: one training sample of one client (add-or-remove), in everything the
client's training produces: the weights it ends with, so the weight delta it uploads and
all the server makes of it (aggregation is post-processing). For algorithms whose upload
is a weight delta trained by `LocalClient.run_local` (fedavg, fedprox: fedbus.node.privacy.dp's
dp_levels admits "sgd" wherever "client" is declared).

The mechanism, per local step (Abadi et al., "Deep Learning with Differential Privacy",
CCS 2016), all of it Opacus's:
- the batch is Poisson-sampled: each of the client's n training samples is taken
  independently with probability q = b / n, b = min(train.batch_size, n) the expected
  batch size (`opacus.utils.uniform_sampler.UniformWithReplacementSampler`), so a batch may
  be of any size, empty included. The number of steps is LocalRun's: epochs x
  ceil(n / batch_size) (fewer under partial work or a time budget); the fixed-size
  minibatches LocalRun draws only count the steps and are not used;
- per-sample gradients are recorded by `opacus.GradSampleModule`'s hooks on the model's
  layers (ctx.model itself is hooked, so `model.features` and `model.head`, called by
  batch_loss, are seen like a call through the wrapper);
- `opacus.optimizers.DPOptimizer` clips each sample's gradient (all parameters together) to
  L2 norm C = privacy.dp_clip, sums them, adds N(0, (z C)^2) per coordinate
  (z = privacy.dp_noise_multiplier) and divides by b; the client's own optimizer (SGD with
  the [train] momentum and weight decay: post-processing) then steps.
The upload is the ordinary delta; the server aggregates it as usual (sample-weighted).

Accounting (the server's, fedbus.node.privacy.budget; `task_sampling`): each task a client is sent
is epochs x ceil(n / batch_size) steps of PoissonSampled(q, Gaussian(z)), charged in full
when the task goes out (partial work or a drop-out pays the same), composed per client over
its tasks; the run's epsilon is the largest client's; target_epsilon stops sampling a
client whose next task would pass it.

Terms of batch_loss that reach the parameters other than through the model's layers
(FedProx's proximal term mu/2 ||w - w_t||^2): Opacus's optimizer replaces each parameter's
gradient with the noised sum of the clipped per-sample gradients, which such a term is not
part of, so it would be dropped. `DPSGD.step` computes their gradient apart: batch_loss on
an empty batch with the layers' parameters detached, so only those terms have a gradient
and no training sample is touched; it is added to the noised gradient before the step
(post-processing: it depends on the weights and the task only).

The model: wrapped per task (hooks added, then removed with every attribute Opacus put on
the parameters), so the node's pool packs and restores the handler as ever and the
state_dict keys never change. In-place activations (nn.ReLU(inplace=True)) are switched
off for the task and restored after: Opacus's backward hooks cannot see through them.
Models Opacus cannot train privately (BatchNorm: a sample's output depends on its batch)
are refused with one line (`model_refusal`); the network must accept an empty batch.

Seeds: the batches and the noise come from the task seed (mixed with a tag), so a client's
task is reproducible (`fedbus replay --client`). The task seed is chosen by the server
and derived from federation.seed, which every node's config holds: whoever knows it can
recompute the noise of every step and the batches, which voids the guarantee against
them. privacy.dp_noise = "secret" (the default) draws both from the operating system's
entropy instead
(a secret of the client's; its training is then not reproducible).
"""
from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["DPSGD", "model_refusal", "run_dp_sgd", "task_sampling"]

_SGD_TAG = 0xD95D  # mixed into the task seed: DP-SGD's streams are its own


def task_sampling(n: int, batch_size: int, epochs: int) -> tuple[float, int]:
    """(q, steps) of one DP-SGD task on a client with n training samples: the Poisson
    sampling rate q = min(batch_size, n) / n and the most steps it takes, epochs x
    ceil(n / batch_size) (LocalRun's). A client without samples takes no step: (1.0, 0)."""
    n, batch_size, epochs = int(n), int(batch_size), int(epochs)
    if batch_size < 1 or epochs < 0 or n < 0:
        raise ValueError(f"need n >= 0, batch_size >= 1, epochs >= 0; got {n}, {batch_size}, "
                         f"{epochs}")
    if n == 0:
        return 1.0, 0
    return min(batch_size, n) / n, epochs * math.ceil(n / batch_size)


def model_refusal(model: nn.Module) -> str | None:
    """One line on why Opacus cannot train `model` with DP-SGD (BatchNorm, ...), or None."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return None
    first = str(errors[0]).split(". ")[0]
    return (f"privacy.dp = sgd: {type(model).__name__} cannot be trained with DP-SGD "
            f"({len(errors)} module(s); {first}); choose an arch Opacus supports, without "
            "BatchNorm (cnn, cnn4, mlp, mlp-fedcl)")


def _seeds(seed: int, secret: bool) -> tuple[int, int]:
    """Seeds of the batch sampler and of the noise: from the task seed, or the OS."""
    if secret:
        return secrets.randbits(63), secrets.randbits(63)
    a, b = np.random.SeedSequence([int(seed) & (2**63 - 1), _SGD_TAG]).generate_state(
        2, dtype=np.uint64)
    return int(a) & (2**63 - 1), int(b) & (2**63 - 1)


class _LossCall(nn.Module):
    """The model as a submodule and a loss over it as forward: what
    torch.func.functional_call needs to run batch_loss with the layers' parameters
    replaced."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(x, y)


class DPSGD:
    """One task's DP-SGD over `model` and its `optimizer` (module doc); a context manager:
    entering hooks the model and wraps the optimizer, leaving undoes both.

        with DPSGD(model, optimizer, clip=C, noise_multiplier=z, expected_batch_size=b,
                   generator=g) as dp:
            loss = dp.step(batch_loss, x, y)   # one DP-SGD step on a Poisson batch
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, clip: float,
                 noise_multiplier: float, expected_batch_size: int,
                 generator: torch.Generator | None = None, secure_mode: bool = False):
        clip, z = float(clip), float(noise_multiplier)
        if not (clip > 0 and math.isfinite(clip)):
            raise ValueError(f"clip must be positive and finite, got {clip}")
        if not (z >= 0 and math.isfinite(z)):
            raise ValueError(f"noise multiplier must be non-negative and finite, got {z}")
        if int(expected_batch_size) < 1:
            raise ValueError(f"expected batch size must be >= 1, got {expected_batch_size}")
        why = model_refusal(model)
        if why is not None:
            raise ValueError(why)
        self.model, self.base_optimizer = model, optimizer
        self.clip, self.z, self.expected_batch_size = clip, z, int(expected_batch_size)
        self.generator = generator
        # Opacus's secure_mode: each noise value the sum of four Gaussians, halved (Holohan
        # and Braghin 2021 s5.1), against the floating-point attacks that read one
        # Gaussian's low bits (Mironov 2012; Jin et al. 2022): node/privacy/dp.py's rule
        self.secure_mode = bool(secure_mode)
        self.gsm = None
        self.optimizer = None  # the DPOptimizer, while entered
        self._inplace: list[tuple[nn.Module, bool]] = []
        self._direct: bool | None = None  # does batch_loss use parameters directly?

    def __enter__(self) -> "DPSGD":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self._inplace = [(m, m.inplace) for m in self.model.modules()
                         if isinstance(getattr(m, "inplace", None), bool)]
        for m, _ in self._inplace:
            m.inplace = False
        try:
            self.gsm = GradSampleModule(self.model, batch_first=True, loss_reduction="mean",
                                        strict=True)
            self.gsm.forbid_grad_accumulation()  # a step after every backward (Poisson)
            self.optimizer = DPOptimizer(self.base_optimizer, noise_multiplier=self.z,
                                         max_grad_norm=self.clip,
                                         expected_batch_size=self.expected_batch_size,
                                         loss_reduction="mean", generator=self.generator,
                                         secure_mode=self.secure_mode)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.gsm is not None:
            self.gsm.remove_hooks()
            self.gsm = None
        self.optimizer = None
        for p in self.model.parameters():
            for attr in ("grad_sample", "summed_grad", "_forward_counter",
                         "_current_grad_sample"):
                if hasattr(p, attr):
                    delattr(p, attr)
        for m in self.model.modules():
            for attr in ("activations", "max_batch_len"):
                if attr in vars(m):
                    delattr(m, attr)
        for m, inplace in self._inplace:
            m.inplace = inplace
        self._inplace = []

    def _direct_grads(self, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor,
                      y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradient of the terms of loss_fn that use the parameters other than through
        the model's layers (FedProx's proximal term), per parameter that has one: loss_fn
        on an empty batch with every layer parameter detached (module doc). Asked on the
        first step; a loss without such terms is not asked again."""
        if self._direct is False:
            return []
        params = [p for p in self.optimizer.params if p.requires_grad]
        detached = {f"model.{k}": v.detach() for k, v in self.model.named_parameters()}
        device = x.device
        self.gsm.disable_hooks()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    torch.enable_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the empty batch's nan mean, hook notes
                probe = torch.func.functional_call(_LossCall(self.model, loss_fn), detached,
                                                   (x[:0], y[:0]), strict=False)
        finally:
            self.gsm.enable_hooks()
        if self._direct is None:
            self._direct = bool(probe.requires_grad)
        if not probe.requires_grad:
            return []
        grads = torch.autograd.grad(probe, params, allow_unused=True)
        out = [(p, g) for p, g in zip(params, grads) if g is not None]
        if not all(bool(torch.isfinite(g).all()) for _, g in out):
            raise ValueError("privacy.dp = sgd: a term of the loss that uses the parameters "
                             "outside the model's layers is not finite on an empty batch "
                             "(it must not depend on the training batch)")
        return out

    def step(self, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor,
             y: torch.Tensor) -> float:
        """One DP-SGD step on the batch (x, y) (any size, empty included): loss_fn(x, y)'s
        per-sample gradients clipped and noised by Opacus, plus the exact gradient of its
        parameter-only terms, then the optimizer's step. Returns the batch's loss (nan for
        an empty batch)."""
        if self.optimizer is None:
            raise RuntimeError("DPSGD.step outside its `with` block")
        self.optimizer.zero_grad(set_to_none=True)  # also clears grad_sample, summed_grad
        direct = self._direct_grads(loss_fn, x, y)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook")
            loss = loss_fn(x, y)
            loss.backward()
        if self.optimizer.pre_step():  # Opacus: clip per sample, sum, noise, / b
            for p, g in direct:
                p.grad.add_(g)
            self.optimizer.original_optimizer.step()
        return float(loss.item()) if len(x) else float("nan")


def _poisson_indices(n: int, q: float, generator: torch.Generator) -> Iterator[list[int]]:
    """Poisson batches of indices from Opacus's sampler, without end (each pass over the
    sampler draws fresh masks from the same generator)."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    sampler = UniformWithReplacementSampler(num_samples=n, sample_rate=q, generator=generator)
    while True:
        yield from sampler


def _poisson(ctx: Any, run: Any, q: float, generator: torch.Generator
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One Poisson batch per step LocalRun counts (its own minibatch is not used), with
    run.work.samples the samples really drawn."""
    n = len(ctx.train_y)
    draws = _poisson_indices(n, q, generator) if n else iter(())
    for x_fixed, _ in run.batches():
        idx = torch.tensor(next(draws), dtype=torch.long).to(ctx.device)
        run.work.samples += len(idx) - len(x_fixed)  # LocalRun adds the fixed batch's
        yield ctx.train_x.index_select(0, idx), ctx.train_y.index_select(0, idx)


def run_dp_sgd(handler: Any, run: Any) -> float:
    """LocalClient.run_local under privacy.dp = "sgd": handler.batch_loss trained with
    DP-SGD (module doc) through handler.optimizer over Poisson batches, one step per step
    of `run`. Returns the mean loss over the non-empty batches (nan without one)."""
    ctx = handler.ctx
    privacy = ctx.extra["privacy"]
    n = len(ctx.train_y)
    q, _ = task_sampling(n, int(ctx.train["batch_size"]), run.epochs)
    secret = privacy.get("dp_noise", "secret") == "secret"
    sample_seed, noise_seed = _seeds(run.seed, secret)
    sampler_gen = torch.Generator().manual_seed(sample_seed)
    noise_gen = torch.Generator(device=ctx.device).manual_seed(noise_seed)
    ctx.model.train()
    total, count = 0.0, 0
    with DPSGD(ctx.model, handler.optimizer, clip=float(privacy["dp_clip"]),
               noise_multiplier=float(privacy["dp_noise_multiplier"]),
               expected_batch_size=max(1, min(int(ctx.train["batch_size"]), n)),
               generator=noise_gen, secure_mode=secret) as dp:
        for x, y in _poisson(ctx, run, q, sampler_gen):
            loss = dp.step(handler.batch_loss, x, y)
            if len(x):
                total += loss
                count += 1
    return total / count if count else float("nan")

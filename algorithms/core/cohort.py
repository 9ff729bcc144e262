"""Cohort training: several clients of one architecture trained as one vectorised cohort.

A node that holds, in one round, tasks for K clients of one architecture and algorithm can
train them together: their trainable parameters are stacked along a leading client axis, one
`torch.func.vmap` forward computes every client's loss on its own minibatch per step, torch's
autograd takes the gradient of their sum (each client's parameters reach only its own loss,
so each gets its own gradient), and one stacked SGD update follows. For a small model
most of a sequential step is per-call overhead, not arithmetic, so K clients cost little
more than one (docs/PERFORMANCE.md: the synthetic MLP setting).

A step is computed one of two ways:
- an affine chain (a network that declares itself one, ProtoNet.affine_chain: the mlps):
  its layers run as batched matrix products over the stacked weights, the chain's backward
  written out (_chain_grads), and the loss's gradient in the features and logits written
  out too for the built-in losses (cross-entropy, FedProx's, FedProto's "mse": no autograd
  in the step at all), else by autograd through the loss alone (its batched twin, or
  vmapped); with plain SGD (no momentum, no weight decay, one rate) each step goes into the
  weights in place. On the 2-core CPU this is what makes a cohort pay: vmap's per-op
  batching, functional_call and autograd's engine cost more than the arithmetic of a small
  model (docs/PERFORMANCE.md);
- any other supported network: the vmapped functional_call forward above.

What stays each client's own, exactly as `LocalClient.run_local` would do it alone:
- its minibatches: each client's `LocalRun.batch_indices()` generator is advanced once per
  cohort step (the rows of every client's batch gathered at once from their training sets),
  so its seed, sample order, partial work (`epochs_to_run`), time budget and work record
  (`run.work`) are the sequential run's own; a generator that ends takes its client out of
  the stack for the rest of the cohort;
- its optimizer: plain SGD (torch.optim.SGD semantics: weight decay added to the gradient,
  momentum buffer b <- m b + g, p <- p - lr b; no dampening, no Nesterov) with the client's
  own lr (after train.lr_decay), momentum and weight decay, read from its optimizer after
  `start_local_run`, and its own momentum buffers (fresh: zero, which gives torch's first
  step b = g exactly; persist: the buffers its optimizer holds);
- its loss: the handler's `functional_loss()` (the hook below), with its own constants
  (FedProx's anchor, FedProto's global prototypes).

Masking, not padding into wrong updates: a client whose run yields no more batches (it
finished its epochs, its partial work or its budget; unequal data sizes) leaves the stack:
its parameters and momentum buffers are set aside as they are and no later step computes
anything for it (compaction rather than a `torch.where` mask, so a cohort of unequal
clients costs the sum of their steps, not K times the longest run's: measured 4x slower
than one by one on power-law sizes with a mask).

Unequal batch sizes (a client's last batch of an epoch): every client's batch is padded to
train.batch_size rows with a per-sample weight w (1 real, 0 padding), and the functional
losses are weighted means, sum(w l) / sum(w), which equal the unpadded mean (padding rows
add exact zeros to the sums and to the gradients). Chosen over grouping the steps by batch
shape because a step stays one vmap call whatever the clients' sizes (with unequal sizes
nearly every step has some client at its last batch), and because each client's shapes then
never depend on which other clients share its cohort. A consequence: batch statistics would
see the padding, so models with buffers (BatchNorm) are not vectorised (below).

Tolerance: the cohort computes the same operations per client in a different order (batched
matrix products under vmap, weighted sums), so updates equal the sequential ones up to
float32 rounding, not bit for bit: tests/test_cohort.py holds them to atol 1e-5 (rtol 1e-4)
after several epochs. The SGD update itself is the same elementwise arithmetic as torch's.

What is not vectorised (`cohort_unsupported` gives the reason; the node trains those clients
one by one and logs it): a handler whose class declares no functional loss, or whose class
changes the loss or training loop below the class that declared it; privacy.dp = "sgd";
segmentation (dense labels); models with buffers (BatchNorm running statistics) or active
dropout (each client draws its own dropout masks from the global generator); optimizers
other than one plain SGD over the model's trainable parameters.

The hook: `LocalClient.functional_loss()` returns a `FunctionalLoss` (a pure loss over one
client's features, logits, labels and sample weights, with its constants), a str (why this
configuration has none, e.g. FedProto's proto_source = "during"), or None (not declared).
It is called where `run_local` would start (the task's weights loaded, the handler's
per-task state set), so it can read that state. The cohort machinery owns the vectorisation;
the algorithm owns its mathematics.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

__all__ = ["FunctionalLoss", "CohortMember", "weighted_ce", "cohort_unsupported",
           "model_unsupported", "train_cohort", "train_handlers"]


@dataclass(frozen=True)
class FunctionalLoss:
    """A client's local loss in a pure form the cohort vectorises.

    fn(h, logits, y, w, params, consts) -> scalar loss of one client's minibatch:
      h [B, D] its features, logits [B, C] its head's output, y [B] int64 labels, w [B]
      float32 sample weights (1 = a real sample, 0 = padding; the loss must stay finite
      even when they are all 0), params {name: tensor} its
      trainable parameters (as model.named_parameters() names them), consts its `consts`.
    consts: the client's own tensors ({name: tensor or {name: tensor}}); the cohort stacks
      them along the client axis, so they must have equal shapes across the cohort.
    key: hashable; clients whose keys differ are trained in separate cohorts (put the
      scalars `fn` closes over here: mu, lam, the regulariser's form).
    """

    fn: Callable[..., torch.Tensor]
    consts: Mapping[str, Any] = field(default_factory=dict)
    key: tuple = ()


def weighted_ce(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy's batch mean over the samples of weight 1 (0 = padding)."""
    ce = F.cross_entropy(logits, y, reduction="none")
    return (ce * w).sum() / w.sum().clamp(min=1.0)


def ce_loss(h, logits, y, w, params, consts):
    """LocalClient's loss: cross-entropy of the head."""
    return weighted_ce(logits, y, w)


CE = FunctionalLoss(ce_loss, {}, ("ce",))


def prox_loss(h, logits, y, w, params, consts, *, mu: float):
    """FedProx's loss (eq. 2): CE + mu/2 sum ||p - anchor||^2, in parameter order."""
    anchor = consts["anchor"]
    prox = sum(((params[n] - anchor[n]) ** 2).sum() for n in anchor)
    return weighted_ce(logits, y, w) + 0.5 * mu * prox


def proto_loss(h, logits, y, w, params, consts, *, lam: float, form: str):
    """FedProto's eq. 7: CE + lam * L_R against the global prototypes consts["g"] [C, D]
    (consts["has"] bool [C]), in FedProtoClient.proto_reg's three forms, over the samples of
    weight 1: "mse" the per-element mean of (h - target)^2, target the sample's class
    prototype where it has one, else h itself (adds 0); "eq8"/"eq8_mean" the sum/mean over
    the minibatch's classes that have a global prototype of ||class mean of h - prototype||."""
    g, has = consts["g"].to(h.dtype), consts["has"]
    ce = weighted_ce(logits, y, w)
    if form == "mse":
        target = torch.where(has[y].unsqueeze(1), g[y], h.detach())
        reg = ((h - target) ** 2 * w.unsqueeze(1)).sum() / (
            w.sum().clamp(min=1.0) * h.shape[1])
        return ce + lam * reg
    # one-hot by comparison (F.one_hot checks its range: data-dependent, refused under vmap)
    classes = torch.arange(g.shape[0], device=y.device)
    onehot = (y.unsqueeze(1) == classes).to(h.dtype) * w.unsqueeze(1)  # [B, C]
    sums = onehot.t() @ h
    n = onehot.sum(0)
    means = sums / n.clamp(min=1).unsqueeze(1)
    sel = (n > 0) & has
    # the norm's gradient at 0 is nan: classes left out are measured on ones, then dropped
    diff = torch.where(sel.unsqueeze(1), means - g, torch.ones_like(means))
    dist = torch.where(sel, torch.linalg.vector_norm(diff, dim=1), torch.zeros_like(n))
    reg = dist.sum()
    if form == "eq8_mean":
        reg = reg / sel.sum().clamp(min=1)
    return ce + lam * reg


# The built-in losses over a leading client axis (h [K, B, D], logits [K, B, C], y and w
# [K, B], params and consts stacked) -> [K]: what vmap of the per-client form computes,
# without vmap's per-op batching (the affine chain's step uses them where the loss is one
# of these; any other loss is vmapped).
def weighted_ce_batched(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # rows flattened: the per-client form's [B, C] layout, so the same kernel and rounding
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                         reduction="none").reshape(y.shape)
    return (ce * w).sum(1) / w.sum(1).clamp(min=1.0)


def ce_loss_batched(h, logits, y, w, params, consts):
    return weighted_ce_batched(logits, y, w)


def prox_loss_batched(h, logits, y, w, params, consts, *, mu: float):
    anchor = consts["anchor"]
    prox = sum(((params[n] - anchor[n]) ** 2).flatten(1).sum(1) for n in anchor)
    return weighted_ce_batched(logits, y, w) + 0.5 * mu * prox


def proto_loss_batched(h, logits, y, w, params, consts, *, lam: float, form: str):
    g, has = consts["g"].to(h.dtype), consts["has"]
    ce = weighted_ce_batched(logits, y, w)
    if form == "mse":
        target = torch.where(has.gather(1, y).unsqueeze(2),
                             g.gather(1, y.unsqueeze(2).expand(-1, -1, g.shape[2])),
                             h.detach())
        reg = ((h - target) ** 2 * w.unsqueeze(2)).sum((1, 2)) / (
            w.sum(1).clamp(min=1.0) * h.shape[2])
        return ce + lam * reg
    classes = torch.arange(g.shape[1], device=y.device)
    onehot = (y.unsqueeze(2) == classes).to(h.dtype) * w.unsqueeze(2)  # [K, B, C]
    sums = onehot.transpose(1, 2) @ h
    n = onehot.sum(1)
    means = sums / n.clamp(min=1).unsqueeze(2)
    sel = (n > 0) & has
    diff = torch.where(sel.unsqueeze(2), means - g, torch.ones_like(means))
    dist = torch.where(sel, torch.linalg.vector_norm(diff, dim=2), torch.zeros_like(n))
    reg = dist.sum(1)
    if form == "eq8_mean":
        reg = reg / sel.sum(1).clamp(min=1)
    return ce + lam * reg


_BATCHED = {ce_loss: ce_loss_batched, prox_loss: prox_loss_batched,
            proto_loss: proto_loss_batched}


def batched_form(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | None:
    """The batched twin of a built-in loss (a functools.partial of one keeps its keywords),
    or None."""
    base, keywords = fn, {}
    if isinstance(fn, functools.partial) and not fn.args:
        base, keywords = fn.func, fn.keywords
    twin = _BATCHED.get(base)
    return functools.partial(twin, **keywords) if twin is not None else None


# The built-in losses' gradients written out, from the batched twins' arithmetic:
# (h, logits, y, w, params, consts) -> (loss [K], d loss/d h or None, d loss/d logits,
# {parameter: d loss/d parameter} for the loss's own terms in the parameters). The affine
# chain's step takes them where the loss is one of these (no autograd at all: on the 2-core
# CPU autograd's engine cost a third of an mlp step, docs/PERFORMANCE.md), else autograd
# through the batched twin or the vmapped loss (_through_autograd).
def _ce_value_and_grad(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """weighted_ce_batched and its gradient in the logits, softmax c - onehot c with
    c = w / sum(w) (in that order, as torch's log_softmax backward rounds it)."""
    lsm = torch.log_softmax(logits, -1)
    wsum = w.sum(1).clamp(min=1.0)
    loss = (-lsm.gather(2, y.unsqueeze(2)).squeeze(2) * w).sum(1) / wsum
    c = (w / wsum.unsqueeze(1)).unsqueeze(2)
    d = lsm.exp_().mul_(c)
    return loss, d.scatter_add_(2, y.unsqueeze(2), -c)


def ce_grads(h, logits, y, w, params, consts):
    loss, d = _ce_value_and_grad(logits, y, w)
    return loss, None, d, {}


def prox_grads(h, logits, y, w, params, consts, *, mu: float):
    """FedProx's eq. 2: the term's gradient is mu (p - anchor)."""
    loss, d = _ce_value_and_grad(logits, y, w)
    anchor = consts["anchor"]
    diffs = {n: params[n] - anchor[n] for n in anchor}
    prox = sum((v ** 2).flatten(1).sum(1) for v in diffs.values())
    return loss + 0.5 * mu * prox, None, d, {n: mu * v for n, v in diffs.items()}


def proto_grads(h, logits, y, w, params, consts, *, lam: float, form: str):
    """FedProto's eq. 7 in its "mse" form: the regulariser's gradient in the features is
    2 lam (h - target) w / (sum(w) D)."""
    assert form == "mse", form
    g, has = consts["g"].to(h.dtype), consts["has"]
    loss, d = _ce_value_and_grad(logits, y, w)
    target = torch.where(has.gather(1, y).unsqueeze(2),
                         g.gather(1, y.unsqueeze(2).expand(-1, -1, g.shape[2])), h)
    diff = h - target
    scale = w.sum(1).clamp(min=1.0) * h.shape[2]
    reg = (diff ** 2 * w.unsqueeze(2)).sum((1, 2)) / scale
    d_h = diff * (2.0 * lam * w / scale.unsqueeze(1)).unsqueeze(2)
    return loss + lam * reg, d_h, d, {}


_WRITTEN = {ce_loss: ce_grads, prox_loss: prox_grads, proto_loss: proto_grads}


def written_form(fn: Callable[..., torch.Tensor]) -> Callable[..., tuple] | None:
    """The written-out gradient of a built-in loss (proto_loss in its "mse" form only), or
    None."""
    base, keywords = fn, {}
    if isinstance(fn, functools.partial) and not fn.args:
        base, keywords = fn.func, fn.keywords
    grads = _WRITTEN.get(base)
    if grads is None or base is proto_loss and keywords.get("form") != "mse":
        return None
    return functools.partial(grads, **keywords)


def _through_autograd(batched_fn: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
    """The same (loss, d_h, d_logits, parameter terms) of any batched loss by autograd, the
    features, logits and parameters as leaves (where the features are the logits, their
    whole gradient is d_logits)."""
    def loss_grads(h, logits, y, w, params, consts):
        h_ = h.detach().requires_grad_()
        lg = h_ if logits is h else logits.detach().requires_grad_()
        leaves = {n: v.detach().requires_grad_() for n, v in params.items()}
        with torch.enable_grad():
            loss = batched_fn(h_, lg, y, w, leaves, consts)
            got = torch.autograd.grad(loss.sum(), [h_, lg, *leaves.values()],
                                      allow_unused=True)
        d_h = None if lg is h_ else got[0]
        terms = {n: g for n, g in zip(leaves, got[2:]) if g is not None}
        return loss.detach(), d_h, got[1], terms
    return loss_grads


# --------------------------------------------------------------------------- support
_LOOP_METHODS = ("train", "run_local", "batch_loss", "begin_local", "clip_gradients")


def model_unsupported(model: torch.nn.Module) -> str | None:
    """Why this network cannot be trained as a cohort, or None."""
    if any(True for _ in model.buffers()):
        return "the model has buffers (BatchNorm running statistics): batch statistics " \
               "are per client and would see the padding"
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return "the model has dropout: each client draws its masks from the global " \
                   "generator in sequence"
    if not hasattr(model, "features") or not hasattr(model, "head"):
        return "the model has no features()/head() split"
    return None


def cohort_unsupported(handler: Any) -> str | None:
    """Why this handler's local training cannot join a cohort (before its task is known),
    or None. The task-dependent part (functional_loss() returning a reason) is checked
    when the cohort starts."""
    from fedbus.algorithms.core.training import LocalClient

    cls = type(handler)
    if not isinstance(handler, LocalClient):
        return f"{cls.__name__} is no LocalClient"
    owner = next((c for c in cls.__mro__ if "functional_loss" in c.__dict__), None)
    if owner is None or owner is LocalClient and cls is not LocalClient:
        return f"{cls.__name__} declares no functional loss (functional_loss hook)"
    for c in cls.__mro__[:cls.__mro__.index(owner)]:
        changed = [m for m in _LOOP_METHODS if m in c.__dict__]
        if changed:
            return (f"{c.__name__} changes {', '.join(changed)} below {owner.__name__}, "
                    f"which declared the functional loss")
    ctx = handler.ctx
    privacy = ctx.extra.get("privacy") or {}
    if privacy.get("dp") == "sgd" or privacy.get("dp_extractor") == "sgd":
        return "privacy.dp = sgd trains with per-sample clipping (Opacus)"
    if ctx.train_y.dim() != 1:
        return "dense labels (segmentation)"
    reason = model_unsupported(ctx.model)
    if reason:
        return reason
    if len(ctx.optimizers) != 1 or ctx.optimizers[0] is not handler.optimizer:
        return "the handler has more than its one optimizer"
    opt = handler.optimizer
    if type(opt) is not torch.optim.SGD or len(opt.param_groups) != 1:
        return "the optimizer is not one plain SGD param group"
    group = opt.param_groups[0]
    if group.get("nesterov") or group.get("dampening", 0) or group.get("maximize"):
        return "SGD with nesterov, dampening or maximize"
    trainable = [p for p in ctx.model.parameters() if p.requires_grad]
    if len(group["params"]) != len(trainable) or any(
            a is not b for a, b in zip(group["params"], trainable)):
        return "the optimizer does not hold exactly the model's trainable parameters"
    return None


# --------------------------------------------------------------------------- core
@dataclass
class CohortMember:
    """One client of a cohort: its network, its optimizer (a plain SGD over the network's
    trainable parameters), its run (whose batches() the cohort draws) and its loss."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    run: Any  # fedbus.algorithms.core.handlers.LocalRun
    loss: FunctionalLoss


class _Split(torch.nn.Module):
    """forward(x) = (features(x), head(features(x))) of the wrapped network."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        h = self.model.features(x)
        return h, self.model.head(h)


def affine_chain(model: torch.nn.Module, names: Sequence[str]
                 ) -> tuple[tuple[tuple[str, bool], ...], int] | None:
    """The model's declared chain of affine layers (ProtoNet.affine_chain) where the cohort
    can run it written out: declared by the class that defines features() and head() (a
    subclass that changes either without declaring again is no chain), and every parameter
    one of its layers' weight or bias, all trainable (`names`). Else None: the vmap path."""
    declare = getattr(model, "affine_chain", None)
    chain = declare() if declare is not None else None
    if chain is None:
        return None
    mro = type(model).__mro__
    owner = next(c for c in mro if "affine_chain" in c.__dict__)
    for method in ("features", "head", "forward"):
        if mro.index(next(c for c in mro if method in c.__dict__)) < mro.index(owner):
            return None
    layers, _ = chain
    expected = [f"{prefix}.{kind}" for prefix, _ in layers for kind in ("weight", "bias")]
    if sorted(expected) != sorted(names) or len(names) != len(list(model.parameters())):
        return None
    return chain


@torch.no_grad()
def _chain_grads(layers: Sequence[tuple[str, bool]], feat: int, loss_grads: Callable,
                 names: Sequence[str], params: Mapping[str, torch.Tensor], consts: Any,
                 x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, lr: float | None = None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every client's gradient for an affine chain: the forward as batched matrix products
    (x [K, B, ...] flattened; weights [K, out, in]), the loss's gradients in the features
    and logits from `loss_grads` (written out, or _through_autograd), the chain's backward
    written out: d_in = (d_out * relu') @ W, grad W = (d_out * relu')^T a_in, grad b = sum
    over rows. Padding rows (w = 0) get a zero loss gradient and so add nothing.
    With `lr` (plain SGD: one rate, no momentum, no weight decay), the step p <- p - lr
    grad is taken in place instead, each weight's product accumulated straight into it
    (baddbmm_) once the layer below has its d_in: no gradient tensor is written and read
    back (measured 10-20 % of a step of the mlp on the 2-core CPU); returns ({}, losses)."""
    k, b = x.shape[0], x.shape[1]
    a = x.reshape(k, b, -1)
    inputs, outs = [], []
    for prefix, relu in layers:
        inputs.append(a)
        a = torch.baddbmm(params[prefix + ".bias"].unsqueeze(1), a,
                          params[prefix + ".weight"].transpose(1, 2))
        if relu:
            a = a.relu_()
        outs.append(a)
    loss, d_h, d, terms = loss_grads(outs[feat], outs[-1], y, w,
                                     {n: params[n] for n in names}, consts)
    grads: dict[str, torch.Tensor] = {}
    for i in range(len(layers) - 1, -1, -1):
        prefix, relu = layers[i]
        if d is None:
            d = torch.zeros_like(outs[i])
        if i == feat and d_h is not None:
            d = d + d_h
        if relu:
            d = d * (outs[i] > 0)
        weight, bias = params[prefix + ".weight"], params[prefix + ".bias"]
        d_in = torch.bmm(d, weight) if i else None
        if lr is None:
            grads[prefix + ".weight"] = torch.bmm(d.transpose(1, 2), inputs[i])
            grads[prefix + ".bias"] = d.sum(1)
        else:
            weight.baddbmm_(d.transpose(1, 2), inputs[i], alpha=-lr)
            bias.add_(d.sum(1), alpha=-lr)
        d = d_in
    for n, g in terms.items():  # the loss's own term in the parameters (FedProx's anchor)
        if lr is None:
            grads[n] = grads[n] + g
        else:
            params[n].add_(g, alpha=-lr)
    return grads, loss


def _vmap_step(model: torch.nn.Module, names: Sequence[str], fn: Callable
               ) -> Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """step(params, consts, x, y, w) -> (every client's gradients, losses) for any supported
    network: the forward vmapped, the backward torch's autograd over the sum of the clients'
    losses (each client's loss depends on its own rows only, so the gradient of the sum in
    its rows is its own loss's; cheaper per step than vmap(grad(...)) here)."""
    split = _Split(model)
    prefixed = {n: "model." + n for n in names}

    def client_loss(params, consts, x, y, w):
        h, logits = functional_call(split, {prefixed[n]: v for n, v in params.items()}, (x,))
        return fn(h, logits, y, w, params, consts)

    batched_loss = vmap(client_loss)

    def step(params, consts, x, y, w):
        leaves = {n: v.detach().requires_grad_() for n, v in params.items()}
        loss = batched_loss(leaves, consts, x, y, w)
        grads = torch.autograd.grad(loss.sum(), [leaves[n] for n in names])
        return dict(zip(names, grads)), loss.detach()
    return step


def _chain_step(chain: tuple[tuple[tuple[str, bool], ...], int], names: Sequence[str],
                fn: Callable) -> Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The same step for an affine chain (_chain_grads), the loss's gradient written out
    where it has that form, else by autograd through its batched twin, else vmapped."""
    layers, feat = chain
    loss_grads = written_form(fn) or _through_autograd(batched_form(fn) or vmap(fn))
    return functools.partial(_chain_grads, layers, feat, loss_grads, names)


def _stack(trees: Sequence[Any]) -> Any:
    first = trees[0]
    if isinstance(first, Mapping):
        return {k: _stack([t[k] for t in trees]) for k in first}
    return torch.stack([torch.as_tensor(t) for t in trees])


def _uniform(values: list[float]) -> bool:
    return all(v == values[0] for v in values)


def _per_client(values: list[float], like: torch.Tensor) -> torch.Tensor:
    t = torch.tensor(values, dtype=like.dtype, device=like.device)
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def _take(tree: Any, index: torch.Tensor) -> Any:
    if isinstance(tree, Mapping):
        return {k: _take(v, index) for k, v in tree.items()}
    return tree.index_select(0, index)


def _tail_default(device: torch.device) -> int:
    """Fewest live clients a vectorised step is taken for; below it the rest finish one by
    one. A vmap step costs a near-fixed overhead (on the 2-core CPU about what 5-8 sequential
    steps of the mlp at batch 10 cost), so a tail > 1 is faster on unequal client sizes, but
    a client's arithmetic then depends on which clients share its cohort (where it switches),
    and the node's cohorts depend on message timing: runs would no longer repeat bit for bit.
    1 (default): every step vectorised, a client's result independent of its cohort."""
    return TAIL_CUDA if device.type == "cuda" else TAIL_CPU


TAIL_CPU = TAIL_CUDA = 1


def train_cohort(members: Sequence[CohortMember], tail: int | None = None) -> list[float]:
    """Train the members' networks as one cohort (module docstring); each network ends with
    the parameters, and each optimizer with the momentum buffers, that its sequential run
    would leave (up to float32 reordering). Returns each member's mean training loss (nan
    where its run took no step), summed in step order as run_local sums it.

    Masking by compaction: the stack holds the clients whose runs still yield batches; when
    a run ends, its client's rows are set aside as they are (no later step touches them) and
    the stack shrinks to the others, so a cohort of unequal clients costs the sum of its
    clients' steps, not K times the longest run's. Once fewer than `tail` clients are left
    (default: _tail_default), they finish one by one: their rows go back into their
    networks and optimizers and each takes its remaining steps with the same functional loss
    over its own network and its own torch SGD."""
    k_all = len(members)
    if k_all == 0:
        return []
    model0 = members[0].model
    names = [n for n, p in model0.named_parameters() if p.requires_grad]
    own = [[dict(m.model.named_parameters())[n] for n in names] for m in members]
    for m in members:
        m.model.train()
    gens: list[Any] = [iter(m.run.batch_indices()) for m in members]
    bs = int(members[0].run.ctx.train["batch_size"])
    # every member's training set in one tensor, and a row of zeros (the padding) last: a
    # step gathers the cohort's rows at once
    xs, ys = [m.run.ctx.train_x for m in members], [m.run.ctx.train_y for m in members]
    data_x = torch.cat([*xs, torch.zeros_like(xs[0][:1])])
    data_y = torch.cat([*ys, torch.zeros_like(ys[0][:1])])
    pad = len(data_y) - 1
    starts = [0]
    for y_ in ys[:-1]:
        starts.append(starts[-1] + len(y_))

    def pull(idx: list[int]) -> list[torch.Tensor | None]:
        out = []
        for k in idx:
            item = None
            if gens[k] is not None:
                try:
                    item = next(gens[k])
                except StopIteration:
                    gens[k] = None
            out.append(item)
        return out

    idx = list(range(k_all))
    batch = pull(idx)  # the first pull starts each run's optimizer (optimizer_state, lr)
    groups = [m.optimizer.param_groups[0] for m in members]
    lrs = [float(g["lr"]) for g in groups]
    moms = [float(g["momentum"]) for g in groups]
    wds = [float(g["weight_decay"]) for g in groups]
    dev = own[0][0].device
    P = {n: torch.stack([own[k][i].detach() for k in range(k_all)]).clone()
         for i, n in enumerate(names)}
    use_mom = any(moms)
    bufs: dict[str, torch.Tensor] = {}
    if use_mom:
        for i, n in enumerate(names):
            rows = []
            for k, m in enumerate(members):
                b = m.optimizer.state.get(own[k][i], {}).get("momentum_buffer")
                rows.append(torch.zeros_like(own[k][i]) if b is None else b.detach())
            bufs[n] = torch.stack(rows).clone()
    C = _stack([m.loss.consts for m in members]) if members[0].loss.consts else {}
    fn = members[0].loss.fn
    chain = affine_chain(model0, names)
    step_fn = _vmap_step(model0, names, fn) if chain is None else _chain_step(chain, names, fn)
    uniform = _uniform(lrs) and _uniform(moms) and _uniform(wds)
    lr, mom, wd = lrs[0], moms[0], wds[0]
    fused = chain is not None and uniform and wd == 0 and not (use_mom and mom != 0)

    final_p: dict[int, dict[str, torch.Tensor]] = {}
    final_b: dict[int, dict[str, torch.Tensor]] = {}
    steps = [0] * k_all
    losses: list[tuple[torch.Tensor, list[int]]] = []
    tail_losses: dict[int, list[float]] = {}
    tail = _tail_default(dev) if tail is None else int(tail)
    ones = shift = None
    while True:
        live = [j for j, b in enumerate(batch) if b is not None]
        if 0 < len(live) < tail:  # the last few: one by one
            for j in live:
                k = idx[j]
                _install(members[k], own[k], names, {n: P[n][j] for n in names},
                         {n: bufs[n][j] for n in names} if use_mom and moms[k] else None)
                tail_losses[k] = _finish_alone(members[k], own[k], names, batch[j], gens[k])
                steps[k] += len(tail_losses[k])
                batch[j] = None
            live = []
        if len(live) < len(idx):  # runs that ended: their rows set aside, the stack shrinks
            for j, k in enumerate(idx):
                if batch[j] is None:
                    final_p[k] = {n: P[n][j] for n in names}
                    if use_mom:
                        final_b[k] = {n: bufs[n][j] for n in names}
            if not live:
                break
            keep = torch.tensor(live, device=dev)
            P = _take(P, keep)
            bufs = _take(bufs, keep)
            C = _take(C, keep) if C else C
            idx = [idx[j] for j in live]
            batch = [batch[j] for j in live]
            ones = None
        k_now = len(idx)
        sizes = [len(b) for b in batch]
        if all(size == bs for size in sizes):
            if ones is None:
                ones = torch.ones(k_now, bs, device=dev)
                shift = torch.tensor([starts[k] for k in idx],
                                     device=dev).repeat_interleave(bs)
            rows = torch.cat(batch) + shift
            X = data_x.index_select(0, rows).view(k_now, bs, *data_x.shape[1:])
            Y = data_y.index_select(0, rows).view(k_now, bs)
            W = ones
        else:  # some client's last batch of an epoch: padded with zeros, weighed 0
            rows = torch.full((k_now, bs), pad, dtype=torch.long, device=dev)
            W = torch.zeros((k_now, bs), device=dev)
            for j, b in enumerate(batch):
                rows[j, :sizes[j]] = b + starts[idx[j]]
                W[j, :sizes[j]] = 1.0
            X = data_x.index_select(0, rows.view(-1)).view(k_now, bs, *data_x.shape[1:])
            Y = data_y.index_select(0, rows.view(-1)).view(k_now, bs)
        if fused:
            _, loss = step_fn(P, C, X, Y, W, lr=lr)
        elif uniform:  # torch.optim.SGD's arithmetic (its foreach path), op for op, in place
            grads, loss = step_fn(P, C, X, Y, W)
            ps, gs = [P[n] for n in names], [grads[n] for n in names]
            if wd != 0:
                torch._foreach_add_(gs, ps, alpha=wd)
            if use_mom and mom != 0:
                bs_ = [bufs[n] for n in names]
                torch._foreach_mul_(bs_, mom)
                torch._foreach_add_(bs_, gs)
                gs = bs_
            torch._foreach_add_(ps, gs, alpha=-lr)
        else:  # clients of different rates (tasks of different rounds: lr_decay)
            grads, loss = step_fn(P, C, X, Y, W)
            for n in names:
                p, g = P[n], grads[n]
                g = g + _per_client([wds[k] for k in idx], p) * p
                if use_mom:
                    bufs[n] = bufs[n] * _per_client([moms[k] for k in idx], p) + g
                    g = bufs[n]
                P[n] = p - _per_client([lrs[k] for k in idx], p) * g
        losses.append((loss, idx))
        for k in idx:
            steps[k] += 1
        batch = pull(idx)

    # each client's state back into its own network and optimizer
    table = torch.cat([t for t, _ in losses]).tolist() if losses else []
    totals = [0.0] * k_all
    pos = 0
    for _, ids in losses:  # summed in step order, as run_local's total += loss.item()
        for k in ids:
            totals[k] += table[pos]
            pos += 1
    out = []
    for k, m in enumerate(members):
        if k in tail_losses:  # finished in place
            for value in tail_losses[k]:
                totals[k] += value
        else:
            _install(m, own[k], names, final_p[k],
                     final_b[k] if use_mom and moms[k] and steps[k] else None)
            if steps[k]:
                for p in own[k]:
                    p.grad = torch.zeros_like(p)
        out.append(totals[k] / steps[k] if steps[k] else float("nan"))
    return out


@torch.no_grad()
def _install(member: CohortMember, params: list[torch.Tensor], names: list[str],
             values: Mapping[str, torch.Tensor], bufs: Mapping[str, torch.Tensor] | None) -> None:
    """A client's rows of the stack into its own network (and momentum buffers into its
    optimizer's state, as torch's SGD keeps them)."""
    for p, n in zip(params, names):
        p.copy_(values[n])
        if bufs is not None:
            member.optimizer.state[p]["momentum_buffer"] = bufs[n].clone()


def _finish_alone(member: CohortMember, params: list[torch.Tensor], names: list[str],
                  first: torch.Tensor, gen: Any) -> list[float]:
    """A client's remaining steps one by one (its pending batch's rows `first`, then the rest
    of its run): its functional loss over its own network, its own optimizer's step; the
    losses."""
    model, opt, loss_fn = member.model, member.optimizer, member.loss
    named = dict(zip(names, params))
    data_x, data_y = member.run.ctx.train_x, member.run.ctx.train_y
    out = []
    item: Any = first
    while item is not None:
        x, y = data_x.index_select(0, item), data_y.index_select(0, item)
        opt.zero_grad(set_to_none=True)
        h = model.features(x)
        loss = loss_fn.fn(h, model.head(h), y, torch.ones(len(y), device=y.device), named,
                          loss_fn.consts)
        loss.backward()
        opt.step()
        out.append(loss.item())
        try:
            item = next(gen)
        except StopIteration:
            item = None
    return out


# --------------------------------------------------------------------------- handlers
class _Captured(Exception):
    """Raised by the capture pass at the point where run_local would start training."""


def train_handlers(handlers: Sequence[Any], tasks: Sequence[Mapping[str, Any]],
                   runs: Sequence[Any], *, before_train: Callable[[int], None] | None = None
                   ) -> tuple[list[dict[str, Any] | None], dict[int, str]]:
    """Run each handler's train(task, run) with its local training done in cohorts.

    Two passes over each handler's own train(): the first stops where run_local would start
    (the task's weights loaded, the handler's per-task state set) and takes the handler's
    functional_loss(); the cohorts train; the second pass runs train() again, its run_local
    now installing the cohort's outcome (the network and momentum are already in place; the
    mean loss goes to last_loss), so everything after the local loop (the delta, prototypes,
    the handler's metrics) is the handler's own code on the trained network. Every handler
    must have passed `cohort_unsupported`, and no two may share a network.

    Returns (payloads, fallbacks): payloads[i] is handler i's train() result, or None where
    it was not trained here; fallbacks {i: reason} lists those (functional_loss() gave a
    reason), which the caller trains one by one. `before_train(i)` runs before each of
    handler i's train() calls (the node seeds torch there, as run_task does)."""
    n = len(handlers)
    losses: dict[int, FunctionalLoss] = {}
    fallbacks: dict[int, str] = {}
    for i, (h, task, run) in enumerate(zip(handlers, tasks, runs)):
        captured: dict[str, Any] = {}

        def capture(handler, run_, captured=captured):
            captured["loss"] = handler.functional_loss()
            raise _Captured

        h._cohort_run = capture
        try:
            if before_train is not None:
                before_train(i)
            h.train(task, run)
        except _Captured:
            pass
        finally:
            h._cohort_run = None
        loss = captured.get("loss")
        if isinstance(loss, FunctionalLoss):
            losses[i] = loss
        else:
            fallbacks[i] = loss if isinstance(loss, str) else \
                f"{type(h).__name__}.functional_loss() gave none"
    # cohorts: one architecture (parameter shapes), one loss key, one handler class
    cohorts: dict[Any, list[int]] = {}
    for i, loss in losses.items():
        model = handlers[i].ctx.model
        shapes = tuple((k, tuple(p.shape)) for k, p in model.named_parameters()
                       if p.requires_grad)
        group = handlers[i].optimizer.param_groups[0]
        # one set of rates per cohort (the same arithmetic for every client, whatever the
        # cohort: tasks of different rounds differ by train.lr_decay)
        rates = (runs[i].lr_factor, group["lr"], group.get("fedbus_base_lr"),
                 group.get("fedbus_lr"), group["momentum"], group["weight_decay"],
                 handlers[i].ctx.train.get("optimizer_state", "fresh"))
        key = (type(handlers[i]), type(model), shapes, loss.key, rates,
               tuple((k, tuple(torch.as_tensor(v).shape)) for k, v in _flat(loss.consts)))
        cohorts.setdefault(key, []).append(i)
    mean_loss: dict[int, float] = {}
    for idx in cohorts.values():
        out = train_cohort([CohortMember(handlers[i].ctx.model, handlers[i].optimizer,
                                         runs[i], losses[i]) for i in idx])
        mean_loss.update(zip(idx, out))
    payloads: list[dict[str, Any] | None] = [None] * n
    for i in sorted(mean_loss):
        h = handlers[i]
        # the second pass reloads the task's weights before run_local: the trained ones
        # go back in there
        trained = [p.detach().clone() for p in h.ctx.model.parameters() if p.requires_grad]

        def install(handler, run_, value=mean_loss[i], trained=trained):
            with torch.no_grad():
                for p, t in zip([p for p in handler.ctx.model.parameters()
                                 if p.requires_grad], trained):
                    p.copy_(t)
            handler.ctx.model.train()
            handler.last_loss = value
            return value

        h._cohort_run = install
        try:
            if before_train is not None:
                before_train(i)
            payloads[i] = h.train(tasks[i], runs[i])
        finally:
            h._cohort_run = None
    return payloads, fallbacks


def _flat(tree: Mapping[str, Any], prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _flat(v, prefix + k + ".")
        else:
            yield prefix + k, v


def mean_steps(runs: Sequence[Any]) -> float:
    """Mean steps per run (for logs)."""
    return sum(r.work.steps for r in runs) / max(1, len(runs)) if runs else math.nan

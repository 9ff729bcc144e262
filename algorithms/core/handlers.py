"""The algorithm-handler contract.

An algorithm is a pair: a ServerHandler (make a client's task, take updates,
aggregate when a round or buffer closes) and a ClientHandler (train on a task,
build the update, evaluate). Handlers own only their mathematics. The engine
owns sampling, deadlines, staleness, retries, message I/O and logging: it hands
a handler plain Python/numpy values and takes plain values back.

Payloads (task, update and eval bodies) are dicts of str -> numpy array, int,
float, str, bool, None, list or nested dict: whatever the wire codec carries.
Arrays received from the wire are read-only views; copy before writing.

Conventions that the engine's validation and the tools rely on:
- prototypes travel as "protos" float32 [C, D] with "counts" int64 [C]
  (count 0 = the client has no such class; its row is zeros);
- model weights travel as "delta": {param name: array}, the client's weights
  minus the global weights it was sent (so stale updates apply cleanly).
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Mapping

import numpy as np
import torch

from fedbus.algorithms.core.metrics import head_metrics


@dataclass
class Work:
    """What a client actually did for one task (partial work is normal)."""

    epochs_asked: int
    epochs_done: float
    steps: int
    samples: int
    stopped: str = "done"  # done | budget (time ran out) | partial (asked to do less)

    @property
    def fraction(self) -> float:
        return 1.0 if self.epochs_asked == 0 else min(1.0, self.epochs_done / self.epochs_asked)

    def to_dict(self) -> dict[str, Any]:
        return {"epochs_asked": self.epochs_asked, "epochs_done": self.epochs_done,
                "steps": self.steps, "samples": self.samples, "stopped": self.stopped}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Work":
        return cls(int(d["epochs_asked"]), float(d["epochs_done"]), int(d["steps"]),
                   int(d["samples"]), str(d.get("stopped", "done")))


@dataclass(frozen=True)
class RoundInfo:
    """Where the federation is: the round (sync) or global version (async)."""

    round: int
    rounds: int

    @property
    def last(self) -> bool:
        return self.round >= self.rounds - 1


@dataclass
class ClientUpdate:
    """One client's answer to a task, as the server handler receives it."""

    client: int
    payload: dict[str, Any]
    num_samples: int  # the client's training-set size
    work: Work
    version: int  # the global version (round) the client's task was made from
    staleness: int = 0  # aggregations that happened since that version
    weight: float = 1.0  # engine's staleness weight, 1/sqrt(1+staleness)
    # A relay's pre-aggregated update (fedbus.algorithms.core.merge): the clients it stands
    # for, each with an empty payload; its own payload is the handler's sum form and its
    # client is the first member's. Empty for a client's own update.
    members: tuple["ClientUpdate", ...] = ()


@dataclass(frozen=True)
class Failure:
    """A sampled client that contributed nothing to this aggregation."""

    client: int
    reason: str  # late | dead | dropped | rejected | error | partial (a handler's choice)


@dataclass
class ServerContext:
    params: Mapping[str, Any]  # the [algorithm] section
    train: Mapping[str, Any]  # the [train] section
    num_classes: int
    feature_dim: int
    clients: int
    rounds: int
    seed: int
    homogeneous: bool  # every client runs the same architecture
    make_model: Callable[[int], torch.nn.Module]  # client i's network, seeded initial weights
    # Simulation only: every client's training split pooled, (x float32 [N, ...], y int64
    # [N]), built on first call. A real deployment has no such thing; the `central`
    # baseline (one model trained on all the data, the reference of Michieli & Ozay's
    # FFD) is its only user. None where the server was built without data (unit tests).
    pooled_train: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
    # The federation's distinct architectures in client order ("cnn", "cnn4", ...), and a
    # builder of any registry arch for this federation's input shape, classes and common
    # feature dim, seeded with the federation seed: the auxiliary ("shared", "student")
    # model of FML and FedKD. Empty/None where the server was built without a config.
    archs: tuple[str, ...] = ()
    build_arch: Callable[[str], torch.nn.Module] | None = None


class _class_or_handler:
    """A method bound to the class when looked up on the class, and to the class with
    `params` = the handler's params when looked up on a handler (ServerHandler.merge_rule:
    a relay asks the class with the run's params, the server's engine asks its handler)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, owner: type) -> Callable[..., Any]:
        if obj is None:
            return functools.partial(self.fn, owner)
        return functools.partial(self.fn, type(obj), params=getattr(obj, "params", None))


class ServerHandler:
    """Server half of an algorithm. Subclasses declare PARAMS (the keys their
    [algorithm] section accepts, with defaults) and implement the three verbs."""

    PARAMS: ClassVar[dict[str, Any]] = {}
    needs_same_model: ClassVar[bool] = False  # weight averaging needs one architecture
    # Sharing the head alone (LG-FedAvg, FedGH) needs one head shape across a model group.
    needs_same_head: ClassVar[bool] = False
    # The [privacy] dp mechanisms this algorithm's uploads admit: record = its upload is
    # prototypes and counts only (fedbus.node.privacy.dp.dp_prototypes replaces them), client = its
    # upload is a weight delta summed by DeltaSums. Read from the class itself, not
    # inherited (fedbus.node.privacy.dp.dp_levels): a subclass whose upload differs admits nothing.
    DP_LEVELS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.params = ctx.params

    # How this class's updates pre-aggregate at a relay (fedbus.algorithms.core.merge.MergeRule),
    # or None: a relay then forwards every update as it is. Declared by the class whose
    # aggregate() handles merged updates; merge_rule() does not let subclasses inherit it.
    MERGE: ClassVar[Any] = None

    @_class_or_handler
    def merge_rule(cls, params: Mapping[str, Any] | None = None) -> Any:
        """The merge rule of a run: the class's MERGE, unless `params` (the run's
        [algorithm] section) choose an aggregation that is no sum (`merges`). On the class
        (a relay) pass the params; on a handler they default to the handler's own."""
        rule = cls.__dict__.get("MERGE")
        if rule is None or params is None or cls.merges(params):
            return rule
        return None

    @classmethod
    def merges(cls, params: Mapping[str, Any]) -> bool:
        """Whether a run with these params aggregates by the class's MERGE sums (a robust
        rule, fedbus.algorithms.core.robust, does not)."""
        return True

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        raise NotImplementedError

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return self.make_task(client, info)

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, Any]:
        """Fold updates into the global state. `updates` may be empty (every
        sampled client failed); return scalar metrics worth logging (the
        record's "agg"). A value that is a dict or a list (plain JSON: str
        keys, Python numbers), e.g. one value per client, goes to the record's
        "agg_extra" instead."""
        raise NotImplementedError

    def global_weights(self) -> Mapping[str, np.ndarray] | None:
        """The weights of the one global model this algorithm keeps ({name: array}, the
        model's state dict as ctx.make_model builds it), or None if it keeps none
        (prototype-only methods, local). Read by analysis metrics such as FFD
        (fedbus.analysis.ffd); never written through."""
        return None

    def count_epochs(self) -> int:
        """How many passes over a client's training set its uploaded per-class "counts" may
        cover: 1 where counts are class sizes (the default), the local epochs asked where
        they count every sample seen while training (FD's "during"). The server bounds
        counts by the client's class sizes times this (fedbus.node.validate), from its own
        config, never from the update's work report."""
        return 1

    def update_spec(self) -> dict[str, tuple[str, tuple[int | None, ...]]]:
        """Arrays an update must carry: {"protos": ("float32", (C, D)), ...}.
        None in a shape matches any size. Used to validate updates before
        aggregate() ever sees them."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


@dataclass
class ClientContext:
    client: int
    model: torch.nn.Module  # on `device`
    device: torch.device
    train_x: torch.Tensor  # on `device`
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    feature_dim: int
    params: Mapping[str, Any]  # [algorithm]
    train: Mapping[str, Any]  # [train]
    seed: int
    extra: dict[str, Any] = field(default_factory=dict)
    # As ServerContext.archs / build_arch (the builder's model is on the CPU).
    archs: tuple[str, ...] = ()
    build_arch: Callable[[str], torch.nn.Module] | None = None
    # Every optimizer make_optimizer built for this client (the handler's own, FML/FedKD's
    # auxiliary ones, FedRep's head one): the ones train.optimizer_state governs.
    # (init=False: a dataclasses.replace of the context starts a list of its own)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list, init=False,
                                                    repr=False, compare=False)

    def make_optimizer(self, params=None) -> torch.optim.Optimizer:
        """SGD with the [train] lr, momentum and weight decay over `params` (default: the
        model's), registered in `optimizers` so that every local run starts it as
        train.optimizer_state says (start_local_run)."""
        optimizer = torch.optim.SGD(self.model.parameters() if params is None else params,
                                    lr=self.train["lr"], momentum=self.train["momentum"],
                                    weight_decay=self.train["weight_decay"])
        self.optimizers.append(optimizer)
        return optimizer

    def start_local_run(self, lr_factor: float = 1.0) -> None:
        """What a client's optimizers hold when a local run starts. train.optimizer_state =
        "fresh" (default): nothing, as a new optimizer; FedProto's reference code
        (lib/update.py, update_weights_het) and HtFLlib build one per local update, and
        FedProto's paper (App. A: "SGD ... momentum of 0.5") says no more. Emptying the
        state is building it anew: torch's SGD starts a momentum buffer (Adam its moments
        and step) at the first step after, and the param groups (lr, a handler's
        per-round lr) stay as set. "persist": the momentum buffers carry over from the
        client's previous local run (fedbus before issue 25). `lr_factor`: train.lr_decay^r
        for a task of round r (LocalRun.lr_factor; 1 = the rates as they are)."""
        if self.train.get("optimizer_state", "fresh") == "fresh":
            for optimizer in self.optimizers:
                optimizer.state.clear()
        if lr_factor != 1.0:
            self._scale_lr(lr_factor)

    def _scale_lr(self, factor: float) -> None:
        """train.lr_decay: each param group runs at its base rate x factor. The base is the
        rate the group had, unless that is the rate this method set last time (a handler
        that leaves the rate alone): then the base is the one it scaled, so the decay never
        compounds, and a handler's own per-round rate (MP-FedCL's) is scaled in turn."""
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                base = group["fedbus_base_lr"] if group.get("fedbus_lr") == group["lr"] \
                    else group["lr"]
                group["fedbus_base_lr"] = base
                group["lr"] = group["fedbus_lr"] = base * factor


class LocalRun:
    """The engine's side of one local update: which minibatches, how many
    epochs, and when to stop. A handler iterates `batches()`; the work done
    is recorded in `work` whether the run finished, ran out of time, or was
    asked to do only part of its epochs.

    A simulated slow device (slow_factor > 1) runs on a virtual clock: every
    second of real work counts as slow_factor seconds, so a time budget cuts it
    exactly where it would cut a device that much slower, and the node holds
    its update back until the virtual time has passed. A real slow device takes
    the same path with slow_factor 1."""

    def __init__(self, ctx: ClientContext, *, epochs: int, seed: int,
                 epochs_to_run: float | None = None, budget_s: float = 0.0,
                 slow_factor: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 lr_factor: float = 1.0):
        self.ctx = ctx
        self.lr_factor = float(lr_factor)  # train.lr_decay ** round (start_local_run)
        self.epochs = int(epochs)
        self.epochs_to_run = float(epochs if epochs_to_run is None else epochs_to_run)
        self.budget_s = float(budget_s)
        self.slow_factor = max(1.0, float(slow_factor))
        self.seed = int(seed)
        self.clock = clock  # public: a handler's extra phase (FedRep's head epochs) shares it
        self._start = clock()
        self.work = Work(self.epochs, 0.0, 0, 0, "done")

    def elapsed(self) -> float:
        """Seconds of (virtual) device time since the run began."""
        return (self.clock() - self._start) * self.slow_factor

    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(len(self.ctx.train_y) / self.ctx.train["batch_size"]))

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each local step's minibatch (x, y) of the client's training set: the rows
        batch_indices() gives."""
        x, y = self.ctx.train_x, self.ctx.train_y
        for idx in self.batch_indices():
            # index_select gathers the same rows as x[idx] at about half the cost per call
            # for a small batch (no Python-level index parsing)
            yield x.index_select(0, idx), y.index_select(0, idx)

    def batch_indices(self) -> Iterator[torch.Tensor]:
        """The row indices of each local step's minibatch, the run's seed, epochs, partial
        work and time budget applied, the work done recorded in `work` as each step is
        taken (cohort training gathers several clients' rows at once from these)."""
        # every local step goes through here (DP-SGD's Poisson batches and FedRep's head
        # run too), so this is where a run's optimizers start as train.optimizer_state says
        self.ctx.start_local_run(self.lr_factor)
        n = len(self.ctx.train_y)
        if n == 0 or self.epochs == 0:
            return
        bs = self.ctx.train["batch_size"]
        per_epoch = self.steps_per_epoch()
        total = per_epoch * self.epochs
        if self.epochs_to_run < self.epochs:
            # Partial work still trains at least one step, so the update is real.
            total = max(1, round(self.epochs_to_run * per_epoch))
            self.work.stopped = "partial"
        gen = torch.Generator().manual_seed(self.seed)
        step = 0
        while step < total:
            order = torch.randperm(n, generator=gen).to(self.ctx.device)
            for i in range(per_epoch):
                if step >= total:
                    break
                if self.budget_s > 0 and self.elapsed() >= self.budget_s:
                    self.work.stopped = "budget"
                    return
                idx = order[i * bs:(i + 1) * bs]
                yield idx
                step += 1
                self.work.steps = step
                self.work.samples += len(idx)
                self.work.epochs_done = step / per_epoch


class ClientHandler:
    """Client half of an algorithm: one instance per client, kept by the node
    between tasks (or evicted and restored through state_dict)."""

    def __init__(self, ctx: ClientContext):
        self.ctx = ctx
        self.params = ctx.params
        self.optimizer = ctx.make_optimizer()

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        """Run local training over run.batches(); return the update payload."""
        raise NotImplementedError

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        """Score on the client's own test split: at least "acc" (the classifier
        head) and, for prototype methods, "proto_acc"; also "loss" (segmentation
        adds "miou", and "proto_miou" for prototype methods)."""
        return head_metrics(self.ctx.model, self.ctx.test_x, self.ctx.test_y)

    @torch.inference_mode()
    def embed(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to n test embeddings and their labels (for the t-SNE plot). Dense
        (segmentation) features: up to n feature pixels with a valid label, evenly
        spaced over those of the first test images (labels downsampled as for
        prototypes: fedbus.algorithms.core.protos.pixel_samples)."""
        x, y = self.ctx.test_x[:n], self.ctx.test_y[:n]
        self.ctx.model.eval()
        h = self.ctx.model.features(x) if len(x) else torch.zeros(0, self.ctx.feature_dim)
        if h.dim() == 4:
            from fedbus.algorithms.core.protos import pixel_samples

            h, y = pixel_samples(h, y, self.ctx.num_classes)
            if len(y) > n:
                pick = torch.linspace(0, len(y) - 1, n, device=y.device).round().long()
                h, y = h[pick], y[pick]
        return h.float().cpu().numpy(), y.cpu().numpy()

    @torch.no_grad()
    def masks(self, task: Mapping[str, Any], n: int) -> dict[str, np.ndarray] | None:
        """Up to n test images with their ground truth and predicted masks, for the
        mask plot of segmentation runs: {"image" uint8 [n, H, W, 3] (de-standardised
        per image to 0..255), "truth" uint8 [n, H, W] (ignored pixels 255), "pred"
        uint8 [n, H, W]}; None for classification data. The prediction is the head's
        argmax with the eval task's global weights when the task carries a whole
        model's ("weights": the FedAvg family scores the aggregate model), else with
        the client's own model (the one its evaluate() scores)."""
        ctx = self.ctx
        if ctx.test_y.dim() != 3 or n <= 0 or len(ctx.test_y) == 0:
            return None
        model = ctx.model
        x, y = ctx.test_x[:n], ctx.test_y[:n]
        weights = task.get("weights") if isinstance(task, Mapping) else None
        own = None
        if isinstance(weights, Mapping) and set(model.state_dict()) <= set(weights):
            own = model_weights(model)
            load_weights(model, weights)
        was_training = model.training
        model.eval()
        try:
            pred = model(x).argmax(1)
        finally:
            model.train(was_training)
            if own is not None:
                load_weights(model, own)
        img = x.float()
        if img.shape[1] not in (1, 3):
            img = img[:, :3]
        lo = img.amin(dim=(1, 2, 3), keepdim=True)
        hi = img.amax(dim=(1, 2, 3), keepdim=True)
        img = ((img - lo) / (hi - lo).clamp(min=1e-8) * 255).round()
        img = img.expand(-1, 3, -1, -1) if img.shape[1] == 1 else img
        truth = torch.where((y >= 0) & (y < ctx.num_classes), y, 255)
        return {"image": img.permute(0, 2, 3, 1).to(torch.uint8).cpu().numpy(),
                "truth": truth.to(torch.uint8).cpu().numpy(),
                "pred": pred.to(torch.uint8).cpu().numpy()}

    def extra_state(self) -> dict[str, Any]:
        """Handler state beyond model and optimizer (e.g. the last global prototypes)."""
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.ctx.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "extra": self.extra_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ctx.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_extra_state(state["extra"])


# --- helpers shared by handlers -------------------------------------------------

def classification_only(ctx: ClientContext, algorithm: str) -> None:
    """ValueError unless every sample has one label: a method whose prototypes or
    knowledge are per class of an image, not per pixel (segmentation)."""
    if ctx.train_y.dim() != 1:
        raise ValueError(f"{algorithm} is for classification (one label per sample); "
                         f"segmentation masks are not supported")


def to_tensor(value: Any, device: torch.device | str = "cpu",
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A wire array (read-only numpy view) as a fresh tensor on `device`."""
    t = torch.from_numpy(np.array(value, copy=True))
    if dtype is not None:
        t = t.to(dtype)
    return t.to(device)


def model_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_weights(model: torch.nn.Module, weights: Mapping[str, Any]) -> None:
    state = model.state_dict()
    missing = set(state) - set(weights)
    if missing:
        raise ValueError(f"weights lack {sorted(missing)[:3]}...")
    model.load_state_dict({k: to_tensor(weights[k], state[k].device, state[k].dtype)
                           for k in state})


def weight_delta(model: torch.nn.Module, base: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The model's weights minus `base`, as float32/int arrays for the wire."""
    out = {}
    for k, v in model.state_dict().items():
        cur = v.detach().cpu().numpy()
        # np.asarray: a 0-d buffer (BatchNorm's num_batches_tracked) would otherwise
        # become a numpy scalar, which the wire turns into a plain int, and validation
        # rejects a declared array that arrives as an int
        out[k] = np.asarray(cur - np.asarray(base[k], dtype=cur.dtype), dtype=cur.dtype)
    return out

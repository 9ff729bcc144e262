"""FedGH: a generalized global prediction header trained on the server.

Yi, Wang, Liu, Shi, Yu, "FedGH: Heterogeneous Federated Learning with Generalized
Global Header", ACM MM 2023 (arXiv:2303.13137). Reference code: the authors'
github.com/LipingYi/FedGH (FedGH_Codes/experiments/FLHetero/FedGH.py and FedGH_mh.py,
the model-heterogeneous run) and TsingZ0/HtFLlib (system/flcore/clients/clientgh.py,
system/flcore/servers/servergh.py). The paper's text is not among the repository's
copies (/work/shared/papers), so no equation numbers are quoted; the steps below are
its Fig. 1 workflow, and where the two codes differ the choice is a named option.

Every client model is features(x) -> h -> head(h) (fedbus.algorithms.core.split): the
feature extractors may differ between clients (a model group), the header (the
sub-module named by the network's `head_module`, a Linear(D, C) in every fedbus
network but MP-FedCL's MLP) must have the same weights' names and shapes on every
client. A client whose head differs raises a ValueError naming the mismatch.

Each round (Fig. 1, steps 4, 1, 2, 3):
- down: the task carries {"head": {name: float32 array}}, the global header's state
  dict with the module prefix stripped ("weight" [C, D], "bias" [C] for a Linear), so
  that networks naming their head differently ("fc", "fc2") share it. The client
  replaces its own header with it (step 4; HtFLlib's `set_parameters`, from round 0
  on, as HtFLlib; the authors' code lets round 0 start from each client's own head).
- the client trains its whole model (extractor and header) with cross-entropy over
  run.batches() (step 1; the optimiser is the [train] one, its momentum emptied at
  every task or kept, as train.optimizer_state says).
- up: the client's local averaged representations (LARs, step 2): per class c the
  mean of f(x) over its training samples of c, {"protos": float32 [C, D],
  "counts": int64 [C]} (count 0 = class absent, zero row). PARAM `protos`:
    "after"      (default; Fig. 1 step 2, the authors' code and HtFLlib's
                 `collect_protos`): one pass over the training set after local
                 training, the model in eval mode (fedbus.algorithms.core.protos);
    "last_epoch" the features the last local epoch computed anyway (train mode,
                 detached; no extra pass). Where the run stopped inside an epoch
                 (partial work, a time budget) that epoch's batches so far are
                 used; a class not met there is sent as absent.
- the server trains the global header with cross-entropy on the (LAR, class) pairs
  it received (step 3): SGD without momentum, a fresh optimiser each aggregation (as
  HtFLlib's `train_head`), PARAM `server_epochs` passes over the pairs in minibatches
  of PARAM `server_batch_size`, shuffled by the server's own seeded generator.
  Defaults follow the authors' code, whose server loop takes one SGD step per
  received LAR, one pass per round: server_epochs = 1, server_batch_size = 1.
  HtFLlib's choice is server_epochs = 100 (main.py's -se) over shuffled minibatches
  of the clients' batch size (server_batch_size = 0 means train.batch_size).
  PARAM `server_lr` = 0.01 (HtFLlib's server_learning_rate; the authors' code steps
  the header with an optimiser built with its --lr, 0.01). The authors' loop never
  zeroes the header's gradients and steps a client's optimiser (momentum 0.9,
  weight decay) that does not hold the header's parameters: we take plain,
  gradient-zeroed SGD steps on the header, as HtFLlib does (a defect of the loop, not
  a choice worth an option).
  The header is initialised from the seeded network of client 0 (ctx.make_model(0)'s
  head, as HtFLlib's server copies client 0's head; the authors' code builds a
  separate FC) and persists across rounds.
  The header's forward runs the head sub-module alone in eval mode (a head() that
  adds dropout, as FedProto's CNN does, would draw from the global RNG; a header
  trained on class means does not want it).

Staleness and weights: each pair's cross-entropy is multiplied by its client's engine
staleness weight w (1/sqrt(1+staleness)) and a minibatch's loss is the mean of
w_b * CE_b over its pairs (not divided by the sum of w, so that a stale LAR takes a
smaller step even in a minibatch of one; all-fresh it is the plain mean of the
codes). Every LAR weighs the same otherwise, whatever the class's sample count (both
codes). Partial work: a client that ran fewer epochs still sends the LARs of its
model as it stands. An aggregation without updates (or without any present class)
leaves the header and the generator untouched.

Evaluation: the authors' code scores each client's model right after its local
training (its own extractor and its header as trained: "trained_acc"); HtFLlib scores
each client's extractor with the freshly received global header (its evaluate() runs
after send_parameters()). evaluate() reports both: "local_head_acc"/"local_head_loss"
(the model as trained) and "global_head_acc"/"global_head_loss" (the eval task's
header swapped in, then the client's own put back); PARAM `eval_head` = "local"
(default, the authors' code) or "global" (HtFLlib) picks which is "acc"/"loss".

Determinism: the server's only randomness is the shuffling, drawn from its own
torch.Generator seeded with ctx.seed; the generator's state and the header are its
state_dict(), so a resumed server reproduces its outputs bit for bit.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             ServerHandler, to_tensor)
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import Params, opt
from fedbus.algorithms.core.protos import class_sums, local_prototypes
from fedbus.algorithms.core.split import head_prefix
from fedbus.algorithms.core.training import LocalClient, staleness_metrics


def server_training_params(over: str, epochs: tuple[int, str], batch_size: tuple[int, str],
                           lr: tuple[float, str] | None = None, *,
                           sampled: bool = False) -> dict[str, Any]:
    """The PARAMS entries of a server that trains a model of its own every aggregation on
    what the clients sent (FedGH's header, FedTGP's prototype generator, FedGen's
    generator), each given as (the algorithm's default, where it comes from: the help
    text's citation); `over` names the items of a server minibatch.
    - "server_epochs": passes over the items received in the aggregation, shuffled, in
      minibatches of server_batch_size; `sampled` (FedGen: its labels are drawn from p(y),
      not received): steps, each on a freshly drawn minibatch;
    - "server_batch_size": items per server step, 0 = train.batch_size (the clients'
      minibatch, HtFLlib's choice; `server_batch_size` resolves it);
    - "server_lr" (where `lr` is given; FedGen's Adam has its own generator_lr): the
      server's SGD learning rate."""
    out = {
        "server_epochs": opt(epochs[0], (f"server steps per aggregation, each on a fresh "
                                         f"minibatch of {over}" if sampled else
                                         f"passes over the received {over} per aggregation")
                             + f" ({epochs[1]})", min=0),
        "server_batch_size": opt(batch_size[0], f"{over} per server step, 0 = train.batch_size "
                                 f"({batch_size[1]})", min=0),
    }
    if lr is not None:
        out["server_lr"] = opt(lr[0], f"server SGD learning rate ({lr[1]})", min=0.0)
    return out


def server_batch_size(handler: Params) -> int:
    """PARAM server_batch_size, 0 read as train.batch_size (server_training_params)."""
    return int(handler.param("server_batch_size")) or int(handler.ctx.train["batch_size"])


def head_module(model: nn.Module) -> nn.Module:
    """The sub-module a network's head() applies (its `head_module` attribute)."""
    return getattr(model, head_prefix(model)[:-1])


def header_weights(module: nn.Module) -> dict[str, np.ndarray]:
    """A header's state dict, names without the module prefix, as float arrays."""
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_header(module: nn.Module, weights: Mapping[str, Any]) -> None:
    """Replace a header's weights with `weights` (names without prefix); a header of
    another structure raises a ValueError (FedGH needs one header shape)."""
    state = module.state_dict()
    if set(state) != set(weights) or any(tuple(np.shape(weights[k])) != tuple(v.shape)
                                         for k, v in state.items()):
        mine = {k: tuple(v.shape) for k, v in state.items()}
        theirs = {k: tuple(np.shape(v)) for k, v in weights.items()}
        raise ValueError(f"fedgh: every client needs the same header; this client's head "
                         f"{mine} differs from the global header {theirs}")
    module.load_state_dict({k: to_tensor(weights[k], v.device, v.dtype)
                            for k, v in state.items()})


def score_both_heads(ctx, header: Mapping[str, Any], eval_global: bool) -> dict[str, float]:
    """The client's model scored with its own header and with `header` swapped in (put
    back after): "acc"/"loss" of the one `eval_global` picks, both as local_head_* and
    global_head_*. FedGen's evaluation too."""
    local = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
    module = head_module(ctx.model)
    backup = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        load_header(module, header)
        glob = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
    finally:
        module.load_state_dict(backup)
    out = dict(glob if eval_global else local)
    out.update(local_head_acc=local["acc"], local_head_loss=local["loss"],
               global_head_acc=glob["acc"], global_head_loss=glob["loss"])
    return out


class FedGHServer(Params, ServerHandler):
    needs_same_head: ClassVar[bool] = True  # the header is shared across the group
    # the upload is {protos (LARs), counts} only (either `protos` source): record-level DP
    DP_LEVELS: ClassVar[tuple[str, ...]] = ("record",)
    PARAMS: ClassVar[dict[str, Any]] = {
        **server_training_params(
            "LARs", epochs=(1, "authors' code: 1; HtFLlib: 100"),
            batch_size=(1, "authors' code: 1; HtFLlib: 0"),
            lr=(0.01, "HtFLlib's server_learning_rate; the authors' --lr")),
        "protos": opt("after", "LARs from: after = one eval-mode pass after local training "
                      "(paper Fig. 1, both codes); last_epoch = the features of the last "
                      "local epoch (no extra pass)", choices=("after", "last_epoch")),
        "eval_head": opt("local", "acc scores: local = the model as trained (authors' code); "
                         "global = own extractor with the global header (HtFLlib)",
                         choices=("local", "global")),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        self.gen = torch.Generator().manual_seed(int(ctx.seed))
        self.header = copy.deepcopy(head_module(ctx.make_model(0))).cpu().float()
        self.header.eval()
        self._head = header_weights(self.header)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # Arrays are replaced, never written in place, after aggregation.
        return {"head": self._head}

    def header_loss(self, protos: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """mean_b w_b CE(header(p_b), y_b) over a minibatch."""
        ce = F.cross_entropy(self.header(protos), labels, reduction="none")
        return (weights * ce).mean()

    def train_header(self, protos: torch.Tensor, labels: torch.Tensor,
                     weights: torch.Tensor) -> float:
        """server_epochs of SGD over shuffled minibatches; the last epoch's mean loss."""
        epochs = int(self.param("server_epochs"))
        bs = server_batch_size(self)
        optimizer = torch.optim.SGD(self.header.parameters(), lr=float(self.param("server_lr")))
        m = len(labels)
        last = float("nan")
        for _ in range(epochs):
            order = torch.randperm(m, generator=self.gen)
            total, steps = 0.0, 0
            for i in range(0, m, bs):
                idx = order[i:i + bs]
                loss = self.header_loss(protos[idx], labels[idx], weights[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item()
                steps += 1
            last = total / steps
        return last

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        rows, labels, weights = [], [], []
        for u in updates:
            counts = np.asarray(u.payload["counts"])
            present = np.flatnonzero(counts > 0)
            rows.append(np.asarray(u.payload["protos"], dtype=np.float32)[present])
            labels.append(present.astype(np.int64))
            weights.append(np.full(len(present), float(u.weight), dtype=np.float32))
        m = int(sum(len(y) for y in labels))
        metrics["lars"] = float(m)
        if m == 0:
            return metrics
        # client by client, class by class (the authors' order); shuffled per epoch
        protos = torch.from_numpy(np.concatenate(rows))
        y = torch.from_numpy(np.concatenate(labels))
        w = torch.from_numpy(np.concatenate(weights))
        metrics["classes_received"] = float(len(np.unique(y.numpy())))
        metrics["server_loss"] = self.train_header(protos, y, w)
        self._head = header_weights(self.header)
        return metrics

    def update_spec(self) -> dict[str, tuple[str, tuple[int | None, ...]]]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {"protos": ("float32", (c, d)), "counts": ("int64", (c,))}

    def state_dict(self) -> dict[str, Any]:
        return {"header": {k: v.copy() for k, v in self._head.items()},
                "generator": self.gen.get_state().numpy().copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_header(self.header, state["header"])
        self._head = header_weights(self.header)
        self.gen.set_state(torch.from_numpy(np.array(state["generator"], dtype=np.uint8,
                                                     copy=True)))


class FedGHClient(LocalClient):
    """Replaces its header with the global one, trains the whole model with CE and
    uploads its class-mean representations (LARs)."""

    PARAMS: ClassVar[dict[str, Any]] = FedGHServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.num_classes = ctx.num_classes
        self.last_epoch = self.param("protos") == "last_epoch"
        self.eval_global = self.param("eval_head") == "global"
        self._collect = False
        self._step, self._per_epoch = 0, 1
        self._sums: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.ctx.model
        h = model.features(x)
        if self._collect:
            if self._step % self._per_epoch == 0:  # a new epoch: forget the last one's
                self._sums = self._counts = None
            s, c = class_sums(h.detach().float(), y, self.num_classes)
            self._sums = s if self._sums is None else self._sums + s
            self._counts = c if self._counts is None else self._counts + c
            self._step += 1
        return F.cross_entropy(model.head(h), y)

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        ctx = self.ctx
        load_header(head_module(ctx.model), task["head"])
        self._collect = self.last_epoch
        self._step, self._per_epoch = 0, run.steps_per_epoch()
        self._sums = self._counts = None
        try:
            self.run_local(run)
        finally:
            self._collect = False
        c, d = self.num_classes, ctx.feature_dim
        if len(ctx.train_y) == 0:
            return {"protos": np.zeros((c, d), np.float32), "counts": np.zeros(c, np.int64)}
        if not self.last_epoch:
            protos, counts = local_prototypes(ctx.model, ctx.train_x, ctx.train_y, c)
            return {"protos": protos, "counts": counts}
        if self._sums is None:  # no batch ran (a zero-epoch task)
            return {"protos": np.zeros((c, d), np.float32), "counts": np.zeros(c, np.int64)}
        means = self._sums / self._counts.clamp(min=1).unsqueeze(1).to(self._sums.dtype)
        out = {"protos": means.cpu().numpy().astype(np.float32),
               "counts": self._counts.cpu().numpy().astype(np.int64)}
        self._sums = self._counts = None
        return out

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        return score_both_heads(self.ctx, task["head"], self.eval_global)


ALGORITHM = Algorithm("fedgh", FedGHServer, FedGHClient,
                      "FedGH (Yi et al. 2023): a global header trained on the server from "
                      "clients' class-mean representations")

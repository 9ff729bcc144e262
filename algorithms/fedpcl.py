"""FedPCL: federated prototype-wise contrastive learning over fixed pre-trained backbones.

Tan, Long, Ma, Liu, Zhou, Jiang, "Federated Learning from Pre-Trained Models: A Contrastive
Learning Approach", NeurIPS 2022 (arXiv:2209.10083). Only the abstract is here
(../shared/papers/fedpcl-tan-neurips2022.txt), so the authors' code is the specification:
github.com/yuetan031/FedPCL @ 0c3895b, lib/update.py (`LocalUpdate.update_weights_lg`,
`LocalTest.test_inference_twoway`), lib/losses.py (`ConLoss`), lib/utils.py (`agg_func`,
`proto_aggregation`), exps/federated_main.py (`FedPCL`, `fed_main`), lib/models/models.py
(`ProjandDeci`), lib/options.py (defaults). No equation numbers exist in the text here; each
choice names the code's function it follows. The audit: docs/FIDELITY.md (fedpcl).

The model: every client runs the same fixed backbones and trains its own projection
(`fed_main`: backbones in eval mode, one `ProjandDeci` per client). In fedbus that is the
registry arch ``frozen:BACKBONES`` (fedbus.models.frozen: representation = normalize(relu(
proj(concatenated backbone features))), the code's fc1 -> ReLU -> L2-normalise). The handler
works on any network (a fully trained one too), L2-normalising its features itself (the
identity on the frozen net's, which already are). What is shared is prototypes only, never
weights: "Sharing prototypes rather than learnable model parameters allows each client to
fuse the representations in a personalized way" (abstract); the projections are never
averaged (`FedPCL` keeps `local_model_list[idx]` per client), so clients may run different
projections (a model group) as long as they share one feature dim.

Client i, per task (`update_weights_lg`, alg = fedpcl):
- loss, PARAM `loss`:
    "code" (default; the code's loss2): the sum over the prototype sets P_j the task carries
           (every client's local prototypes, the client's own included; a class missing from
           P_j filled with the global average prototype, as the code does) of ConLoss(z, y,
           P_j): a supervised-contrastive loss whose anchors are prototypes. The code feeds
           two views of each image (TwoCropTransform); its digit transforms are deterministic
           (Resize, ToTensor, Normalize), so the two views are the same image and fedbus
           contrasts the batch's normalised features z twice over (V = 2 copies, 2B rows).
           Row r (sample r mod B, label y_r) has the anchor a_r = P_j[y_r]; with
               l_rk = a_r . z_k / tau       (k over the 2B rows, k != r)
               L_r  = -(tau / tau_base) 1/|Pos_r| sum_{p in Pos_r} (l_rp - log sum_{k != r}
                      exp(l_rk)),   Pos_r = {p != r : y_p = y_r}
           ConLoss = the mean of L_r over the 2B rows (tau = tau_base = 0.07: ConLoss's
           defaults, the factor is 1). A row whose class has no prototype anywhere (possible
           only with partial participation; the code would fail on it) has no anchor and
           is left out of the mean; its features stay in the others' denominators.
    "global_local" (PFLlib's reading, system/flcore/clients/clientpcl.py, a third party's):
           L_G + 1/M sum_j L_P,j, each a cross-entropy of the softmax over classes of
           z . P[k] / tau (the sample as anchor, the class prototypes as contrast set), L_G
           over the global average prototypes, L_P,j over client j's. Offered for comparison
           with PFLlib's FedPCL; not the authors' code.
  PARAM `temperature` tau = 0.07 (ConLoss(temperature=0.07)).
  PARAM `ce_weight` (default 0): weight of the cross-entropy of the network's head. The code
  computes it (loss1 = NLLLoss of ProjandDeci's log-softmax) but back-propagates loss =
  loss2 only; the abstract describes the method as prototype-wise contrastive learning and
  the code predicts by prototypes, never by the head, so fedbus reads the paper's loss as the
  contrastive term alone; ce_weight > 0 adds the head's cross-entropy (fedbus's linear head
  on the representation, not ProjandDeci's fc2 -> ReLU -> normalise) for those who read
  the unused loss1 as intended.
- when the contrastive term starts, PARAM `wait_for_all` (default True: the code's `if
  len(global_protos) == args.num_users`, i.e. from round 1 with every client every round):
  only once the server holds prototypes from every client; False: as soon as it holds any.
  Until then (and with ce_weight = 0) the loss is empty and no step is taken: the code's
  round-0 loss is 0 * loss1, whose only effect is its Adam's weight decay on the projection.
- optimiser, PARAM `optimizer`: "adam" (default; update.py: torch.optim.Adam(lr=args.lr,
  weight_decay=1e-4), built anew every round, i.e. train.optimizer_state = "fresh"; the
  code's lr is 0.001: set train.lr) with PARAM `adam_weight_decay` = 1e-4 (hard-coded in
  update.py), or "sgd" (the [train] section's SGD). Only the parameters with requires_grad
  are stepped (the frozen net's projection and head).
- then its local prototypes (`update_weights_lg`'s last loop + `agg_func`): per class the
  mean of the normalised features over its training set, model in eval mode, after
  training; uploaded as {"protos" float32 [C, D], "counts" int64 [C]} (counts = class sizes,
  0 = absent). The code's loop runs over its shuffled drop_last loader, so it leaves out up to
  a batch of samples at random; fedbus uses every sample.
- evaluate, PARAM `infer`: "local" (default; `test_inference_twoway`: the class of the
  nearest of the client's OWN local prototypes, by MSE, among the classes it holds: the
  prototypes of its last task) or "global" (the nearest global average prototype among the
  classes that have one). "acc" and "proto_acc" both report that prediction (the method has
  no other classifier); "loss" (the head's cross-entropy) only with ce_weight > 0.

Server, per aggregation (`FedPCL` in federated_main.py):
- each update replaces its client's stored prototype set (the code's `local_protos[idx]`,
  which persists across rounds), unless the server holds a newer one from that client (a
  late update folded after a fresher one): the latest version wins;
- global average prototypes (`proto_aggregation`): per class, the unweighted mean over the
  stored sets that hold the class (counts > 0). No weights, no staleness weights: the code
  averages every client's latest set as it stands, and a stale set counts as it is;
- the task is every stored set (`global_protos = copy.deepcopy(local_protos)`, all sent to
  every client): {"sets" float32 [M, C, D] (missing classes filled with the average, as the
  client-side fill of the code), "sets_has" bool [M, C], "avg" float32 [C, D], "avg_has"
  bool [C]}; M = 0 while the regulariser waits (wait_for_all). Its size grows with the
  clients: M x C x D floats per task, as in the code.

Relays and secure aggregation: no merge rule. Every client's set must reach the server as
it is (each is sent back to every client), so there is no sum to pre-add; relays forward
updates one by one and secure aggregation is refused. DP_LEVELS is empty: the sets are
re-broadcast one by one, beyond what record-level DP's accounting of one upload covers.
Classification only.

Not offered: the code's `add_noise_img` / `add_noise_proto` perturbations (off by default
there), its ViT backbones and its augmentations for other datasets (fedbus trains on the
partition's tensors as they are).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             ServerHandler, classification_only, to_tensor)
from fedbus.algorithms.core.metrics import HeadScores
from fedbus.algorithms.core.params import Params, opt
from fedbus.algorithms.core.protos import class_means, embeddings, nearest_prototype
from fedbus.algorithms.core.training import LocalClient, staleness_metrics

#: the code's two augmented views of each image (TwoCropTransform)
VIEWS = 2


# --- the losses ---------------------------------------------------------------------------------

def prototype_contrast(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                       has: torch.Tensor, temperature: float, base_temperature: float = 0.07,
                       views: int = VIEWS) -> torch.Tensor:
    """The code's ConLoss (lib/losses.py, contrast_mode "all") with `views` copies of the
    batch as its views: anchors the prototypes protos[y] of each row's class, contrast set
    the V B rows of z (module doc). Rows whose class has no prototype (has[y] False), or no
    positive (V = 1 and a class alone in the batch), are left out of the mean. z [B, D]
    normalised, protos [C, D], has bool [C]."""
    if len(y) == 0:
        return z.sum() * 0.0
    feats = z.repeat(views, 1)  # view-major, as torch.cat(torch.unbind(features, dim=1))
    labels = y.repeat(views)
    n = len(labels)
    logits = protos.to(z.dtype)[labels] @ feats.T / temperature  # [VB, VB]
    not_self = ~torch.eye(n, dtype=torch.bool, device=z.device)
    positive = (labels.unsqueeze(0) == labels.unsqueeze(1)) & not_self
    log_prob = logits - torch.logsumexp(logits.masked_fill(~not_self, float("-inf")), dim=1,
                                        keepdim=True)
    npos = positive.sum(1)
    mean_pos = (log_prob * positive).sum(1) / npos.clamp(min=1)
    keep = has[labels] & (npos > 0)
    if not bool(keep.any()):
        return z.sum() * 0.0
    return -(temperature / base_temperature) * mean_pos[keep].mean()


def prototype_softmax(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                      has: torch.Tensor, temperature: float) -> torch.Tensor:
    """PFLlib's term: CE(z . protos^T / tau, y) over the classes with a prototype, averaged
    over the samples whose class has one."""
    keep = has[y]
    if not bool(keep.any()):
        return z.sum() * 0.0
    logits = (z @ protos.to(z.dtype).T / temperature).masked_fill(~has, float("-inf"))
    return F.cross_entropy(logits[keep], y[keep])


# --- server -------------------------------------------------------------------------------------

class FedPCLServer(Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {
        "loss": opt("code", "client loss: code = the sum over every client's prototype set of "
                    "ConLoss (prototype anchors, lib/losses.py); global_local = PFLlib's "
                    "reading, L_G + mean_j L_P,j (softmax over class prototypes)",
                    choices=("code", "global_local")),
        "temperature": opt(0.07, "temperature tau of the contrastive loss (the code's "
                           "ConLoss(temperature=0.07))", min=1e-6),
        "ce_weight": opt(0.0, "weight of the head's cross-entropy (0 = the paper's loss, "
                         "contrastive only; the code computes it and does not use it)", min=0.0),
        "wait_for_all": opt(True, "start the contrastive term only once every client's "
                            "prototypes are at the server (the code); false: from the first"),
        "optimizer": opt("adam", "adam = the code's Adam (lr = train.lr; the code's 0.001) "
                         "with adam_weight_decay; sgd = the [train] section's SGD",
                         choices=("adam", "sgd")),
        "adam_weight_decay": opt(1e-4, "Adam's weight decay (hard-coded 1e-4 in the code's "
                                 "update.py)", min=0.0),
        "infer": opt("local", "prediction: local = nearest of the client's own local "
                     "prototypes (test_inference_twoway); global = nearest global average "
                     "prototype", choices=("local", "global")),
    }
    # every client's set is sent back as it is: no sum to pre-add at a relay (module doc)
    MERGE = None
    DP_LEVELS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx):
        super().__init__(ctx)
        k, c, d = ctx.clients, ctx.num_classes, ctx.feature_dim
        self.sets = np.zeros((k, c, d), dtype=np.float32)  # each client's latest set
        self.sets_has = np.zeros((k, c), dtype=bool)
        self.version = np.full(k, -1, dtype=np.int64)  # -1 = nothing from that client yet
        self.avg = np.zeros((c, d), dtype=np.float32)
        self.avg_has = np.zeros(c, dtype=bool)

    # -- the server step ---------------------------------------------------------------------
    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        replaced = 0
        for u in updates:
            if u.version < self.version[u.client]:
                continue  # a newer set of this client is already here
            self.sets[u.client] = np.asarray(u.payload["protos"], dtype=np.float32)
            self.sets_has[u.client] = np.asarray(u.payload["counts"]) > 0
            self.sets[u.client][~self.sets_has[u.client]] = 0.0
            self.version[u.client] = u.version
            replaced += 1
        if updates:
            self.avg, self.avg_has = average_sets(self.sets, self.sets_has)
        metrics["sets_replaced"] = float(replaced)
        metrics["clients_with_prototypes"] = float((self.version >= 0).sum())
        metrics["classes"] = float(self.avg_has.sum())
        return metrics

    def active(self) -> bool:
        """Whether tasks carry the prototype sets (the contrastive term's start)."""
        reported = self.version >= 0
        return bool(reported.all()) if self.param("wait_for_all") else bool(reported.any())

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        if not self.active():
            sets, sets_has = np.zeros((0, c, d), np.float32), np.zeros((0, c), bool)
        else:
            held = np.flatnonzero(self.version >= 0)
            sets, sets_has = filled_sets(self.sets[held], self.sets_has[held], self.avg,
                                         self.avg_has)
        return {"sets": sets, "sets_has": sets_has, "avg": self.avg, "avg_has": self.avg_has}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"avg": self.avg, "avg_has": self.avg_has}

    def update_spec(self) -> dict[str, tuple[str, tuple[int | None, ...]]]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {"protos": ("float32", (c, d)), "counts": ("int64", (c,))}

    def state_dict(self) -> dict[str, Any]:
        # "protos"/"has": the names the run's embeddings plot reads the global prototypes by
        return {"sets": self.sets.copy(), "sets_has": self.sets_has.copy(),
                "version": self.version.copy(), "protos": self.avg.copy(),
                "has": self.avg_has.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sets = np.array(state["sets"], dtype=np.float32, copy=True)
        self.sets_has = np.array(state["sets_has"], dtype=bool, copy=True)
        self.version = np.array(state["version"], dtype=np.int64, copy=True)
        self.avg = np.array(state["protos"], dtype=np.float32, copy=True)
        self.avg_has = np.array(state["has"], dtype=bool, copy=True)


def average_sets(sets: np.ndarray, sets_has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The code's `proto_aggregation`: per class the unweighted mean of the sets holding it.
    sets [K, C, D], sets_has [K, C] -> (avg float32 [C, D], has bool [C])."""
    held = np.asarray(sets_has, dtype=np.float64)
    n = held.sum(axis=0)
    total = np.einsum("kc,kcd->cd", held, np.asarray(sets, dtype=np.float64))
    has = n > 0
    avg = np.where(has[:, None], total / np.maximum(n, 1.0)[:, None], 0.0)
    return avg.astype(np.float32), has


def filled_sets(sets: np.ndarray, sets_has: np.ndarray, avg: np.ndarray,
                avg_has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each set with the classes it lacks taken from the average (update_weights_lg: `if
    label not in global_protos[i].keys(): global_protos[i][label] = global_avg_protos[label]`).
    Returns (float32 [M, C, D], has bool [M, C])."""
    fill = ~sets_has & avg_has[None, :]
    out = np.where(fill[:, :, None], avg[None], sets).astype(np.float32)
    return out, sets_has | fill


# --- client -------------------------------------------------------------------------------------

class FedPCLClient(LocalClient):
    """Trains its own projection with the prototype-wise contrastive loss against every
    client's prototypes; uploads its local prototypes; predicts by the nearest one."""

    PARAMS: ClassVar[dict[str, Any]] = FedPCLServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        classification_only(ctx, "fedpcl")
        self.num_classes = ctx.num_classes
        self.loss_form = self.param("loss")
        self.temperature = float(self.param("temperature"))
        self.ce_weight = float(self.param("ce_weight"))
        if self.param("optimizer") == "adam":
            ctx.optimizers.remove(self.optimizer)  # the SGD the base class made
            self.optimizer = torch.optim.Adam(
                [p for p in ctx.model.parameters() if p.requires_grad], lr=ctx.train["lr"],
                weight_decay=float(self.param("adam_weight_decay")))
            ctx.optimizers.append(self.optimizer)  # started fresh per task as the code's
        self._sets: torch.Tensor | None = None  # the task's prototype sets [M, C, D]
        self._sets_has: torch.Tensor | None = None
        self._avg: torch.Tensor | None = None
        self._avg_has: torch.Tensor | None = None
        # the client's own local prototypes of its last task (infer = "local")
        self._own: torch.Tensor | None = None
        self._own_has: torch.Tensor | None = None

    # -- training ----------------------------------------------------------------------------
    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        dev = self.ctx.device
        self._sets = to_tensor(task["sets"], dev, torch.float32)
        self._sets_has = to_tensor(task["sets_has"], dev, torch.bool)
        self._avg = to_tensor(task["avg"], dev, torch.float32)
        self._avg_has = to_tensor(task["avg_has"], dev, torch.bool)
        try:
            self.run_local(run)
        finally:
            self._sets = self._sets_has = self._avg = self._avg_has = None
        protos, counts = self.local_protos()
        self._own = torch.from_numpy(protos).to(dev)
        self._own_has = torch.from_numpy(counts > 0).to(dev)
        return {"protos": protos, "counts": counts}

    def contrastive(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The contrastive term of PARAM loss against the task's sets; None before it starts."""
        if self._sets is None or len(self._sets) == 0:
            return None
        if self.loss_form == "global_local":
            local = sum(prototype_softmax(z, y, p, h, self.temperature)
                        for p, h in zip(self._sets, self._sets_has)) / len(self._sets)
            return prototype_softmax(z, y, self._avg, self._avg_has, self.temperature) + local
        return sum(prototype_contrast(z, y, p, h, self.temperature)
                   for p, h in zip(self._sets, self._sets_has))

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        model = self.ctx.model
        h = model.features(x)
        loss = self.contrastive(F.normalize(h, dim=1), y)
        if self.ce_weight > 0:
            ce = self.ce_weight * F.cross_entropy(model.head(h), y)
            loss = ce if loss is None else loss + ce
        return loss

    def local_protos(self) -> tuple[np.ndarray, np.ndarray]:
        """(protos float32 [C, D], counts int64 [C]): per class the mean normalised feature
        over the training set, eval mode (`agg_func` over update_weights_lg's last loop)."""
        ctx = self.ctx
        if len(ctx.train_y) == 0:
            return (np.zeros((self.num_classes, ctx.feature_dim), np.float32),
                    np.zeros(self.num_classes, np.int64))
        z = F.normalize(embeddings(ctx.model, ctx.train_x), dim=1)
        means, counts = class_means(z, ctx.train_y, self.num_classes)
        return (means.cpu().numpy().astype(np.float32), counts.cpu().numpy().astype(np.int64))

    # -- evaluation --------------------------------------------------------------------------
    @torch.inference_mode()
    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        if len(ctx.test_y) == 0:
            return {"acc": float("nan"), "proto_acc": float("nan"), "num_test": 0}
        if self.param("infer") == "global":
            protos = to_tensor(task["avg"], ctx.device, torch.float32)
            allowed = to_tensor(task["avg_has"], ctx.device, torch.bool)
        else:
            if self._own is None:  # evaluated before its first task: its current prototypes
                p, c = self.local_protos()
                self._own, self._own_has = (torch.from_numpy(p).to(ctx.device),
                                            torch.from_numpy(c > 0).to(ctx.device))
            protos, allowed = self._own, self._own_has
        h = embeddings(ctx.model, ctx.test_x)
        if bool(allowed.any()):
            pred = nearest_prototype(F.normalize(h, dim=1), protos, allowed)
            acc = float((pred == ctx.test_y).float().mean().item())
        else:
            acc = 0.0
        out = {"acc": acc, "proto_acc": acc, "num_test": int(len(ctx.test_y))}
        if self.ce_weight > 0:
            head = HeadScores()
            head.add(ctx.model.head(h), ctx.test_y)
            out["loss"] = head.result()["loss"]
        return out

    # -- state -------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"own": None if self._own is None else self._own.clone(),
                "own_has": None if self._own_has is None else self._own_has.clone()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        own, has = state.get("own"), state.get("own_has")
        self._own = None if own is None else own.to(self.ctx.device)
        self._own_has = None if has is None else has.to(self.ctx.device)


ALGORITHM = Algorithm("fedpcl", FedPCLServer, FedPCLClient,
                      "FedPCL (Tan et al. 2022): prototype-wise contrastive learning of "
                      "personal projections over fixed pre-trained backbones")

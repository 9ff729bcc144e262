"""FedNH: class prototypes spread uniformly on the hypersphere, smoothly infused with semantics.

Dai, Chen, Li, Heinecke, Sun, Xu, "Tackling Data Heterogeneity in Federated Learning with
Class Prototypes", AAAI 2023 (arXiv:2212.02758). The paper text here is its abstract and the
authors' AAAI poster (../shared/papers/fednh-dai-aaai2023.txt): eq. (1), the uniform
initialisation, and Algorithm 1's skeleton, line 8 (head update) and line 10 (body update).
Where that text is silent, the authors' code is the specification: github.com/Yutong-Dai/FedNH
(MIT) @ 60c3161, src/flbase/strategies/FedNH.py (`FedNHClient._estimate_prototype`,
`FedNHServer.aggregate`), FedUH.py (`FedUHClient._initialize_model`, `FedUHClient.training`),
models/CNN.py (`Conv2CifarNH.forward`), utils.py (`setup_optimizer`), strategies/FedAvg.py
(`FedAvgServer.aggregate`), main.py and experiments/gen_script.py / FedNH_dir.sh (the settings
of the paper's runs). Each choice below that the text here leaves open names the code's
function or setting it follows ("code", "the code's"); the audit, paper | code | fedbus per
equation: docs/FIDELITY.md (fednh).

The model (Algorithm 1 line 1: "the body theta; the head W in R^{|C| x d}"). The body is the
fedbus network's `features` (every weight not under its `head_module`, buffers included); its
own linear head is not used. The head is the class prototypes W, one unit row per class, and
the classifier is cosine (code, `Conv2CifarNH.forward`):
    logits = s * normalize(f_theta(x)) . W^T,
normalize the row-wise L2 normalisation (norm clamped at 1e-12, as the code's), s a scalar.
PARAM `scale_init` (default 1.0: `Conv2CifarNH`, the CNN of the paper's CIFAR runs; the code's
`ResNetModNH` starts at 20.0) and PARAM `learn_scale` (default True: s is a trainable
parameter of the code's model; False with scale_init = 30 is the code's
`FedNH_fix_scaling = True`). Clients never train W (code: `prototype.requires_grad_(False)`
in `FedUHClient._initialize_model`); they train the body and s.

Server, initialisation (eq. 1): max M^2 s.t. ||w_i - w_j||^2 >= M^2, ||w_i|| = 1, i != j.
PARAM `init`:
    "uniform"    (default; eq. 1): an exact maximiser where one is known in closed form:
                 d = 2: the |C| points at angles 2 pi c / |C| on the circle (also the code's
                 FedNH_head_init = "uniform", which it offers for d = 2 only); |C| <= d: the
                 regular simplex e_c - (1/|C|) 1 in the first |C| coordinates, normalised
                 (pairwise cosine -1/(|C| - 1), the largest minimum distance
                 sqrt(2 |C| / (|C| - 1)); a ReLU feature on axis c scores class c highest);
                 |C| = d + 1: the same simplex in the Helmert basis of the plane orthogonal
                 to 1; otherwise a numerical approximation (`uniform_prototypes`: projected
                 gradient on the sphere of a soft maximum of the pairwise cosines, seeded,
                 2000 steps, deterministic);
    "orthogonal" (the code's default, FedNH_head_init = "orthogonal":
                 `torch.nn.init.orthogonal_`): rows of a random orthogonal matrix from the
                 server's seed, normalised (for |C| <= d they are orthonormal already: pairwise
                 cosine 0, an approximate solution of eq. 1).

Client k, per task (Algorithm 1 line 6, (theta_k, mu_k) <- ClientUpdate(theta, W); code,
`FedUHClient.training` + `FedNHClient.upload`):
- loads the global body theta and scale s, and the task's prototypes W (fixed);
- trains body and s by SGD on the cross-entropy of the cosine logits over `run.batches()` (the
  engine's seeded minibatches, time budget and partial work), each step's gradient clipped to
  global norm PARAM `clip_norm` (default 10, code: `clip_grad_norm_(max_norm=10)`; 0 = off);
  the [train] section's lr, momentum and weight decay, with a fresh optimiser every task
  (train.optimizer_state = "fresh", as the code's `setup_optimizer` per round). The code's
  paper runs (gen_script.py) use lr 0.01, momentum 0.9, weight decay 1e-5, 5 local epochs,
  batch size 64: set them in [train] to match. The learning rate of a task made at round
  (version) r is PARAM `lr_schedule`:
      "diminishing" (default; the paper runs' --client_lr_scheduler): train.lr * lr_decay^r,
                    PARAM `lr_decay` (default 0.99, the code's yaml lr_decay_per_round);
      "stepwise"    (main.py's default scheduler): train.lr while r + 1 < rounds // 2 (the
                    code counts rounds from 1), then train.lr / 10;
      "constant":   train.lr.
- uploads (code, `FedNHClient._estimate_prototype`) after training, one eval-mode pass over its
  training set: mu_{k,c} = normalize(mean over its samples of class c of normalize(f(x))) for
  each class it holds (zero rows for the others) as "protos" float32 [C, D], with its class
  counts n_{k,c} as "counts" int64 [C] (the code uploads n_{k,c} mu_{k,c} and the counts: the
  same information), and "delta" = its body and s minus the ones it was sent (s under the key
  "fednh.scale", shape [1]), so a stale update applies cleanly.

Server, per aggregation (updates weighted by the engine's staleness weight w_k, 1 when fresh):
- head update (Algorithm 1 line 8): for every class c that some update holds,
      mu_c = normalize(sum_k a_kc mu_{k,c} / sum_k a_kc),
      W_c <- normalize(rho W_c + (1 - rho) mu_c)
  (code, `FedNHServer.aggregate`: both normalisations are the code's; the poster prints line 8
  without them, but eq. 1 keeps ||w_c|| = 1). a_kc, PARAM `aggregate`: "weighted" (default;
  the code: a_kc = w_k n_{k,c}, the poster's alpha_k^{t+1} is not defined in the text here) or
  "mean" (w_k for each client holding c). PARAM `rho` (default 0.9: the code's
  FedNH_smoothing). A class nobody sent keeps W_c (the code's: its average is the zero vector,
  normalize(rho W_c) = W_c).
- body update (Algorithm 1 line 10, theta^{t+1} = (1/|S_t|) sum_k theta_k): theta <- theta +
  server_lr * sum_k b_k delta_k / sum_k b_k, the same for s (the code averages every entry of
  its state dict, the scale included). b_k, PARAM `body_aggregate`: "mean" (default; line 10
  and the code's FedAvgServer.aggregate, an unweighted mean) or "weighted" (w_k n_k, FedAvg's
  sample weights); with "mean" b_k = w_k. PARAM `server_lr` (default 1.0, the code's server
  learning_rate).
- In async mode one aggregation (every `buffer` updates) is one application of line 8 and 10.

Evaluation on the client's test split, PARAM `eval_model`:
    "global" (default; the paper's GM column: the global model, body, s and W as the eval task
             carries them, swapped in for the evaluation);
    "local"  (the paper's PM: the client's own model after its last local update, with the
             scale it trained and the prototypes of its last task).
acc and loss are the cosine classifier's; proto_acc is the nearest prototype (L2) to the
normalised feature, which ranks as the cosine logits do (||z - w||^2 = 2 - 2 z.w for unit z,
w): with s > 0 it equals acc up to float rounding at near-ties; it is reported because W are
FedNH's class prototypes.
Classification only (features [B, D]).

Relays and secure aggregation (`MERGE`, `FedNHSums`): line 10 and the sums inside line 8 are
weighted sums, sum_k b_k delta_k with sum_k b_k, and per class sum_k a_kc mu_{k,c} with
sum_k a_kc; a relay pre-adds them and the server steps and smooths as over single updates (up
to float64 rounding). The smoothing and the normalisations act on the sums' quotient, at the
server. No [privacy] dp level is declared: the upload is a weight delta and prototypes at once.

Not implemented (both off by default in the code): FedNH_client_adv_prototype_agg (client
prototypes weighted by each sample's softmax probability of its class) and
FedNH_server_adv_prototype_agg (server weights exp(W_c . mu_{k,c}), which the code requires
with the former: with only one of them its aggregate() reads a key the upload lacks).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedbus.algorithms import Algorithm
from fedbus.algorithms.core.handlers import (ClientUpdate, Failure, LocalRun, RoundInfo,
                                             ServerHandler, model_weights, to_tensor)
from fedbus.algorithms.core.merge import DeltaAndPrototypeSums, weighted_sum
from fedbus.algorithms.core.metrics import HeadScores
from fedbus.algorithms.core.params import Params, opt
from fedbus.algorithms.core.protos import (class_means, embeddings,
                                           nearest_prototype, prototype_means)
from fedbus.algorithms.core.training import LocalClient, staleness_metrics
from fedbus.algorithms.core.weights import apply_delta, weights_spec
from fedbus.algorithms.fedper import body_map, load_part, part_delta, part_weights, swapped_part

#: the scale s in the weights and deltas (beside the body's state-dict names)
SCALE = "fednh.scale"
INITS = ("uniform", "orthogonal")


# --- eq. 1: the initial prototypes ------------------------------------------------------------

def uniform_prototypes(num_classes: int, dim: int, seed: int = 0,
                       steps: int = 2000) -> np.ndarray:
    """float32 [C, D], unit rows maximising the smallest pairwise distance (eq. 1): the circle
    (D = 2), the regular simplex (C <= D + 1), else a numerical approximation (module doc)."""
    c, d = int(num_classes), int(dim)
    if c < 1 or d < 1:
        raise ValueError(f"need at least one class and one dimension, got {c} x {d}")
    if c == 1:
        w = np.zeros((1, d))
        w[0, 0] = 1.0
    elif d == 1:  # two antipodal points; more cannot be separated on a line
        w = np.array([[1.0 if i % 2 == 0 else -1.0] for i in range(c)])
    elif d == 2:
        theta = 2.0 * math.pi * np.arange(c) / c
        w = np.stack([np.cos(theta), np.sin(theta)], axis=1)
    elif c <= d:
        w = np.zeros((c, d))
        w[:, :c] = np.eye(c) - 1.0 / c
    elif c == d + 1:
        # Helmert basis of the plane orthogonal to 1: row k-1 = (1, .., 1, -k, 0, ..) / norm
        h = np.zeros((c - 1, c))
        for k in range(1, c):
            h[k - 1, :k] = 1.0
            h[k - 1, k] = -float(k)
            h[k - 1] /= math.sqrt(k * (k + 1))
        w = h.T  # vertex i's coordinates: H e_i (e_i - 1/C in that basis)
    else:
        w = _spread(c, d, seed, steps)
    w = w / np.sqrt(np.einsum("cd,cd->c", w, w))[:, None]
    return w.astype(np.float32)


def _spread(c: int, d: int, seed: int, steps: int) -> np.ndarray:
    """Projected gradient descent on the unit sphere of (1/T) log sum_{i != j} exp(T w_i.w_j),
    a soft maximum of the pairwise cosines, T annealed from 10 to 300, normalised steps. In
    float64 with np.einsum (no BLAS, so no thread-count-dependent rounding): the same W for a
    seed on every machine and in replay."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(c, d))
    w /= np.sqrt(np.einsum("cd,cd->c", w, w))[:, None]
    off = ~np.eye(c, dtype=bool)
    for k in range(steps):
        frac = k / steps
        temp, lr = 10.0 * 30.0 ** frac, 0.02 * (1.0 - frac) + 1e-4
        g = np.einsum("id,jd->ij", w, w)
        p = np.where(off, np.exp(np.maximum(temp * (g - g[off].max()), -60.0)), 0.0)
        p /= p.sum()
        grad = np.einsum("ij,jd->id", p + p.T, w)
        grad -= np.einsum("cd,cd->c", grad, w)[:, None] * w  # tangent to the sphere
        w = w - lr * grad / max(float(np.sqrt(np.einsum("cd,cd->c", grad, grad)).max()), 1e-300)
        w /= np.sqrt(np.einsum("cd,cd->c", w, w))[:, None]
    return w


def initial_prototypes(num_classes: int, dim: int, how: str, seed: int) -> np.ndarray:
    """The server's W^0 (float32 [C, D], unit rows): PARAM init (module doc)."""
    if how == "uniform":
        return uniform_prototypes(num_classes, dim, seed)
    if how == "orthogonal":
        gen = torch.Generator().manual_seed(int(seed))
        w = torch.nn.init.orthogonal_(torch.empty(num_classes, dim, dtype=torch.float64),
                                      generator=gen)
        return F.normalize(w, dim=1).numpy().astype(np.float32)
    raise ValueError(f"init = {how!r}: one of {', '.join(INITS)}")


def normalize_rows(a: np.ndarray) -> np.ndarray:
    """Each row over max(its L2 norm, 1e-12), float64 (torch's F.normalize)."""
    a = np.asarray(a, dtype=np.float64)
    return a / np.maximum(np.sqrt(np.einsum("cd,cd->c", a, a)), 1e-12)[:, None]


def infuse(protos: np.ndarray, means: np.ndarray, received: np.ndarray,
           rho: float) -> np.ndarray:
    """Algorithm 1 line 8 as the code computes it: W_c <- normalize(rho W_c + (1 - rho)
    normalize(mean_c)) for the received classes; the others keep W_c. float32 [C, D]."""
    new = normalize_rows(rho * np.asarray(protos, np.float64)
                         + (1.0 - rho) * normalize_rows(means))
    return np.where(np.asarray(received, bool)[:, None], new, protos).astype(np.float32)


def client_lr(base: float, schedule: str, decay: float, rnd: int, rounds: int) -> float:
    """The learning rate of a task made at round (version) rnd: PARAM lr_schedule (module doc;
    the code's `setup_optimizer`, its rounds counted from 1: its round - 1 = rnd)."""
    if schedule == "diminishing":
        return float(base) * float(decay) ** int(rnd)
    if schedule == "stepwise":
        return float(base) if int(rnd) + 1 < int(rounds) // 2 else float(base) * 0.1
    return float(base)


# --- relays and secure aggregation --------------------------------------------------------------

class FedNHSums(DeltaAndPrototypeSums):
    """FedNH's server step in sum form: "delta_sum" = sum_k b_k delta_k (body and scale) with
    "mass" = [sum_k b_k], b_k = 1 (line 10's plain mean; params["body_aggregate"] = "mean") or
    n_k ("weighted"), and "proto_sums" = per class sum_k a_kc mu_{k,c} with its mass, a_kc =
    n_{k,c} (params["aggregate"] = "weighted") or [n_{k,c} > 0]. The server smooths and
    normalises the quotient (line 8)."""

    name = "fednh-sums"

    def lift(self, payload, num_samples, work, params, client=-1):
        if "protos" not in payload or "counts" not in payload:
            raise ValueError("a FedNH update carries protos and counts")
        b = float(num_samples) if params.get("body_aggregate") == "weighted" else 1.0
        return {"delta_sum": {k: np.asarray(v, dtype=np.float64) * b
                              for k, v in payload["delta"].items()},
                "mass": np.array([b]),
                "proto_sums": self.protos.lift(payload, num_samples, work, params, client)}


# --- server -------------------------------------------------------------------------------------

class FedNHServer(Params, ServerHandler):
    PARAMS: ClassVar[dict[str, Any]] = {
        "rho": opt(0.9, "smoothing of Algorithm 1 line 8, W <- rho W + (1 - rho) mu (the code's "
                   "FedNH_smoothing = 0.9)", min=0.0, max=1.0),
        "init": opt("uniform", "initial prototypes: uniform = eq. 1 (circle, regular simplex, "
                    "else a numerical maximiser of the smallest distance); orthogonal = the "
                    "code's FedNH_head_init (torch.nn.init.orthogonal_)", choices=INITS),
        "aggregate": opt("weighted", "per-class mean of the clients' prototypes in line 8: "
                         "weighted = by class counts n_kc (the code); mean = each holder once",
                         choices=("weighted", "mean")),
        "body_aggregate": opt("mean", "body and scale average, line 10: mean = unweighted over "
                              "the updates (poster line 10, the code); weighted = by training-set "
                              "size (FedAvg)", choices=("mean", "weighted")),
        "server_lr": opt(1.0, "server step on the averaged body delta (the code's server "
                         "learning_rate = 1.0)", min=0.0),
        "scale_init": opt(1.0, "initial scale s of the cosine logits (the code: 1.0 in "
                          "Conv2CifarNH, 20.0 in ResNetModNH; 30 with FedNH_fix_scaling)",
                          min=0.0),
        "learn_scale": opt(True, "train s with the body (the code's default); False keeps it at "
                           "scale_init (FedNH_fix_scaling = True, with scale_init = 30)"),
        "clip_norm": opt(10.0, "clip each local step's gradient to this global L2 norm (the "
                         "code's max_norm = 10); 0 = no clipping", min=0.0),
        "lr_schedule": opt("diminishing", "client lr of a round-r task: diminishing = train.lr x "
                           "lr_decay^r (the paper runs' scheduler); stepwise = train.lr while "
                           "r + 1 < rounds // 2, then train.lr / 10 (main.py's default); "
                           "constant",
                           choices=("diminishing", "stepwise", "constant")),
        "lr_decay": opt(0.99, "decay per round of the diminishing schedule (the code's "
                        "lr_decay_per_round = 0.99)", min=0.0, max=1.0),
        "eval_model": opt("global", "evaluated model: global = the global body, scale and "
                          "prototypes (the paper's GM); local = the client's own model after its "
                          "last local update, with the prototypes it trained against (PM)",
                          choices=("global", "local")),
    }
    needs_same_model: ClassVar[bool] = True  # the body is averaged weight by weight
    # lines 8 and 10 are weighted sums before the server's smoothing: a relay pre-adds them,
    # secure aggregation sums them (fedbus.algorithms.core.merge)
    MERGE = FedNHSums()

    def __init__(self, ctx):
        super().__init__(ctx)
        model = ctx.make_model(0)
        self._initial = model_weights(model)
        self.weights: dict[str, np.ndarray] = part_weights(model, body_map(model))
        if SCALE in self.weights:
            raise ValueError(f"the network has a weight named {SCALE!r}")
        self.weights[SCALE] = np.array([float(self.param("scale_init"))], np.float32)
        self._weights_spec = weights_spec(self.weights)
        self.protos = initial_prototypes(ctx.num_classes, ctx.feature_dim, self.param("init"),
                                         ctx.seed)

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        # aggregate() builds new arrays, never writes these in place
        return {"weights": self.weights, "protos": self.protos, "round": int(info.round),
                "rounds": int(info.rounds)}

    def make_eval(self, client: int, info: RoundInfo) -> dict[str, Any]:
        return {"weights": self.weights, "protos": self.protos}

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        metrics = staleness_metrics(updates, failures)
        if updates:
            # single updates lifted and merged ones as they are, each times its staleness
            # weight: the flat and the relayed federation add the same sums
            total, _ = weighted_sum(updates, self.MERGE, self.resolved_params())
            mass = float(total["mass"][0])
            if mass > 0:  # line 10
                lr = float(self.param("server_lr"))
                self.weights = apply_delta(self.weights, {k: lr * v / mass for k, v in
                                                          total["delta_sum"].items()})
            sums = total["proto_sums"]
            received = np.asarray(sums["mass"]) > 0
            means = prototype_means(sums["sums"], sums["mass"])
            before = self.protos
            self.protos = infuse(before, means, received, float(self.param("rho")))  # line 8
            metrics["classes_received"] = float(received.sum())
            moved = np.einsum("cd,cd->c", before.astype(np.float64), self.protos)[received]
            if moved.size:
                metrics["proto_cos_moved"] = float(moved.mean())  # mean cos(W_c^t, W_c^t+1)
        metrics["scale"] = float(self.weights[SCALE][0])
        return metrics

    def update_spec(self) -> dict[str, Any]:
        c, d = self.ctx.num_classes, self.ctx.feature_dim
        return {"delta": dict(self._weights_spec), "protos": ("float32", (c, d)),
                "counts": ("int64", (c,))}

    def global_weights(self) -> dict[str, np.ndarray]:
        """The network's state dict: the global body with client 0's initial head (FedNH's
        classifier is the prototypes, not that head)."""
        return {**self._initial, **{k: v for k, v in self.weights.items() if k != SCALE}}

    def state_dict(self) -> dict[str, Any]:
        # "protos"/"has": the names the run's embeddings plot reads the global prototypes by
        return {"weights": {k: v.copy() for k, v in self.weights.items()},
                "protos": self.protos.copy(), "has": np.ones(len(self.protos), bool)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.weights = {k: np.array(v, copy=True) for k, v in state["weights"].items()}
        self.protos = np.array(state["protos"], dtype=np.float32, copy=True)


# --- client -------------------------------------------------------------------------------------

class FedNHClient(LocalClient):
    """Cosine classifier over fixed prototypes; trains the body and the scale; uploads its
    normalised class means with counts and its body delta (module doc)."""

    PARAMS: ClassVar[dict[str, Any]] = FedNHServer.PARAMS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.part = body_map(ctx.model)
        self.learn_scale = bool(self.param("learn_scale"))
        self.scale = torch.nn.Parameter(
            torch.tensor([float(self.param("scale_init"))], device=ctx.device),
            requires_grad=self.learn_scale)
        if self.learn_scale:  # [train]'s lr, momentum and weight decay, as the code's model
            self.optimizer.add_param_group({"params": [self.scale]})
        self.clip = float(self.param("clip_norm"))
        self._trainable = [p for n, p in ctx.model.named_parameters() if n in self.part]
        if self.learn_scale:
            self._trainable.append(self.scale)
        self._protos: torch.Tensor | None = None  # W of the current (or last) task

    # -- training --------------------------------------------------------------------------
    def logits(self, h: torch.Tensor, protos: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """s * normalize(h) . W^T (the code's Conv2CifarNH.forward with W frozen)."""
        return scale * (F.normalize(h, dim=1, eps=1e-12) @ protos.to(h.dtype).T)

    def batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ctx.model.features(x)
        return F.cross_entropy(self.logits(h, self._protos, self.scale), y)

    def clip_gradients(self) -> None:
        """The code's clip_grad_norm_(max_norm=10) before each step."""
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self._trainable, max_norm=self.clip)

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        ctx = self.ctx
        weights = task["weights"]
        load_part(ctx.model, self.part, weights)
        sent_scale = float(np.asarray(weights[SCALE]).reshape(-1)[0])
        with torch.no_grad():
            self.scale.fill_(sent_scale)
        self._protos = to_tensor(task["protos"], ctx.device, torch.float32)
        lr = client_lr(ctx.train["lr"], self.param("lr_schedule"), self.param("lr_decay"),
                       int(task.get("round", 0)), int(task.get("rounds", 1)))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.run_local(run)
        protos, counts = self.local_protos()
        delta = part_delta(ctx.model, self.part, weights)
        delta[SCALE] = np.array([self.scale.item() - sent_scale], np.float32)
        return {"delta": delta, "protos": protos, "counts": counts}

    def local_protos(self) -> tuple[np.ndarray, np.ndarray]:
        """mu_{k,c} = normalize(mean of normalize(f(x)) over the class's training samples),
        eval mode (the code's _estimate_prototype), float32 [C, D] (zero rows for absent
        classes), with the class counts int64 [C]."""
        ctx = self.ctx
        if len(ctx.train_y) == 0:
            return (np.zeros((ctx.num_classes, ctx.feature_dim), np.float32),
                    np.zeros(ctx.num_classes, np.int64))
        z = F.normalize(embeddings(ctx.model, ctx.train_x), dim=1, eps=1e-12)
        means, counts = class_means(z, ctx.train_y, ctx.num_classes)
        protos = F.normalize(means, dim=1, eps=1e-12)  # absent classes stay zero rows
        return (protos.cpu().numpy().astype(np.float32),
                counts.cpu().numpy().astype(np.int64))

    # -- evaluation ------------------------------------------------------------------------
    @torch.inference_mode()
    def scores(self, protos: torch.Tensor, scale: torch.Tensor) -> dict[str, float]:
        """acc, loss (the cosine classifier) and proto_acc (nearest prototype) on the test
        split with the model as it is, from one feature pass."""
        ctx = self.ctx
        head = HeadScores()
        if len(ctx.test_y) == 0:
            return {**head.result(), "proto_acc": float("nan")}
        z = F.normalize(embeddings(ctx.model, ctx.test_x), dim=1, eps=1e-12)
        for i in range(0, len(z), 512):
            head.add(self.logits(z[i:i + 512], protos, scale), ctx.test_y[i:i + 512])
        pred = nearest_prototype(z, protos)
        return {**head.result(), "proto_acc": float((pred == ctx.test_y).float().mean().item())}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        if self.param("eval_model") == "local":
            protos = self._protos if self._protos is not None else \
                to_tensor(task["protos"], ctx.device, torch.float32)
            return self.scores(protos, self.scale.detach())
        weights = task["weights"]
        scale = to_tensor(np.asarray(weights[SCALE]).reshape(1), ctx.device, torch.float32)
        with swapped_part(ctx.model, self.part, weights):
            return self.scores(to_tensor(task["protos"], ctx.device, torch.float32), scale)

    # -- state -----------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"scale": self.scale.detach().clone(),
                "protos": None if self._protos is None else self._protos.clone()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            self.scale.copy_(state["scale"].to(self.scale.device))
        protos = state.get("protos")
        self._protos = None if protos is None else protos.to(self.ctx.device)


ALGORITHM = Algorithm("fednh", FedNHServer, FedNHClient,
                      "FedNH (Dai et al. 2023): uniform class prototypes smoothly infused with "
                      "class semantics, cosine classifier, averaged body")

"""FedKD: communication-efficient federated learning via adaptive mutual distillation
and SVD-compressed updates.

Wu, Wu, Lyu, Huang, Xie, "Communication-efficient federated learning via knowledge
distillation", Nature Communications 13:2032, 2022. Reference code: the authors'
github.com/wuch15/FedKD (run.py, model_bert.py) and TsingZ0/HtFLlib
system/flcore/clients/clientkd.py, system/flcore/servers/serverkd.py (the
heterogeneous-model version FedTGP ran).

Client k keeps a large private teacher ("mentor": ctx.model, any architecture of the
model group) and a copy of the small shared student ("mentee": the auxiliary model
of fedbus.algorithms.fml, PARAM `shared_arch`, by default the federation's
smallest architecture as FedTGP's appendix chose). On every minibatch, with t the
teacher and s the student (the paper's Methods, adaptive mutual distillation):

    L_t^task = CE(y, y_t),                L_s^task = CE(y, y_s)
    L_t^d = KL(y_s || y_t) / (L_t^task + L_s^task)
    L_s^d = KL(y_t || y_s) / (L_t^task + L_s^task)
    L_t^h = L_s^h = MSE(H_t, W_h H_s) / (L_t^task + L_s^task)
    L_t = L_t^task + L_t^d + L_t^h,       L_s = L_s^task + L_s^d + L_s^h

y = softmax outputs, H the feature vectors (features(x): both are the federation's
common feature_dim wide in fedbus), W_h a learnable linear map (no bias, as the
reference) that stays on the client and is never sent. Choices where the paper is
silent, as fixed behaviour:
- each loss trains its own model: the other model's outputs in L_t^d/L_s^d, and the
  other side of the MSE, are detached (mutual distillation: each model learns from
  the other's predictions), so W_h is trained by the student's hidden loss; the
  authors' code sums everything into one undetached loss and HtFLlib backpropagates
  both losses into every model;
- the adaptive denominator L_t^task + L_s^task is detached (it is a per-batch
  weight: with its gradient, a model could lower its distillation loss by raising
  its task loss) and floored at 1e-8 (no 0/0 on a perfectly fitted batch);
- the MSE averages over batch x feature_dim (nn.MSELoss, as both codes).

Three optimisers with the [train] settings: the teacher's, W_h's (both at train.lr,
as HtFLlib) and the student's at PARAM `mentee_lr` (0 = train.lr; FedTGP's appendix:
"we set its auxiliary model learning rate to be the same as the one of the client
model"; HtFLlib's default mentee_learning_rate = 0.01 is its default client lr). All
three start every task empty or carry their momentum over, as train.optimizer_state
says (algorithms/core/handlers.py: ClientContext.start_local_run).

Communication (the paper's Methods, dynamic gradient approximation): the student's update
delta = (trained student) - (student weights the task carried) is compressed weight
by weight. A floating weight with >= 2 dimensions whose rows and columns both
number >= 2 (a conv kernel [o, i, kh, kw] is reshaped to [o, i*kh*kw]) travels as
the factors of its truncated SVD, M ~= U_K diag(s_K) V_K, with K the smallest rank
whose energy sum_{k<=K} s_k^2 / sum_k s_k^2 >= T(t) (K >= 1; an all-zero matrix
sends K = 1 with s = 0); biases, vectors and integer buffers travel raw. The
threshold grows over training,

    T(t) = T_start + (T_end - T_start) * t / T,

t the round counted from 1 (the authors' run.py: (1 + comm_round) / epochs, so the
last round uses T_end; fedbus rounds count from 0, so t = round + 1, clamped to
[0, T]) and T = the federation's rounds; the task carries "energy" = T(t) and the
"round" it was made for. PARAMS t_start = 0.95 and t_end = 0.98 (the FedKD paper and
HtFLlib's defaults; FedTGP's appendix ran T_start = T_end = 0.95). PARAM compress =
true (default; false sends full deltas and full weights: FedKD's distillation alone).

- update (up): {"delta": {name: {"u": float32 [m, K], "s": float32 [K],
  "v": float32 [K, n]} for a compressed weight, or the raw array}} (compress =
  false: {"delta": {name: array}}); K varies per weight and round (None in the spec).
- server: reconstructs each update's delta (U diag(s) V reshaped to the weight's
  shape) and applies w <- w + sum_k s_k n_k delta_k / sum_k s_k n_k (s_k the engine's
  staleness weight, n_k the training-set size; the references average uniformly,
  which equal-sized fresh clients match). An update whose factors do not fit
  together counts as a failure ("rejected"); an empty aggregation keeps the student.
- task (down): {"weights": the global student's weights, compressed like the
  uploads at the task's T(t) (compress = false: raw), "energy", "round"}. The paper
  compresses the aggregated update and clients add it to their student; on the bus
  a client may have missed versions (asynchronous mode, a folded straggler, an
  evicted handler), so the server sends the compressed global *weights* instead, as
  HtFLlib does (its clients load recover(compressed global parameters)). The
  server's own weights stay exact: a client's delta is relative to the weights it
  reconstructed and is added to the exact global, so the truncation error of one
  downlink does not accumulate across rounds. A weight whose factors would be no
  smaller than the weight (K (m + n + 1) >= m n: typical of freshly initialised,
  nearly full-rank weights) travels raw and exact instead (HtFLlib sends the factors
  regardless); the client tells the two apart by type (a map of factors or an array).

Evaluation: the teacher's head ("acc", "loss": the personalised model the paper and
FedTGP score), plus "aux_acc"/"aux_loss" for the global student as reconstructed from
the eval task. Partial work uploads its (compressed) delta like any other. Model
groups: only the student, one architecture for all, is shared.
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
                                             load_weights, weight_delta)
from fedbus.algorithms.core.metrics import head_metrics
from fedbus.algorithms.core.params import opt
from fedbus.algorithms.core.training import staleness_metrics
from fedbus.algorithms.core.weights import average_deltas, fedavg_coefs, model_spec
from fedbus.algorithms.fml import CLIP_GRAD, KL, SHARED_ARCH, AuxClient, AuxServer, kl_div

FACTORS = ("u", "s", "v")


# --- the energy schedule and SVD compression -------------------------------------------------

def energy_threshold(t_start: float, t_end: float, round: int, rounds: int) -> float:
    """T(t) = T_start + (T_end - T_start) * t / T with t = round + 1 (1-based), clamped."""
    frac = min(1.0, max(0.0, (int(round) + 1) / max(1, int(rounds))))
    return float(t_start + (t_end - t_start) * frac)


def energy_rank(s: np.ndarray, energy: float) -> int:
    """The smallest K >= 1 with sum_{k<=K} s_k^2 >= energy * sum_k s_k^2 (s descending)."""
    sq = np.square(np.asarray(s, dtype=np.float64))
    total = sq.sum()
    if len(sq) == 0:
        return 0
    if total <= 0.0:
        return 1
    cum = np.cumsum(sq)
    # a relative tolerance, so that an energy the prefix meets exactly is met in floats too
    k = int(np.searchsorted(cum, energy * total * (1.0 - 1e-9), side="left")) + 1
    return min(max(k, 1), len(sq))


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A weight's shape as the matrix it is compressed as: [shape[0], prod(rest)]."""
    return int(shape[0]), int(math.prod(shape[1:]))


def is_compressible(dtype: Any, shape: tuple[int, ...]) -> bool:
    """A floating weight of >= 2 dimensions whose matrix has >= 2 rows and columns."""
    if len(shape) < 2 or not np.issubdtype(np.dtype(dtype), np.floating):
        return False
    m, n = matrix_shape(tuple(shape))
    return m >= 2 and n >= 2


def svd_compress(value: np.ndarray, energy: float) -> dict[str, np.ndarray]:
    """{"u" [m, K], "s" [K], "v" [K, n]} float32 of the weight's matrix at `energy`."""
    a = np.asarray(value, dtype=np.float64)
    m, n = matrix_shape(a.shape)
    u, s, vt = np.linalg.svd(a.reshape(m, n), full_matrices=False)
    k = energy_rank(s, energy)
    return {"u": np.ascontiguousarray(u[:, :k], dtype=np.float32),
            "s": np.ascontiguousarray(s[:k], dtype=np.float32),
            "v": np.ascontiguousarray(vt[:k], dtype=np.float32)}


def svd_reconstruct(factors: Mapping[str, Any], shape: tuple[int, ...],
                    dtype: Any = np.float32) -> np.ndarray:
    """U diag(s) V reshaped to `shape`; ValueError if the factors do not fit it."""
    u, s, v = (np.asarray(factors[k], dtype=np.float64) for k in FACTORS)
    m, n = matrix_shape(tuple(shape))
    k = s.shape[0] if s.ndim == 1 else -1
    if k < 0 or u.shape != (m, k) or v.shape != (k, n) or k > min(m, n):
        raise ValueError(f"SVD factors u {u.shape}, s {s.shape}, v {v.shape} do not make a "
                         f"rank-K [{m}, {n}] matrix")
    return ((u * s) @ v).reshape(tuple(shape)).astype(dtype)


def compress_weights(weights: Mapping[str, Any], energy: float, names: set[str] | frozenset[str],
                     smaller_only: bool = False) -> dict[str, Any]:
    """Each weight in `names` as SVD factors, the rest as they are. smaller_only: a
    weight whose factors (K (m + n + 1) numbers) would not be smaller than the weight
    itself (m n) stays raw."""
    out: dict[str, Any] = {}
    for k, v in weights.items():
        if k not in names:
            out[k] = v
            continue
        f = svd_compress(v, energy)
        out[k] = v if smaller_only and sent_numbers(f) >= np.asarray(v).size else f
    return out


def expand_weights(payload: Mapping[str, Any],
                   spec: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """Full arrays ({name: (dtype, shape)} of `spec`) from a possibly compressed payload."""
    out = {}
    for k, (dtype, shape) in spec.items():
        v = payload[k]
        if isinstance(v, Mapping):
            out[k] = svd_reconstruct(v, shape, dtype)
        else:
            out[k] = np.asarray(v)
    return out


def sent_numbers(payload: Mapping[str, Any]) -> int:
    return sum(sent_numbers(v) if isinstance(v, Mapping) else int(np.asarray(v).size)
               for v in payload.values())


# --- the adaptive mutual distillation --------------------------------------------------------

def fedkd_losses(logits_t: torch.Tensor, logits_s: torch.Tensor, h_t: torch.Tensor,
                 h_s_proj: torch.Tensor, y: torch.Tensor, kl: str = "batchmean"
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(L_t, L_s, parts) of one minibatch. h_s_proj = W_h H_s. Each model's
    distillation and hidden terms see the other side detached; the adaptive
    denominator L_t^task + L_s^task is detached."""
    ce_t = F.cross_entropy(logits_t, y)
    ce_s = F.cross_entropy(logits_s, y)
    den = (ce_t + ce_s).detach().clamp_min(1e-8)
    logp_t = F.log_softmax(logits_t, dim=1)
    logp_s = F.log_softmax(logits_s, dim=1)
    d_t = kl_div(logp_t, logp_s.detach(), kl) / den
    d_s = kl_div(logp_s, logp_t.detach(), kl) / den
    h_t_loss = F.mse_loss(h_t, h_s_proj.detach()) / den
    h_s_loss = F.mse_loss(h_s_proj, h_t.detach()) / den
    parts = {"ce_t": ce_t.item(), "ce_s": ce_s.item(), "d_t": d_t.item(), "d_s": d_s.item(),
             "h": h_t_loss.item()}
    return ce_t + d_t + h_t_loss, ce_s + d_s + h_s_loss, parts


# --- server ----------------------------------------------------------------------------------

class FedKDServer(AuxServer):
    PARAMS: ClassVar[dict[str, Any]] = {
        "mentee_lr": opt(0.0, "the student's learning rate (0 = train.lr: FedTGP's appendix; "
                         "HtFLlib's default 0.01 is its client lr)", min=0.0),
        "compress": opt(True, "SVD-compress the student's updates and the downlink weights "
                        "(the paper); false sends them full"),
        "t_start": opt(0.95, "energy threshold T_start of the first round (FedKD paper, "
                       "HtFLlib: 0.95)", min=0.0, max=1.0),
        "t_end": opt(0.98, "energy threshold T_end of the last round (FedKD paper, HtFLlib: "
                     "0.98; FedTGP's appendix used 0.95)", min=0.0, max=1.0),
        "shared_arch": SHARED_ARCH,
        "kl": KL,
        "clip_grad": CLIP_GRAD,
    }
    algorithm: ClassVar[str] = "fedkd"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.compress = bool(self.param("compress"))
        self.names = frozenset(k for k, (dtype, shape) in self._weights_spec.items()
                               if is_compressible(dtype, shape))
        self._down: tuple[float, dict[str, Any]] | None = None  # (energy, compressed weights)

    def energy(self, info: RoundInfo) -> float:
        return energy_threshold(float(self.param("t_start")), float(self.param("t_end")),
                                info.round, info.rounds)

    def downlink(self, energy: float) -> dict[str, Any]:
        """The global student as the task carries it (cached until the weights change)."""
        if not self.compress:
            return self.weights
        if self._down is None or self._down[0] != energy:
            self._down = (energy, compress_weights(self.weights, energy, self.names,
                                                   smaller_only=True))
        return self._down[1]

    def make_task(self, client: int, info: RoundInfo) -> dict[str, Any]:
        energy = self.energy(info)
        return {"weights": self.downlink(energy), "energy": energy, "round": int(info.round)}

    def aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                  info: RoundInfo) -> dict[str, float]:
        deltas, kept, failures = [], [], list(failures)
        ratios, ranks = [], []
        full = sum(int(v.size) for v in self.weights.values())
        for u in updates:
            try:
                deltas.append(expand_weights(u.payload["delta"], self._weights_spec))
            except (ValueError, KeyError):
                failures.append(Failure(u.client, "rejected"))
                continue
            kept.append(u)
            ratios.append(sent_numbers(u.payload["delta"]) / max(1, full))
            ranks += [np.asarray(v["s"]).shape[0] / min(matrix_shape(self._weights_spec[k][1]))
                      for k, v in u.payload["delta"].items() if isinstance(v, Mapping)]
        metrics = staleness_metrics(kept, failures)
        metrics["energy"] = self.energy(info)
        if kept:
            self.weights = average_deltas(self.weights, deltas, fedavg_coefs(kept))
            self._down = None
            metrics["up_ratio"] = float(np.mean(ratios))
            if ranks:
                metrics["rank_frac"] = float(np.mean(ranks))
        return metrics

    def update_spec(self) -> dict[str, Any]:
        if not self.compress:
            return {"delta": dict(self._weights_spec)}
        spec: dict[str, Any] = {}
        for k, (dtype, shape) in self._weights_spec.items():
            if k in self.names:
                m, n = matrix_shape(shape)
                spec[k] = {"u": ("float32", (m, None)), "s": ("float32", (None,)),
                           "v": ("float32", (None, n))}
            else:
                spec[k] = (dtype, shape)
        return {"delta": spec}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._down = None


# --- client ----------------------------------------------------------------------------------

class FedKDClient(AuxClient):
    PARAMS: ClassVar[dict[str, Any]] = FedKDServer.PARAMS
    algorithm: ClassVar[str] = "fedkd"

    def __init__(self, ctx):
        super().__init__(ctx)
        teacher_dim = int(getattr(ctx.model, "feature_dim", 0) or ctx.feature_dim)
        student_dim = int(getattr(self.aux, "feature_dim", 0) or ctx.feature_dim)
        # W_h: drawn from the client's seed without touching the caller's RNG
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(ctx.seed) + int(ctx.client))
            proj = torch.nn.Linear(student_dim, teacher_dim, bias=False)
        self.proj = proj.to(ctx.device)
        self.proj_optimizer = ctx.make_optimizer(self.proj.parameters())
        self.compress = bool(self.param("compress"))
        self.spec = model_spec(self.aux)
        self.names = frozenset(k for k, (dtype, shape) in self.spec.items()
                               if is_compressible(dtype, shape))
        self.t_start = float(self.param("t_start"))
        self.last_parts: dict[str, float] = {}

    def aux_lr(self) -> float | None:
        return float(self.param("mentee_lr")) or None

    def global_student(self, task: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return expand_weights(task["weights"], self.spec)

    def run_mutual(self, run: LocalRun) -> float:
        teacher, student, proj = self.ctx.model, self.aux, self.proj
        teacher.train()
        student.train()
        total, steps = 0.0, 0
        sums: dict[str, float] = {}
        for x, y in run.batches():
            for o in (self.optimizer, self.aux_optimizer, self.proj_optimizer):
                o.zero_grad(set_to_none=True)
            h_t, h_s = teacher.features(x), student.features(x)
            loss_t, loss_s, parts = fedkd_losses(teacher.head(h_t), student.head(h_s),
                                                 h_t, proj(h_s), y, self.kl)
            (loss_t + loss_s).backward()  # detached cross terms: each loss trains its own side
            self.clip_grads(teacher, student, proj)
            for o in (self.optimizer, self.aux_optimizer, self.proj_optimizer):
                o.step()
            total += loss_t.item() + loss_s.item()
            steps += 1
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
        self.last_parts = {k: v / steps for k, v in sums.items()}
        self.last_loss = total / steps if steps else float("nan")
        return self.last_loss

    def train(self, task: Mapping[str, Any], run: LocalRun) -> dict[str, Any]:
        base = self.global_student(task)
        load_weights(self.aux, base)
        self.run_mutual(run)
        delta = weight_delta(self.aux, base)
        if self.compress:
            delta = compress_weights(delta, float(task.get("energy", self.t_start)), self.names)
        return {"delta": delta}

    def evaluate(self, task: Mapping[str, Any]) -> dict[str, float]:
        ctx = self.ctx
        out = head_metrics(ctx.model, ctx.test_x, ctx.test_y)
        out.update(self.aux_metrics(self.global_student(task)))
        return out

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "proj": self.proj.state_dict(),
                "proj_optimizer": self.proj_optimizer.state_dict()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        super().load_extra_state(state)
        self.proj.load_state_dict(state["proj"])
        self.proj_optimizer.load_state_dict(state["proj_optimizer"])


ALGORITHM = Algorithm("fedkd", FedKDServer, FedKDClient,
                      "FedKD (Wu et al. 2022): adaptive mutual distillation, SVD-compressed "
                      "student updates")

"""Differential privacy with an accountant: the [privacy] `dp` mechanisms and their epsilon.

Three mechanisms, each the Gaussian mechanism on a clipped sum, all under the add-or-remove
neighbouring relation (one record, or one client, present or absent), which is the
relation the accountant (Google's dp-accounting, `dp_accounting`) is built with.

The theorem every epsilon here rests on: the Gaussian mechanism (a query of L2 sensitivity
D released with N(0, (z D)^2) per coordinate is (alpha, alpha / 2 z^2)-RDP, Mironov 2017),
Poisson-subsampled where stated (Mironov, Talwar, Zhang 2019; Abadi et al. 2016), composed
adaptively over the releases by dp-accounting's RDP or PLD accountant and converted to
(epsilon, delta). Its assumptions: the sensitivity holds (the clip, rounding included); the
sampling is the Poisson sampling composed (each unit in independently with probability q,
from randomness the adversary does not know); the noise is secret and real-valued
(CryptoGaussian: a ChaCha20 stream, each value the sum of four floating-point Gaussians as
Opacus's secure_mode, Holohan and Braghin 2021 section 5.1, which defeats the low-bit attack
of Jin et al. S&P 2022 at cost 2^159; a discrete Gaussian would remove the residual gap). Where a setting would break one, the config refuses it
(fedbus.node.config._check_dp_claims).

record (privacy.dp = "record", prototype algorithms; `dp_prototypes`)
    What is protected: one training sample of one client. After local training the client
    releases, instead of its exact class means, a noisy version computed from its whole
    training set: every sample's feature vector f(x) = model.features(x) is scaled to L2
    norm at most C (dp_clip), the per-class sums S_k = sum of the clipped features of class
    k get N(0, (z C)^2) per coordinate and the per-class counts n_k get N(0, z^2)
    (z = dp_noise_multiplier). Sensitivity: adding or removing one sample moves exactly one
    class's sum by a vector of norm <= C and its count by 1, and nothing else; scaling the
    count coordinate by C, the release is (S, C n) + N(0, (z C)^2 I), whose L2 sensitivity
    is sqrt(C^2 + C^2) = sqrt(2) C. That is a Gaussian mechanism of noise multiplier
    z / sqrt(2) (`record_noise_multiplier`), composed once per round the client takes part
    in. That sensitivity holds for a feature map f that does not depend on the client's
    data: a network trained without DP on the same data is none (one sample moves the
    weights, so every feature). Hence record level is admitted only with train.epochs = 0
    (the network is its seeded initialisation, or a backbone pre-trained on disjoint data,
    `frozen:`), or with privacy.dp_extractor = "sgd": every local step is DP-SGD (as "sgd"
    below, same C and z; LocalClient.run_local), so f at each release is the output of DP
    mechanisms and of the server's messages (post-processing of DP releases), and the
    prototype release composes adaptively with those steps (the ledger charges each task
    both, fedbus.node.privacy.budget). The wire carries only post-processing of (S~, n~): "protos" S~_k / n~_k where
    n~_k >= 1 (projected back onto the ball of radius C, where every true class mean of
    clipped features lies; projection onto a convex set that holds the true value never
    moves the estimate away from it), zero rows elsewhere, and "counts" as 0/1 presence
    flags (n~_k >= 1), as privacy.withhold_counts sends them.
    Accounting: no amplification by client sampling. The server chooses the cohort and
    sees who answered, so against the server (the party record-level DP is about) a
    client's participation is known; each of its releases composes in full
    (`Accountant.add(record_noise_multiplier(z))`, q = 1). The epsilon is per client: the
    rounds it took part in.

client (privacy.dp = "client", weight-delta algorithms; `clip_update`, `gaussian_like`)
    What is protected: a whole client (all its data), against anyone who sees only the
    released global models. DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning
    Differentially Private Recurrent Language Models", ICLR 2018): each sampled client's
    weight delta is clipped to global L2 norm C (`clip_update`: its float32 result within
    C; under secure aggregation to C - `secagg_clip_margin`, so the fixed-point encoding
    stays within C); the server adds N(0, (z C)^2) per coordinate to the *unweighted* sum
    of the clipped deltas (`gaussian_like`) and divides by the fixed denominator q x
    federation.clients, the expected cohort size (fedbus.node.engine.Engine._dp_noised;
    an empty cohort still releases the noise); one client then moves the noised sum by at
    most C, a Gaussian mechanism of multiplier z per round. Each live client takes part in
    a round independently with probability q = federation.fraction (Poisson, drawn by the
    engine from the server's secret seed, so no client knows the cohorts; sampling =
    "size" is refused), and an observer of the global models does not see the cohort, so
    each round is a Poisson-subsampled Gaussian (`Accountant.add(z, q)`), composed over the
    rounds.

sgd (privacy.dp = "sgd", weight-delta algorithms; fedbus.algorithms.core.dp_sgd, with Opacus)
    What is protected: one training sample of one client, in the weights its local
    training ends with (so its delta, and everything made from it). DP-SGD (Abadi et al.,
    CCS 2016): every local step takes a Poisson batch (each sample with probability
    q = b / n, b = min(batch_size, n)), clips each sample's gradient to L2 norm C, adds
    N(0, (z C)^2) to their sum and divides by b (Opacus's GradSampleModule and
    DPOptimizer). Accounting, per client (fedbus.node.privacy.budget): each task it is sent is
    epochs x ceil(n / batch_size) steps of PoissonSampled(q, Gaussian(z)), composed over its
    tasks (`Accountant.add(z, q, steps)`); no amplification by client sampling. Admitted
    wherever "client" is (the upload is a weight delta; `dp_levels`), for clients that
    train through LocalClient.run_local.

What the accountant composes and why. `Accountant` keeps the list of (z, q, steps) it was
given, grouped by (z, q), and hands the library one event per group: steps x
PoissonSampled(q, Gaussian(z)), or steps x Gaussian(z) when q = 1, as a
SelfComposedDpEvent. Grouping makes the cost of epsilon() independent of the number of
rounds (one event per distinct (z, q)), and results are cached until the next add. RDP
(`dp_accounting.rdp.RdpAccountant`) uses the integer orders RDP_ORDERS: the subsampled
Gaussian's RDP at an integer order is a finite sum the library computes exactly, where
fractional orders take a series that is 3-7x slower (and that the library drops with a
warning when it fails to converge). Against the library's default orders (which add
fractional ones) the epsilon was at most 3 % looser for epsilon up to 20 on the settings we
tried (q in 0.01..1, z in 0.5..2, 10..1000 rounds), and much looser only where epsilon is
in the hundreds. PLD (`dp_accounting.pld.PLDAccountant`) uses
value_discretization_interval = PLD_DISCRETIZATION = 1e-3 (the library's default is 1e-4):
on the same settings the epsilons agreed with 1e-4's within 0.03 % for 5-10x less time
(1e-2 was 3 % off at epsilon about 1); the PLD bound is pessimistic (an upper bound) at any
interval.

What is not protected.
- Everything besides the released arrays: the update body's "num_samples" and "work"
  (samples, steps: they reveal the training-set size, which under add-or-remove is itself
  what one record changes), which clients answered and when, message sizes and timing.
  A caller that wants the record-level guarantee to cover the whole message must not send
  the true training-set size.
- Record level: which classes a client holds is protected only as far as the noisy count
  hides it (a flag is noise, not a count); evaluation results, and the test embeddings and
  masks sent for plots, come from the test split, which is not covered; the client's model
  itself is not released by the prototype algorithms (it never leaves the client).
  Classification only: dense (segmentation) labels are refused (one image is many pixels).
- sgd: the batches and the noise come from the task seed, which the server (and any node,
  from the run's federation.seed) knows and could recompute them from, unless
  privacy.dp_noise = "secret" draws them from the client's OS (fedbus.algorithms.core.dp_sgd); the
  network's BatchNorm layers (refused) and anything the client computes outside
  LocalClient.run_local are not covered.
- Client level: nothing against the server, which sees each clipped delta before noising
  (or their exact sum under secure aggregation) and draws the cohorts; nor amplification
  against a relay or the broker, which see who is sent a task. The guarantee covers the
  global models only. Under secure aggregation a round whose unmasking fails releases
  nothing, and a Poisson cohort may hold one client (its clipped delta is then the sum).
- The older privacy.clip_norm / noise_sigma / withhold_counts (fedbus.node.privacy.prototypes) carry
  no guarantee and are not accounted.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import dp_accounting
import numpy as np
import torch
from dp_accounting import pld, rdp

__all__ = ["PLD_DISCRETIZATION", "RDP_ORDERS", "Accountant", "clip_update", "delta_norm",
           "dp_levels",
           "dp_prototypes", "dp_refusal", "gaussian_like", "record_noise_multiplier",
           "secagg_clip_margin", "sgd_refusal"]

# Integer Renyi orders (module doc: exact and fast for the subsampled Gaussian).
RDP_ORDERS: tuple[float, ...] = tuple(float(a) for a in [*range(2, 65), 80, 96, 128, 256,
                                                         512])
# The PLD accountant's value discretization interval (module doc).
PLD_DISCRETIZATION = 1e-3
_NOISE_TAG = 0xD1F5  # mixed into every seed here, so dp noise never reuses another stream


def _event(noise_multiplier: float, sampling_rate: float) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_rate == 1.0:
        return gaussian
    return dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian)


class Accountant:
    """The epsilon, at `delta`, of a sequence of (Poisson-subsampled) Gaussian mechanisms,
    composed by dp-accounting's RDP ("rdp") or PLD ("pld") accountant (module doc)."""

    def __init__(self, kind: str = "rdp", delta: float = 1e-5):
        if kind not in ("rdp", "pld"):
            raise ValueError(f"accountant kind must be 'rdp' or 'pld', got {kind!r}")
        if not 0.0 < float(delta) < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {delta}")
        self.kind = kind
        self.delta = float(delta)
        self._groups: dict[tuple[float, float], int] = {}  # (z, q) -> steps, first-add order
        self._cache: dict[tuple, float] = {}

    @staticmethod
    def _checked(noise_multiplier: float, sampling_rate: float, steps: int
                 ) -> tuple[float, float, int]:
        z, q = float(noise_multiplier), float(sampling_rate)
        if not (z > 0.0 and math.isfinite(z)):
            raise ValueError(f"noise multiplier must be positive and finite, got {z}")
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sampling rate must lie in (0, 1], got {q}")
        if int(steps) != steps or steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {steps}")
        return z, q, int(steps)

    def add(self, noise_multiplier: float, sampling_rate: float = 1.0, steps: int = 1) -> None:
        """Compose `steps` more releases, each PoissonSampled(q, Gaussian(z)) (Gaussian(z)
        when q = 1)."""
        z, q, steps = self._checked(noise_multiplier, sampling_rate, steps)
        if steps:
            self._groups[(z, q)] = self._groups.get((z, q), 0) + steps

    def _key(self, groups: Mapping[tuple[float, float], int]) -> tuple:
        return tuple((z, q, s) for (z, q), s in groups.items())

    def _compute(self, key: tuple) -> float:
        if not key:
            return 0.0
        if key in self._cache:
            return self._cache[key]
        if self.kind == "rdp":
            acc = rdp.RdpAccountant(list(RDP_ORDERS))
        else:
            acc = pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
        for z, q, steps in key:
            acc.compose(dp_accounting.SelfComposedDpEvent(_event(z, q), steps))
        eps = float(acc.get_epsilon(self.delta))
        if len(self._cache) >= 8:  # the current state and a few look-aheads
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = eps
        return eps

    def epsilon(self) -> float:
        """Epsilon at self.delta of everything composed so far (0.0 when nothing is)."""
        return self._compute(self._key(self._groups))

    def epsilon_after(self, noise_multiplier: float, sampling_rate: float = 1.0,
                      steps: int = 1) -> float:
        """What epsilon() would be after add(noise_multiplier, sampling_rate, steps); the
        accountant is not changed (the answer is cached, so the add that may follow and
        its epsilon() cost nothing more)."""
        z, q, steps = self._checked(noise_multiplier, sampling_rate, steps)
        groups = dict(self._groups)
        if steps:
            groups[(z, q)] = groups.get((z, q), 0) + steps
        return self._compute(self._key(groups))

    @property
    def steps(self) -> int:
        """Releases composed so far, all (z, q) together."""
        return sum(self._groups.values())

    def state_dict(self) -> dict[str, Any]:
        """Plain data (msgpack- and JSON-able): {"kind", "delta", "entries": [[z, q, steps],
        ...]}, one entry per distinct (z, q) in first-composed order."""
        return {"kind": self.kind, "delta": self.delta,
                "entries": [[z, q, s] for z, q, s in self._key(self._groups)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rebuild from state_dict(): the same groups in the same order, so the same
        epsilon. The kind and delta are taken from the state when it has them."""
        kind = str(state.get("kind", self.kind))
        if kind not in ("rdp", "pld"):
            raise ValueError(f"accountant kind must be 'rdp' or 'pld', got {kind!r}")
        groups: dict[tuple[float, float], int] = {}
        for entry in state.get("entries", []):
            z, q, steps = self._checked(*entry)
            if steps:
                groups[(z, q)] = groups.get((z, q), 0) + steps
        self.kind, self.delta = kind, float(state.get("delta", self.delta))
        self._groups = groups
        self._cache = {}

    def __repr__(self) -> str:
        return (f"Accountant({self.kind!r}, delta={self.delta:g}, "
                f"entries={self.state_dict()['entries']})")


def record_noise_multiplier(z: float) -> float:
    """The noise multiplier, for the accountant, of one `dp_prototypes` release made with
    noise multiplier z: z / sqrt(2). One record moves its class's feature sum by at most C
    (the clip; the sum is noised with std z C) and its class count by 1 (noised with std z):
    L2 sensitivity sqrt(C^2 + C^2) = sqrt(2) C against noise std z C (count axis scaled by
    C), i.e. sqrt(2) in units of the noise scale."""
    return float(z) / math.sqrt(2.0)


class CryptoGaussian:
    """Gaussian noise from a cryptographic stream, hardened against the floating-point attack.

    Uniforms: ChaCha20's keystream (the `cryptography` package) under a 256-bit key, 53 bits
    per double; Gaussians: Box-Muller in float64. A reader of the noisy output cannot predict
    or recompute the stream without the key (numpy's PCG64, used before, is a statistical
    generator: its state follows from enough of its output). Each value returned is
    (g1 + g2 + g3 + g4) / 2 of four independent N(0, std^2) draws: Holohan and Braghin,
    "Secure random sampling in differential privacy" (ESORICS 2021), section 5.1, n = 2 —
    Opacus's `secure_mode` does the same — so the low-bit gaps of one floating-point Gaussian
    that Jin et al. (S&P 2022) exploit no longer identify the value added (an attack's cost
    2^(53 (2n - 1)) = 2^159). It is still floating point, not a discrete Gaussian: the
    residual gap is that paper's, stated in SECURITY.md.

    seed None: a fresh key from `secrets` (the kernel's CSPRNG), noise no one can recompute;
    an integer: the key is SHA-256 of the seed and a tag, for `dp_noise = "seeded"`
    simulations (the same seed and shapes give the same noise)."""

    _NONCE = bytes(16)  # one key, one stream: a key is never reused with another nonce

    def __init__(self, seed: int | None):
        import hashlib
        import secrets

        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        if seed is None:
            key = secrets.token_bytes(32)
        else:
            seed = int(seed)
            if seed < 0:
                raise ValueError(f"a noise seed is a non-negative integer, got {seed}")
            key = hashlib.sha256(b"fedbus dp noise %d %d" % (_NOISE_TAG, seed)).digest()
        self._stream = Cipher(algorithms.ChaCha20(key, self._NONCE), mode=None).encryptor()

    def _uniform(self, n: int) -> np.ndarray:
        """n doubles in (0, 1]: 53 random bits each, never 0 (Box-Muller takes a log)."""
        words = np.frombuffer(self._stream.update(bytes(8 * n)), dtype="<u8")
        return ((words >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53

    def normal(self, loc: float, scale: float, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 N(loc, scale^2) values shaped `size` (the four-draw sum above)."""
        shape = (size,) if isinstance(size, int) else tuple(size)
        n = math.prod(shape)
        r = np.sqrt(-2.0 * np.log(self._uniform(2 * n)))  # Box-Muller: 2n pairs, 4n draws
        theta = self._uniform(2 * n)
        theta *= 2.0 * math.pi
        draws = np.concatenate([r * np.cos(theta), r * np.sin(theta)]).reshape(4, n)
        return (loc + float(scale) * draws.sum(axis=0) / 2.0).reshape(shape)


def _rng(seed: int | None) -> CryptoGaussian:
    """The noise source of every DP release here (CryptoGaussian)."""
    return CryptoGaussian(seed)


def secagg_clip_margin(length: int, frac_bits: int) -> float:
    """The most secure aggregation's fixed-point rounding (round to nearest, step
    2^-frac_bits) can lengthen a vector of `length` values in L2: sqrt(length) x
    2^-(frac_bits + 1). A client-level clip of C - this margin keeps the encoded delta
    within C, the sensitivity the noise is calibrated to."""
    return math.sqrt(max(int(length), 0)) * 2.0 ** -(int(frac_bits) + 1)


@torch.inference_mode()
def dp_prototypes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                  clip: float, z: float, seed: int | None, batch: int = 512, *,
                  project: bool = True, stats: dict[str, int] | None = None
                  ) -> dict[str, np.ndarray]:
    """A record-level DP release of a client's class prototypes over (x, y) (module doc):
    {"protos": float32 [C, D], "counts": int64 [C] presence flags}.

    Every sample's model.features(x) (model in eval mode, its mode restored after) is scaled
    to L2 norm at most `clip`; the per-class sums (float64) get N(0, (z clip)^2) noise per
    coordinate and the counts N(0, z^2), from numpy's generator seeded by `seed` (the same
    seed and inputs give the same release; None: fresh OS entropy, `_rng`). `stats`, when
    given, receives {"features": N, "clipped": features scaled down} (for the client's own
    log: sent, the count would be an unnoised statistic of its data). protos_k = S~_k / n~_k, projected onto the ball
    of radius `clip` when `project` (post-processing), where n~_k >= 1, else a zero row;
    counts_k = 1 there, else 0. An empty training set is released too (pure noise: under
    add-or-remove it must look like any other). Classification only: dense labels (masks)
    raise ValueError."""
    clip, z = float(clip), float(z)
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip must be positive and finite, got {clip}")
    if not (z >= 0 and math.isfinite(z)):
        raise ValueError(f"noise multiplier must be non-negative and finite, got {z}")
    if y.dim() != 1:
        raise ValueError("record-level DP prototypes are for classification labels [N]; "
                         f"got labels of shape {tuple(y.shape)} (dense/segmentation data)")
    was_training = model.training
    model.eval()
    try:
        sums, counts = None, None
        starts = range(0, len(y), batch) if len(y) else [0]
        for i in starts:
            h = model.features(x[i:i + batch])
            if h.dim() != 2:
                raise ValueError("record-level DP prototypes need features [B, D]; got "
                                 f"{tuple(h.shape)} (dense/segmentation networks)")
            h = h.double()
            norms = torch.linalg.vector_norm(h, dim=1, keepdim=True)
            # (1 - 2^-40): float64 rounding of the product never leaves the ball of radius C
            h = h * torch.clamp(clip * (1.0 - 2.0 ** -40) / norms.clamp(min=1e-300), max=1.0)
            if stats is not None:
                stats["features"] = stats.get("features", 0) + int(norms.numel())
                stats["clipped"] = stats.get("clipped", 0) + int((norms > clip).sum())
            yb = y[i:i + batch].to(h.device)
            if len(yb) and (int(yb.min()) < 0 or int(yb.max()) >= num_classes):
                raise ValueError(f"labels must lie in [0, {num_classes})")
            s = torch.zeros(num_classes, h.shape[1], dtype=torch.float64, device=h.device)
            s.index_add_(0, yb, h)
            c = torch.bincount(yb, minlength=num_classes)[:num_classes]
            sums = s if sums is None else sums + s
            counts = c if counts is None else counts + c
    finally:
        model.train(was_training)
    s = sums.cpu().numpy()
    n = counts.cpu().numpy().astype(np.float64)
    rng = _rng(seed)
    s = s + rng.normal(0.0, z * clip, size=s.shape)
    n = n + rng.normal(0.0, z, size=n.shape)
    present = n >= 1.0
    protos = np.where(present[:, None], s / np.where(present, n, 1.0)[:, None], 0.0)
    if project:
        norms = np.linalg.norm(protos, axis=1, keepdims=True)
        protos = protos * np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return {"protos": protos.astype(np.float32), "counts": present.astype(np.int64)}


def _leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()):
    """(path, array) of a nested dict, in sorted key order (so draws do not depend on the
    dict's insertion order)."""
    for k in sorted(tree):
        v = tree[k]
        if isinstance(v, Mapping):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), np.asarray(v)


def _rebuild(tree: Mapping[str, Any], fn) -> dict[str, Any]:
    return {k: _rebuild(v, fn) if isinstance(v, Mapping) else fn(np.asarray(v))
            for k, v in tree.items()}


def clip_update(tree: Mapping[str, Any], clip: float) -> tuple[dict[str, Any], float]:
    """Client-level clipping of a weight delta: the whole tree ({name: array}, nested dicts
    allowed) scaled by min(1, clip / ||tree||), ||tree|| the global L2 norm over all its
    arrays together (float64 accumulation). Returns (the clipped tree, float32 arrays of the
    same shapes; the norm before clipping). Every array counts and is scaled, integer
    buffers included (BatchNorm's num_batches_tracked): they come back float32. The
    float32 result's own norm is at most `clip` (rounding to float32 can lengthen a vector
    by a relative 2^-24; the scale is shrunk until it does not)."""
    clip = float(clip)
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip must be positive and finite, got {clip}")
    norm = _norm(tree)
    if not math.isfinite(norm):
        raise ValueError("the update holds a non-finite value: it cannot be clipped")
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    while True:
        out = _rebuild(tree, lambda a: (a.astype(np.float64) * scale).astype(np.float32))
        if scale == 1.0 or _norm(out) <= clip:
            return out, norm
        scale *= 1.0 - 2.0 ** -22


def delta_norm(tree: Mapping[str, Any]) -> float:
    """The global L2 norm of a delta's float arrays (what clip_update bounds)."""
    return _norm({k: v for k, v in tree.items()
                  if isinstance(v, Mapping) or np.asarray(v).dtype.kind == "f"})


def _norm(tree: Mapping[str, Any]) -> float:
    sq = 0.0
    for _, a in _leaves(tree):
        a = a.astype(np.float64, copy=False).ravel()
        sq += float(np.dot(a, a))
    return math.sqrt(sq)


def gaussian_like(tree: Mapping[str, Any], std: float, seed: int) -> dict[str, Any]:
    """N(0, std^2) float64 noise arrays shaped like `tree`'s (nested dicts allowed),
    drawn in sorted key order from numpy's generator seeded by SeedSequence([seed, tag]):
    the same seed and shapes give the same noise."""
    std = float(std)
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"std must be non-negative and finite, got {std}")
    rng = _rng(seed)
    draws = {path: rng.normal(0.0, std, size=a.shape) for path, a in _leaves(tree)}

    def build(sub: Mapping[str, Any], prefix: tuple[str, ...]) -> dict[str, Any]:
        return {k: build(v, (*prefix, k)) if isinstance(v, Mapping) else draws[(*prefix, k)]
                for k, v in sub.items()}

    return build(tree, ())


# --- which algorithms admit which mechanism ------------------------------------------------

def dp_levels(server_cls: type) -> tuple[str, ...]:
    """The class's own DP_LEVELS (ServerHandler.DP_LEVELS), not inherited: a subclass whose
    upload differs (FedAvg-proto, MP-FedCL over FedAvg) admits nothing until it declares.
    "sgd" (DP-SGD on the client, fedbus.algorithms.core.dp_sgd) comes with "client": an
    upload that is a weight delta is post-processing of the client's DP-SGD training."""
    levels = tuple(vars(server_cls).get("DP_LEVELS", ()))
    if "client" in levels and "sgd" not in levels:
        levels += ("sgd",)
    return levels


def _registry() -> list[tuple[str, type]]:
    from fedbus.algorithms import available, get_algorithm

    out = []
    for name in available():
        try:
            server = get_algorithm(name).server
        except (ImportError, KeyError, TypeError, AttributeError):
            server = None  # a broken plugin does not stop the others being listed
        if server is not None:
            out.append((name, server))
    return out


def _name_of(server_cls: type) -> str:
    for name, cls in _registry():
        if cls is server_cls:
            return name
    return server_cls.__name__


def dp_refusal(server_cls: Any, level: str, params: Mapping[str, Any] | None = None
               ) -> str | None:
    """Why an algorithm cannot run with privacy.dp = level, in one line, or None when it can
    (and always for "off"). `server_cls`: the ServerHandler class (get_algorithm(name).server),
    an Algorithm, or a registered name. `params` (the run's [algorithm] section), when given,
    also refuses client-level DP under an aggregation that is no sum (algorithm.robust)."""
    if level == "off":
        return None
    if level not in ("record", "client", "sgd"):
        return f"privacy.dp = {level}: unknown mechanism (off, record, client or sgd)"
    name = None
    if isinstance(server_cls, str):
        from fedbus.algorithms import get_algorithm

        name, server_cls = server_cls, get_algorithm(server_cls).server
    elif hasattr(server_cls, "server") and hasattr(server_cls, "name"):
        name, server_cls = server_cls.name, server_cls.server
    name = name or _name_of(server_cls)
    if level not in dp_levels(server_cls):
        what = {"record": "its upload is not only prototypes and counts",
                "client": "its upload is not a weight delta summed by DeltaSums",
                "sgd": "its upload is not a weight delta (DP-SGD makes the trained weights "
                "private)"}[level]
        admit = ", ".join(n for n, cls in _registry() if level in dp_levels(cls)) or "none"
        return f"privacy.dp = {level}: {name} cannot: {what}; algorithms that admit it: {admit}"
    if level == "sgd":
        why = sgd_refusal(name)
        if why is not None:
            return why
    if level == "client" and params is not None and not server_cls.merges(params):
        return (f"privacy.dp = client: {name} with algorithm.robust = "
                f"{params.get('robust')} aggregates by a rule that is no sum; client-level DP "
                "noises the sum of the clipped deltas")
    return None


def sgd_refusal(name: str, setting: str = "privacy.dp = sgd") -> str | None:
    """DP-SGD's own conditions (privacy.dp = sgd, or `setting`: privacy.dp_extractor = sgd
    under record level): Opacus installed, and a client that trains through
    LocalClient.run_local (where fedbus.algorithms.core.dp_sgd takes over the steps)."""
    import importlib.util

    if importlib.util.find_spec("opacus") is None:
        return (f"{setting} needs the opacus package, which is not installed: "
                "pip install 'fedbus[privacy]'")
    from fedbus.algorithms import get_algorithm
    from fedbus.algorithms.core.training import LocalClient

    try:
        client = get_algorithm(name).client
    except (ImportError, KeyError, TypeError, AttributeError):
        return None  # a server class known by no name: its declaration stands
    if not (isinstance(client, type) and issubclass(client, LocalClient)
            and client.run_local is LocalClient.run_local):
        return (f"{setting}: {name} cannot: its client does not train through "
                "LocalClient.run_local, where DP-SGD takes over the steps")
    return None

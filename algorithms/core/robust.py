"""Robust aggregation: bounding what an update that passes validation can still do.

The engine refuses updates of the wrong shape or dtype, and the server separately refuses
updates whose norm exceeds a bound; an attacker inside those bounds ("in-range poison")
still moves a mean by (its value - the honest mean) / n. The rules here replace a family's
mean by a statistic that a stated fraction of attackers cannot move outside the honest
clients' values. They are options, not the papers' aggregation: each family's default,
`robust = "none"`, is its paper's weighted mean, unchanged bit for bit.

Rules (n updates; f of them from attackers; d coordinates; every rule here is a function
of its inputs alone, and ties are broken by client order):

- "median", coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018, Option I): per
  coordinate the middle value (the mean of the two middle ones for even n).
  Tolerates f < n/2 (breakdown point 1/2): every coordinate of the result lies between the
  smallest and the largest honest value of that coordinate, whatever the attackers send.
  Cost: O(n d log n) time (a sort per coordinate), O(n x chunk) memory beyond the inputs.
- "trimmed_mean", coordinate-wise beta-trimmed mean (Yin et al. 2018, Option II): per
  coordinate, drop the t = floor(beta n) smallest and the t largest values and average
  the n - 2t left, 0 <= beta < 1/2. Tolerates f <= t: every coordinate of the result lies
  between the smallest and the largest honest value (with beta = 0 it is the plain mean).
  Cost: O(n d log n) time (a sort per coordinate), O(n x chunk) memory.
- "krum", Krum / multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning
  with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017): each vector's score
  is the sum of its squared distances to its n - f - 2 nearest other vectors; Krum returns
  the vector of lowest score, multi-Krum (m > 1) the average of the m lowest (m is capped at
  n - f, so that the m chosen can all be honest). Needs n >= 2f + 3 (the paper's
  n > 2f + 2). Bound: an honest vector's score is at most (n - f - 2) D^2, D the diameter
  of the honest vectors; a chosen attacker's score is no larger, and at least
  n - 2f - 1 >= 2 of its scored neighbours are honest, so every chosen vector lies within
  sqrt(n - f - 2) D of an honest vector, and their average within (sqrt(n - f - 2) + 1) D
  of the honest mean. Unlike the coordinate-wise rules the result is (an average of)
  whole updates. Cost: O(n^2 d) time (the pairwise distances, one n x n Gram matrix per
  column chunk, BLAS), O(n^2 + n x chunk) memory. Distances are taken after subtracting
  the first vector (exact for the translation, less cancellation in the Gram form).
  With too few vectors (n < 2f + 3) Krum cannot hold its bound; refusing to aggregate
  would stall the federation, so the rule falls back to the coordinate-wise median for
  that aggregation (or that class) and the handler reports it ("robust_fallbacks").

Measured on a shared 2-core machine (numpy, float64; `timeit`, best of 2-3): 100
clients x 10 classes x 512 dims, per class: eq. 6's mean 6 ms, median 15 ms, trimmed mean
9 ms, Krum 4 ms. 50 clients' weight deltas: fedbus's "cnn" (21,840 weights) mean 2 ms,
median 25 ms, trimmed mean 13 ms, Krum 10 ms; "cnn4" (878,538 weights, 168 MiB of deltas)
mean 0.07-0.11 s, median 0.61 s, trimmed mean 0.64 s, Krum 0.19 s (multi-Krum m = 40:
0.22 s); "resnet8" (1.23 M weights) mean 0.15 s, median 0.59 s, trimmed mean 0.65 s,
Krum 0.29 s. n clients x 200,000 weights, one BLAS thread: median 0.21 / 0.62 / 1.1 / 3.1 s
and Krum 0.10 / 0.28 / 0.91 / 2.4 s for n = 50 / 100 / 200 / 400 (Krum's n^2 d runs as
matrix products; it stays below the sorts up to n = 400). So a robust rule costs 3-10x the
weighted mean at these sizes (timings on a shared, loaded machine: upper figures).

What changes against the families' means, for every robust rule:
- each update counts once: the sample-count weights (n_i of FedAvg, |D_i,k| of FedProto's
  eq. 6), which a client reports itself and an attacker would inflate, and the engine's
  staleness weights are dropped; class counts still decide which clients hold a class;
- a relay's pre-aggregated sums cannot be taken apart, so a handler under a robust rule
  declares no merge rule (`Robust.merges`): relays forward every update and the server
  refuses merged ones (fedbus.algorithms.core.merge);
- under secure aggregation (masking) the server sees only the sum of the updates, so no
  robust rule can run: the client-side clip and the server's bound on the sum are what
  remain.

Where the rules apply (PARAM `robust` and its settings, ROBUST_PARAMS):
- weights (FedAvg, FedProx, FedAvg-proto's weights): w <- w + rule(delta_1..delta_n), the
  rule over every weight of the state dict at once (Krum's distances over the floating
  point entries only: an integer buffer such as BatchNorm's num_batches_tracked counts
  steps, not learning, and would dominate them; a chosen update's whole delta is
  averaged);
- prototypes (FedProto's eq. 6, FedAvg-proto's eq. 3, the client prototypes FedTGP's server
  trains on): per class, the rule over the prototypes of the clients that hold the class
  (`per_class`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RULES = ("none", "median", "trimmed_mean", "krum")
# The algorithms whose server declares ROBUST_PARAMS (a config error elsewhere names them).
ALGORITHMS = ("fedavg", "fedprox", "fedavg-proto", "fedproto", "fedtgp")
CHUNK = 1 << 16  # columns stacked at a time: memory n x CHUNK float64 beyond the inputs


# --- the rules on a stack of vectors -----------------------------------------------------

def _stack(x: Any) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim < 1 or len(a) == 0:
        raise ValueError("a robust rule needs at least one vector")
    return a


def _sorted_columns(a: np.ndarray) -> np.ndarray:
    """a [n, ...] sorted along the clients, as [d, n] rows (contiguous: the faster sort)."""
    return np.sort(np.ascontiguousarray(a.reshape(len(a), -1).T), axis=1)


def median(x: Any) -> np.ndarray:
    """Coordinate-wise median of x [n, ...] (float64 [...]; for even n the mean of the two
    middle values, as np.median): tolerates f < n/2 attackers, each coordinate staying
    within the honest values' range. O(n d log n) time (a sort per coordinate, faster here
    than np.median's selection for the n of a federation)."""
    a = _stack(x)
    n = len(a)
    s = _sorted_columns(a)
    mid = s[:, n // 2] if n % 2 else (s[:, n // 2 - 1] + s[:, n // 2]) / 2.0
    return mid.reshape(a.shape[1:])


def trim_count(n: int, beta: float) -> int:
    """t = floor(beta n), the values dropped from each end (beta in [0, 1/2))."""
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed mean: beta = {beta} must be in [0, 0.5)")
    return math.floor(beta * n + 1e-9)  # 0.29 * 100 is 28.999...: still 29


def trimmed_mean(x: Any, beta: float) -> np.ndarray:
    """Coordinate-wise beta-trimmed mean of x [n, ...] (float64 [...]): per coordinate the
    mean of the values left after dropping the floor(beta n) smallest and largest (the
    sorted values summed in order, so the result does not depend on the client order).
    Tolerates f <= floor(beta n) attackers. O(n d log n) time."""
    a = _stack(x)
    n = len(a)
    t = trim_count(n, beta)
    return _sorted_columns(a)[:, t:n - t].mean(axis=1).reshape(a.shape[1:])


def check_krum(n: int, f: int) -> None:
    """ValueError unless Krum can hold its bound: n >= 2f + 3 (Blanchard et al.'s n > 2f+2)."""
    if f < 0:
        raise ValueError(f"krum: f = {f} must be >= 0")
    if n < 2 * f + 3:
        raise ValueError(f"krum with f = {f} needs n >= 2f + 3 = {2 * f + 3} vectors, got {n}")


def pairwise_sq_distances(x: Any) -> np.ndarray:
    """||x_i - x_j||^2 for the rows of x [n, d] (float64 [n, n], symmetric, zero diagonal),
    by the Gram matrix of the rows minus the first row. O(n^2 d) time."""
    a = _stack(x)
    a = a.reshape(len(a), -1)
    sq = np.zeros((len(a), len(a)))
    for lo in range(0, a.shape[1], CHUNK):
        _add_gram_distances(sq, a[:, lo:lo + CHUNK])
    return _finish_distances(sq)


def _add_gram_distances(sq: np.ndarray, block: np.ndarray) -> None:
    """sq += the squared distances between the rows of block (float64 [n, c])."""
    b = block - block[:1]
    g = b @ b.T
    norms = np.diag(g).copy()
    sq += norms[:, None] + norms[None, :] - 2.0 * g


def _finish_distances(sq: np.ndarray) -> np.ndarray:
    sq = np.maximum((sq + sq.T) / 2.0, 0.0)
    np.fill_diagonal(sq, 0.0)
    return sq


def krum_scores(sq: np.ndarray, f: int) -> np.ndarray:
    """Krum's score of each of n vectors from their squared distances [n, n]: the sum of the
    n - f - 2 smallest distances to the others."""
    n = len(sq)
    check_krum(n, f)
    k = n - f - 2
    others = np.sort(sq[~np.eye(n, dtype=bool)].reshape(n, n - 1), axis=1)
    return others[:, :k].sum(axis=1)


def krum_select(sq: np.ndarray, f: int, m: int = 1) -> np.ndarray:
    """Indices of the min(m, n - f) lowest Krum scores, best first (ties: lower index)."""
    if m < 1:
        raise ValueError(f"multi-krum: m = {m} must be >= 1")
    scores = krum_scores(sq, f)
    return np.argsort(scores, kind="stable")[:min(m, len(sq) - f)]


def krum(x: Any, f: int, m: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Krum (m = 1) or multi-Krum of x [n, ...]: (the mean of the chosen vectors, float64
    [...], summed in client order; the chosen indices, best first). Needs n >= 2f + 3;
    m is capped at n - f. Each chosen vector lies within sqrt(n - f - 2) D of an honest one
    (D the honest diameter). O(n^2 d) time."""
    a = _stack(x)
    chosen = krum_select(pairwise_sq_distances(a), f, m)
    return a[np.sort(chosen)].sum(axis=0) / len(chosen), chosen


def _column_blocks(trees: Sequence[Mapping[str, Any]], names: Sequence[str],
                   chunk: int | None = None):
    """The n trees' arrays under `names`, flattened and laid end to end, in float64 blocks of
    `chunk` (default CHUNK) columns [n, <= chunk]: yields (block, pieces), each piece (name,
    lo, hi, at) saying that block columns at..at + hi - lo are that name's flat entries
    lo..hi. Blocks span names, so a model of many small tensors costs a few large
    operations, not many small ones."""
    chunk = chunk or CHUNK
    flats = [[np.asarray(t[k]).reshape(-1) for k in names] for t in trees]
    spans: list[tuple[int, int, int, int]] = []  # (name index, lo, hi, at)
    width = 0

    def block() -> tuple[np.ndarray, list[tuple[str, int, int, int]]]:
        out = np.empty((len(trees), width))
        for row, flat in zip(out, flats):
            for j, lo, hi, at in spans:
                row[at:at + hi - lo] = flat[j][lo:hi]
        return out, [(names[j], lo, hi, at) for j, lo, hi, at in spans]

    for j in range(len(names)):
        size, lo = flats[0][j].size, 0
        while lo < size:
            take = min(size - lo, chunk - width)
            spans.append((j, lo, lo + take, width))
            width += take
            lo += take
            if width == chunk:
                yield block()
                spans, width = [], 0
    if spans:
        yield block()


# --- a configured rule ------------------------------------------------------------------

@dataclass
class Outcome:
    """What one robust aggregation did: how many Krum aggregations fell back to the median
    (too few vectors), and which rows Krum chose (per class for prototypes)."""

    fallbacks: int = 0
    chosen: dict[int, list[int]] = field(default_factory=dict)  # class (or -1) -> rows


@dataclass(frozen=True)
class RobustRule:
    """A rule of RULES other than "none", with its settings: trim = beta of the trimmed
    mean, f = the attackers Krum assumes, m = how many Krum picks and averages."""

    name: str
    trim: float = 0.1
    f: int = 1
    m: int = 1

    def __post_init__(self) -> None:
        if self.name not in RULES or self.name == "none":
            raise ValueError(f"robust rule {self.name!r}: one of {', '.join(RULES[1:])}")
        trim_count(1, self.trim)
        if self.f < 0 or self.m < 1:
            raise ValueError(f"krum: f = {self.f} must be >= 0 and m = {self.m} >= 1")

    def krum_fits(self, n: int) -> bool:
        return n >= 2 * self.f + 3

    def vectors(self, x: Any, out: Outcome | None = None, key: int = -1) -> np.ndarray:
        """The rule over the rows of x [n, ...] (float64 [...]); Krum with n < 2f + 3 falls
        back to the median (counted in `out`)."""
        a = _stack(x)
        if self.name == "median":
            return median(a)
        if self.name == "trimmed_mean":
            return trimmed_mean(a, self.trim)
        if not self.krum_fits(len(a)):
            if out is not None:
                out.fallbacks += 1
            return median(a)
        value, chosen = krum(a, self.f, self.m)
        if out is not None:
            out.chosen[key] = [int(i) for i in chosen]
        return value

    def trees(self, trees: Sequence[Mapping[str, Any]],
              out: Outcome | None = None) -> dict[str, np.ndarray]:
        """The rule over n weight dicts ({name: array}, the same names and shapes), float64
        per name: coordinate-wise rules name by name and chunk by chunk; Krum over the
        concatenation of the floating-point entries (see the module doc)."""
        if not trees:
            raise ValueError("a robust rule needs at least one update")
        names = list(trees[0])
        shapes = [np.shape(trees[0][k]) for k in names]
        for t in trees[1:]:
            if list(t) != names or [np.shape(t[k]) for k in names] != shapes:
                raise ValueError("updates carry different weight names or shapes")
        if self.name == "krum" and self.krum_fits(len(trees)):
            return self._krum_trees(trees, names, out)
        rule = self if self.name != "krum" else RobustRule("median")
        if self.name == "krum" and out is not None:
            out.fallbacks += 1
        flat = {k: np.empty(int(np.prod(shape, dtype=np.int64))) for k, shape in
                zip(names, shapes)}
        for block, pieces in _column_blocks(trees, names):
            value = rule.vectors(block)
            for k, lo, hi, at in pieces:
                flat[k][lo:hi] = value[at:at + hi - lo]
        return {k: flat[k].reshape(shape) for k, shape in zip(names, shapes)}

    def _krum_trees(self, trees, names, out):
        n = len(trees)
        sq = np.zeros((n, n))
        floats = [k for k in names if np.issubdtype(np.asarray(trees[0][k]).dtype, np.floating)]
        for block, _ in _column_blocks(trees, floats):
            _add_gram_distances(sq, block)
        chosen = krum_select(_finish_distances(sq), self.f, self.m)
        if out is not None:
            out.chosen[-1] = [int(i) for i in chosen]
        rows = np.sort(chosen)
        result = {}
        for k in names:
            acc = np.zeros(np.shape(trees[0][k]))
            for i in rows:
                acc = acc + np.asarray(trees[i][k], dtype=np.float64)
            result[k] = acc / len(rows)
        return result

    def per_class(self, protos: Any, present: Any,
                  out: Outcome | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prototypes [N, C, D] of N clients, presence [N, C] (a class count > 0): per class
        k, the rule over the prototypes of the clients that hold k. Returns (float32 [C, D],
        zero rows for classes nobody holds; bool [C], the classes someone holds). Counts
        decide presence only: they do not weigh a robust rule."""
        p = np.asarray(protos)
        has = np.asarray(present, dtype=bool)
        if p.ndim != 3 or has.shape != p.shape[:2]:
            raise ValueError(f"protos [N, C, D] and presence [N, C] expected, got {p.shape}, "
                             f"{has.shape}")
        result = np.zeros(p.shape[1:], dtype=np.float64)
        for k in range(p.shape[1]):
            rows = np.flatnonzero(has[:, k])
            if len(rows):
                sub = Outcome()
                result[k] = self.vectors(p[rows, k], sub, key=k)
                if out is not None:
                    out.fallbacks += sub.fallbacks
                    out.chosen.update({c: [int(rows[i]) for i in chosen]
                                       for c, chosen in sub.chosen.items()})
        return result.astype(np.float32), has.any(axis=0)


# --- the handler option -------------------------------------------------------------------

def _params() -> dict[str, Any]:
    from fedbus.algorithms.core.params import opt  # local imports merge and base; no cycle here

    return {
        "robust": opt("none", "robust aggregation against in-range poison "
                      "(fedbus.algorithms.core.robust): none = the paper's weighted mean; median = "
                      "coordinate-wise median (f < n/2); trimmed_mean = drop floor(robust_trim "
                      "n) from each end per coordinate; krum = Krum / multi-Krum (n >= "
                      "2 robust_f + 3, else the median). Each update counts once; relays "
                      "forward updates unmerged", choices=RULES),
        "robust_trim": opt(0.1, "trimmed_mean: beta, the fraction trimmed from each end "
                           "(tolerates floor(beta n) attackers)", min=0.0, max=0.49),
        "robust_f": opt(1, "krum: f, the attackers assumed (needs n >= 2f + 3 updates, or "
                        "per class holders)", min=0),
        "robust_m": opt(1, "krum: m, how many lowest-score updates are averaged (1 = Krum; "
                        "> 1 = multi-Krum, capped at n - f)", min=1),
    }


# The PARAMS entries of a family that supports robust aggregation.
ROBUST_PARAMS: dict[str, Any] = _params()


def rule_in(handler_cls: type, params: Mapping[str, Any]) -> RobustRule | None:
    """The robust rule a handler class runs under `params` (its [algorithm] section), or
    None for "none" and for a class whose PARAMS do not declare `robust` (a subclass with
    its own aggregation and PARAMS, e.g. FedAtt under FedAvgServer)."""
    declared = getattr(handler_cls, "PARAMS", {})
    if "robust" not in declared:
        return None

    def value(key: str) -> Any:
        return params[key] if key in params else getattr(declared[key], "default",
                                                         declared[key])

    name = value("robust")
    if name == "none":
        return None
    return RobustRule(str(name), float(value("robust_trim")), int(value("robust_f")),
                      int(value("robust_m")))


class Robust:
    """Mixin of a ServerHandler whose PARAMS include ROBUST_PARAMS: `robust_rule()` reads
    the option, and `merges()` tells ServerHandler.merge_rule that a run under a robust
    rule has no merge rule (relays forward updates; the server refuses merged ones)."""

    params: Mapping[str, Any]

    @classmethod
    def merges(cls, params: Mapping[str, Any]) -> bool:
        return rule_in(cls, params) is None

    def robust_rule(self) -> RobustRule | None:
        return rule_in(type(self), self.params)


def no_merged(updates: Sequence[Any], rule: RobustRule) -> None:
    """ValueError if a relay's merged update reached a robust aggregation (the server refuses
    them before, since merge_rule() is None; a direct caller gets told why)."""
    if any(getattr(u, "members", ()) for u in updates):
        raise ValueError(f"robust = {rule.name!r} cannot use a relay's pre-aggregated sums")


def report(metrics: dict[str, Any], rule: RobustRule, out: Outcome,
           clients: Sequence[int], prefix: str = "") -> None:
    """Add an outcome to an aggregation's metrics: "{prefix}robust_fallbacks" (Krum rounds
    or classes that fell back to the median) and, for Krum, "{prefix}krum_chosen": the
    chosen clients (a list for weights, {class: list} for prototypes: the record's
    agg_extra)."""
    metrics[f"{prefix}robust_fallbacks"] = float(out.fallbacks)
    if rule.name == "krum" and out.chosen:
        ids = {k: [int(clients[i]) for i in rows] for k, rows in out.chosen.items()}
        metrics[f"{prefix}krum_chosen"] = ids[-1] if -1 in ids else \
            {str(k): v for k, v in sorted(ids.items())}


def unsupported_hint(section: str, key: str) -> str:
    """For the config's unknown-key error: where a robust key is accepted."""
    if section == "algorithm" and key in ROBUST_PARAMS:
        return f" ({key} is an option of {', '.join(ALGORITHMS)})"
    return ""

"""Checks an update must pass before any handler sees it.

The engine checks that it answers an outstanding task of this run (sender,
task id, version); this module checks its content against bounds the server
computes itself, never ones the update claims:

* shape: the fields the engine needs, the arrays the algorithm declared (dtype
  and shape), nesting no deeper than MAX_DEPTH (walked without recursion);
* no NaN or Inf anywhere;
* counts: non-negative integers, each class's count at most the client's own
  samples of that class (from the partition the server built), their sum at most
  the client's samples; compared element by element before any sum, so no int64
  sum can wrap. The work report the client makes (epochs asked, ...) never widens
  a bound;
* norms (`Norms`): each prototype row (PROTOTYPE_KEYS, last axis) at most
  `proto`, and the L2 norm of all other float arrays together (a weight delta, a
  head, logits) at most `update`: what a clipped client can send, refused above;
* class ids in range.

Relays (fedbus.node.relay) run the same checks on each member before merging it,
so one bad member goes up alone and is refused there, and `check_merged` bounds a
merged update by its members' bounds (mass per class, sums' norms).

Evaluation results get a typed schema too (`check_eval_result`): metrics are
numbers in range (rates in [0, 1], NaN allowed where a client has no test
samples), num_test within the client's test set, embeddings and masks arrays.

A failing message is refused with the reason, counted, and never aggregated.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# Real bodies nest a few levels (a merged update's members: body/members/[i]/work); a
# fixed, small limit keeps every walk here iterative and far from Python's recursion limit.
MAX_DEPTH = 32
PROTOTYPE_KEYS = ("protos", "protos_before")
# Rates a client reports from its test set; the rest of METRIC_KEYS are losses.
RATE_METRICS = ("acc", "proto_acc", "aux_acc", "local_head_acc", "global_head_acc",
                "global_acc", "miou", "proto_miou")
MAX_METRICS = 64  # keys in one evaluation's metrics
MAX_LOSS = 1e9
MAX_WORK = float(1 << 53)  # a work report's numbers stay exact as floats


class Rejected(ValueError):
    """Why an update was refused (the message goes back to the client)."""


@dataclass(frozen=True)
class Norms:
    """Server-side norm bounds (SECURITY.md): `proto` for each prototype row, `update` for
    the L2 norm of all other float arrays of one update together. 0 = unbounded."""

    proto: float = 0.0
    update: float = 0.0


@dataclass(frozen=True)
class ClientBounds:
    """What one client's update can honestly claim, from the server's own partition:
    `samples` its training-set size, `classes` its samples per class (None: unknown, the
    total bounds each class), `units` labelled units a sample (H * W for segmentation),
    `epochs` the passes its counts may cover (ServerHandler.count_epochs: the server's own
    config, never the update's work report), `presence` whether its counts are presence
    flags (privacy.dp = "record": a count above 1 would weigh the client's prototype as
    that many honest clients')."""

    samples: int
    classes: np.ndarray | None = None
    units: int = 1
    epochs: int = 1
    presence: bool = False  # counts are presence flags (record DP, withhold_counts): 0/1

    def class_max(self, num_classes: int) -> np.ndarray:
        """int64 [C]: the most a count of each class can be."""
        if self.presence:
            return np.ones(num_classes, np.int64)
        k = max(1, int(self.epochs))
        if self.classes is not None and self.units == 1 and len(self.classes) == num_classes:
            return np.asarray(self.classes, dtype=np.int64) * k
        return np.full(num_classes, self.total(), np.int64)

    def total(self) -> int:
        """The most all counts together can be."""
        return int(self.samples) * max(1, int(self.units)) * max(1, int(self.epochs))


DEFAULT_PROTO_NORM = 1e4  # features of the zoo's networks are 1-100 long
# Under secure aggregation the server sees only the round's sum, so its one check on a
# client's prototypes is on that sum: |sum_k| <= mass_k x the bound. A client can move
# class k's global prototype by at most (its mass / the round's mass of k) x (bound +
# the honest prototype's norm), whatever it sends; with DEFAULT_PROTO_NORM that is a
# shift of thousands against honest norms of ~5. Honest clients clip to this instead
# (fedbus.node.privacy.secure_round.SecureClient), where nothing else bounds them: the
# upper end of the zoo's feature norms, so honest prototypes are not cut.
SECURE_PROTO_CLIP = 100.0


def proto_bound(max_proto_norm: float, clip_norm: float, noise_sigma: float, dim: int) -> float:
    """The longest prototype an honest client sends: max_proto_norm when set; else what
    clipping to clip_norm allows, the clip plus its Gaussian noise's length sigma (sqrt(D) +
    8) (a chi-distributed length exceeds sqrt(D) + t with probability below exp(-t^2 / 2);
    t = 8: 1e-14); without clipping DEFAULT_PROTO_NORM."""
    if max_proto_norm > 0:
        return float(max_proto_norm)
    if clip_norm > 0:
        return float(clip_norm) + float(noise_sigma) * (math.sqrt(max(int(dim), 0)) + 8.0)
    return DEFAULT_PROTO_NORM


def secure_proto_clip(privacy: Mapping[str, Any]) -> float:
    """What each client clips its prototype rows to before masking under secure
    aggregation: SECURE_PROTO_CLIP, or 0 (no clipping) where privacy.clip_norm or
    record-level DP bounds them already, or secure aggregation is off."""
    if not privacy.get("secure_aggregation", False) or \
            float(privacy.get("clip_norm", 0.0)) > 0 or privacy.get("dp", "off") == "record":
        return 0.0
    return SECURE_PROTO_CLIP


def run_norms(security: Mapping[str, Any], privacy: Mapping[str, Any], dim: int) -> Norms:
    """The norm bounds of a run's [security] and [privacy] sections for features of `dim`
    (the server's and a relay's alike). Unless max_proto_norm is set, the prototype bound
    is the clip that honest clients apply: clip_norm plus its noise's allowance; dp_clip
    under record-level DP (each release is projected onto the ball of radius dp_clip,
    fedbus.node.privacy.dp); secure_proto_clip under secure aggregation; else
    DEFAULT_PROTO_NORM. Under client-level DP a delta is clipped to dp_clip (weight 1 in
    the sum), so the update bound is at most dp_clip."""
    set_bound = float(security.get("max_proto_norm", 0.0))
    clip_norm = float(privacy.get("clip_norm", 0.0))
    proto = proto_bound(set_bound, clip_norm, float(privacy.get("noise_sigma", 0.0)), dim)
    dp = privacy.get("dp", "off")
    if set_bound <= 0 and clip_norm <= 0:
        if dp == "record":
            proto = float(privacy.get("dp_clip", 1.0))
        elif secure_proto_clip(privacy) > 0:
            proto = secure_proto_clip(privacy)
    update = float(security.get("max_update_norm", 0.0))
    if dp == "client":
        update = min(update, float(privacy.get("dp_clip", 1.0))) if update > 0 else \
            float(privacy.get("dp_clip", 1.0))
    return Norms(proto=proto, update=update)


def _check_number(name: str, value: Any, *, low: float = 0, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Rejected(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        raise Rejected(f"{name} = {value!r} is out of range")


def _walk(value: Any, path: str = "payload"):
    """(path, value) for every array and float in a payload, depth first, iteratively;
    Rejected past MAX_DEPTH levels."""
    stack = [(value, path, 0)]
    while stack:
        v, p, depth = stack.pop()
        if isinstance(v, (np.ndarray, float)):
            yield p, v
        elif isinstance(v, (dict, Mapping, list, tuple)):
            if depth >= MAX_DEPTH:
                raise Rejected(f"{p} is nested deeper than {MAX_DEPTH} levels")
            items = v.items() if isinstance(v, (dict, Mapping)) else enumerate(v)
            fmt = "{}.{}" if isinstance(v, (dict, Mapping)) else "{}[{}]"
            stack.extend((x, fmt.format(p, k), depth + 1) for k, x in reversed(list(items)))


def _finite(value: np.ndarray | float) -> bool:
    if isinstance(value, np.ndarray):
        return value.dtype.kind not in "fc" or bool(np.isfinite(value).all())
    return math.isfinite(value)


def non_finite(payload: Any) -> list[str]:
    """Paths of the floats and float arrays in a payload that are or hold NaN or Inf (a
    node checks its own update with this before sending; the server rejects such)."""
    return [path for path, value in _walk(payload) if not _finite(value)]


def _flatten_spec(spec: Mapping[str, Any], prefix: tuple[str, ...] = ()):
    """{"delta": {"conv1.weight": (dtype, shape)}} -> ((delta, conv1.weight), dtype, shape).
    Keys are kept whole: weight names contain dots."""
    for key, value in spec.items():
        if isinstance(value, Mapping):
            yield from _flatten_spec(value, prefix + (key,))
        else:
            yield prefix + (key,), value[0], value[1]


def _lookup(payload: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = payload
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            raise Rejected(f"payload lacks {'/'.join(path)!r}")
        node = node[part]
    return node


def _check_work(work: Any, name: str = "work") -> None:
    if not isinstance(work, (dict, Mapping)):
        raise Rejected(f"{name} must be a map")
    for key in ("epochs_asked", "epochs_done", "steps", "samples"):
        if key not in work:
            raise Rejected(f"{name} lacks {key!r}")
        _check_number(f"{name}.{key}", work[key], high=MAX_WORK)


def _check_arrays(payload: Any, spec: Mapping[str, Any] | None,
                  max_bytes: int | None) -> dict[str, float]:
    """The declared arrays are there with their dtype and shape; nothing is NaN or Inf;
    the arrays fit under max_bytes. Returns the squared L2 norm of each top-level float
    array of a payload that is a map of arrays, by key: the finiteness check computed it
    (_finite_sq_norm), and check_norms needs it."""
    if not isinstance(payload, (dict, Mapping)):
        raise Rejected("payload must be a map")
    for path, dtype, shape in _flatten_spec(spec or {}):
        name = "/".join(path)
        arr = _lookup(payload, path)
        if not isinstance(arr, np.ndarray):
            raise Rejected(f"{name} must be an array, got {type(arr).__name__}")
        if arr.dtype != np.dtype(dtype):
            raise Rejected(f"{name} has dtype {arr.dtype}, expected {dtype}")
        if len(arr.shape) != len(shape) or any(
                want is not None and got != want for got, want in zip(arr.shape, shape)):
            raise Rejected(f"{name} has shape {tuple(arr.shape)}, expected "
                           f"{tuple('*' if s is None else s for s in shape)}")
    total = 0
    squares: dict[str, float] = {}
    if all(type(v) is np.ndarray for v in payload.values()):  # the usual: a map of arrays
        for key, value in payload.items():
            if value.dtype.kind == "f" and value.size:
                sq = _finite_sq_norm(value)
                if sq is None:
                    raise Rejected(f"payload.{key} contains NaN or Inf")
                squares[key] = sq
            elif not _finite(value):
                raise Rejected(f"payload.{key} contains NaN or Inf")
            total += value.nbytes
    else:
        for path, value in _walk(payload):
            if not _finite(value):
                raise Rejected(f"{path} contains NaN or Inf" if isinstance(value, np.ndarray)
                               else f"{path} is {value}")
            total += value.nbytes if isinstance(value, np.ndarray) else 0
    if max_bytes is not None and total > max_bytes:
        raise Rejected(f"payload arrays of {total} bytes exceed the {max_bytes}-byte cap")
    return squares


def _finite_sq_norm(a: np.ndarray) -> float | None:
    """The squared L2 norm of a float array if every value in it is finite, else None, in
    one pass where it can: a finite sum of squares proves every value finite (NaN and Inf
    carry into it, and squares cannot cancel), so np.isfinite is asked only where the sum
    is not finite, to tell a NaN or Inf from a float32 square that overflowed."""
    flat = a.ravel()
    sq = float(np.dot(flat, flat))
    if math.isfinite(sq):
        return sq
    if not bool(np.isfinite(a).all()):
        return None
    if a.dtype == np.float64:
        return sq  # inf: above any bound, which is all a bound needs
    wide = flat.astype(np.float64)  # a float32 overflow: say how far (as _sq_norm does)
    return float(np.dot(wide, wide))


def _row_norms(a: np.ndarray) -> np.ndarray:
    """L2 norms along the last axis. In the array's own float precision: a square that
    overflows is inf, and inf is above any bound, which is all a bound needs."""
    a = np.asarray(a)
    if a.dtype.kind != "f":
        a = a.astype(np.float64)
    return np.sqrt(np.einsum("...i,...i->...", a, a)) if a.ndim else np.abs(a)


def _sq_norm(a: np.ndarray) -> float:
    a = np.asarray(a).ravel()
    sq = float(np.dot(a, a))
    if not math.isfinite(sq) and a.dtype != np.float64:  # a float32 overflow: say how far
        a = a.astype(np.float64)
        sq = float(np.dot(a, a))
    return sq


def _float_arrays(value: Any, path: str):
    """(path, array) of the float arrays below value: a payload is arrays and maps of
    arrays (a weight delta), so no walk is needed but for anything nested deeper."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f" and value.size:
            yield path, value
    elif isinstance(value, dict) and all(isinstance(v, np.ndarray) for v in value.values()):
        for k, v in value.items():
            if v.dtype.kind == "f" and v.size:
                yield f"{path}.{k}", v
    else:
        for p, v in _walk(value, path):
            if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size:
                yield p, v


def check_norms(payload: Mapping[str, Any], norms: Norms | None,
                squares: Mapping[str, float] | None = None) -> None:
    """Prototype rows within norms.proto; every other float array of the payload, together,
    within norms.update (tolerance 1e-4 relative: a float32 clip lands a hair above).
    squares: squared norms of top-level arrays already computed (_check_arrays)."""
    if norms is None or (norms.proto <= 0 and norms.update <= 0):
        return  # no bound to check (the default): no norm to compute
    rest = 0.0
    for key, top in payload.items():
        if key in PROTOTYPE_KEYS and isinstance(top, np.ndarray) and top.ndim >= 1:
            if norms.proto > 0 and top.dtype.kind == "f" and top.size:
                worst = float(_row_norms(top).max())
                if not worst <= norms.proto * (1 + 1e-4):
                    raise Rejected(f"payload.{key} has a prototype of L2 norm {worst:.4g}, "
                                   f"above the server's bound {norms.proto:.4g}")
            continue
        if squares is not None and key in squares:
            rest += squares[key]
            continue
        for _, value in _float_arrays(top, f"payload.{key}"):
            rest += _sq_norm(value)
    if norms.update > 0 and not math.sqrt(rest) <= norms.update * (1 + 1e-4):
        raise Rejected(f"the update's arrays have L2 norm {math.sqrt(rest):.4g}, above the "
                       f"server's bound {norms.update:.4g}")


def check_counts(counts: Any, bounds: ClientBounds, num_classes: int,
                 name: str = "counts") -> None:
    """Per-class counts within the client's own class sizes and, summed, its samples; in
    Python integers, each compared before the sum, so nothing can wrap."""
    if not isinstance(counts, np.ndarray) or not counts.size:
        return
    if counts.dtype.kind not in "iu":
        raise Rejected(f"{name} must be integers, got {counts.dtype}")
    if counts.ndim != 1:
        raise Rejected(f"{name} must be one count per class")
    values = counts.tolist()
    if min(values) < 0:
        raise Rejected(f"{name} must be non-negative")
    units = max(1, int(bounds.units))
    total_max = bounds.total()
    if bounds.presence:
        over = next((k for k, n in enumerate(values) if n > 1), None)
        if over is not None:
            raise Rejected(f"{name}[{over}] = {values[over]}: a count is a presence flag, 0 "
                           "or 1, where clients send class presence (privacy.dp = record "
                           "or privacy.withhold_counts)")
    if len(values) == num_classes:
        for k, (n, most) in enumerate(zip(values, bounds.class_max(num_classes).tolist())):
            if n > most:
                raise Rejected(f"{name}[{k}] = {n} is more than the client's {most} samples "
                               f"of class {k}")
    elif max(values) > total_max:
        raise Rejected(f"{name} holds {max(values)}, more than the client's {total_max} "
                       "samples")
    total = sum(values)
    if total > total_max:
        raise Rejected(f"{name} sum to {total}, more than the client's {int(bounds.samples)} "
                       "samples" + (f" x {units} label pixels" if units > 1 else ""))


def canonical_client(address: Any) -> int:
    """The client index of "c<int>" written as the engine writes it ("c3", not "c03")."""
    if not isinstance(address, str) or not address.startswith("c") or \
            not address[1:].isdigit() or address != f"c{int(address[1:])}":
        raise Rejected(f"{address!r} is not a client address")
    return int(address[1:])


def check_update(body: Any, spec: Mapping[str, Any] | None, *,
                 num_classes: int, max_samples: int, max_bytes: int | None = None,
                 nbytes: int = 0, label_pixels: int = 1, class_samples: Any = None,
                 norms: Norms | None = None, count_epochs: int = 1,
                 presence: bool = False) -> None:
    """Raise Rejected with the reason if an update body is not acceptable.

    max_bytes: the size cap (the bus's max_frame): the message (nbytes, header + body) and
    the arrays of its payload must both stay under it.
    max_samples / class_samples: the client's training samples, in all and per class (from
    the server's partition; None: the total bounds each class).
    label_pixels: labelled units per sample, 1 for classification; H * W for segmentation
    masks, whose per-class counts count pixels (at feature resolution, at most H * W a
    sample): counts may then sum to max_samples * label_pixels.
    count_epochs: the passes counts may cover (ServerHandler.count_epochs).
    presence: counts are presence flags (record-level DP, withhold_counts), each 0 or 1.
    norms: the server's norm bounds (check_norms); None checks none.
    spec: the declared arrays; None checks none (a relay, which builds no model).
    """
    if max_bytes is not None and nbytes > max_bytes:
        raise Rejected(f"update of {nbytes} bytes exceeds the {max_bytes}-byte cap")
    if not isinstance(body, (dict, Mapping)):
        raise Rejected(f"update body must be a map, got {type(body).__name__}")
    for key in ("task", "version", "num_samples", "work", "payload"):
        if key not in body:
            raise Rejected(f"update lacks {key!r}")
    _check_number("num_samples", body["num_samples"], high=max_samples)
    _check_work(body["work"])
    payload = body["payload"]
    squares = _check_arrays(payload, spec, max_bytes)
    bounds = ClientBounds(int(max_samples), None if class_samples is None else
                          np.asarray(class_samples), int(label_pixels), int(count_epochs),
                          presence=bool(presence))
    check_counts(payload.get("counts"), bounds, num_classes)
    classes = payload.get("classes")
    if isinstance(classes, np.ndarray) and classes.size:
        if classes.dtype.kind not in "iu" or classes.min() < 0 or classes.max() >= num_classes:
            raise Rejected(f"class ids must lie in [0, {num_classes})")
    check_norms(payload, norms, squares)


def check_merged(body: Any, spec: Mapping[str, Any], *,
                 max_samples: Callable[[int], int], max_bytes: int | None = None,
                 nbytes: int = 0, units: int = 1, num_classes: int | None = None,
                 class_samples: Callable[[int], Any] | None = None,
                 norms: Norms | None = None, count_epochs: int = 1) -> None:
    """Raise Rejected if a relay's pre-aggregated update (kind "merged", PROTOCOL.md §4) is
    not acceptable: its members ([client address, task, num_samples, work], each client
    once, in the engine's spelling, its samples at most max_samples(client)), and its
    payload, the handler's sum form (`spec`: MergeRule.spec), finite, whose "mass" is
    non-negative and, class by class, no more than its members' own samples of that class
    allow (class_samples(client), else their totals; units: label pixels a sample), and
    whose sums are no longer than mass x the norm bound. Which tasks the members answer is
    the engine's check."""
    if max_bytes is not None and nbytes > max_bytes:
        raise Rejected(f"merged update of {nbytes} bytes exceeds the {max_bytes}-byte cap")
    if not isinstance(body, (dict, Mapping)):
        raise Rejected(f"merged body must be a map, got {type(body).__name__}")
    for key in ("version", "members", "payload"):
        if key not in body:
            raise Rejected(f"merged update lacks {key!r}")
    members = body["members"]
    if not isinstance(members, list) or not members:
        raise Rejected("members must be a non-empty list")
    seen: set[int] = set()
    samples = 0
    clients = []
    for i, m in enumerate(members):
        if not isinstance(m, list) or len(m) != 4 or not isinstance(m[0], str):
            raise Rejected(f"members[{i}] must be [client, task, num_samples, work]")
        address, task, n, work = m
        client = canonical_client(address)
        if client in seen:
            raise Rejected(f"client {address!r} is listed twice")
        seen.add(client)
        if isinstance(task, bool) or not isinstance(task, int):
            raise Rejected(f"members[{i}] task must be an int")
        try:
            bound = max_samples(client)
        except (KeyError, ValueError):
            bound = 0
        _check_number(f"members[{i}] num_samples", n, high=bound)
        _check_work(work, f"members[{i}] work")
        samples += int(n)
        clients.append(client)
    payload = body["payload"]
    _check_arrays(payload, spec, max_bytes)
    mass = payload.get("mass")
    if not isinstance(mass, np.ndarray) or not mass.size:
        return
    if float(mass.min()) < 0:
        raise Rejected("mass is negative")
    u = max(1, int(units))
    if num_classes is not None and mass.shape == (num_classes,):
        # prototype sums: per class, at most the members' samples of that class (weighted)
        # or the number of members holding it (unweighted; each holds >= 1 sample of it)
        limit = np.zeros(num_classes, np.float64)
        for c in clients:
            cs = None if class_samples is None else class_samples(c)
            b = ClientBounds(max_samples(c), None if cs is None else np.asarray(cs), u,
                             count_epochs)
            limit += b.class_max(num_classes)
    else:
        limit = np.full(mass.shape, float(max(samples, len(clients)) * u), np.float64)
    over = np.flatnonzero(np.asarray(mass, np.float64) > limit * (1 + 1e-9))
    if over.size:
        k = int(over[0])
        raise Rejected(f"mass[{k}] = {float(mass.flat[k]):.6g} is more than the members' "
                       f"samples allow ({float(limit.flat[k]):.6g})")
    _check_merged_norms(payload, np.asarray(mass, np.float64), norms)
    pool = payload.get("pool")
    if isinstance(pool, Mapping) and num_classes is not None:
        for r, (c, counts) in enumerate(zip(np.asarray(pool.get("clients", [])).tolist(),
                                            pool.get("counts", []))):
            cs = None if class_samples is None else class_samples(int(c))
            check_counts(np.asarray(counts), ClientBounds(max_samples(int(c)), None if cs is None
                                                          else np.asarray(cs), u,
                                                          count_epochs),
                         num_classes, name=f"pool counts[{r}]")
        if norms is not None and norms.proto > 0 and isinstance(pool.get("protos"), np.ndarray):
            worst = float(_row_norms(pool["protos"]).max()) if pool["protos"].size else 0.0
            if worst > norms.proto * (1 + 1e-4):
                raise Rejected(f"pool protos hold a prototype of L2 norm {worst:.4g}, above "
                               f"the server's bound {norms.proto:.4g}")


def _check_merged_norms(payload: Mapping[str, Any], mass: np.ndarray,
                        norms: Norms | None) -> None:
    """A sum of weights a_i times vectors of norm <= B has norm <= B sum a_i = B mass."""
    if norms is None:
        return
    sums = payload.get("sums")
    if norms.proto > 0 and isinstance(sums, np.ndarray) and sums.ndim == 2 and \
            sums.shape[0] == mass.shape[0]:
        over = np.flatnonzero(_row_norms(sums) > norms.proto * mass * (1 + 1e-4) + 1e-12)
        if over.size:
            raise Rejected(f"sums[{int(over[0])}] is longer than mass x the prototype bound")
    if norms.update > 0 and mass.shape == (1,):
        rest = 0.0
        for key in ("delta_sum", "state"):
            for _, value in _walk(payload.get(key, {}), key):
                if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                    rest += _sq_norm(value)
        if math.sqrt(rest) > norms.update * float(mass[0]) * (1 + 1e-4) + 1e-12:
            raise Rejected("the merged sums are longer than mass x the update bound")


def check_eval_result(body: Any, *, test_size: int, units: int = 1,
                      feature_max: int = 1 << 16) -> None:
    """Raise Rejected unless an evaluation result fits its schema: {"eval": int, "version":
    int, "metrics": {name: number}} (rates in [0, 1] or NaN, losses in [0, MAX_LOSS] or NaN,
    num_test an int in [0, test_size]), optional "embeddings" {"h": float [n, D], "y": int
    [n]} with n <= test_size x units (segmentation embeds pixels: units = H * W), optional
    "masks" a map of arrays."""
    if not isinstance(body, (dict, Mapping)):
        raise Rejected(f"eval result must be a map, got {type(body).__name__}")
    for key in ("eval", "metrics"):
        if key not in body:
            raise Rejected(f"eval result lacks {key!r}")
    if isinstance(body["eval"], bool) or not isinstance(body["eval"], int):
        raise Rejected("eval must be an int")
    metrics = body["metrics"]
    if not isinstance(metrics, (dict, Mapping)):
        raise Rejected("metrics must be a map")
    if len(metrics) > MAX_METRICS:
        raise Rejected(f"metrics has {len(metrics)} keys (max {MAX_METRICS})")
    for key, value in metrics.items():
        if not isinstance(key, str) or len(key) > 64:
            raise Rejected("metric names must be strings of at most 64 characters")
        if key == "num_test":
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not 0 <= value <= test_size:
                raise Rejected(f"num_test = {value!r} is not an int in [0, {test_size}]")
            continue
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Rejected(f"metric {key!r} must be a number, got {type(value).__name__}")
        if math.isnan(value):
            continue  # a client without test samples reports NaN
        high = 1.0 if key in RATE_METRICS else MAX_LOSS
        low = 0.0 if key in RATE_METRICS or key == "loss" else -MAX_LOSS
        if not low <= value <= high:
            raise Rejected(f"metric {key!r} = {value!r} is out of range [{low}, {high}]")
    emb = body.get("embeddings")
    if emb is not None:
        if not isinstance(emb, (dict, Mapping)) or set(emb) != {"h", "y"}:
            raise Rejected("embeddings must be {'h': array, 'y': array}")
        h, y = emb["h"], emb["y"]
        if not (isinstance(h, np.ndarray) and isinstance(y, np.ndarray) and h.ndim == 2
                and y.ndim == 1 and len(h) == len(y) <= test_size * max(1, int(units))
                and h.dtype.kind == "f"
                and y.dtype.kind in "iu" and h.shape[1] <= feature_max and _finite(h)):
            raise Rejected("embeddings must be finite h [n, D] and int y [n], n <= the test "
                           "set's labelled units")
    masks = body.get("masks")
    if masks is not None:
        if not isinstance(masks, (dict, Mapping)):
            raise Rejected("masks must be a map")
        for path, value in _walk(masks, "masks"):
            if not _finite(value):
                raise Rejected(f"{path} contains NaN or Inf")

"""Partitioners: split one Dataset across clients, each client with a train and a test set.

    parts = make_partition(ds, scheme="dirichlet", num_clients=20, seed=0, alpha=0.1)
    parts[i].train, parts[i].test      # int64 indices into ds.x

Every scheme is seeded: the same (dataset, scheme, params, num_clients, seed) gives the same
split, in any process. No index is given to two clients (within a client, train and test are
disjoint too). Schemes and their params (config keys of the [data] table):

nway-kshot (ways, ways_std, shots, shots_std) -- FedProto's (Tan et al., AAAI 2022)
    First each class's indices are shuffled and split into a train pool and a held-out test
    pool (test_fraction of the class goes to the test pool). Client i then draws
    n_i = round(N(ways, ways_std)) clipped to [1, classes] classes, uniformly among the classes
    whose train pool is not empty, and k_i = round(N(shots, shots_std)) (>= 1) train samples of
    each, without replacement (disjoint across clients). When a pool runs out the client gets
    what is left; the shortfall is recorded in ``ClientSplit.meta`` and warned about. Test
    samples come only from the client's own classes, out of the held-out pools: per class, each
    client asks for round(k * tf / (1 - tf)) (so its own train/test ratio is 75/25 by default);
    when a class's pool cannot serve every request, it is shared in proportion to the requests.
    (FedProto's paper says only that each client's n and k are an average "plus random
    noise" with a standard deviation of 1 or 2; the Gaussian here is that description. The
    paper sets no lower bound, so n_i = 1 happens: at ways 3, ways_std 2 with probability
    P(N(3, 2) < 1.5) = 22.7 %, 3, 4 and 5 clients of 20 at the tan-table1 recipe's seeds
    0, 1, 2. FedProto's code, exps/federated_main.py, draws n_i uniformly in
    [max(2, ways - stdev), min(classes, ways + stdev)], never one class, and on MNIST k_i
    uniformly in [shots - stdev + 1, shots + stdev - 1).)
dirichlet (alpha, min_samples) -- PFLlib/MOON label skew
    For each class, proportions p ~ Dir(alpha * 1); clients already holding N/num_clients or
    more samples get none of it; the class is cut at the cumulative proportions. Repeated
    until every client holds at least min_samples (at most 1000 tries, then ValueError).
pathological (classes_per_client) -- FedAvg's "pathological non-IID"
    Every client holds exactly c classes: clients pick c distinct classes, the least used ones
    first (ties broken at random), and each class's samples are cut into equal shards, one
    per client that holds it (FedAvg's sort-and-shard, made class-pure).
powerlaw (powerlaw_sigma, min_samples) -- unbalanced sizes, IID labels
    Client sizes proportional to LogNormal(0, sigma) draws (heavy-tailed; LEAF/FedLab's
    unbalanced split), each at least min(min_samples, N // num_clients); samples random.
pathological-powerlaw (classes_per_client, powerlaw_sigma, min_samples)
    As pathological, but a class's pool is shared in proportion to each holder's
    LogNormal(0, sigma) weight: FedProx's MNIST (2 digits a device, power-law sizes), which
    Michieli & Ozay use (S1.2). Each client gets at least
    ceil(min_samples / classes_per_client) of each of its classes where the pool allows.
iid
    A random permutation cut into num_clients near-equal parts.
natural
    The dataset's own groups (FedProx synthetic: one user per client); needs
    num_clients <= number of groups (30 for synthetic): client i gets group i.
domains -- feature skew (Digit-5, Office-Caltech-10; MP-FedCL's Tables V/VII)
    The dataset's groups are its domains (digit5-offline, digit5, office10, an npz with
    ``groups``). Client i draws from domain i % D only (round-robin: with D clients each
    holds one whole domain; with num_clients >= D every domain is used; with fewer, the last
    domains go unused and a warning says so). A domain's samples are shuffled and cut into
    near-equal parts, one per client assigned to it (IID within the domain), so every client
    sees the dataset's whole label space. ``ClientSplit.meta`` records "domain" and
    "domain_name".
domains-dirichlet (alpha, min_samples)
    As domains, but within each domain the samples are shared among its clients by the
    dirichlet scheme above (label skew on top of feature skew; min_samples per client).
file:PATH.json
    An explicit partition (see save_partition); num_clients must match the file.

Except for nway-kshot and file:, each client's samples are shuffled and cut into train and
test: ceil(test_fraction * n) test samples (at most n - 1), as PFLlib/HtFLlib's 75/25 split.
pool_test_splits then optionally deals the pooled test samples back at random
(data.test_distribution = "global": every client tested on the federation's overall
distribution instead of its own skew).
"""
from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from .datasets import Dataset

SCHEMES = ("nway-kshot", "dirichlet", "pathological", "pathological-powerlaw", "powerlaw", "iid",
           "natural", "domains", "domains-dirichlet", "file:PATH")
PARAMS: dict[str, dict[str, Any]] = {
    "nway-kshot": {"ways": 3, "ways_std": 2.0, "shots": 100, "shots_std": 10.0},
    "dirichlet": {"alpha": 0.5, "min_samples": 10},
    "pathological": {"classes_per_client": 2},
    "pathological-powerlaw": {"classes_per_client": 2, "powerlaw_sigma": 2.0, "min_samples": 10},
    "powerlaw": {"powerlaw_sigma": 2.0, "min_samples": 10},
    "iid": {},
    "natural": {},
    "domains": {},
    "domains-dirichlet": {"alpha": 0.5, "min_samples": 10},
    "file": {},
}
MAX_DIRICHLET_TRIES = 1000


@dataclass
class ClientSplit:
    """One client's share: int64 indices into Dataset.x (sorted).

    meta: what the partitioner decided for this client (nway-kshot: ways, shots, classes and
    any shortfall); not written to partition files.
    """

    train: np.ndarray
    test: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.train = np.asarray(self.train, dtype=np.int64)
        self.test = np.asarray(self.test, dtype=np.int64)


class PartitionError(ValueError):
    """A partition file or request that cannot be used; the message says why."""


# ------------------------------------------------------------------------------- helpers
def _split_train_test(idx: np.ndarray, test_fraction: float,
                      rng: np.random.Generator) -> ClientSplit:
    idx = rng.permutation(np.asarray(idx, dtype=np.int64))
    n = len(idx)
    n_test = min(math.ceil(test_fraction * n), max(n - 1, 0)) if test_fraction > 0 else 0
    return ClientSplit(np.sort(idx[n_test:]), np.sort(idx[:n_test]))


def _check_params(scheme: str, params: dict[str, Any]) -> dict[str, Any]:
    allowed = PARAMS[scheme]
    unknown = set(params) - set(allowed)
    if unknown:
        raise ValueError(f"partition {scheme!r} takes no parameter(s) "
                         f"{', '.join(sorted(unknown))}"
                         + (f"; it takes {', '.join(allowed)}" if allowed else ""))
    return {**allowed, **params}


def _class_indices(y: np.ndarray, num_classes: int) -> list[np.ndarray]:
    return [np.flatnonzero(y == c).astype(np.int64) for c in range(num_classes)]


# ---------------------------------------------------------------------------- nway-kshot
def _nway_kshot(ds: Dataset, num_clients: int, rng: np.random.Generator, test_fraction: float,
                ways: float, ways_std: float, shots: float, shots_std: float) -> list[ClientSplit]:
    if not 0 <= test_fraction < 1:
        raise ValueError(f"nway-kshot: test_fraction must be in [0, 1), got {test_fraction}")
    C = ds.num_classes
    train_pool, test_pool = [], []
    for idx in _class_indices(ds.y, C):
        idx = rng.permutation(idx)
        n_test = round(len(idx) * test_fraction)
        test_pool.append(idx[:n_test])
        train_pool.append(idx[n_test:])
    taken = [0] * C
    ways_i = np.clip(np.round(rng.normal(ways, ways_std, num_clients)), 1, C).astype(int)
    shots_i = np.maximum(np.round(rng.normal(shots, shots_std, num_clients)), 1).astype(int)
    train: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    counts = np.zeros((num_clients, C), dtype=np.int64)
    metas: list[dict[str, Any]] = []
    short_clients = 0
    for i in range(num_clients):
        open_classes = np.array([c for c in range(C) if taken[c] < len(train_pool[c])])
        n = int(min(ways_i[i], len(open_classes)))
        if n == 0:
            raise ValueError(
                f"nway-kshot: the train pools ran out at client {i} of {num_clients} "
                f"({ds.name}: {sum(len(p) for p in train_pool)} train samples, asked "
                f"~{ways}x{shots} per client); lower data.shots or data.ways, use fewer "
                f"clients or a larger dataset")
        classes = np.sort(rng.choice(open_classes, size=n, replace=False))
        k = int(shots_i[i])
        shortfall = {}
        for c in classes:
            got = train_pool[c][taken[c]:taken[c] + k]
            taken[c] += len(got)
            train[i].append(got)
            counts[i, c] = len(got)
            if len(got) < k:
                shortfall[int(c)] = k - len(got)
        if n < ways_i[i]:
            shortfall["classes"] = int(ways_i[i] - n)
        short_clients += bool(shortfall)
        metas.append({"ways": int(ways_i[i]), "shots": k, "classes": classes.tolist(),
                      "shortfall": shortfall})
    if short_clients:
        warnings.warn(f"nway-kshot on {ds.name}: {short_clients} of {num_clients} clients got "
                      f"fewer classes or samples than drawn because the class pools ran out "
                      f"(see ClientSplit.meta['shortfall'])", stacklevel=3)
    # held-out test samples: per class, requests in proportion to each client's train count
    ratio = test_fraction / (1 - test_fraction) if test_fraction > 0 else 0.0
    test: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(C):
        want = np.round(counts[:, c] * ratio).astype(np.int64)
        want[counts[:, c] > 0] = np.maximum(want[counts[:, c] > 0], 1 if ratio > 0 else 0)
        pool = test_pool[c]
        if want.sum() > len(pool):
            share = want * (len(pool) / want.sum())
            give = np.floor(share).astype(np.int64)
            rest = len(pool) - give.sum()
            order = np.argsort(-(share - give), kind="stable")
            give[order[:rest]] += 1
            want = give
        start = 0
        for i in np.flatnonzero(want):
            test[i].append(pool[start:start + want[i]])
            start += want[i]
    out = []
    for i in range(num_clients):
        tr = np.sort(np.concatenate(train[i])) if train[i] else np.empty(0, np.int64)
        te = np.sort(np.concatenate(test[i])) if test[i] else np.empty(0, np.int64)
        out.append(ClientSplit(tr, te, meta=metas[i]))
    return out


# ----------------------------------------------------------------------------- dirichlet
def _dirichlet(ds: Dataset, num_clients: int, rng: np.random.Generator, alpha: float,
               min_samples: int) -> list[np.ndarray]:
    if alpha <= 0:
        raise ValueError(f"dirichlet: alpha must be > 0, got {alpha}")
    N = len(ds.y)
    if min_samples * num_clients > N:
        raise ValueError(f"dirichlet: {num_clients} clients x min_samples {min_samples} "
                         f"exceeds the {N} samples of {ds.name}; lower data.min_samples "
                         f"or the number of clients")
    by_class = _class_indices(ds.y, ds.num_classes)
    min_size = -1
    for _ in range(MAX_DIRICHLET_TRIES):
        batch: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx_k in by_class:
            if len(idx_k) == 0:
                continue
            idx_k = rng.permutation(idx_k)
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            p = p * (sizes < N / num_clients)
            if p.sum() <= 0:  # pragma: no cover - only when every client is exactly full
                p = np.full(num_clients, 1.0)
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
            for j, chunk in enumerate(np.split(idx_k, cuts)):
                batch[j].append(chunk)
                sizes[j] += len(chunk)
        min_size = int(sizes.min())
        if min_size >= min_samples:
            return [np.concatenate(b) if b else np.empty(0, np.int64) for b in batch]
    raise ValueError(f"dirichlet: after {MAX_DIRICHLET_TRIES} tries some client still has "
                     f"fewer than min_samples = {min_samples} samples (best try: {min_size}); "
                     f"raise data.alpha, lower data.min_samples or use fewer clients")


# -------------------------------------------------------------------------- pathological
def _pathological(ds: Dataset, num_clients: int, rng: np.random.Generator,
                  classes_per_client: int,
                  sizes: tuple[float, int] | None = None) -> list[np.ndarray]:
    """Each client holds classes_per_client classes, the least used first. A class's pool
    goes to its holders in equal shards, or, with sizes = (sigma, min_samples), in shares
    proportional to each client's LogNormal(0, sigma) weight (one weight per client, so a
    client is large or small in all its classes), each share at least
    ceil(min_samples / classes_per_client) where the pool allows."""
    by_class = _class_indices(ds.y, ds.num_classes)
    present = [c for c in range(ds.num_classes) if len(by_class[c])]
    c_per = int(classes_per_client)
    if not 1 <= c_per <= len(present):
        raise ValueError(f"pathological: classes_per_client must be in 1..{len(present)} "
                         f"(the classes present in {ds.name}), got {classes_per_client}")
    use = np.zeros(ds.num_classes, dtype=np.int64)
    holders: dict[int, list[int]] = {c: [] for c in present}
    for i in range(num_clients):
        cand = np.array(present)
        # least used first, random among equals
        order = np.lexsort((rng.random(len(cand)), use[cand]))
        chosen = cand[order[:c_per]]
        for c in chosen:
            use[c] += 1
            holders[int(c)].append(i)
    if sizes is not None:
        sigma, min_samples = sizes
        weights = rng.lognormal(0.0, float(sigma), num_clients)
        min_share = max(int(min_samples), 1) / c_per
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, clients in holders.items():
        if not clients:
            continue
        if len(clients) > len(by_class[c]):
            raise ValueError(f"pathological: class {c} of {ds.name} has {len(by_class[c])} "
                             f"samples for {len(clients)} clients; use fewer clients or "
                             f"fewer classes_per_client")
        pool = rng.permutation(by_class[c])
        if sizes is None:
            shards = np.array_split(pool, len(clients))
        else:
            shards = np.split(pool, np.cumsum(_shares(len(pool), weights[clients],
                                                      math.ceil(min_share)))[:-1])
        for i, shard in zip(clients, shards):
            parts[i].append(shard)
    return [np.concatenate(p) for p in parts]


def _shares(n: int, w: np.ndarray, floor: int) -> np.ndarray:
    """n items cut into len(w) counts: each at least min(floor, n // len(w)), the rest in
    proportion to w (largest remainders first)."""
    base = min(max(floor, 1), n // len(w))
    free = n - base * len(w)
    exact = w / w.sum() * free
    extra = np.floor(exact).astype(np.int64)
    extra[np.argsort(-(exact - extra), kind="stable")[: free - extra.sum()]] += 1
    return base + extra


# ------------------------------------------------------------------------------ powerlaw
def _powerlaw(ds: Dataset, num_clients: int, rng: np.random.Generator, powerlaw_sigma: float,
              min_samples: int) -> list[np.ndarray]:
    N = len(ds.y)
    if num_clients > N:
        raise ValueError(f"powerlaw: {num_clients} clients for {N} samples")
    floor = int(min(max(min_samples, 1), N // num_clients))
    w = rng.lognormal(0.0, float(powerlaw_sigma), num_clients)
    free = N - floor * num_clients
    extra = np.floor(w / w.sum() * free).astype(np.int64)
    extra[np.argsort(-w, kind="stable")[: free - extra.sum()]] += 1
    sizes = floor + extra
    perm = rng.permutation(N)
    return np.split(perm, np.cumsum(sizes)[:-1])


# ------------------------------------------------------------------------------- domains
def _domains(ds: Dataset, num_clients: int, rng: np.random.Generator, *, dirichlet: bool,
             alpha: float = 0.5, min_samples: int = 10
             ) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    scheme = "domains-dirichlet" if dirichlet else "domains"
    if not ds.groups:
        raise ValueError(f"partition {scheme!r} needs a dataset with domains (digit5-offline, "
                         f"digit5, office10, or an npz with 'groups'); {ds.name} has none")
    if dirichlet and alpha <= 0:
        raise ValueError(f"{scheme}: alpha must be > 0, got {alpha}")
    groups = [np.asarray(g, dtype=np.int64) for g in ds.groups]
    every = np.concatenate(groups)
    if len(np.unique(every)) != len(every):
        raise ValueError(f"partition {scheme!r}: the groups (domains) of {ds.name} overlap")
    D = len(groups)
    names = list(ds.meta.get("domains") or [str(d) for d in range(D)])
    if num_clients < D:
        warnings.warn(f"{scheme} on {ds.name}: {num_clients} clients for {D} domains; "
                      f"domains {', '.join(names[num_clients:])} go unused", stacklevel=3)
    pieces: list[np.ndarray] = [np.empty(0, np.int64)] * num_clients
    metas: list[dict[str, Any]] = [{} for _ in range(num_clients)]
    for d in range(min(D, num_clients)):
        clients = list(range(d, num_clients, D))
        idx = groups[d]
        if len(idx) < len(clients):
            raise ValueError(f"{scheme}: domain {names[d]!r} of {ds.name} has {len(idx)} "
                             f"samples for {len(clients)} clients; use fewer clients")
        if dirichlet and len(clients) > 1:
            sub = SimpleNamespace(y=ds.y[idx], num_classes=ds.num_classes,
                                  name=f"{ds.name} domain {names[d]!r}")
            chunks = [idx[local] for local in _dirichlet(sub, len(clients), rng, alpha,
                                                          min_samples)]
        else:
            chunks = np.array_split(rng.permutation(idx), len(clients))
        for i, chunk in zip(clients, chunks):
            pieces[i] = chunk
            metas[i] = {"domain": d, "domain_name": names[d]}
    return pieces, metas


# ------------------------------------------------------------------------------ dispatch
def make_partition(ds: Dataset, *, scheme: str, num_clients: int, seed: int,
                   test_fraction: float = 0.25, **params: Any) -> list[ClientSplit]:
    """Split ``ds`` across ``num_clients`` clients; returns one ClientSplit per client.

    scheme: "nway-kshot" (ways, ways_std, shots, shots_std), "dirichlet" (alpha,
        min_samples), "pathological" (classes_per_client), "powerlaw" (powerlaw_sigma,
        min_samples), "iid", "natural", "domains", "domains-dirichlet" (alpha, min_samples),
        "file:PATH" (see the module doc). Unknown scheme or
        parameter -> ValueError. Missing params take the [data] config defaults.
    seed: every random choice comes from ``numpy.random.default_rng(seed)``.
    test_fraction: the per-client test share (0.25: PFLlib/HtFLlib's 75/25).
    """
    if not isinstance(scheme, str):
        raise TypeError(f"partition scheme must be a string, got {scheme!r}")
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    num_clients = int(num_clients)
    if scheme.startswith("file:"):
        _check_params("file", params)
        parts = load_partition(scheme[5:], dataset_size=len(ds))
        if len(parts) != num_clients:
            raise PartitionError(f"{scheme[5:]}: the file holds {len(parts)} clients but the "
                                 f"federation has {num_clients} (federation.clients)")
        return parts
    if scheme not in PARAMS or scheme == "file":
        raise ValueError(f"unknown partition {scheme!r}; valid: {', '.join(SCHEMES)}")
    p = _check_params(scheme, params)
    rng = np.random.default_rng(seed)
    if scheme == "nway-kshot":
        return _nway_kshot(ds, num_clients, rng, test_fraction, **p)
    if scheme in ("domains", "domains-dirichlet"):
        pieces, metas = _domains(ds, num_clients, rng, dirichlet=scheme != "domains", **p)
        out = [_split_train_test(idx, test_fraction, rng) for idx in pieces]
        for part, meta in zip(out, metas):
            part.meta = meta
        return out
    if scheme == "natural":
        if not ds.groups:
            raise ValueError(f"partition 'natural' needs a dataset with natural groups "
                             f"(synthetic, or an npz with 'groups'); {ds.name} has none")
        if num_clients > len(ds.groups):
            raise ValueError(f"partition 'natural': {ds.name} has {len(ds.groups)} groups "
                             f"(users) but federation.clients = {num_clients}; use at most "
                             f"{len(ds.groups)} clients")
        pieces = [np.asarray(g, dtype=np.int64) for g in ds.groups[:num_clients]]
    elif scheme == "iid":
        if num_clients > len(ds):
            raise ValueError(f"iid: {num_clients} clients for {len(ds)} samples")
        pieces = np.array_split(rng.permutation(len(ds)), num_clients)
    elif scheme == "dirichlet":
        pieces = _dirichlet(ds, num_clients, rng, **p)
    elif scheme == "pathological":
        pieces = _pathological(ds, num_clients, rng, **p)
    elif scheme == "pathological-powerlaw":
        pieces = _pathological(ds, num_clients, rng, p["classes_per_client"],
                               sizes=(p["powerlaw_sigma"], p["min_samples"]))
    else:
        pieces = _powerlaw(ds, num_clients, rng, **p)
    return [_split_train_test(idx, test_fraction, rng) for idx in pieces]


# ------------------------------------------------------------------------ test splits
TEST_DISTRIBUTIONS = ("local", "global")


def pool_test_splits(parts: Sequence[ClientSplit], seed: int) -> list[ClientSplit]:
    """data.test_distribution = "global": every client's test samples pooled, shuffled and
    dealt back, each client keeping its test-set size and its training set.

    With "local" (the partitioners' own splits) a client's test set is skewed like its
    training data, so a model that knows only its own classes can score high. Pooled, the
    test sets follow the federation's overall distribution (under label skew, close to the
    dataset's class mix), the reading of the tests in Qiao et al.'s papers where Local and
    FedProto fall far below FedAvg. The draw has its own seed stream, so the training
    splits, and so training itself, are those of "local" with the same seed."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x7E57]))
    sizes = [len(p.test) for p in parts]
    pooled = rng.permutation(np.concatenate([p.test for p in parts]).astype(np.int64))
    shards = np.split(pooled, np.cumsum(sizes)[:-1]) if parts else []
    return [ClientSplit(p.train, np.sort(t), dict(p.meta, test_distribution="global"))
            for p, t in zip(parts, shards)]


# ---------------------------------------------------------------------------------- files
def save_partition(parts: Sequence[ClientSplit], path: str | os.PathLike,
                   meta: dict[str, Any] | None = None) -> None:
    """Write ``{"num_clients": N, "clients": [{"train": [...], "test": [...]}, ...]}`` as JSON
    (plus an optional "meta" object that readers may ignore)."""
    doc: dict[str, Any] = {"num_clients": len(parts),
                           "clients": [{"train": [int(v) for v in p.train],
                                        "test": [int(v) for v in p.test]} for p in parts]}
    if meta:
        doc["meta"] = meta
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    os.replace(tmp, path)


def _indices(v: Any, where: str) -> np.ndarray:
    if not isinstance(v, list):
        raise PartitionError(f"{where} must be a list of integer indices")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int):
            raise PartitionError(f"{where} holds {x!r}: indices must be integers")
        if x < 0:
            raise PartitionError(f"{where} holds {x}: indices must be >= 0")
        if x >= 2**63:  # no dataset is that large, and int64 cannot hold it
            raise PartitionError(f"{where} holds {x}: too large to be an index")
    return np.asarray(v, dtype=np.int64)


def load_partition(path: str | os.PathLike, dataset_size: int | None = None) -> list[ClientSplit]:
    """Read a partition file written by save_partition (or any tool writing that format).

    Checks: a JSON object with a "clients" list (and "num_clients" equal to its length when
    given); every index an integer >= 0 (and < dataset_size when given); no duplicate within
    a client's train or test, train/test disjoint per client, and no index given to two
    clients. Errors are PartitionError (a ValueError) naming the client and the problem.
    """
    path = Path(os.path.expanduser(path))
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PartitionError(f"partition file not found: {os.path.abspath(path)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PartitionError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("clients"), list):
        raise PartitionError(f"{path}: expected an object {{\"num_clients\": N, \"clients\": "
                             f"[{{\"train\": [...], \"test\": [...]}}, ...]}}")
    clients = doc["clients"]
    if "num_clients" in doc and doc["num_clients"] != len(clients):
        raise PartitionError(f"{path}: num_clients = {doc['num_clients']!r} but "
                             f"{len(clients)} clients are listed")
    if not clients:
        raise PartitionError(f"{path}: no clients")
    out = []
    for i, c in enumerate(clients):
        if not isinstance(c, dict) or "train" not in c or "test" not in c:
            raise PartitionError(f"{path}: client {i} must be an object with 'train' and "
                                 f"'test' index lists")
        tr = _indices(c["train"], f"{path}: client {i} train")
        te = _indices(c["test"], f"{path}: client {i} test")
        for name, a in (("train", tr), ("test", te)):
            if len(np.unique(a)) != len(a):
                raise PartitionError(f"{path}: client {i} {name} lists an index twice")
            if dataset_size is not None and len(a) and a.max() >= dataset_size:
                raise PartitionError(f"{path}: client {i} {name} index {int(a.max())} is out "
                                     f"of range for a dataset of {dataset_size} samples")
        both = np.intersect1d(tr, te)
        if len(both):
            raise PartitionError(f"{path}: client {i} has index {int(both[0])} in both train "
                                 f"and test ({len(both)} shared)")
        out.append(ClientSplit(tr, te))
    idx = np.concatenate([np.concatenate([p.train, p.test]) for p in out])
    owner = np.repeat(np.arange(len(out)), [len(p.train) + len(p.test) for p in out])
    order = np.argsort(idx, kind="stable")
    same = np.flatnonzero(idx[order][1:] == idx[order][:-1])
    if len(same):
        j = order[same[0]]
        raise PartitionError(f"{path}: index {int(idx[j])} given to clients {int(owner[j])} "
                             f"and {int(owner[order[same[0] + 1]])} ({len(same)} shared)")
    return out

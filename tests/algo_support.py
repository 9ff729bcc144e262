"""Support for the algorithm handler tests (tests/test_algo_*.py): real data (scikit-learn's
digits), tiny real networks, contexts, and handlers called directly, with no broker.

Two small harnesses share this module:

* the fedavg / fedproto / fedtgp one: ``Net`` via ``make_model`` (feature dim ``D``, ``C``
  classes), ``client_ctx`` / ``server_ctx`` with ``TRAIN``, ``digits_parts`` /
  ``iid_digits_parts``, and ``simulate``, a short in-process federation that hands payloads
  over as the wire does (``freeze``);
* the mpfedcl / proto-attention one: ``make_model_fn`` (same network shape, other sizes),
  ``tiny_server_ctx`` / ``tiny_client_ctx`` taking the file's own training settings (bound
  by ``tiny_harness``), and ``seven_class_digits`` for the files' ``digits_clients`` fixtures.

``update`` builds a ClientUpdate and ``check_spec`` checks a payload against an update spec,
for both.
"""
from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import (ClientContext, ClientUpdate, LocalRun, RoundInfo,
                                             ServerContext, Work)

C, D = 10, 32
TRAIN = {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.0, "batch_size": 32}


# --- networks -------------------------------------------------------------------------------

class BodyHead(nn.Module):
    """The split every fedbus network has: features = self.body, head = self.fc."""

    def features(self, x):
        return self.body(x)

    def head(self, h):
        return self.fc(h)

    def forward(self, x):
        return self.head(self.features(x))


class Net(BodyHead):
    """Linear layers d_in -> *hidden -> feat with ReLUs (``features``), then a linear head."""

    def __init__(self, d_in: int = 64, hidden: tuple[int, ...] = (), feat: int = D,
                 classes: int = C):
        super().__init__()
        pre, width = [], d_in
        for h in hidden:
            pre += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.body = nn.Sequential(*pre, nn.Linear(width, feat), nn.ReLU())
        self.fc = nn.Linear(feat, classes)



def make_model(i: int, seed: int = 0, deep: bool = False) -> Net:
    """64 -> 32 -> 10 (deep: 64 -> 48 -> 32 -> 10), seeded without touching the global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed + (1000 if deep else 0))
        return Net(hidden=(48,) if deep else ())


def make_model_fn(d_in=64, feat=16, classes=10, seed=0):
    """A make_model(i) for d_in -> 32 -> feat -> classes; it seeds the global RNG."""
    def make(i: int) -> nn.Module:
        torch.manual_seed(seed)
        return Net(d_in, (32,), feat, classes)
    return make


# --- data -------------------------------------------------------------------------------------

def _digits():
    data = load_digits()
    return data, torch.tensor(data.data / 16.0, dtype=torch.float32)


def iid_digits_parts(k: int, seed: int = 0):
    """k iid clients, each (train_x, train_y, test_x, test_y), 75/25."""
    data, x = _digits()
    y = torch.tensor(data.target, dtype=torch.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    parts = []
    for chunk in np.array_split(order, k):
        cut = int(0.75 * len(chunk))
        tr, te = torch.as_tensor(chunk[:cut]), torch.as_tensor(chunk[cut:])
        parts.append((x[tr], y[tr], x[te], y[te]))
    return parts


def digits_parts(k: int, ways: int = 10, seed: int = 0):
    """k clients; client j holds classes j, j+1, ..., j+ways-1 (mod 10), split
    75/25 into train and test; the class pools are shared out without overlap."""
    data, x = _digits()
    y = np.asarray(data.target)
    rng = np.random.default_rng(seed)
    owners = {c: [j for j in range(k) if (c - j) % 10 < ways] for c in range(10)}
    idx = {j: [] for j in range(k)}
    for c in range(10):
        pool = rng.permutation(np.nonzero(y == c)[0])
        for j, chunk in zip(owners[c], np.array_split(pool, max(1, len(owners[c])))):
            idx[j].extend(chunk.tolist())
    parts = []
    yt = torch.as_tensor(y, dtype=torch.int64)
    for j in range(k):
        order = rng.permutation(np.array(idx[j]))
        cut = int(0.75 * len(order))
        tr, te = torch.as_tensor(order[:cut]), torch.as_tensor(order[cut:])
        parts.append((x[tr], yt[tr], x[te], yt[te]))
    return parts


def seven_class_digits(seed: int):
    """Three non-IID clients: client i holds classes {3i, ..., 3i+6} mod 10, 60 % of each,
    split 75/25 into train and test."""
    d, x = _digits()
    y = torch.tensor(d.target, dtype=torch.int64)
    rng = np.random.default_rng(seed)
    parts = []
    for i in range(3):
        classes = [(i * 3 + j) % 10 for j in range(7)]
        idx = np.concatenate([rng.permutation(np.flatnonzero(d.target == c))
                              [: int(0.6 * (d.target == c).sum())] for c in classes])
        idx = rng.permutation(idx)
        cut = int(0.75 * len(idx))
        parts.append((x[idx[:cut]], y[idx[:cut]], x[idx[cut:]], y[idx[cut:]]))
    return parts


# --- contexts ---------------------------------------------------------------------------------

def client_ctx(i, part, params, model=None, seed=0):
    model = make_model(i, seed) if model is None else model
    return ClientContext(client=i, model=model, device=torch.device("cpu"),
                         train_x=part[0], train_y=part[1], test_x=part[2], test_y=part[3],
                         num_classes=C, feature_dim=D, params=params, train=TRAIN, seed=seed + i)


def server_ctx(params, clients=4, rounds=3, make=make_model, num_classes=C, feature_dim=D,
               homogeneous=True):
    return ServerContext(params=params, train=TRAIN, num_classes=num_classes,
                         feature_dim=feature_dim, clients=clients, rounds=rounds, seed=0,
                         homogeneous=homogeneous, make_model=make)


def tiny_client_ctx(i, part, params, seed=0, *, train):
    """A client of make_model_fn()'s network (16 features, 10 classes), 5-round runs."""
    trx, tr_y, tex, te_y = part
    return ClientContext(client=i, model=make_model_fn()(i), device=torch.device("cpu"),
                         train_x=trx, train_y=tr_y, test_x=tex, test_y=te_y, num_classes=10,
                         feature_dim=16, params=params, train=train, seed=seed)


def tiny_server_ctx(params, make=None, classes=10, feat=16, clients=3, seed=0, *, train):
    return ServerContext(params=params, train=train, num_classes=classes, feature_dim=feat,
                         clients=clients, rounds=5, seed=seed, homogeneous=True,
                         make_model=make or make_model_fn(feat=feat, classes=classes))


def tiny_harness(train):
    """server_ctx, client_ctx and update for a test file of the mpfedcl / proto-attention
    harness with its own training settings: update's weight is 1 unless given (whatever the
    staleness) and its payload is passed on as built, not frozen."""
    return (partial(tiny_server_ctx, train=train), partial(tiny_client_ctx, train=train),
            partial(update, weight=1.0, frozen=False))


# --- payloads ---------------------------------------------------------------------------------

def freeze(value):
    """What the wire hands over: fresh read-only arrays."""
    if isinstance(value, dict):
        return {k: freeze(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        out = value.copy()
        out.flags.writeable = False
        return out
    return value


def check_spec(payload, spec, by_name=False):
    """Assert that payload matches spec ({key: (dtype, shape) or a nested spec}; None in a
    shape matches any size). by_name=False: every key must be present and the dtype equal
    np.dtype(dtype). by_name=True: a missing key raises KeyError and the dtype's name is
    compared."""
    for key, want in spec.items():
        if not by_name:
            assert key in payload, key
        if isinstance(want, dict):
            check_spec(payload[key], want, by_name)
            continue
        dtype, shape = want
        arr = payload[key]
        if by_name:
            assert isinstance(arr, np.ndarray), key
            assert arr.dtype.name == dtype, (key, arr.dtype)
            assert len(arr.shape) == len(shape), (key, arr.shape, shape)
        else:
            assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype(dtype), (key, arr.dtype)
            assert len(arr.shape) == len(shape), key
        assert all(s is None or s == a for s, a in zip(shape, arr.shape)), (key, arr.shape)


def update(i, payload, n=10, version=0, staleness=0, *, weight=None, work=None, frozen=True):
    """A ClientUpdate. weight: 1 / sqrt(1 + staleness) unless given; work: one step of n
    samples unless given; frozen: hand the payload over as the wire does (freeze), else as
    built."""
    return ClientUpdate(client=i, payload=freeze(payload) if frozen else payload, num_samples=n,
                        work=work or Work(1, 1.0, 1, n), version=version, staleness=staleness,
                        weight=1.0 / math.sqrt(1 + staleness) if weight is None else weight)


# --- a short federation -------------------------------------------------------------------------

def simulate(name, params, rounds=3, clients=4, epochs=1, ways=5, hetero=False,
             metrics=("acc", "proto_acc")):
    """A short in-process federation on digits_parts(clients, ways) (ways=None:
    iid_digits_parts(clients)); hetero: odd clients get the deep network. Returns the server,
    the client handlers and, per round, the clients' mean of each of metrics (a single name:
    that mean alone)."""
    algo = get_algorithm(name)
    parts = iid_digits_parts(clients) if ways is None else digits_parts(clients, ways)
    server = algo.server(server_ctx(params, clients, rounds, homogeneous=not hetero))
    handlers = [algo.client(client_ctx(i, p, params, model=make_model(i, deep=hetero and i % 2)))
                for i, p in enumerate(parts)]
    history = []
    for r in range(rounds):
        info = RoundInfo(r, rounds)
        ups = []
        for i, h in enumerate(handlers):
            run = LocalRun(h.ctx, epochs=epochs, seed=1000 * r + i)
            payload = h.train(freeze(server.make_task(i, info)), run)
            check_spec(payload, server.update_spec())
            ups.append(update(i, payload, len(h.ctx.train_y), version=r))
        server.aggregate(ups, [], info)
        evals = [h.evaluate(freeze(server.make_eval(i, info))) for i, h in enumerate(handlers)]
        if isinstance(metrics, str):
            history.append(float(np.mean([e[metrics] for e in evals])))
        else:
            history.append({k: float(np.mean([e[k] for e in evals])) for k in metrics})
    return server, handlers, history

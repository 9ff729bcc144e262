"""The clients a node hosts: their data, their networks, and which stay materialised.

A node may host thousands of clients on a few cores and a few GiB, so nothing is built
per client that can be shared:

* Data (`NodeData`): the hosted clients' samples are gathered once into one array per
  split, client after client, on the node's device; a client's `train_x` is a slice of
  it (a view, no copy). Nodes started by `fedbus run` on Linux are forked from a
  launcher that loaded the dataset, so the source arrays are shared between them too.
* Networks (`ModelStore`): one network object per architecture is built (seeded, as
  `make_model` builds it) and its initial weights kept; a client takes a network of
  its architecture from the store (a returned one with the initial weights copied in,
  or a copy of the template) and gives it back when evicted. No network is initialised
  twice, which is what made a restore cost as much as a first build.
* Residency (`ClientPool`): materialised handlers are kept while their measured
  footprint (weights, gradients, optimizer and extra state) fits `launch.node_memory_mb`
  (and, when set, at most `launch.max_resident` of them); the least recently used are
  evicted. An evicted client is kept compactly: its handler's state packed into one
  flat byte buffer per client (`pack_state`), in memory or in a file (`evict_to`).
  Restoring loads that state into a fresh handler over a stored network, so a client
  evicted and restored computes exactly what it would have computed resident.
"""
from __future__ import annotations

import copy
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, ClientHandler
from fedbus.models import arch_for_client
from fedbus.node.config import Config
from fedbus.node.data import FederatedData
from fedbus.node.setup import distinct_archs, federated_data, make_model

MiB = 1 << 20


# --------------------------------------------------------------------------- data
class NodeData:
    """The hosted clients' splits as one tensor per split on `device`; `split(c)` gives
    client c's (train_x, train_y, test_x, test_y) as views into them."""

    def __init__(self, data: FederatedData, clients: list[int], device: torch.device):
        self.clients = sorted({int(c) for c in clients})
        for c in self.clients:
            if not 0 <= c < data.num_clients:
                raise IndexError(f"client {c} out of range 0..{data.num_clients - 1}")
        self.spans: dict[int, tuple[int, int, int, int]] = {}  # c -> train and test slices
        train_idx, test_idx = [], []
        n_train = n_test = 0
        for c in self.clients:
            part = data.parts[c]
            train_idx.append(part.train)
            test_idx.append(part.test)
            self.spans[c] = (n_train, n_train + len(part.train), n_test, n_test + len(part.test))
            n_train += len(part.train)
            n_test += len(part.test)
        ds = data.dataset

        def gather(parts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
            idx = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
            x = torch.from_numpy(np.ascontiguousarray(ds.x[idx], dtype=np.float32))
            y = torch.from_numpy(np.ascontiguousarray(data.labels(idx), dtype=np.int64))
            return _to_device(x, device), _to_device(y, device)

        self.train_x, self.train_y = gather(train_idx)
        self.test_x, self.test_y = gather(test_idx)

    def split(self, client: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor]:
        a, b, c, d = self.spans[client]
        return self.train_x[a:b], self.train_y[a:b], self.test_x[c:d], self.test_y[c:d]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.train_x, self.train_y, self.test_x, self.test_y))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # one pinned staging copy makes the upload a single DMA
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# --------------------------------------------------------------------------- networks
class ModelStore:
    """Networks by architecture: built once each, then handed out and taken back."""

    def __init__(self, cfg: Config, data: FederatedData, device: torch.device):
        self.cfg, self.data, self.device = cfg, data, device
        self.templates: dict[str, torch.nn.Module] = {}
        self.initial: dict[str, dict[str, torch.Tensor]] = {}
        self.free: dict[str, list[torch.nn.Module]] = {}
        self.built = 0  # networks made (template copies included): the cost a restore avoids

    def _template(self, arch: str, client: int) -> torch.nn.Module:
        model = self.templates.get(arch)
        if model is None:
            model = make_model(self.cfg, client, self.data).to(self.device)
            self.templates[arch] = model
            self.initial[arch] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model

    def take(self, arch: str, client: int) -> torch.nn.Module:
        """A network of `arch` holding the federation's initial weights, in training mode."""
        template = self._template(arch, client)
        free = self.free.get(arch)
        if free:
            model = free.pop()
            model.load_state_dict(self.initial[arch])
            for p in model.parameters():  # a handler may have frozen some (FedRep's head)
                p.requires_grad_(True)
                p.grad = None
            model.train()
        else:
            model = clone_module(template)
            self.built += 1
        return model

    def give_back(self, arch: str, model: torch.nn.Module) -> None:
        self.free.setdefault(arch, []).append(model)

    def builder(self):
        """ClientContext.build_arch for this node: a network of any registry arch (FML's and
        FedKD's shared model), a copy of one seeded build instead of a new initialisation."""
        from fedbus.node.setup import arch_builder

        build = arch_builder(self.cfg, self.data)
        cache: dict[str, torch.nn.Module] = {}

        def build_arch(arch: str) -> torch.nn.Module:
            if arch in cache:
                return clone_module(cache[arch])
            model = build(arch)
            # built under `with torch.device("meta")` to count parameters: no weights to keep
            if not any(t.is_meta for t in model.state_dict().values()):
                cache[arch] = clone_module(model)
            return model
        return build_arch


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a network with its own parameters and buffers (no gradients), ~5x faster
    than copy.deepcopy: containers are copied one level, other attributes (shapes, names,
    settings) shared, as nothing here keeps tensors outside parameters and buffers."""
    cls = module.__class__
    new = cls.__new__(cls)
    state = {k: v.copy() if isinstance(v, (dict, list, set)) else v
             for k, v in module.__dict__.items()}
    state["_parameters"] = {
        k: None if p is None else torch.nn.Parameter(p.detach().clone(), p.requires_grad)
        for k, p in module._parameters.items()}
    state["_buffers"] = {k: None if b is None else b.detach().clone()
                         for k, b in module._buffers.items()}
    state["_modules"] = {k: None if m is None else clone_module(m)
                         for k, m in module._modules.items()}
    new.__dict__ = state
    return new


# --------------------------------------------------------------------------- state
@dataclass
class Packed:
    """A handler's state in one flat buffer: `layout` is the state with every tensor
    replaced by a `_Slot`; `flat` holds the tensors' bytes back to back (CPU)."""

    layout: Any
    flat: torch.Tensor  # uint8

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel())


@dataclass(frozen=True)
class _Slot:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def pack_state(state: Any) -> Packed:
    """Copy every tensor of a (nested) state into one CPU byte buffer."""
    tensors: list[torch.Tensor] = []
    offset = 0

    def walk(obj: Any) -> Any:
        nonlocal offset
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            slot = _Slot(offset, t.numel() * t.element_size(), t.dtype, tuple(t.shape))
            tensors.append(t)
            offset += slot.nbytes
            return slot
        if isinstance(obj, np.ndarray):
            return obj.copy()
        return copy.deepcopy(obj)

    layout = _map_leaves(state, walk)
    flat = torch.empty(offset, dtype=torch.uint8)
    for t, slot in zip(tensors, _slots(layout)):
        if slot.nbytes:
            flat[slot.offset:slot.offset + slot.nbytes].copy_(
                t.contiguous().reshape(-1).view(torch.uint8).cpu())
    return Packed(layout, flat)


def _slots(layout: Any):
    if isinstance(layout, _Slot):
        yield layout
    elif isinstance(layout, dict):
        for v in layout.values():
            yield from _slots(v)
    elif isinstance(layout, (list, tuple)):
        for v in layout:
            yield from _slots(v)


def unpack_state(packed: Packed) -> Any:
    """The state `pack_state` packed: tensors are views into the flat buffer (on the CPU;
    load_state_dict moves them where the handler's own tensors live)."""
    flat = packed.flat

    def walk(obj: Any) -> Any:
        if isinstance(obj, _Slot):
            if obj.nbytes == 0:
                return torch.empty(obj.shape, dtype=obj.dtype)
            return flat[obj.offset:obj.offset + obj.nbytes].view(obj.dtype).reshape(obj.shape)
        return obj

    return _map_leaves(packed.layout, walk)


def _map_leaves(obj: Any, fn) -> Any:
    """obj with its dicts, lists and tuples rebuilt and every other value x as fn(x)."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_leaves(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_leaves(v, fn) for v in obj)
    return fn(obj)


# --------------------------------------------------------------------------- residency
class ClientPool:
    """Materialises client handlers on demand and keeps those that fit the memory budget.

    memory_mb: budget for materialised clients (their measured weights, gradients,
        optimizer and extra state); the least recently used beyond it are evicted.
        Activations and the node's data are not counted.
    max_resident: at most this many materialised at once as well (0 = no cap).
    evict_to: "memory" (packed state in RAM) or "disk" (one file per client in `spool`).
    clients: the clients this node hosts (their data is gathered once); None = all.
    """

    def __init__(self, cfg: Config, device: torch.device, *, clients: list[int] | None = None,
                 memory_mb: float | None = None, max_resident: int | None = None,
                 evict_to: str = "memory", spool: Path | None = None):
        self.cfg = cfg
        self.device = device
        self.algo = get_algorithm(cfg.algorithm.name)
        self.data = federated_data(cfg)
        hosted = list(range(self.data.num_clients)) if clients is None else list(clients)
        self.node_data = NodeData(self.data, hosted, device)
        self._size_balance: float | None = None
        self.models = ModelStore(cfg, self.data, device)
        self.build_arch = self.models.builder()
        self.archs = distinct_archs(cfg)
        self.budget = int(float(cfg.launch.node_memory_mb if memory_mb is None
                                else memory_mb) * MiB)
        self.max_resident = int(cfg.launch.max_resident if max_resident is None
                                else max_resident)
        self.evict_to = evict_to
        self.spool = spool
        self.resident: OrderedDict[int, ClientHandler] = OrderedDict()
        # What a materialised client holds, measured per architecture: first on a fresh
        # handler, then again on the first one that has trained (optimizer buffers and
        # gradients appear with the first step); measuring every client would cost a
        # state_dict() each time.
        self.arch_cost: dict[str, int] = {}
        self.settled: set[str] = set()
        self.arch_count: dict[str, int] = {}
        self.evicted: dict[int, Packed | Path] = {}
        self.pinned: set[int] = set()  # never evicted while pinned (a cohort in training)
        self.evictions = self.restores = 0
        self._last = -1

    @property
    def used(self) -> int:
        """Bytes the materialised clients hold (by the per-architecture measure)."""
        return sum(n * self.arch_cost[a] for a, n in self.arch_count.items())

    def get(self, client: int) -> ClientHandler:
        handler = self.resident.get(client)
        if handler is not None:
            self.resident.move_to_end(client)
            return handler
        self._settle(self._last)
        handler = self.build(client)
        stashed = self.evicted.pop(client, None)
        if stashed is not None:
            handler.load_state_dict(self._restore(stashed))
            self.restores += 1
        arch = self._arch(client)
        if arch not in self.arch_cost:
            self.arch_cost[arch] = self._footprint(handler)
        self.arch_count[arch] = self.arch_count.get(arch, 0) + 1
        self.resident[client] = handler
        self._last = client
        self._fit()
        return handler

    def _arch(self, client: int) -> str:
        return arch_for_client(self.cfg.model, client)

    def _settle(self, client: int) -> None:
        """Measure an architecture again on its first client that has trained."""
        handler = self.resident.get(client)
        if handler is None:
            return
        arch = self._arch(client)
        if arch in self.settled:
            return
        if any(p.grad is not None for p in handler.ctx.model.parameters()):
            self.arch_cost[arch] = max(self.arch_cost[arch], self._footprint(handler))
            self.settled.add(arch)

    def build(self, client: int) -> ClientHandler:
        """A handler for `client` over a stored network holding the initial weights."""
        if client not in self.node_data.spans:
            raise KeyError(f"client {client} is not hosted by this node")
        train_x, train_y, test_x, test_y = self.node_data.split(client)
        model = self.models.take(arch_for_client(self.cfg.model, client), client)
        ctx = ClientContext(client=client, model=model, device=self.device,
                            train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y,
                            num_classes=self.data.num_classes, feature_dim=model.feature_dim,
                            params=dict(self.cfg.algorithm), train=dict(self.cfg.train),
                            seed=self.cfg.federation.seed,
                            extra={"privacy": dict(self.cfg.privacy),
                                   "node_balance": self.size_balance},
                            archs=self.archs, build_arch=self.build_arch)
        return self.algo.client(ctx)

    def _footprint(self, handler: ClientHandler) -> int:
        """Bytes a materialised handler holds: its state's tensors (weights, optimizer
        buffers, extra) plus a gradient per parameter."""
        state = handler.state_dict()
        grads = sum(p.numel() * p.element_size() for p in handler.ctx.model.parameters())
        return _tensor_bytes(state) + grads

    def _fit(self) -> None:
        """Evict least recently used clients until the rest fit; the newest always stays,
        and so do pinned clients (a cohort in training: fedbus.node.client_host)."""
        while len(self.resident) > 1 and (
                self.used > self.budget
                or (self.max_resident and len(self.resident) > self.max_resident)):
            victim = next((c for c in self.resident if c not in self.pinned), None)
            if victim is None or victim == next(reversed(self.resident)):
                break
            self.evict(victim)

    @property
    def size_balance(self) -> float:
        """Mean over max of the hosted clients' training-set sizes (1 = equal sizes): how much
        of a cohort's vectorised steps do work (train.cohort = auto on the CPU). Computed
        once: the hosted partition does not change, and every client build reads it (a
        pass over 12,500 hosted clients at each build was 14 % of a node's time in the
        100,000-client bench)."""
        if self._size_balance is None:
            sizes = [b - a for a, b, _, _ in self.node_data.spans.values()]
            self._size_balance = sum(sizes) / len(sizes) / max(sizes) \
                if sizes and max(sizes) else 1.0
        return self._size_balance

    def release(self) -> None:
        """Unpin every client (a cohort is done) and evict what no longer fits."""
        self.pinned.clear()
        self._fit()

    def cohort_room(self, client: int) -> int:
        """How many clients of `client`'s architecture a cohort may hold resident at once:
        what the memory budget (by the architecture's measured footprint) and
        launch.max_resident allow, at least 1."""
        if self._arch(client) not in self.arch_cost:
            self.get(client)  # measures its architecture
        room = self.budget // max(1, self.arch_cost[self._arch(client)])
        if self.max_resident:
            room = min(room, self.max_resident)
        return max(1, int(room))

    def evict(self, client: int) -> None:
        handler = self.resident.pop(client)
        arch = self._arch(client)
        self.arch_count[arch] -= 1
        packed = pack_state(handler.state_dict())
        self.evicted[client] = self._stash(client, packed)
        self.models.give_back(arch, handler.ctx.model)
        self.evictions += 1

    def _stash(self, client: int, packed: Packed) -> Packed | Path:
        if self.evict_to == "disk" and self.spool is not None:
            # each tensor cloned out of the packed buffer: torch.save refuses views of one
            # storage as different dtypes (float weights beside BatchNorm's int64 counter)
            path = self.spool / f"client-{client}.pt"
            tmp = path.with_suffix(".tmp")
            state = _map_leaves(unpack_state(packed),
                                lambda x: x.clone() if isinstance(x, torch.Tensor) else x)
            torch.save(state, tmp)
            os.replace(tmp, path)
            return path
        return packed

    def _restore(self, stashed: Packed | Path) -> Any:
        if isinstance(stashed, Path):
            state = torch.load(stashed, map_location="cpu", weights_only=True)
            stashed.unlink(missing_ok=True)
            return state
        return unpack_state(stashed)

    def stats(self) -> dict[str, Any]:
        """Residency figures for logs and benchmarks."""
        in_memory = sum(p.nbytes for p in self.evicted.values() if isinstance(p, Packed))
        return {"resident": len(self.resident), "evicted": len(self.evicted),
                "resident_mb": round(self.used / MiB, 2),
                "evicted_mb": round(in_memory / MiB, 2),
                "data_mb": round(self.node_data.nbytes / MiB, 2),
                "networks_built": self.models.built, "evictions": self.evictions,
                "restores": self.restores}


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0

"""Each client's own state on disk, so that a resumed run continues the same experiment.

A client handler's state (its model, its optimiser, what its algorithm keeps between
rounds: FedProto's global prototypes, FedPer's head, FML's meme model, ...) lives only on
its node. The server's checkpoint (RUN/checkpoint.fbk) cannot hold it, so the node writes
it itself, after a task its client trains:

    STATE_DIR/<run id>/client-<id>-r<round>.pt      (torch.save, loaded with weights_only)

keeping the files a resume may still need (below). Files are keyed by client, not by node, so a
node restarted under another name, or hosting other clients, finds them.

In step with the server: the server's checkpoint at version V is written once round V-1
has closed and been evaluated (sync mode), so every task of rounds < V has been trained.
A resumed server starts again at round V, and a node restores each client's newest state
of a round before the first round it is sent after the restart (`cutoff`): the state the
uninterrupted run had when round V began. Tasks of rounds >= V that ran before the stop are
ignored, as the server redoes them. In async mode the server's checkpoint does not wait
for clients in training, so a resumed async run is close to, not equal to, the
uninterrupted one.

When a state is written (the rule a resume relies on): at the server's checkpoint cadence,
off the message path, and durable before any checkpoint that counts its round done. After a
task trains, the node takes a copy of the client's state in memory (a snapshot: the next
task trains the live model in place) and sends the update at once; the snapshot waits in
the node's StateWriter. Before the server writes its checkpoint at version V (sync mode:
once round V-1 has closed and been evaluated) it sends `flush` to every node it sent a task
since that node's last acknowledged flush, and writes the checkpoint only when each has
answered `flushed` or left (broker/PROTOCOL.md §4.2); the next round starts meanwhile.
The flush leaves before the next round's tasks, so a node answers it once the snapshots
of the rounds before V are on disk (the writer thread writes them then, while the node
trains round V: one torch.save per changed client per round, never on the path of an
update). So a checkpoint on disk never counts done a round whose states a
node could still lose: a node killed before its answer leaves the previous checkpoint, and
a resume restores each client's newest state of a round before it (newest_before). A
snapshot is never replaced by a newer one a flush could still need, since the flush after
its round comes before the next round's tasks (a later snapshot of the same round replaces it:
a task redone after a server restart). In async mode the server flushes nothing: the writer
writes each snapshot as soon as it can, a client's newer one replacing one not yet written. Files are kept so that the newest one
before any checkpoint the server may still resume from is there: each flush names the
version of the server's checkpoint on disk (`durable`), and a client's files older than its
newest before that version are deleted (async mode: the newest `keep`). A stop writes
nothing more (what is still in memory is of rounds no checkpoint on disk counts done); a
completed run writes what is pending, so that each changed state is written exactly once
whatever the timing of the end (a count a test can rely on), then deletes the states.

What is not written, as no resume can need it: a state unchanged since the client's newest
file (Fingerprint: torch's change counters, no bytes read; the no-op clients that `fedbus
bench rounds` runs, whose model never changes, write once per run; a handler's live
model, optimizer and extra state are marked without building its state first,
live_mark), since a resume restores that file, the same state; an empty state while the
client has no file, since restoring nothing leaves it in that same initial state; and
anything in a run that cannot resume its clients (`fedbus run --no-client-state`, `fedbus
node --state-dir none`: the node makes no store, and answers a flush at once).
`written_by_round` and `skipped` count what was done, logged by the node as it stops
("client states").

For tests: FEDBUS_HOLD_STATE_WRITES=R (every node) or R:NODE makes a node's writer hold
back every flush of round R or later (nothing of them is written, no `flushed` is sent), so
that a kill in that window is an event a test can wait for rather than a race.
"""
from __future__ import annotations

import copy
import hashlib
import os
import re
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedbus.algorithms.core.handlers import ClientHandler

_NAME = re.compile(r"client-(\d+)-r(\d+)\.pt$")


def node_mark(node: str) -> str:
    """The file that marks a node configured for the run whose folder holds it (a name is
    any string: hashed to name a file)."""
    return "node-" + hashlib.sha256(node.encode()).hexdigest()[:16]


class ClientStateStore:
    """node: the node's name, marked in the run's folder (node_mark) until discard, so a
    node restarted before its first config knows its run even with no state written yet
    (last_run). durable: None keeps the newest `keep` files of a client; an int (sync runs,
    set from each flush) keeps a client's newest file of a round before it and every newer
    one (the module's rule). Files are written by write(), from the node's StateWriter
    thread; what decides whether a state is written (snapshot_client) runs on the node's
    own thread."""

    def __init__(self, root: str | Path, run_id: str, *, keep: int = 2,
                 node: str | None = None, durable: int | None = None):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id or ""):
            raise ValueError(f"run id {run_id!r} cannot name a folder")
        self.path = Path(root) / run_id
        self.keep = max(1, keep)
        self.durable = durable
        self.path.mkdir(parents=True, exist_ok=True)
        self._mark = self.path / node_mark(node) if node is not None else None
        if self._mark is not None:
            self._mark.touch()
        self._lock = threading.Lock()  # saved and written_by_round: the writer thread's too
        self.saved: dict[int, list[int]] = {}  # client -> rounds on disk, oldest first
        self.written_by_round: Counter[int] = Counter()  # files this store wrote, by round
        self.skipped = 0  # states not written: a resume gets the same without (save's rule)
        self._newest: dict[int, Fingerprint] = {}  # client -> its newest snapshot's mark
        self._live: dict[int, Fingerprint] = {}  # client -> live_mark at that snapshot
        self._top: dict[int, int] = {}  # client -> the round of its newest state or snapshot
        for f in self.path.iterdir():
            m = _NAME.fullmatch(f.name)
            if m:
                self.saved.setdefault(int(m[1]), []).append(int(m[2]))
        for client, rounds in self.saved.items():
            rounds.sort()
            self._top[client] = rounds[-1]

    def _file(self, client: int, round_: int) -> Path:
        return self.path / f"client-{client}-r{round_}.pt"

    def save(self, client: int, round_: int, state: Any, witness: Any = None) -> bool:
        """Write the client's state after its task of `round_` now, unless a resume would
        get the same state without it (admit). Returns whether a file was written."""
        if not self.admit(client, round_, state, witness):
            return False
        self.write(client, round_, state)
        return True

    def admit(self, client: int, round_: int, state: Any, witness: Any = None) -> bool:
        """Whether the client's state after its task of `round_` is to be written: not if
        it is unchanged since the client's newest state (written or snapshot by this store;
        Fingerprint, with `witness`), or empty while the client has none. Notes it as the
        client's newest when it is."""
        if isinstance(state, Mapping) and not state and client not in self._top:
            self.skipped += 1
            return False
        mark = Fingerprint(state, witness)
        if client in self._newest and mark.same(self._newest[client]):
            self.skipped += 1
            return False
        if round_ >= self._top.get(client, -1):
            self._top[client] = round_
            self._newest[client] = mark
        else:  # an older round late: the newest state is not this one
            self._newest.pop(client, None)
        return True

    def write(self, client: int, round_: int, state: Any) -> None:
        """The file of the client's state after its task of `round_` (atomically: a stop
        while writing leaves the previous file); then the files no resume can need go
        (prune)."""
        path = self._file(client, round_)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        with self._lock:
            rounds = [r for r in self.saved.get(client, []) if r != round_] + [round_]
            rounds.sort()
            self.saved[client] = rounds
            self.written_by_round[round_] += 1
        self.prune(client)

    def prune(self, client: int) -> None:
        """Delete the client's files no resume can need: with `durable` known, those older
        than its newest of a round before it; otherwise all but the newest `keep`."""
        with self._lock:
            rounds = self.saved.get(client, [])
            if self.durable is None:
                gone = rounds[:-self.keep]
            else:
                below = [r for r in rounds if r < self.durable]
                gone = below[:-1]
            if not gone:
                return
            self.saved[client] = [r for r in rounds if r not in gone]
        for old in gone:
            self._file(client, old).unlink(missing_ok=True)

    def prune_all(self) -> None:
        for client in list(self.saved):
            self.prune(client)

    def snapshot_client(self, client: int, round_: int, handler: ClientHandler) -> Any | None:
        """The handler's state_dict() after its task of `round_`, copied (the next task
        trains the live tensors in place), to be written; None where a resume gets the same
        without it (admit, its model's gradients the witness). The state is not built when
        the handler's live model, optimizer and extra state are as they were at the
        client's newest snapshot (live_mark): a node asks after every task, and building a
        state costs more than the task of a client whose state never changes."""
        live = live_mark(handler)
        if live is not None and client in self._newest and live.same(self._live.get(client)):
            self.skipped += 1
            return None
        state = handler.state_dict()
        admitted = self.admit(client, round_, state,
                              witness=[p.grad for p in handler.ctx.model.parameters()])
        if live is not None and client in self._newest:  # the newest snapshot is this state
            self._live[client] = live
        else:
            self._live.pop(client, None)
        return _copied(state, {}) if admitted else None

    def save_client(self, client: int, round_: int, handler: ClientHandler) -> bool:
        """snapshot_client, written now. Returns whether a file was written."""
        state = self.snapshot_client(client, round_, handler)
        if state is None:
            return False
        self.write(client, round_, state)
        return True

    def newest_before(self, client: int, cutoff: int) -> int | None:
        """The round of the client's newest saved state before round `cutoff`, or None."""
        with self._lock:
            rounds = [r for r in self.saved.get(client, []) if r < cutoff]
        return rounds[-1] if rounds else None

    def load(self, client: int, round_: int) -> Any:
        """The state saved after the client's task of `round_` (on the CPU; the handler's
        load_state_dict moves it to its device). ValueError names a damaged file."""
        path = self._file(client, round_)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign file: say which, and why
            raise ValueError(f"client state {path} cannot be read: "
                             f"{type(err).__name__}: {err}") from None

    def discard(self, clients: list[int]) -> None:
        """Delete these clients' states (the run completed: nothing to resume), and the
        run's folder once it is empty."""
        for client in clients:
            self._newest.pop(client, None)
            self._live.pop(client, None)
            self._top.pop(client, None)
            with self._lock:
                rounds = self.saved.pop(client, [])
            for round_ in rounds:
                self._file(client, round_).unlink(missing_ok=True)
        if self._mark is not None:
            self._mark.unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:  # other nodes' clients still there
            pass

    def stats(self) -> dict[str, Any]:
        """What this store wrote: files by round (as "round": count), and the states it did
        not write (save's rule)."""
        with self._lock:
            by_round = sorted(self.written_by_round.items())
        return {"written": sum(n for _, n in by_round), "skipped": self.skipped,
                "by_round": {str(r): n for r, n in by_round}}

    def clients(self) -> set[int]:
        """The clients with a saved state."""
        with self._lock:
            return set(self.saved)


def _copied(value: Any, memo: dict[int, Any]) -> Any:
    """A copy of a state that training in place cannot change: tensors cloned (detached),
    numpy arrays copied, containers rebuilt; an object met twice is copied once, so what
    the state shares stays shared. copy.deepcopy does the same at ~9x the cost (tensors'
    __deepcopy__), on the message path."""
    done = memo.get(id(value))
    if done is not None:
        return done
    kind = type(value)
    if kind in _EXACT_TYPES or kind is float:
        return value
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
    elif isinstance(value, np.ndarray):
        out = value.copy()
    elif kind is dict:
        out = {k: _copied(v, memo) for k, v in value.items()}
    elif kind is OrderedDict:  # a module's state_dict, with its _metadata (versions)
        out = OrderedDict((k, _copied(v, memo)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = copy.deepcopy(value._metadata)
    elif kind is list:
        out = [_copied(v, memo) for v in value]
    elif kind is tuple:
        out = tuple(_copied(v, memo) for v in value)
    else:  # (an OrderedDict, a dataclass, a numpy scalar: their own deep copy)
        out = copy.deepcopy(value)
    memo[id(value)] = out
    return out


class Fingerprint:
    """What tells a client's state that changed since its newest file from one that did
    not, without reading the state's bytes: each tensor by its storage (held by a weak
    reference, so the same live storage, never a freed one whose address came back), its
    offset, shape, stride, dtype and torch's version counter, which every in-place change
    torch makes bumps (an optimizer step, load_state_dict, a copy_ under no_grad); numpy
    arrays by a digest of their bytes; every other value (numbers, strings, the structure)
    as itself or its exact bits, with its type, compared with ==. `witness` adds tensors
    that change when a task trains without being part of the state (the model's
    gradients). Not seen: a change written behind torch's counter (through `.data` or a
    numpy view of a tensor) in a task that leaves every gradient as it was.

    The structure is a flat list (each value its type, then a container's length and
    items), compared in one C-level ==: a node checks every task's state of every client,
    so this is on the message path (a sha1 of each value's repr cost 4x more)."""

    __slots__ = ("tensors", "values")

    def __init__(self, state: Any, witness: Any = None):
        tensors: list[torch.Tensor] = []
        values: list[Any] = []
        _flatten((state, witness), values, tensors)
        self.values = _kept(values)
        self.tensors = _marks(tensors)

    @classmethod
    def of_parts(cls, values: list, tensors: list[torch.Tensor]) -> Fingerprint:
        """A fingerprint of values and tensors already flattened (live_mark)."""
        mark = cls.__new__(cls)
        mark.values = _kept(values)
        mark.tensors = _marks(tensors)
        return mark

    def same(self, other: Fingerprint | None) -> bool:
        # weak references are == while both storages live and are the same object
        return other is not None and self.tensors is not None and \
            other.tensors is not None and self.values == other.values and \
            self.tensors == other.tensors


def _marks(tensors: list[torch.Tensor]) -> list[tuple] | None:
    """Each tensor's _tensor_mark; None (never the same) if one has none."""
    seen: dict[int, tuple | None] = {}  # a parameter is in the model and the optimizer
    marks = []
    for t in tensors:
        mark = seen[id(t)] if id(t) in seen else seen.setdefault(id(t), _tensor_mark(t))
        if mark is None:
            return None
        marks.append(mark)
    return marks


def _tensor_mark(t: torch.Tensor) -> tuple | None:
    try:
        storage = t.untyped_storage()
        return (weakref.ref(storage), t.storage_offset(), tuple(t.shape), t.stride(),
                t.dtype, t.device, t._version)
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, meta: always changed
        return None


# Values kept as themselves, with their type beside them (1, 1.0 and True are ==); floats
# as their hex, which tells -0.0 from 0.0 and is equal for a NaN.
_EXACT_TYPES = frozenset((bool, int, str, bytes, type(None), torch.dtype, torch.device))
_EXACT = (bool, int, str, bytes, torch.dtype, torch.device)
_MAPPING, _TENSOR, _ARRAY = object(), object(), object()  # markers no value can equal


class _Opaque:
    """A value whose change cannot be told: equal to nothing but itself, never kept."""

    __slots__ = ()


# Values kept as they are up to this many; a longer list (a state with many plain values)
# is kept as its digest, so that a node's marks of 1,000s of clients stay small.
_KEPT_VALUES = 4096


def _kept(values: list) -> list:
    if len(values) <= _KEPT_VALUES:
        return values
    if any(type(v) is _Opaque for v in values):
        return [_Opaque()]
    # (the markers' and types' reprs are fixed for the process, as the marks are)
    return [hashlib.sha1(repr(values).encode(), usedforsecurity=False).digest()]


def _flatten(value: Any, out: list, tensors: list) -> None:
    kind = type(value)
    if kind in _EXACT_TYPES:  # the common leaves first: an optimizer's hyperparameters
        out.append(kind)
        out.append(value)
    elif kind is float:
        out.append(float)
        out.append(value.hex())
    elif isinstance(value, torch.Tensor):
        out.append(_TENSOR)
        tensors.append(value)
    elif isinstance(value, Mapping):
        out.append(_MAPPING)
        out.append(len(value))
        for k, v in value.items():
            if type(k) is str:  # a call less for the common key
                out.append(str)
                out.append(k)
            else:
                _flatten(k, out, tensors)
            if type(v) in _EXACT_TYPES:
                out.append(type(v))
                out.append(v)
            elif type(v) is float:
                out.append(float)
                out.append(v.hex())
            else:
                _flatten(v, out, tensors)
    elif isinstance(value, (list, tuple)):
        out.append(list if isinstance(value, list) else tuple)
        out.append(len(value))
        for v in value:
            if isinstance(v, torch.Tensor):  # a call less for a param group's parameters
                out.append(_TENSOR)
                tensors.append(v)
            else:
                _flatten(v, out, tensors)
    elif isinstance(value, np.ndarray) and value.dtype != object:
        digest = hashlib.sha1(np.ascontiguousarray(value).reshape(-1).view(np.uint8),
                              usedforsecurity=False).digest()
        out.append(_ARRAY)
        out.append((value.dtype, value.shape, digest))
    elif isinstance(value, np.generic):  # its bits (a numpy float's -0.0, NaN)
        out.append(kind)
        out.append(value.tobytes())
    elif isinstance(value, float):
        out.append(kind)
        out.append(float.hex(value))
    elif isinstance(value, complex):
        out.append(kind)
        out.append((value.real.hex(), value.imag.hex()))
    elif isinstance(value, _EXACT):
        out.append(kind)
        out.append(value)
    else:  # a repr may not show all of an object: count it as changed, and write
        out.append(_Opaque())


def live_mark(handler: ClientHandler) -> Fingerprint | None:
    """A Fingerprint of what ClientHandler.state_dict() and the gradients witness would
    hold, read from the live objects without building that state: each module of the
    model (its type, names, parameters with their gradients, buffers, children, in
    state_dict's order), the optimizer's param groups and state, and extra_state(). Same
    marks, same state: a state_dict holds detached views of these very tensors, which
    share their storage and version counter. None where a state could hold more than
    that: a handler or optimizer with its own state_dict, a module with its own
    _save_to_state_dict or get_extra_state, or state-dict hooks (save_client then
    fingerprints the built state)."""
    if type(handler).state_dict is not ClientHandler.state_dict:
        return None
    optimizer = getattr(handler, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or \
            type(optimizer).state_dict is not torch.optim.Optimizer.state_dict or \
            optimizer._optimizer_state_dict_pre_hooks or \
            optimizer._optimizer_state_dict_post_hooks:
        return None
    values: list[Any] = []
    tensors: list[torch.Tensor] = []
    if not _walk_module(handler.ctx.model, values, tensors):
        return None
    _flatten((optimizer.param_groups, optimizer.state, handler.extra_state()), values, tensors)
    return Fingerprint.of_parts(values, tensors)


_Module = torch.nn.Module
_PLAIN_MODULES: dict[type, bool] = {}  # module class -> its state is Module's own


def _plain_module(kind: type) -> bool:
    plain = _PLAIN_MODULES.get(kind)
    if plain is None:
        plain = _PLAIN_MODULES[kind] = (
            kind.state_dict is _Module.state_dict and
            kind._save_to_state_dict is _Module._save_to_state_dict and
            getattr(kind, "get_extra_state", _Module.get_extra_state) is
            _Module.get_extra_state)
    return plain


def _walk_module(module: torch.nn.Module, out: list, tensors: list) -> bool:
    """Flatten what Module.state_dict would hold of `module` and its children (and each
    parameter's gradient); False if it could hold more (live_mark)."""
    kind = type(module)
    if not _plain_module(kind) or module._state_dict_hooks or module._state_dict_pre_hooks:
        return False
    params, buffers, children = module._parameters, module._buffers, module._modules
    out.append(kind)
    out.append(len(params))
    for name, param in params.items():
        out.append(name)
        if param is None:
            out.append(None)
            continue
        out.append(_TENSOR)
        tensors.append(param)
        grad = param.grad
        if grad is None:
            out.append(None)
        else:
            out.append(_TENSOR)
            tensors.append(grad)
    out.append(len(buffers))
    if buffers:
        skipped = module._non_persistent_buffers_set
        for name, buf in buffers.items():
            out.append(name)
            out.append(name in skipped)
            _flatten(buf, out, tensors)
    out.append(len(children))
    for name, child in children.items():
        out.append(name)
        if child is None:
            out.append(None)
        elif not _walk_module(child, out, tensors):
            return False
    return True


def last_run(root: str | Path | None, clients: list[int], node: str) -> str:
    """The run a node was last configured for, as its state folder says: the newest run
    folder holding its node_mark or states of its clients ("" if none). A node restarted
    before its first config registers for that run: had it ended while the node was
    down, the broker sends it the run's shutdown (PROTOCOL.md §5). A run that completed
    deleted both, so a folder kept for the next run names none."""
    if root is None:
        return ""
    wanted, mark, found, newest = set(clients), node_mark(node), "", -1.0
    try:
        runs = sorted(Path(root).iterdir())
    except OSError:
        return ""
    for run in runs:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", run.name):
            continue
        try:
            files = [f for f in run.iterdir() if f.name == mark or (
                (m := _NAME.fullmatch(f.name)) and int(m[1]) in wanted)]
            when = max((f.stat().st_mtime for f in files), default=None)
        except OSError:  # (another node discarding its clients' states meanwhile)
            continue
        if when is not None and when > newest:
            found, newest = run.name, when
    return found

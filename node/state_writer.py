"""A node's client-state writer: snapshots written off the message path, at flushes.

The node hands each changed client's state snapshot to put() and sends the client's update
at once. The server's `flush` (broker/PROTOCOL.md §4.2) is a barrier(): every snapshot put
before it is written (fedbus.node.client_state.ClientStateStore.write), then the barrier's
`done` runs (the node's `flushed` answer). Snapshots wait in epochs, one per barrier, so a
snapshot a pending flush needs is never replaced by a newer one; within the open epoch a
snapshot of the same client and round replaces the older (a redone task). Async runs
(`newest_wins`: no flush comes) write each snapshot as soon as the writer can, a newer
snapshot of the client replacing one not written yet.

threaded: one writer thread writes while the node serves messages; the first epoch is
written when its barrier is put, or early while more than `max_pending_bytes` of
snapshots wait (bounded memory). Not threaded (`fedbus bench sim`, deterministic):
barrier() writes everything before it returns.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from fedbus.broker.log import get_logger

log = get_logger("fedbus.node")

# snapshots waiting beyond this many bytes are written before their flush comes
MAX_PENDING_BYTES = 512 << 20


class _Epoch:
    __slots__ = ("barrier", "items")

    def __init__(self) -> None:
        # key (client, or (client, round)) -> (client, round, state, bytes), oldest first
        self.items: dict[Any, tuple[int, int, Any, int]] = {}
        self.barrier: tuple[int, int | None, Callable[[], None]] | None = None


class StateWriter:
    def __init__(self, store: Any, *, threaded: bool = True, newest_wins: bool = False,
                 max_pending_bytes: int = MAX_PENDING_BYTES, hold_from: int | None = None,
                 name: str = ""):
        self.store = store
        self.newest_wins = newest_wins
        self.max_pending_bytes = max_pending_bytes
        # (tests) flushes of this round or later are held: nothing of them is written
        self.hold_from = hold_from
        self._cond = threading.Condition()
        self._epochs: deque[_Epoch] = deque([_Epoch()])
        self._pending_bytes = 0
        self._closed = False
        self._draining = False  # closing, everything pending written first
        self.failed = 0  # writes that failed (their flush is not answered)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"fedbus-state-writer-{name}")
            self._thread.start()

    def put(self, client: int, round_: int, state: Any) -> None:
        """A client's state after its task of `round_`, to be written by the next flush."""
        size = _nbytes(state)
        key = client if self.newest_wins else (client, round_)
        with self._cond:
            epoch = self._epochs[-1]
            old = epoch.items.pop(key, None)
            if old is not None:
                self._pending_bytes -= old[3]
            epoch.items[key] = (client, round_, state, size)
            self._pending_bytes += size
            if self.newest_wins or self._pending_bytes > self.max_pending_bytes:
                self._cond.notify()
        if self._thread is None and (self.newest_wins or
                                     self._pending_bytes > self.max_pending_bytes):
            self._drain()

    def barrier(self, round_: int, durable: int | None, done: Callable[[], None]) -> None:
        """Every snapshot put so far written, then `durable` (the server's checkpoint on
        disk: ClientStateStore.prune's bound, None: unchanged) applied and `done` run."""
        with self._cond:
            self._epochs[-1].barrier = (round_, durable, done)
            self._epochs.append(_Epoch())
            self._cond.notify()
        if self._thread is None:
            self._drain()

    def pending(self) -> int:
        """Snapshots not written yet."""
        with self._cond:
            return sum(len(e.items) for e in self._epochs)

    def close(self, drain: bool = False) -> None:
        """Stop. What is still pending is written first with `drain` (a completed run:
        each changed state is then written once, whatever the timing of the end, so that
        a node's count of writes is the same in every run), else not (a stop: no checkpoint
        on disk needs it). Flushes still pending are not answered."""
        with self._cond:
            self._closed, self._draining = True, drain
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        elif drain:
            self._drain()

    # --- the writing ------------------------------------------------------------------

    def _held(self, epoch: _Epoch) -> bool:
        return self.hold_from is not None and epoch.barrier is not None and \
            epoch.barrier[0] >= self.hold_from

    def _next(self, wait: bool) -> tuple | None:
        """The next job: ("write", item) or ("barrier", barrier); None when there is none
        (not waiting) or the writer is closed."""
        with self._cond:
            while not self._closed or self._draining:
                first = self._epochs[0]
                drain = self._draining
                ready = first.barrier is not None and (drain or not self._held(first))
                if first.items and (ready or drain or self.newest_wins or
                                    self._pending_bytes > self.max_pending_bytes):
                    key = next(iter(first.items))
                    item = first.items.pop(key)
                    self._pending_bytes -= item[3]
                    return "write", item
                if ready:
                    self._epochs.popleft()
                    return "barrier", first.barrier
                if drain or not wait:  # (draining: the open epoch, empty, is all that is left)
                    return None
                self._cond.wait()
            return None

    def _do(self, job: tuple) -> None:
        what, arg = job
        if what == "write":
            client, round_, state, _ = arg
            try:
                self.store.write(client, round_, state)
            except Exception as err:  # noqa: BLE001 (a full disk: said; its flush goes unanswered)
                self.failed += 1
                log.error("client state not written: the server's next checkpoint waits",
                          client=client, round=round_, error=f"{type(err).__name__}: {err}")
            return
        round_, durable, done = arg
        if self._draining:
            return
        if self.failed:
            log.error("flush not answered: a client state of it could not be written",
                      round=round_, failed=self.failed)
            self.failed = 0
            return
        if durable is not None and (self.store.durable is None or
                                    durable > self.store.durable):
            self.store.durable = durable
            self.store.prune_all()
        try:
            done()
        except Exception as err:  # noqa: BLE001 (the node is stopping: its peer is closed)
            log.info("flushed not sent", round=round_, error=f"{type(err).__name__}: {err}")

    def _drain(self) -> None:
        while (job := self._next(wait=False)) is not None:
            self._do(job)

    def _run(self) -> None:
        while (job := self._next(wait=True)) is not None:
            self._do(job)


def _nbytes(value: Any) -> int:
    """About how many bytes a snapshot holds (its tensors and arrays)."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return getattr(value, "nbytes", 0) if not isinstance(value, (str, bytes)) else len(value)

"""Planted defects for `fedbus bench sim --plant NAME` and tests/test_sim.py: each patches a
production function while a `with planted(NAME):` block runs (and puts it back after), so
that the simulation can be shown to catch it. Never used outside the simulation.

  duplicate     the server's two defences against a duplicate update are off: the runtime's
                duplicate detection (Peer._is_duplicate) and the engine's one answer per task
                (the task stays outstanding after its update): caught as `once`
  dedup-off     the runtime's duplicate detection alone is off: the engine still keeps each
                update once (no violation expected: the defences are layered)
  record-lost   a resumed server drops one record too many (RunDir.keep_through keeps one
                version less than its checkpoint counts done): caught as `window`
  double-fold   a late update folded into one aggregation stays set aside and is folded into
                the next too (Engine._close_round keeps `late`): caught as `aggregated`
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PLANTS = ("duplicate", "dedup-off", "record-lost", "double-fold")


def _patches(name: str) -> list[tuple[Any, str, Any]]:
    from fedbus.broker.peer import Peer
    from fedbus.node.engine import Engine
    from fedbus.record.rundir import RunDir

    def never_duplicate(self, src, inc, seq, now):
        return False

    if name in ("duplicate", "dedup-off"):
        out = [(Peer, "_is_duplicate", never_duplicate)]
        if name == "duplicate":
            real_update = Engine.on_update

            def keeps_task(self, src, body, nbytes, now):
                task = self.tasks.get(body["task"])
                outs = real_update(self, src, body, nbytes, now)
                if task is not None and task.id not in self.tasks:
                    self._add_task(task)
                return outs

            out.append((Engine, "on_update", keeps_task))
        return out
    if name == "record-lost":
        real_keep = RunDir.keep_through

        def keeps_less(self, version):
            return real_keep(self, max(0, version - 1))

        return [(RunDir, "keep_through", keeps_less)]
    if name == "double-fold":
        real_close = Engine._close_round

        def folds_again(self, now):
            late = list(self.late)
            outs = real_close(self, now)
            self.late = late + self.late
            return outs

        return [(Engine, "_close_round", folds_again)]
    raise ValueError(f"no planted defect {name!r}: choose one of {', '.join(PLANTS)}")


@contextmanager
def planted(name: str | None) -> Iterator[None]:
    """The defect `name` planted while the block runs (None: nothing planted)."""
    patches = _patches(name) if name else []
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, fn in patches:
        setattr(obj, attr, fn)
    try:
        yield
    finally:
        for obj, attr, fn in reversed(saved):
            setattr(obj, attr, fn)

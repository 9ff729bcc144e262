"""Each client's own state on disk, so that a resumed run continues the same experiment.

A client handler's state (its model, its optimiser, what its algorithm keeps between
rounds: FedProto's global prototypes, FedPer's head, FML's meme model, ...) lives only on
its node. The server's checkpoint (RUN/checkpoint.fbk) cannot hold it, so the node writes
it itself, after every task a client trains:

    STATE_DIR/<run id>/client-<id>-r<round>.pt      (torch.save, loaded with weights_only)

keeping the newest `keep` files per client. Files are keyed by client, not by node, so a
node restarted under another name, or hosting other clients, finds them.

In step with the server: the server's checkpoint at version V is written once round V-1
has closed and been evaluated (sync mode), so every task of rounds < V has been trained.
A resumed server starts again at round V, and a node restores each client's newest state
of a round before the first round it is sent after the restart (`cutoff`): the state the
uninterrupted run had when round V began. Tasks of rounds >= V that ran before the stop are
ignored, as the server redoes them. In async mode the server's checkpoint does not wait
for clients in training, so a resumed async run is close to, not equal to, the
uninterrupted one.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"client-(\d+)-r(\d+)\.pt$")


class ClientStateStore:
    def __init__(self, root: str | Path, run_id: str, *, keep: int = 2):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id or ""):
            raise ValueError(f"run id {run_id!r} cannot name a folder")
        self.path = Path(root) / run_id
        self.keep = max(1, keep)
        self.path.mkdir(parents=True, exist_ok=True)
        self.saved: dict[int, list[int]] = {}  # client -> rounds on disk, oldest first
        for f in self.path.iterdir():
            m = _NAME.fullmatch(f.name)
            if m:
                self.saved.setdefault(int(m[1]), []).append(int(m[2]))
        for rounds in self.saved.values():
            rounds.sort()

    def _file(self, client: int, round_: int) -> Path:
        return self.path / f"client-{client}-r{round_}.pt"

    def save(self, client: int, round_: int, state: Any) -> None:
        """Write the client's state after its task of `round_` (atomically: a stop while
        writing leaves the previous file), then drop all but the newest `keep`."""
        path = self._file(client, round_)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        rounds = [r for r in self.saved.get(client, []) if r != round_] + [round_]
        rounds.sort()
        for old in rounds[:-self.keep]:
            self._file(client, old).unlink(missing_ok=True)
        self.saved[client] = rounds[-self.keep:]

    def newest_before(self, client: int, cutoff: int) -> int | None:
        """The round of the client's newest saved state before round `cutoff`, or None."""
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
            for round_ in self.saved.pop(client, []):
                self._file(client, round_).unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:  # other nodes' clients still there
            pass

    def clients(self) -> set[int]:
        """The clients with a saved state."""
        return set(self.saved)

"""How many client states a node writes (fedbus.node.client_state's rule), counted in real
federations: one file per task that changed its client's state, written by the node's
writer thread at the server's flush after it (off the message path; what a completed run
still holds is written as it ends, so the count does not depend on when the end came); one
per client for the no-op clients `fedbus bench rounds` runs, whose state never changes;
none at all in a run that cannot resume its clients. Counts only: nothing here depends on
the machine's speed."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import torch
from helpers import TINY, merged, metrics, run_federation

from fedbus.node.client_state import ClientStateStore, Fingerprint

ROUNDS = 3


def _sections(algorithm: str) -> dict:
    return merged(TINY, federation={"rounds": ROUNDS, "clients": 4},
                  algorithm={"name": algorithm})


def _state_logs(run_dir) -> list[dict]:
    """Each node's "client states" line (logged as it stops)."""
    out = []
    for path in sorted((run_dir / "logs").glob("node-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("event") == "client states":
                out.append(entry)
    return out


def _tasks_by_round(run_dir) -> Counter:
    return Counter({str(r["round"]): int(r["sampled"]) for r in metrics(run_dir)})


def test_a_stateful_client_writes_one_state_per_task(tmp_path):
    run_dir, summary = run_federation(tmp_path, _sections("fedproto"), "--log-level", "info")
    assert summary["rounds_completed"] == ROUNDS
    logs = _state_logs(run_dir)
    assert len(logs) == TINY["launch"]["nodes"]  # every node stopped and said
    written = Counter()
    for entry in logs:
        written.update(entry["by_round"])
        assert entry["skipped"] == 0
    tasks = _tasks_by_round(run_dir)
    assert sum(tasks.values()) == 4 * ROUNDS  # every client trained every round
    assert written == tasks
    # the run completed: nothing left to resume
    assert not list((run_dir / "clients").glob("*/client-*.pt"))


def test_flushes_never_answered_hold_no_round_back(tmp_path, monkeypatch):
    """Every node's writer holds back every flush (FEDBUS_HOLD_STATE_WRITES=1): no
    checkpoint before the last can be written, yet the rounds go on, the run completes, and
    each trained state is still written once (as the run ends)."""
    monkeypatch.setenv("FEDBUS_HOLD_STATE_WRITES", "1")
    run_dir, summary = run_federation(tmp_path, _sections("fedproto"), "--log-level", "info")
    assert summary["rounds_completed"] == ROUNDS
    written = Counter()
    for entry in _state_logs(run_dir):
        written.update(entry["by_round"])
    assert written == _tasks_by_round(run_dir)


def test_an_async_run_writes_states_without_flushes(tmp_path):
    """Async mode: the server sends no flush; each node writes a trained client's state as
    soon as its writer can (a newer one of the client replacing one not yet written), so
    every client aggregated has one written, at the latest as the run completes."""
    sections = merged(_sections("fedproto"),
                      federation={"mode": "async", "concurrency": 2, "buffer": 2})
    run_dir, summary = run_federation(tmp_path, sections, "--log-level", "info")
    assert summary["rounds_completed"] == ROUNDS
    aggregated = {int(c) for r in metrics(run_dir) for c in r["participants"]}
    assert sum(e["written"] for e in _state_logs(run_dir)) >= len(aggregated) >= 2
    assert not list((run_dir / "clients").glob("*/client-*.pt"))


def test_an_unchanging_client_writes_its_state_once(tmp_path):
    # the no-op trains nothing: its model and optimizer stay as built
    run_dir, _ = run_federation(tmp_path, _sections("noop"), "--log-level", "info")
    logs = _state_logs(run_dir)
    assert len(logs) == TINY["launch"]["nodes"]
    written = Counter()
    for entry in logs:
        written.update(entry["by_round"])
    assert written == {"0": 4}  # each client's first state, then nothing new
    tasks = sum(_tasks_by_round(run_dir).values())
    assert tasks == 4 * ROUNDS
    assert sum(e["skipped"] for e in logs) == tasks - 4


def test_a_run_that_cannot_resume_its_clients_writes_nothing(tmp_path):
    run_dir, summary = run_federation(tmp_path, _sections("fedproto"), "--log-level", "info",
                                      "--no-client-state")
    assert summary["rounds_completed"] == ROUNDS
    assert _state_logs(run_dir) == []  # no store at all
    assert not (run_dir / "clients").exists()


def test_the_store_skips_a_state_a_resume_would_get_anyway(tmp_path):
    store = ClientStateStore(tmp_path, "run1")
    assert store.save(1, 0, {}) is False and store.saved == {}  # empty, nothing on disk
    w = torch.ones(2)
    assert store.save(2, 0, {"w": w, "step": 1}) is True
    assert store.save(2, 1, {"w": w, "step": 1}) is False  # untouched
    assert store.saved[2] == [0]
    w[0] = 5.0  # in place: the next state differs
    assert store.save(2, 2, {"w": w, "step": 1}) is True
    assert store.newest_before(2, 2) == 0  # round 1 was skipped: round 0's file holds it
    assert store.save(2, 3, {"w": w, "step": 2}) is True  # a plain value changed
    # once a client has a file, an empty state replaces it (else a resume would restore
    # the older, non-empty one)
    assert store.save(2, 4, {}) is True and store.load(2, 4) == {}
    assert store.stats() == {"written": 4, "skipped": 2,
                             "by_round": {"0": 1, "2": 1, "3": 1, "4": 1}}
    # a restarted node's store knows no digests: it writes the next state, whatever it is
    again = ClientStateStore(tmp_path, "run1")
    assert again.save(2, 5, {}) is True


def test_the_fingerprint_tells_every_change_torch_counts():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def state():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "extra": (np.ones(2), None, "x")}

    def mark():
        return Fingerprint(state(), [p.grad for p in model.parameters()])

    first = mark()
    assert mark().same(first)  # nothing happened
    model(torch.ones(1, 3)).sum().backward()
    assert not mark().same(first)  # gradients appeared (a witness)
    after_grad = mark()
    opt.step()
    assert not mark().same(after_grad)  # the step changed weights and momentum
    stepped = mark()
    with torch.no_grad():
        model.weight[0, 0] = 0.5
    assert not mark().same(stepped)
    edited = mark()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert not mark().same(edited)  # a copy_ counts, even of the same values
    loaded = mark()
    opt.param_groups[0]["lr"] = 0.05
    assert not mark().same(loaded)  # a plain value
    model.bias = torch.nn.Parameter(torch.zeros(2))  # a new tensor, wherever it lands
    assert not Fingerprint({"b": model.bias}).same(Fingerprint({"b": torch.zeros(2)}))

    class Opaque:  # its repr would not show a change: counted as changed every time
        pass

    kept = Opaque()
    assert not Fingerprint({"o": kept}).same(Fingerprint({"o": kept}))


def test_the_fingerprint_tells_values_apart_by_type_and_exact_bits():
    def same(a, b):
        return Fingerprint(a).same(Fingerprint(b))

    assert same({"lr": 0.1, "n": 3, "s": "x", "t": (1, None)},
                {"lr": 0.1, "n": 3, "s": "x", "t": (1, None)})
    assert same({"best": float("nan")}, {"best": float("nan")})  # NaN: no write each task
    for a, b in [(1, 1.0), (1, True), (0.0, -0.0), (np.float32(0.0), np.float32(-0.0)),
                 (np.float32(1), np.float64(1)), (np.float64(1.0), 1.0), ([1], (1,)),
                 ({"a": [1, 2]}, {"a": [[1], 2]}), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
                 ([1, [2]], [[1], 2]), (torch.float32, torch.float64), ("1", b"1"),
                 (np.zeros(4, np.float32), np.zeros(2, np.float64)),
                 (np.zeros((2, 2)), np.zeros(4)), (1 + 2j, 1 - 2j)]:
        assert not same(a, b), (a, b)
    kept = np.zeros(3)
    before = Fingerprint({"proto": kept})
    kept[1] = 2.0  # numpy has no change counter: its bytes are read
    assert not Fingerprint({"proto": kept}).same(before)

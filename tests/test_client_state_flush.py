"""The node's client-state writer (fedbus.node.state_writer) and what it keeps on disk
(fedbus.node.client_state's rule): snapshots wait in memory until the server's flush, a
flush is answered once everything taken before it is written, a snapshot a flush still
needs is never replaced by a newer one, and the files kept are those a resume from the
server's checkpoint on disk can need. Orderings only: a threaded barrier is awaited as an
event (with a generous liveness guard), nothing is timed."""
from __future__ import annotations

import threading

import torch

from fedbus.node.client_state import ClientStateStore
from fedbus.node.state_writer import StateWriter

LIVENESS_S = 60.0  # a guard against a hang, never a verdict


def _rounds_on_disk(store: ClientStateStore, client: int) -> list[int]:
    return sorted(int(f.stem.rsplit("-r", 1)[1])
                  for f in store.path.glob(f"client-{client}-r*.pt"))


def test_snapshots_are_written_at_the_flush_not_before(tmp_path):
    store = ClientStateStore(tmp_path, "run1", durable=0)
    writer = StateWriter(store, threaded=False)
    answered = []
    writer.put(0, 0, {"w": torch.zeros(2)})
    writer.put(1, 0, {"w": torch.ones(2)})
    assert not list(store.path.glob("*.pt")) and writer.pending() == 2
    writer.barrier(1, 0, lambda: answered.append(1))
    assert answered == [1] and writer.pending() == 0
    assert store.stats()["by_round"] == {"0": 2}
    assert torch.equal(store.load(1, 0)["w"], torch.ones(2))
    writer.barrier(2, 1, lambda: answered.append(2))  # nothing new: answered at once
    assert answered == [1, 2] and store.stats()["written"] == 2


def test_a_snapshot_a_flush_needs_is_not_replaced_by_a_newer_one(tmp_path):
    store = ClientStateStore(tmp_path, "run1", durable=0)
    # the flush of round 1 is held back (FEDBUS_HOLD_STATE_WRITES=1): a snapshot of round
    # 1 taken after it arrived goes to the next epoch, beside round 0's, not over it
    writer = StateWriter(store, threaded=False, hold_from=1)
    answered = []
    writer.put(0, 0, {"step": 0})
    writer.put(0, 0, {"step": 10})  # the same task again (a server's redo): replaced
    writer.barrier(1, 0, lambda: answered.append(1))
    writer.put(0, 1, {"step": 1})
    assert writer.pending() == 2 and answered == [] and not list(store.path.glob("*.pt"))
    writer.close(drain=True)  # a completed run: all written, the held flush unanswered
    assert answered == [] and _rounds_on_disk(store, 0) == [0, 1]
    assert store.load(0, 0) == {"step": 10} and store.load(0, 1) == {"step": 1}


def test_async_writes_each_snapshot_without_waiting_for_a_flush(tmp_path):
    """No flush comes in async mode: a snapshot is written as soon as the writer can, the
    newest of a client replacing one not yet written (held here: a full first epoch)."""
    store = ClientStateStore(tmp_path, "run1", keep=2)
    writer = StateWriter(store, threaded=False, newest_wins=True)
    writer.put(4, 0, {"step": 0})
    assert _rounds_on_disk(store, 4) == [0] and writer.pending() == 0
    for r in (1, 2, 3):
        writer.put(4, r, {"step": r})
    assert _rounds_on_disk(store, 4) == [2, 3]  # the newest `keep`
    threaded = StateWriter(ClientStateStore(tmp_path, "run2"), newest_wins=True)
    with threaded._cond:  # the writer cannot take a job while this is held
        for r in range(3):
            threaded.put(5, r, {"step": r})
        assert threaded.pending() == 1
    threaded.close(drain=True)
    assert _rounds_on_disk(threaded.store, 5) == [2]


def test_a_stop_writes_nothing_more(tmp_path):
    store = ClientStateStore(tmp_path, "run1", durable=0)
    writer = StateWriter(store)  # threaded, as on a node
    writer.put(0, 0, {"step": 0})
    writer.close()
    assert not list(store.path.glob("*.pt"))


def test_the_writer_thread_answers_a_flush_once_its_states_are_on_disk(tmp_path):
    store = ClientStateStore(tmp_path, "run1", durable=0)
    writer = StateWriter(store)
    seen: list[list[int]] = []
    done = threading.Event()

    def flushed():  # what the node sends: by then every state before it is on disk
        seen.append(_rounds_on_disk(store, 0) + _rounds_on_disk(store, 1))
        done.set()

    writer.put(0, 0, {"w": torch.zeros(3)})
    writer.put(1, 0, {"w": torch.zeros(3)})
    writer.barrier(1, 0, flushed)
    assert done.wait(LIVENESS_S)
    assert seen == [[0, 0]]
    writer.close()


def test_a_held_flush_is_never_answered_and_its_states_never_written(tmp_path):
    store = ClientStateStore(tmp_path, "run1", durable=0)
    writer = StateWriter(store, hold_from=2)
    first, second = threading.Event(), threading.Event()
    writer.put(0, 0, {"step": 0})
    writer.barrier(1, 0, first.set)
    writer.put(0, 1, {"step": 1})
    writer.barrier(2, 1, second.set)
    assert first.wait(LIVENESS_S)
    writer.put(0, 2, {"step": 2})
    # the held epoch stays whole: round 1's snapshot and the barrier behind it wait
    assert writer.pending() == 2 and not second.is_set()
    writer.close()
    assert _rounds_on_disk(store, 0) == [0] and not second.is_set()


def test_the_files_kept_are_those_a_resume_from_the_checkpoint_on_disk_can_need(tmp_path):
    store = ClientStateStore(tmp_path, "run1", durable=0)
    for r in range(5):  # no checkpoint on disk yet: everything is kept
        store.write(7, r, {"step": r})
    assert _rounds_on_disk(store, 7) == [0, 1, 2, 3, 4]
    writer = StateWriter(store, threaded=False)
    writer.barrier(5, 3, lambda: None)  # checkpoint 3 on disk: round 2's state and newer
    assert _rounds_on_disk(store, 7) == [2, 3, 4] and store.newest_before(7, 3) == 2
    writer.barrier(6, 3, lambda: None)  # (an older or equal bound changes nothing)
    assert _rounds_on_disk(store, 7) == [2, 3, 4]
    # async (durable unknown): the newest `keep`
    other = ClientStateStore(tmp_path, "run2", keep=2)
    for r in range(4):
        other.write(1, r, {"step": r})
    assert _rounds_on_disk(other, 1) == [2, 3]


def test_a_snapshot_is_a_copy_the_next_task_cannot_change(tmp_path):
    from helpers import TINY

    from fedbus.node.config import build_config
    from fedbus.node.pool import ClientPool

    cfg = build_config({**TINY, "algorithm": {"name": "fedproto"}})
    handler = ClientPool(cfg, torch.device("cpu"), clients=[0]).get(0)
    store = ClientStateStore(tmp_path, "run1", durable=0)
    state = store.snapshot_client(0, 0, handler)
    before = {k: v.clone() for k, v in state["model"].items()}
    with torch.no_grad():
        for p in handler.ctx.model.parameters():
            p.add_(1.0)  # what the next task's steps do: in place
    assert all(torch.equal(before[k], state["model"][k]) for k in before)
    assert state["model"]._metadata == handler.ctx.model.state_dict()._metadata  # versions
    handler.load_state_dict(state)  # what a resume does with it once written
    assert all(torch.equal(before[k], v) for k, v in handler.ctx.model.state_dict().items())
    assert store.snapshot_client(0, 1, handler) is not None  # loading it is a change too
    assert store.snapshot_client(0, 2, handler) is None  # unchanged since: not taken

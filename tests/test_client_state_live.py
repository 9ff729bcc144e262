"""client_state.live_mark: a node skips building a client's state when the handler's live
model, optimizer and extra state are as they were at the client's newest file. Each change
the built state (and its gradients witness) would show must show in the live mark too:
real handlers, real training on digits, no clock."""
from __future__ import annotations

import numpy as np
import torch
from algo_support import client_ctx, digits_parts, freeze, server_ctx
from torch import nn

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import LocalRun, RoundInfo
from fedbus.node.client_state import ClientStateStore, Fingerprint, live_mark


def _client(name: str = "fedproto"):
    algo = get_algorithm(name)
    server = algo.server(server_ctx({}))
    handler = algo.client(client_ctx(0, digits_parts(4)[0], {}))
    task = freeze(server.make_task(0, RoundInfo(0, 3)))
    return handler, task


def _built(handler) -> Fingerprint:
    return Fingerprint(handler.state_dict(), [p.grad for p in handler.ctx.model.parameters()])


def _changes(handler, task):
    """Each step changes what a resume would restore (or the gradients witness)."""
    model, opt = handler.ctx.model, handler.optimizer
    first = next(model.parameters())

    def train():
        handler.ctx.train = {**handler.ctx.train, "optimizer_state": "persist"}
        handler.train(task, LocalRun(handler.ctx, epochs=1, seed=0))

    def edit():
        with torch.no_grad():
            first[0, 0] += 1.0

    def load():
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})

    def lr():
        opt.param_groups[0]["lr"] *= 0.5

    def forget_momentum():
        opt.state.clear()

    def drop_grads():
        opt.zero_grad(set_to_none=True)

    def swap_data():  # behind the version counter: a new storage
        first.data = first.data.clone()

    def new_parameter():
        module = next(m for m in model.modules() if m._parameters)
        pname = next(iter(module._parameters))
        setattr(module, pname, nn.Parameter(getattr(module, pname).detach().clone()))

    def new_buffer():
        model.register_buffer("seen", torch.zeros(2))

    def buffer_persists():
        model.register_buffer("scratch", torch.zeros(2), persistent=False)
        model._non_persistent_buffers_set.discard("scratch")

    def new_child():
        model.extra_head = nn.Linear(2, 2)

    return [train, edit, load, lr, forget_momentum, drop_grads, swap_data, new_parameter,
            new_buffer, buffer_persists, new_child]


def test_the_live_mark_changes_whenever_the_built_state_does():
    handler, task = _client()
    mark, built = live_mark(handler), _built(handler)
    assert mark is not None
    assert live_mark(handler).same(mark) and _built(handler).same(built)  # nothing happened
    for change in _changes(handler, task):
        change()
        assert not _built(handler).same(built), change.__name__  # (the step is a change)
        assert not live_mark(handler).same(mark), change.__name__
        mark, built = live_mark(handler), _built(handler)
        assert live_mark(handler).same(mark), change.__name__  # and then it is still


def test_the_live_mark_sees_extra_state():
    handler, _ = _client()

    class Kept(type(handler)):  # as FML keeps its meme model: in extra_state
        def extra_state(self):
            return {"protos": self.protos, "aux": self.aux.state_dict(),
                    "aux_optimizer": self.aux_optimizer.state_dict()}

    kept = Kept(handler.ctx)
    kept.protos = np.zeros((2, 3), np.float32)
    kept.aux = nn.Linear(3, 2)
    kept.aux_optimizer = torch.optim.SGD(kept.aux.parameters(), lr=0.1, momentum=0.9)
    mark = live_mark(kept)
    assert mark is not None and live_mark(kept).same(mark)
    kept.protos[1, 2] = 1.0  # numpy, in place: read by its bytes
    assert not live_mark(kept).same(mark)
    mark = live_mark(kept)
    kept.aux(torch.ones(1, 3)).sum().backward()
    kept.aux_optimizer.step()  # weights and a momentum buffer
    assert not live_mark(kept).same(mark)
    mark = live_mark(kept)
    kept.aux_optimizer.param_groups[0]["momentum"] = 0.5
    assert not live_mark(kept).same(mark)


def test_the_live_mark_gives_way_where_a_state_could_hold_more(tmp_path):
    handler, _ = _client()
    assert live_mark(handler) is not None

    class OwnState(type(handler)):
        def state_dict(self):
            return {"own": 1}

    assert live_mark(OwnState(handler.ctx)) is None

    handle = handler.optimizer.register_state_dict_post_hook(lambda opt, state: state)
    assert live_mark(handler) is None
    handle.remove()

    class Extra(nn.Module):
        def get_extra_state(self):
            return {"k": 1}

        def set_extra_state(self, state):
            pass

    handler.ctx.model.extra = Extra()
    assert live_mark(handler) is None
    del handler.ctx.model.extra
    handle = handler.ctx.model.register_state_dict_post_hook(lambda *a: None)
    assert live_mark(handler) is None
    # the store then fingerprints the built state: unchanged is still not written
    store = ClientStateStore(tmp_path, "run1")
    assert store.save_client(0, 0, handler) is True
    assert store.save_client(0, 1, handler) is False
    handle.remove()


def test_save_client_skips_only_what_the_newest_file_holds(tmp_path):
    handler, task = _client()
    store = ClientStateStore(tmp_path, "run1")
    assert store.save_client(0, 0, handler) is True
    assert store.save_client(0, 1, handler) is False  # live marks: nothing built
    handler.train(task, LocalRun(handler.ctx, epochs=1, seed=0))
    assert store.save_client(0, 2, handler) is True
    restored = store.load(0, 2)
    for k, v in handler.ctx.model.state_dict().items():
        assert torch.equal(restored["model"][k], v)
    assert store.save_client(0, 3, handler) is False
    # an older round written late is not the newest file: the next state is written
    with torch.no_grad():
        next(handler.ctx.model.parameters()).add_(1.0)
    assert store.save_client(0, 1, handler) is True and store.saved[0] == [1, 2]
    assert store.save_client(0, 4, handler) is True
    assert store.stats()["skipped"] == 2
    # a node restarted knows no marks: its first state is written, unchanged or not
    assert ClientStateStore(tmp_path, "run1").save_client(0, 5, handler) is True


def test_a_tensor_without_a_storage_counts_as_changed():
    sparse = torch.eye(3).to_sparse()  # no storage to mark: written every time
    assert not Fingerprint({"s": sparse}).same(Fingerprint({"s": sparse}))
    dense = torch.eye(3)
    assert Fingerprint({"d": dense}).same(Fingerprint({"d": dense}))


def test_a_state_of_many_plain_values_is_kept_as_a_digest():
    history = [float(i) for i in range(10_000)]  # e.g. a handler's per-step losses
    first = Fingerprint({"losses": history})
    assert len(first.values) == 1  # not 10,000 values kept per client
    assert Fingerprint({"losses": list(history)}).same(first)
    history[5_000] = -1.0
    assert not Fingerprint({"losses": history}).same(first)
    history[5_000] = 5_000.0
    assert Fingerprint({"losses": history}).same(first)
    assert not Fingerprint({"losses": history + [-0.0]}).same(Fingerprint({"losses": history + [0.0]}))

    class Opaque:
        pass

    kept = Opaque()  # its change cannot be told: never the same, even among many values
    assert not Fingerprint({"o": kept, "losses": history}).same(
        Fingerprint({"o": kept, "losses": history}))

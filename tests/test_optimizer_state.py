"""train.optimizer_state (issue 25, finding 1): what a client's optimizers hold when a local
run starts. "fresh" (default: FedProto's reference code, lib/update.py update_weights_het,
and HtFLlib build a new SGD for every local update; the papers are silent) empties every
optimizer the client built through ClientContext.make_optimizer (the handler's own, FML and
FedKD's auxiliary ones, FedRep's head one); "persist" carries the momentum buffers over from
the client's previous task. Real training of real handlers on scikit-learn's digits, two
tasks each; each optimizer's state is read through torch's step pre-hook at its first step of
a task, i.e. before that task has moved it."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from algo_support import TRAIN, client_ctx, digits_parts, freeze, make_model, server_ctx, update

from fedbus.algorithms import BUILTIN, available, get_algorithm
from fedbus.algorithms.core.handlers import LocalRun, RoundInfo

torch.set_num_threads(1)

# Every built-in algorithm whose clients train (noop sends a fixed array; central's clients
# only evaluate: its one model trains at the server), new ones included once their module is
# there
TRAINING = tuple(name for name in BUILTIN
                 if name in available() and name not in ("noop", "central"))


def build_arch(arch: str) -> torch.nn.Module:
    return make_model(0)  # FML's and FedKD's auxiliary model: the federation's one network


@pytest.fixture(scope="module")
def parts():
    return digits_parts(2, ways=5)


def contexts(parts, mode: str):
    """A server and two clients' contexts with train.optimizer_state = mode."""
    train = {**TRAIN, "optimizer_state": mode}
    server = dataclasses.replace(server_ctx({}, clients=2, rounds=2), train=train,
                                 archs=("net",), build_arch=build_arch)
    clients = [dataclasses.replace(client_ctx(i, p, {}), train=train, archs=("net",),
                                   build_arch=build_arch) for i, p in enumerate(parts)]
    return server, clients


def snapshot(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state (momentum buffers), copied, keyed by position."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: {k: v.clone() for k, v in optimizer.state[p].items()
                if isinstance(v, torch.Tensor)}
            for i, p in enumerate(params) if optimizer.state[p]}


class FirstStepStates:
    """Each of a client's optimizers' state at its first step of the current task (torch's
    step pre-hook runs before the step): what the task started it with."""

    def __init__(self, optimizers):
        self.at_first_step: dict[int, dict] = {}
        for index, optimizer in enumerate(optimizers):
            optimizer.register_step_pre_hook(self._hook(index))

    def _hook(self, index):
        def record(optimizer, args, kwargs):
            self.at_first_step.setdefault(index, snapshot(optimizer))
        return record

    def new_task(self) -> None:
        self.at_first_step = {}


def two_tasks(name, parts, mode):
    """Three rounds of a real two-client federation. Returns per client: its optimizers'
    states when its second task ended and at their first step of its third. (Not the first
    two: FedPCL's first task takes no step, its loss waiting for every client's prototypes.)"""
    algo = get_algorithm(name)
    sctx, cctxs = contexts(parts, mode)
    server = algo.server(sctx)
    handlers = [algo.client(c) for c in cctxs]
    probes = [FirstStepStates(h.ctx.optimizers) for h in handlers]
    ended, started = [], []
    for r in range(3):
        info = RoundInfo(r, 3)
        ups = []
        for i, (h, probe) in enumerate(zip(handlers, probes)):
            probe.new_task()
            payload = h.train(freeze(server.make_task(i, info)),
                              LocalRun(h.ctx, epochs=1, seed=100 * r + i))
            ups.append(update(i, payload, len(h.ctx.train_y), version=r))
            if r == 1:
                ended.append([snapshot(o) for o in h.ctx.optimizers])
            elif r == 2:
                started.append(dict(probe.at_first_step))
        server.aggregate(ups, [], info)
    return handlers, ended, started


@pytest.mark.parametrize("name", TRAINING)
def test_fresh_optimizers_start_every_task_without_momentum(name, parts):
    handlers, ended, started = two_tasks(name, parts, "fresh")
    for h, end, start in zip(handlers, ended, started):
        # the handler's own optimizer stepped, and the second task left momentum buffers behind
        assert h.ctx.optimizers.index(h.optimizer) in start
        assert any(end[i] for i in start)
        # ... which the third did not start with: every optimizer that stepped began empty
        assert all(state == {} for state in start.values()), name


@pytest.mark.parametrize("name", TRAINING)
def test_persisting_optimizers_start_a_task_where_the_last_one_left_them(name, parts):
    handlers, ended, started = two_tasks(name, parts, "persist")
    for h, end, start in zip(handlers, ended, started):
        assert h.ctx.optimizers.index(h.optimizer) in start
        for i, state in start.items():
            assert state.keys() == end[i].keys() and state, (name, i)
            for j in state:
                for k in state[j]:
                    assert torch.equal(state[j][k], end[i][j][k]), (name, i, j, k)


def test_fresh_is_a_new_optimizer_bit_for_bit(parts):
    """A FedAvg task under "fresh" gives what the reference code's new SGD per local update
    gives: the same client rebuilt (a new handler, so a new optimizer). Under "persist" the
    same task moves the model differently: task 1's momentum still pushes it."""
    algo = get_algorithm("fedavg")
    sctx, cctxs = contexts(parts, "fresh")
    server = algo.server(sctx)
    first, second = (freeze(server.make_task(0, RoundInfo(r, 2))) for r in range(2))
    deltas = {}
    for mode in ("fresh", "persist"):
        ctx = dataclasses.replace(cctxs[0], model=make_model(0),
                                  train={**TRAIN, "optimizer_state": mode})
        client = algo.client(ctx)
        client.train(first, LocalRun(ctx, epochs=1, seed=1))
        deltas[mode] = client.train(second, LocalRun(ctx, epochs=1, seed=2))["delta"]
    rebuilt = algo.client(dataclasses.replace(cctxs[0], model=make_model(0)))
    new = rebuilt.train(second, LocalRun(rebuilt.ctx, epochs=1, seed=2))["delta"]
    assert all((deltas["fresh"][k] == new[k]).all() for k in new)
    assert any((deltas["persist"][k] != new[k]).any() for k in new)


def test_config_default_and_values():
    from fedbus.node.config import ConfigError, build_config

    assert build_config({}).train["optimizer_state"] == "fresh"
    assert build_config({"train": {"optimizer_state": "persist"}}).train[
        "optimizer_state"] == "persist"
    with pytest.raises(ConfigError, match="optimizer_state"):
        build_config({"train": {"optimizer_state": "keep"}})

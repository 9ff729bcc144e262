"""train.lr_decay: one per-round learning-rate decay for every algorithm (issue 25, the
experiment that tests whether MP-FedCL's lead on Table VI is its decayed rate). A task of
round r trains at train.lr x lr_decay^r, never compounded over tasks, on top of an
algorithm's own schedule; 1 (the default) leaves every optimizer as it was."""
from __future__ import annotations

import pytest
import torch

from fedbus.algorithms.core.handlers import RoundInfo
from fedbus.broker.wire import decode_body, encode_body
from fedbus.node.client_host import ClientPool, run_task
from fedbus.node.config import build_config
from fedbus.node.engine import task_seed
from fedbus.node.server import build_handler


def _cfg(algorithm: str, train_decay: float, **params) -> object:
    return build_config({
        "federation": {"clients": 3, "seed": 2, "rounds": 6},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
        "model": {"arch": "mlp"}, "algorithm": {"name": algorithm, **params},
        # one by one: the rates are read at the optimizer's step, which a cohort does not
        # take (it reads the decayed rate from the optimizer and steps itself; the cohort's
        # decay is tests/test_cohort.py's)
        "train": {"lr": 0.1, "momentum": 0.5, "lr_decay": train_decay, "cohort": "off"}})


def _rates_at_first_step(cfg, versions: list[int]) -> list[list[float]]:
    """Client 0's optimizer rates at the first step of its task in each round."""
    pool, server = ClientPool(cfg, torch.device("cpu")), build_handler(cfg)
    handler = pool.get(0)
    seen: list[list[float]] = []
    first = [True]

    def record(optimizer, *_):
        if first[0]:
            seen.append([g["lr"] for g in optimizer.param_groups])
            first[0] = False
    for optimizer in handler.ctx.optimizers:
        optimizer.register_step_pre_hook(record)
    for v in versions:
        task = decode_body(encode_body(server.make_task(0, RoundInfo(v, 6))))
        first[0] = True
        run_task(handler, {"task": v + 1, "version": v, "epochs": 1,
                           "seed": task_seed(2, 0, v), "payload": task})
    assert len(seen) == len(versions)
    return seen


def test_each_round_trains_at_the_decayed_rate_without_compounding():
    rates = _rates_at_first_step(_cfg("fedavg", 0.9), [0, 1, 2, 5])
    assert [r[0] for r in rates] == pytest.approx([0.1, 0.1 * 0.9, 0.1 * 0.9 ** 2,
                                                   0.1 * 0.9 ** 5])


def test_it_scales_an_algorithms_own_schedule():
    """MP-FedCL sets train.lr x its lr_decay^r itself every task: train.lr_decay multiplies
    that, and with MP-FedCL's own decay off the two schedules are one."""
    both = _rates_at_first_step(_cfg("mpfedcl", 0.9, lr_decay=0.95), [1, 3])
    assert [r[0] for r in both] == pytest.approx([0.1 * 0.95 * 0.9, 0.1 * 0.95 ** 3 * 0.9 ** 3])
    ours = _rates_at_first_step(_cfg("mpfedcl", 0.95, lr_decay=1.0), [1, 3])
    own = _rates_at_first_step(_cfg("mpfedcl", 1.0, lr_decay=0.95), [1, 3])
    assert [r[0] for r in ours] == pytest.approx([r[0] for r in own])


def test_the_default_leaves_every_optimizer_as_it_was():
    cfg = _cfg("fedavg", 1.0)
    assert build_config({}).train.lr_decay == 1.0
    rates = _rates_at_first_step(cfg, [0, 3])
    assert [r[0] for r in rates] == [0.1, 0.1]
    handler = ClientPool(cfg, torch.device("cpu")).get(0)
    for optimizer in handler.ctx.optimizers:
        assert all("fedbus_lr" not in g for g in optimizer.param_groups)


def test_fedreps_head_epochs_run_at_this_rounds_rate():
    """FedRep's first steps are its head epochs (an optimizer of their own, a LocalRun of
    their own): they decay with the task's round, not the previous task's."""
    rates = _rates_at_first_step(_cfg("fedrep", 0.9, head_epochs=1), [0, 2, 3])
    assert [r[0] for r in rates] == pytest.approx([0.1, 0.1 * 0.9 ** 2, 0.1 * 0.9 ** 3])

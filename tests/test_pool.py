"""The node's client pool (fedbus.node.pool): shared data views, stored networks, packed
state, and residency under a memory budget. Real handlers, real training on digits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedbus.algorithms.core.handlers import ClientUpdate, Failure, RoundInfo, Work
from fedbus.broker.wire import decode_body, encode_body
from fedbus.node.client_host import ClientPool, node_threads, run_task
from fedbus.node.config import ConfigError, build_config
from fedbus.node.engine import task_seed
from fedbus.node.pool import NodeData, pack_state, unpack_state
from fedbus.node.server import build_handler
from fedbus.node.setup import federated_data

torch.set_num_threads(1)


def _cfg(algorithm: str = "fedproto", clients: int = 6, arch: str = "mlp", **launch) -> object:
    return build_config({
        "federation": {"clients": clients, "seed": 3},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
        "model": {"arch": arch},
        "algorithm": {"name": algorithm},
        "train": {"momentum": 0.9, "batch_size": 16},
        "launch": launch,
    })


def _federate(cfg, pool: ClientPool, rounds: int, order: list[int]) -> list[bytes]:
    """`rounds` rounds of every client in `order` through the real handlers; each
    update's payload encoded as it would travel."""
    server = build_handler(cfg)
    sent = []
    for version in range(rounds):
        updates = []
        for client in order:
            task = decode_body(encode_body(server.make_task(client, RoundInfo(version, rounds))))
            body = {"task": 1, "version": version, "epochs": 1,
                    "seed": task_seed(cfg.federation.seed, client, version), "payload": task}
            update, _ = run_task(pool.get(client), body)
            wire = encode_body(update["payload"])
            sent.append(wire)
            updates.append(ClientUpdate(client, decode_body(wire), update["num_samples"],
                                        Work.from_dict(update["work"]), version))
        server.aggregate(updates, [Failure(c, "late") for c in ()], RoundInfo(version, rounds))
    return sent


@pytest.mark.parametrize("evict_to", ["memory", "disk"])
def test_evicted_and_restored_clients_compute_bit_identical_updates(tmp_path, evict_to):
    # FedProto clients keep their own network and optimizer momentum between rounds: a
    # budget too small for two clients evicts every client after each task, so each round
    # restores every client from its packed state.
    cfg = _cfg()
    order = [4, 0, 5, 2, 1, 3]
    roomy = ClientPool(cfg, torch.device("cpu"))
    tight = ClientPool(cfg, torch.device("cpu"), memory_mb=0.01, evict_to=evict_to,
                       spool=tmp_path)
    a = _federate(cfg, roomy, 3, order)
    b = _federate(cfg, tight, 3, order)
    assert roomy.evictions == 0 and len(roomy.resident) == 6
    assert tight.evictions >= 17 and tight.restores >= 12 and len(tight.resident) == 1
    assert a == b
    assert len(set(a)) == len(a)  # the updates do differ by client and round
    if evict_to == "disk":
        assert sorted(p.name for p in tmp_path.iterdir()) == \
            sorted(f"client-{c}.pt" for c in order if c != order[-1])
    # 18 materialisations over two networks: the one evicted last and the newest's (a
    # client is measured, so materialised, before the budget can evict for it)
    assert tight.models.built == 2


def test_a_state_of_several_dtypes_is_evicted_to_disk_and_restored(tmp_path):
    """resnet8's BatchNorm counters (int64) sit beside float32 weights in one packed buffer:
    the spool file must hold each as its own tensor (torch.save refused the views)."""
    cfg = _cfg(arch="resnet8", clients=3)
    order = [2, 0, 1]
    roomy = ClientPool(cfg, torch.device("cpu"))
    tight = ClientPool(cfg, torch.device("cpu"), max_resident=1, evict_to="disk",
                       spool=tmp_path)
    assert {t.dtype for t in roomy.get(0).ctx.model.state_dict().values()} >= \
        {torch.float32, torch.int64}
    roomy = ClientPool(cfg, torch.device("cpu"))
    assert _federate(cfg, roomy, 2, order) == _federate(cfg, tight, 2, order)
    assert tight.evictions >= 4 and tight.restores >= 3


def test_the_budget_counts_what_a_client_holds_and_keeps_the_newest():
    cfg = _cfg()
    one = ClientPool(cfg, torch.device("cpu")).get(0)
    weights = sum(p.numel() * 4 for p in one.ctx.model.parameters())
    # three clients' weights + gradients fit; a fourth does not
    pool = ClientPool(cfg, torch.device("cpu"), memory_mb=3.5 * 2 * weights / 2**20)
    for c in range(3):
        pool.get(c)
    assert list(pool.resident) == [0, 1, 2] and pool.evictions == 0
    pool.get(3)
    assert list(pool.resident) == [1, 2, 3] and list(pool.evicted) == [0]
    pool.get(1)  # a hit: most recently used now
    pool.get(4)
    assert list(pool.resident) == [3, 1, 4]
    assert pool.stats()["resident"] == 3 and pool.stats()["evicted"] == 2
    # max_resident caps the count as well
    capped = ClientPool(cfg, torch.device("cpu"), max_resident=2)
    for c in range(4):
        capped.get(c)
    assert list(capped.resident) == [2, 3]


def test_a_reused_network_starts_from_the_initial_weights_with_nothing_frozen():
    cfg = _cfg(algorithm="fedrep")
    pool = ClientPool(cfg, torch.device("cpu"), max_resident=1)
    first = pool.get(0)
    initial = {k: v.clone() for k, v in first.ctx.model.state_dict().items()}
    with torch.no_grad():
        for p in first.ctx.model.parameters():
            p.add_(1.0)
            p.requires_grad_(False)
    pool.get(1)  # materialised over a second network, then 0 is evicted: its network freed
    second = pool.get(2)  # takes client 0's network
    assert second.ctx.model is first.ctx.model
    for k, v in second.ctx.model.state_dict().items():
        assert torch.equal(v, initial[k])
    assert all(p.requires_grad and p.grad is None for p in second.ctx.model.parameters())
    restored = pool.get(0)  # and client 0 gets its own (changed) weights back
    assert all(torch.equal(v, initial[k] + 1.0)
               for k, v in restored.ctx.model.state_dict().items() if v.is_floating_point())


def test_node_data_gives_each_client_views_of_one_block():
    cfg = _cfg(clients=8)
    data = federated_data(cfg)
    node = NodeData(data, [6, 1, 3], torch.device("cpu"))
    base = node.train_x.untyped_storage().data_ptr()
    for c in (1, 3, 6):
        train_x, train_y, test_x, test_y = node.split(c)
        mine = data.client(c)
        np.testing.assert_array_equal(train_x.numpy(), mine.train_x)
        np.testing.assert_array_equal(train_y.numpy(), mine.train_y)
        np.testing.assert_array_equal(test_x.numpy(), mine.test_x)
        np.testing.assert_array_equal(test_y.numpy(), mine.test_y)
        assert train_x.untyped_storage().data_ptr() == base  # a slice, not a copy
    assert node.train_x.shape[0] == sum(len(data.parts[c].train) for c in (1, 3, 6))
    with pytest.raises(IndexError, match="out of range"):
        NodeData(data, [8], torch.device("cpu"))
    with pytest.raises(KeyError, match="not hosted"):
        ClientPool(cfg, torch.device("cpu"), clients=[1]).get(2)


def test_packed_state_round_trips_nested_tensors_arrays_and_scalars():
    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                       "n": torch.tensor(7, dtype=torch.int64)},
             "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3, dtype=torch.float64)}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "extra": {"protos": np.eye(2, dtype=np.float32), "empty": torch.zeros(0, 4),
                       "pair": (torch.tensor([True, False]), 3)}}
    packed = pack_state(state)
    assert packed.nbytes == 6 * 4 + 8 + 3 * 8 + 2
    state["model"]["w"].add_(100)  # the pack is a copy
    state["extra"]["protos"][0, 0] = 9
    back = unpack_state(packed)
    assert torch.equal(back["model"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert back["model"]["n"].item() == 7 and back["model"]["n"].dtype == torch.int64
    assert back["optimizer"]["state"][0]["momentum_buffer"].dtype == torch.float64
    assert back["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert back["extra"]["protos"][0, 0] == 1.0 and back["extra"]["empty"].shape == (0, 4)
    assert back["extra"]["pair"][0].tolist() == [True, False] and back["extra"]["pair"][1] == 3


def test_threads_auto_shares_the_cores_among_the_nodes():
    import os

    cores = len(os.sched_getaffinity(0))
    assert node_threads(_cfg(nodes=1)) == cores
    assert node_threads(_cfg(nodes=10_000)) == 1
    assert node_threads(_cfg(threads=3)) == 3
    with pytest.raises(ConfigError, match="node_memory_mb"):
        _cfg(node_memory_mb=-1.0)

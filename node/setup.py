"""What the server and the client nodes both build from a config: the data
partition and each client's network. Kept in one place so the two sides can
never disagree about shapes, feature dims or initial weights."""
from __future__ import annotations

from fedbus.models import arch_for_client, build_model, feature_dim_for
from fedbus.node.config import Config, ConfigError
from fedbus.node.data import FederatedData

_DATA: dict[str, FederatedData] = {}


def federated_data(cfg: Config) -> FederatedData:
    """The partitioned dataset, loaded once per process (same seed, same split)."""
    key = repr((sorted(cfg.data.items()), cfg.federation.clients, cfg.federation.seed))
    if key not in _DATA:
        _DATA[key] = FederatedData(dict(cfg.data), cfg.federation.clients, cfg.federation.seed)
    return _DATA[key]


def make_model(cfg: Config, client: int, data: FederatedData | None = None):
    """Client `client`'s network with its seeded initial weights."""
    data = data or federated_data(cfg)
    arch = arch_for_client(cfg.model, client)
    return build_model(arch, in_shape=tuple(data.in_shape), num_classes=data.num_classes,
                       feature_dim=feature_dim_for(cfg.model),
                       pretrained=cfg.model.pretrained, seed=cfg.federation.seed)


def arch_builder(cfg: Config, data: FederatedData | None = None):
    """build(arch) -> a network of any registry arch for this federation's data and
    common feature dim, seeded with federation.seed: FML's and FedKD's shared model."""
    data = data or federated_data(cfg)

    def build(arch: str):
        return build_model(arch, in_shape=tuple(data.in_shape), num_classes=data.num_classes,
                           feature_dim=feature_dim_for(cfg.model), seed=cfg.federation.seed)
    return build


def distinct_archs(cfg: Config) -> tuple[str, ...]:
    """The federation's architectures, each once, in client order."""
    n = min(cfg.federation.clients, len(cfg.model.group) or 1)
    return tuple(dict.fromkeys(arch_for_client(cfg.model, i) for i in range(n)))


def archs(cfg: Config) -> list[str]:
    return [arch_for_client(cfg.model, i) for i in range(cfg.federation.clients)]


def check_models(cfg: Config, needs_same_model: bool, needs_same_head: bool = False) -> int:
    """The common feature dim of every client's network; a clear error when a
    weight-averaging algorithm is asked to mix architectures, or a head-sharing one
    (LG-FedAvg, FedGH) networks whose heads differ."""
    data = federated_data(cfg)
    names = sorted(set(archs(cfg)))
    if needs_same_model and len(names) > 1:
        raise ConfigError(f"algorithm.name = {cfg.algorithm.name!r} averages model weights, "
                          f"so every client needs one architecture; model.group gives "
                          f"{', '.join(names)}")
    models = {arch_for_client(cfg.model, i): make_model(cfg, i, data)
              for i in range(min(cfg.federation.clients, len(cfg.model.group) or 1))}
    dims = {arch: model.feature_dim for arch, model in models.items()}
    if len(set(dims.values())) > 1:
        raise ConfigError(f"model.group gives different feature dims {dims}; set "
                          "model.feature_dim so prototypes share one space")
    if needs_same_head and len(names) > 1:
        from fedbus.algorithms.core.split import head_names

        heads = {}
        for arch, model in models.items():  # the networks built for the dims above
            state = model.state_dict()
            heads[arch] = tuple((k.split(".", 1)[1], tuple(state[k].shape))
                                for k in head_names(model))
        if len(set(heads.values())) > 1:
            shapes = "; ".join(f"{a}: {', '.join(f'{k} {list(s)}' for k, s in h)}"
                               for a, h in heads.items())
            raise ConfigError(f"algorithm.name = {cfg.algorithm.name!r} shares the head, so "
                              f"every network of model.group needs one head shape; got {shapes}")
    return next(iter(dims.values()))


def pooled_train(data: FederatedData):
    """Every client's training split concatenated in client order, (x float32, y int64):
    the data of the `central` baseline. Simulation only (one process holds it all)."""
    import numpy as np

    parts = [data.client(i) for i in range(data.num_clients)]
    x = np.concatenate([p.train_x for p in parts]).astype(np.float32, copy=False)
    y = np.concatenate([p.train_y for p in parts]).astype(np.int64, copy=False)
    return x, y

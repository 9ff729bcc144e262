"""FederatedData: the [data] config table turned into per-client arrays.

    fd = FederatedData(cfg.data, num_clients=cfg.federation.clients, seed=cfg.federation.seed)
    d = fd.client(3)       # ClientData: train_x, train_y, test_x, test_y, num_classes, in_shape

Segmentation sets (shapes-seg, voc2012: a Dataset with ``masks``) are partitioned by their
per-image label (the dominant object class) and hand out the masks as labels: train_y/test_y
int64 [n, H, W], ignored pixels as -100 (torch's cross-entropy ignore_index). Their sample
count comes from the [data] key domain_samples (shapes-seg: images generated, 0 = 2000;
voc2012: at most this many images, 0 = all) and their side from image_size.

The dataset is loaded once and partitioned once per process (both cached), deterministically
from (the [data] table, num_clients, seed): every process that builds the same FederatedData
sees the same split.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .datasets import Dataset, load_dataset
from .partition import PARAMS, ClientSplit, make_partition, pool_test_splits
from .segmentation import CLIENT_IGNORE

#: the [data] table: every key and its default
DATA_DEFAULTS: dict[str, Any] = {
    "dataset": "digits",
    "data_dir": "",
    "partition": "nway-kshot",
    "test_fraction": 0.25,
    "test_distribution": "local",
    "ways": 3,
    "ways_std": 2.0,
    "shots": 100,
    "shots_std": 10.0,
    "alpha": 0.5,
    "min_samples": 10,
    "classes_per_client": 2,
    "powerlaw_sigma": 2.0,
    "synthetic_alpha": 0.5,
    "synthetic_beta": 0.5,
    "image_size": 0,
    "domain_samples": 0,
}


@dataclass
class ClientData:
    """One client's arrays (copies; safe to keep or modify).

    train_x/test_x: float32 [n, *in_shape]; train_y/test_y: int64 [n], or for a
    segmentation set the masks int64 [n, H, W] (ignored pixels -100);
    num_classes: classes of the whole dataset (the head's width); in_shape: one sample's shape.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    in_shape: tuple[int, ...]


def data_config(data_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """The [data] table with defaults filled in; unknown keys -> ValueError."""
    cfg = dict(data_cfg or {})
    unknown = sorted(set(cfg) - set(DATA_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown [data] key {unknown[0]!r}; keys are "
                         f"{', '.join(DATA_DEFAULTS)}")
    return {**DATA_DEFAULTS, **cfg}


def dataset_from_config(cfg: Mapping[str, Any], seed: int) -> Dataset:
    """load_dataset() for a filled-in [data] table."""
    name = str(cfg["dataset"])
    params: dict[str, Any] = {}
    base = name.strip().lower()
    if base == "synthetic":
        params = {"synthetic_alpha": float(cfg["synthetic_alpha"]),
                  "synthetic_beta": float(cfg["synthetic_beta"])}
    elif base in ("digit5", "office10"):
        params = {"image_size": int(cfg["image_size"]),
                  "domain_samples": int(cfg["domain_samples"])}
    elif base in ("shapes-seg", "voc2012"):
        params = {"image_size": int(cfg["image_size"]),
                  "num_images": int(cfg["domain_samples"])}
    elif base.split(":", 1)[0] == "digit5-offline":
        params = {"domain_samples": int(cfg["domain_samples"])}
    return load_dataset(name, data_dir=cfg["data_dir"] or None, seed=int(seed), **params)


def partition_from_config(ds: Dataset, cfg: Mapping[str, Any], num_clients: int,
                          seed: int) -> list[ClientSplit]:
    """make_partition() for a filled-in [data] table."""
    scheme = str(cfg["partition"]).strip()
    keys = PARAMS.get("file" if scheme.startswith("file:") else scheme, {})
    parts = make_partition(ds, scheme=scheme, num_clients=int(num_clients), seed=int(seed),
                           test_fraction=float(cfg["test_fraction"]),
                           **{k: cfg[k] for k in keys})
    where = str(cfg.get("test_distribution", "local"))
    if where == "global":
        return pool_test_splits(parts, int(seed))
    if where != "local":
        raise ValueError(f"data.test_distribution must be local or global, got {where!r}")
    return parts


_CACHE: dict[tuple, tuple[Dataset, list[ClientSplit]]] = {}
_LOCK = threading.Lock()


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


class FederatedData:
    """The federation's data: one dataset, one partition, per-client arrays.

    Built from the [data] config table (a mapping; missing keys take DATA_DEFAULTS), the
    client count (federation.clients) and the seed (federation.seed). Attributes:
    dataset (Dataset), parts (list[ClientSplit]), num_clients, num_classes, in_shape, config
    (the filled-in table).
    """

    def __init__(self, data_cfg: Mapping[str, Any], num_clients: int, seed: int):
        self.config = data_config(data_cfg)
        self.num_clients = int(num_clients)
        self.seed = int(seed)
        key = (tuple(sorted((k, _freeze(v)) for k, v in self.config.items())),
               self.num_clients, self.seed)
        with _LOCK:
            hit = _CACHE.get(key)
        if hit is None:
            ds = dataset_from_config(self.config, self.seed)
            parts = partition_from_config(ds, self.config, self.num_clients, self.seed)
            with _LOCK:
                hit = _CACHE.setdefault(key, (ds, parts))
        self.dataset, self.parts = hit
        self.num_classes = self.dataset.num_classes
        self.in_shape = self.dataset.in_shape

    @property
    def label_shape(self) -> tuple[int, ...]:
        """One sample's label shape: () for classification, (H, W) for segmentation."""
        m = self.dataset.masks
        return () if m is None else tuple(int(v) for v in m.shape[1:])

    @property
    def label_pixels(self) -> int:
        """Labelled units per sample: 1, or H * W pixels for segmentation (the bound on
        how many a client's per-class counts can add up to, per sample)."""
        return int(np.prod(self.label_shape, dtype=np.int64)) if self.label_shape else 1

    def labels(self, idx: np.ndarray) -> np.ndarray:
        """int64 labels of samples ``idx``: ``y`` [n], or the masks [n, H, W] of a
        segmentation set with the ignore index (meta["ignore_index"]) turned into -100."""
        ds = self.dataset
        if ds.masks is None:
            return ds.y[idx]
        m = ds.masks[idx]
        ignore = int(ds.meta.get("ignore_index", 255))
        return np.where(m == ignore, CLIENT_IGNORE, m.astype(np.int64))

    def client(self, i: int) -> ClientData:
        """Client ``i``'s arrays (0 <= i < num_clients)."""
        if not 0 <= i < self.num_clients:
            raise IndexError(f"client {i} out of range 0..{self.num_clients - 1}")
        p, ds = self.parts[i], self.dataset
        return ClientData(ds.x[p.train], self.labels(p.train), ds.x[p.test],
                          self.labels(p.test), self.num_classes, self.in_shape)

    def class_counts(self, split: str = "train") -> np.ndarray:
        """int64 [num_clients, num_classes]: samples per class of each client's train (or
        "test") set (segmentation: images per dominant class)."""
        if split not in ("train", "test"):
            raise ValueError("split must be 'train' or 'test'")
        y = self.dataset.y
        return np.stack([np.bincount(y[getattr(p, split)], minlength=self.num_classes)
                         for p in self.parts]).astype(np.int64)

    def __repr__(self) -> str:
        return (f"FederatedData({self.dataset.name!r}, partition={self.config['partition']!r}, "
                f"clients={self.num_clients}, seed={self.seed}, classes={self.num_classes}, "
                f"in_shape={self.in_shape})")


def clear_cache() -> None:
    """Forget cached datasets and partitions (tests; long-lived processes)."""
    from .datasets import clear_cache as clear_datasets

    with _LOCK:
        _CACHE.clear()
    clear_datasets()

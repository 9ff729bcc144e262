"""fedbus.node.data: datasets, partitions and each client's arrays.

    from fedbus.node.data import FederatedData
    fd = FederatedData({"dataset": "digits", "partition": "dirichlet", "alpha": 0.1},
                       num_clients=10, seed=0)
    d = fd.client(0)           # d.train_x float32 [n, 1, 8, 8], d.train_y int64 [n], ...

The lower layers: load_dataset (datasets.py), make_partition / save_partition /
load_partition (partition.py), the generators (synthetic.py, mnist1d.py), the segmentation
sets shapes-seg and voc2012 (segmentation.py: masks as labels, d.train_y int64 [n, H, W]).
See docs/DATA.md.
This package imports nothing else of fedbus.
"""
from .datasets import DATASETS, Dataset, DatasetUnavailable, load_dataset
from .federated import (
    DATA_DEFAULTS,
    ClientData,
    FederatedData,
    clear_cache,
    data_config,
    dataset_from_config,
    partition_from_config,
)
from .partition import (
    SCHEMES,
    ClientSplit,
    PartitionError,
    load_partition,
    make_partition,
    pool_test_splits,
    save_partition,
)

__all__ = [
    "DATASETS", "DATA_DEFAULTS", "SCHEMES", "ClientData", "ClientSplit", "Dataset",
    "DatasetUnavailable", "FederatedData", "PartitionError", "clear_cache", "data_config",
    "dataset_from_config", "load_dataset", "load_partition", "make_partition",
    "partition_from_config", "pool_test_splits", "save_partition",
]

"""Partitioners (disjointness, sizes, the requested class statistics, seeding), partition
files (round trip, validation) and the `fedbus partition` command."""
from __future__ import annotations

import argparse
import io
import json
import math
import warnings

import numpy as np
import pytest
import torch
from helpers import MNIST_NPZ, needs_mnist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedbus.node.data import (
    ClientSplit,
    FederatedData,
    PartitionError,
    load_dataset,
    load_partition,
    make_partition,
    save_partition,
)

torch.set_num_threads(1)



@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def mnist1d():
    return load_dataset("mnist1d", seed=0)


def check_disjoint(parts: list[ClientSplit], n: int, *, nonempty_test: bool = True) -> None:
    seen = []
    for i, p in enumerate(parts):
        assert p.train.dtype == np.int64 and p.test.dtype == np.int64
        assert len(p.train) > 0, f"client {i} has no train samples"
        if nonempty_test:
            assert len(p.test) > 0, f"client {i} has no test samples"
        assert len(np.intersect1d(p.train, p.test)) == 0
        seen += [p.train, p.test]
    allidx = np.concatenate(seen)
    assert allidx.min() >= 0 and allidx.max() < n
    assert len(np.unique(allidx)) == len(allidx), "an index is given to two clients"


def same(a: list[ClientSplit], b: list[ClientSplit]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x.train, y.train) and
                                    np.array_equal(x.test, y.test) for x, y in zip(a, b))


SCHEMES = [("iid", {}), ("dirichlet", {"alpha": 0.3}), ("pathological", {}),
           ("powerlaw", {}), ("nway-kshot", {"shots": 10, "shots_std": 2.0})]


@pytest.mark.parametrize("scheme,params", SCHEMES, ids=[s for s, _ in SCHEMES])
def test_disjoint_seeded_and_split(digits, scheme, params):
    a = make_partition(digits, scheme=scheme, num_clients=12, seed=5, **params)
    b = make_partition(digits, scheme=scheme, num_clients=12, seed=5, **params)
    c = make_partition(digits, scheme=scheme, num_clients=12, seed=6, **params)
    assert len(a) == 12
    check_disjoint(a, len(digits))
    assert same(a, b) and not same(a, c)
    if scheme != "nway-kshot":
        # everything is handed out, each client cut 75/25 as PFLlib
        assert sum(len(p.train) + len(p.test) for p in a) == len(digits)
        for p in a:
            n = len(p.train) + len(p.test)
            assert len(p.test) == min(math.ceil(0.25 * n), n - 1)


def test_test_fraction_parameter(digits):
    parts = make_partition(digits, scheme="iid", num_clients=4, seed=0, test_fraction=0.1)
    for p in parts:
        n = len(p.train) + len(p.test)
        assert len(p.test) == math.ceil(0.1 * n)
    parts = make_partition(digits, scheme="iid", num_clients=4, seed=0, test_fraction=0.0)
    assert all(len(p.test) == 0 for p in parts)
    with pytest.raises(ValueError, match="test_fraction"):
        make_partition(digits, scheme="iid", num_clients=4, seed=0, test_fraction=1.0)


def test_unknown_scheme_and_params(digits):
    with pytest.raises(ValueError) as e:
        make_partition(digits, scheme="shards", num_clients=3, seed=0)
    for name in ["nway-kshot", "dirichlet", "pathological", "powerlaw", "iid", "file:PATH"]:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="alpha"):
        make_partition(digits, scheme="iid", num_clients=3, seed=0, alpha=0.1)


# ------------------------------------------------------------------------------ nway-kshot
def test_nway_kshot_statistics(mnist1d):
    ds = mnist1d
    parts = make_partition(ds, scheme="nway-kshot", num_clients=100, seed=1, ways=3,
                           ways_std=1.0, shots=8, shots_std=2.0)
    check_disjoint(parts, len(ds))
    test_pool = np.concatenate([p.test for p in parts])
    train_all = np.concatenate([p.train for p in parts])
    assert len(np.intersect1d(test_pool, train_all)) == 0
    ways, shots = [], []
    for p in parts:
        m = p.meta
        assert m["shortfall"] == {}
        counts = np.bincount(ds.y[p.train], minlength=10)
        held = np.flatnonzero(counts)
        assert held.tolist() == m["classes"] and len(held) == m["ways"]
        assert set(counts[held].tolist()) == {m["shots"]}           # k_i of every class
        assert set(ds.y[p.test].tolist()) <= set(held.tolist())    # test from own classes
        tc = np.bincount(ds.y[p.test], minlength=10)
        assert np.all(np.abs(tc[held] - np.round(m["shots"] / 3)) <= 1)  # 75/25 per class
        ways.append(m["ways"])
        shots.append(m["shots"])
    ways, shots = np.array(ways), np.array(shots)
    assert 1 <= ways.min() and ways.max() <= 10
    assert abs(ways.mean() - 3) < 0.3 and abs(ways.std() - 1) < 0.3
    assert abs(shots.mean() - 8) < 0.6 and abs(shots.std() - 2) < 0.5


def test_nway_kshot_class_spread(mnist1d):
    # with a small ways_std, almost every client holds exactly `ways` classes
    parts = make_partition(mnist1d, scheme="nway-kshot", num_clients=40, seed=2, ways=2,
                           ways_std=0.1, shots=10, shots_std=0.0)
    assert all(p.meta["ways"] == 2 and len(np.unique(mnist1d.y[p.train])) == 2 for p in parts)
    assert all(len(p.train) == 20 for p in parts)


@needs_mnist
def test_nway_kshot_on_real_mnist():
    ds = load_dataset(f"npz:{MNIST_NPZ}")
    # FedProto's MNIST setting (20 clients, n = 3 +- 2, k = 100 +- 10) on 7,500 train samples
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts = make_partition(ds, scheme="nway-kshot", num_clients=20, seed=0, ways=3,
                               ways_std=2.0, shots=100, shots_std=10.0)
    short = sum(bool(p.meta["shortfall"]) for p in parts)
    assert (short > 0) == any("ran out" in str(w.message) for w in caught)
    assert short <= 5
    check_disjoint(parts, len(ds))
    for p in parts:
        counts = np.bincount(ds.y[p.train], minlength=10)
        if not p.meta["shortfall"]:
            assert set(counts[counts > 0].tolist()) == {p.meta["shots"]}
        assert set(np.unique(ds.y[p.test])) <= set(np.flatnonzero(counts))


def test_nway_kshot_pool_exhaustion_is_recorded(digits):
    with pytest.warns(UserWarning, match="ran out"):
        parts = make_partition(digits, scheme="nway-kshot", num_clients=10, seed=0)
    check_disjoint(parts, len(digits), nonempty_test=False)
    short = [p for p in parts if p.meta["shortfall"]]
    assert short
    for p in short:
        got = np.bincount(digits.y[p.train], minlength=10)
        for c, missing in p.meta["shortfall"].items():
            if c != "classes":
                assert got[c] == p.meta["shots"] - missing
    with pytest.raises(ValueError, match="ran out"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_partition(digits, scheme="nway-kshot", num_clients=60, seed=0, shots=100)


# ------------------------------------------------------------------------------- dirichlet
def test_dirichlet_skew_and_min_samples(mnist1d):
    ds = mnist1d
    glob = np.bincount(ds.y, minlength=10) / len(ds)

    def props(alpha):
        parts = make_partition(ds, scheme="dirichlet", num_clients=10, seed=0, alpha=alpha,
                               min_samples=10)
        check_disjoint(parts, len(ds))
        sizes = [len(p.train) + len(p.test) for p in parts]
        assert min(sizes) >= 10
        return np.stack([np.bincount(ds.y[np.concatenate([p.train, p.test])], minlength=10) /
                         (len(p.train) + len(p.test)) for p in parts])

    skewed, flat = props(0.05), props(1000.0)
    assert np.abs(flat - glob).max() < 0.06          # large alpha ~ IID
    assert np.abs(skewed - glob).max() > 0.3          # small alpha: strong label skew
    # clients of the skewed split hold fewer classes (>= 2% of their data)
    assert (skewed > 0.02).sum(1).mean() < (flat > 0.02).sum(1).mean() - 3


def test_dirichlet_min_samples_impossible(digits):
    with pytest.raises(ValueError, match="exceeds"):
        make_partition(digits, scheme="dirichlet", num_clients=100, seed=0, min_samples=20)
    with pytest.raises(ValueError, match="tries"):
        make_partition(digits, scheme="dirichlet", num_clients=50, seed=0, alpha=0.001,
                       min_samples=35)


# ---------------------------------------------------------------------------- pathological
@pytest.mark.parametrize("c", [1, 2, 3])
def test_pathological_exactly_c_classes(digits, c):
    parts = make_partition(digits, scheme="pathological", num_clients=20, seed=3,
                           classes_per_client=c)
    check_disjoint(parts, len(digits))
    holders = np.zeros(10, dtype=int)
    for p in parts:
        classes = np.unique(digits.y[np.concatenate([p.train, p.test])])
        assert len(classes) == c
        holders[classes] += 1
        assert set(np.unique(digits.y[p.test])) <= set(classes)
    assert holders.sum() == 20 * c and holders.max() - holders.min() <= 1   # balanced use
    # each class is cut into near-equal shards among its holders
    for k in range(10):
        shard = [np.sum(digits.y[np.concatenate([p.train, p.test])] == k) for p in parts]
        shard = [s for s in shard if s]
        assert max(shard) - min(shard) <= 1
    with pytest.raises(ValueError, match="classes_per_client"):
        make_partition(digits, scheme="pathological", num_clients=5, seed=0,
                       classes_per_client=11)


def test_pathological_powerlaw_sizes(digits):
    """FedProx's MNIST split (Michieli & Ozay S1.2): 2 classes a client, power-law sizes."""
    parts = make_partition(digits, scheme="pathological-powerlaw", num_clients=40, seed=1,
                           classes_per_client=2, powerlaw_sigma=2.0, min_samples=10)
    check_disjoint(parts, len(digits))
    sizes = np.array([len(p.train) + len(p.test) for p in parts])
    assert sizes.sum() == len(digits) and sizes.min() >= 10
    assert sizes.max() > 5 * np.median(sizes)                 # heavy tail
    held = [np.unique(digits.y[np.concatenate([p.train, p.test])]) for p in parts]
    assert all(len(c) == 2 for c in held)
    # the same holders as pathological's (its draws come first), only the shares differ
    equal = make_partition(digits, scheme="pathological", num_clients=40, seed=1)
    assert [list(c) for c in held] == [
        list(np.unique(digits.y[np.concatenate([p.train, p.test])])) for p in equal]
    # seeded: the same call gives the same split
    again = make_partition(digits, scheme="pathological-powerlaw", num_clients=40, seed=1)
    assert all(np.array_equal(a.train, b.train) for a, b in zip(parts, again))
    # sigma 0: every holder's weight is 1, i.e. pathological's near-equal shards
    flat = make_partition(digits, scheme="pathological-powerlaw", num_clients=40, seed=1,
                          powerlaw_sigma=0.0)
    for k in range(10):
        shard = [np.sum(digits.y[np.concatenate([p.train, p.test])] == k) for p in flat]
        shard = [s for s in shard if s]
        assert max(shard) - min(shard) <= 1


def test_global_test_distribution_pools_the_test_splits():
    """data.test_distribution = "global": the same training splits, the test samples pooled
    and dealt back; under label skew each client is then tested on (nearly) every class."""
    cfg = {"dataset": "digits", "partition": "dirichlet", "alpha": 0.1, "test_fraction": 0.3}
    local = FederatedData(cfg, 8, seed=4)
    pooled = FederatedData({**cfg, "test_distribution": "global"}, 8, seed=4)
    check_disjoint(pooled.parts, len(pooled.dataset))
    for a, b in zip(local.parts, pooled.parts):
        np.testing.assert_array_equal(a.train, b.train)          # training is untouched
        assert len(a.test) == len(b.test)                        # so is every test size
    assert sorted(np.concatenate([p.test for p in local.parts]).tolist()) == sorted(
        np.concatenate([p.test for p in pooled.parts]).tolist())
    y = local.dataset.y
    own = [len(np.unique(y[p.test])) for p in local.parts]
    dealt = [len(np.unique(y[p.test])) for p in pooled.parts]
    assert np.mean(dealt) > np.mean(own) + 2, (own, dealt)
    # a client's test classes no longer follow its training classes
    outside = [np.mean(~np.isin(y[p.test], y[p.train])) for p in pooled.parts]
    assert np.mean(outside) > 0.3
    again = FederatedData({**cfg, "test_distribution": "global"}, 8, seed=4)
    assert all(np.array_equal(a.test, b.test) for a, b in zip(pooled.parts, again.parts))
    with pytest.raises(ValueError, match="test_distribution"):
        FederatedData({**cfg, "test_distribution": "mine"}, 8, seed=4)


# -------------------------------------------------------------------------- powerlaw / iid
def test_powerlaw_sizes(digits):
    parts = make_partition(digits, scheme="powerlaw", num_clients=40, seed=0,
                           powerlaw_sigma=2.0, min_samples=10)
    sizes = np.array([len(p.train) + len(p.test) for p in parts])
    assert sizes.sum() == len(digits) and sizes.min() >= 10
    assert sizes.max() > 5 * np.median(sizes)                 # heavy tail
    flat = make_partition(digits, scheme="powerlaw", num_clients=40, seed=0, powerlaw_sigma=0.0)
    fs = np.array([len(p.train) + len(p.test) for p in flat])
    assert fs.max() - fs.min() <= 1


def test_iid_balanced(mnist1d):
    parts = make_partition(mnist1d, scheme="iid", num_clients=8, seed=0)
    sizes = [len(p.train) + len(p.test) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    for p in parts:
        frac = np.bincount(mnist1d.y[p.train], minlength=10) / len(p.train)
        assert np.abs(frac - 0.1).max() < 0.05


def test_natural_partition():
    ds = load_dataset("synthetic", seed=0)
    parts = make_partition(ds, scheme="natural", num_clients=30, seed=0)
    check_disjoint(parts, len(ds))
    for p, g in zip(parts, ds.groups):
        assert np.array_equal(np.sort(np.concatenate([p.train, p.test])), g)
    assert len(make_partition(ds, scheme="natural", num_clients=7, seed=0)) == 7
    with pytest.raises(ValueError, match="at most 30"):
        make_partition(ds, scheme="natural", num_clients=31, seed=0)
    with pytest.raises(ValueError, match="natural groups"):
        make_partition(load_dataset("digits"), scheme="natural", num_clients=3, seed=0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scheme=st.sampled_from(["iid", "dirichlet", "pathological", "powerlaw"]),
       clients=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       tf=st.sampled_from([0.0, 0.2, 0.25, 0.5]))
def test_property_disjoint_cover(digits, scheme, clients, seed, tf):
    params = {"min_samples": 5} if scheme in ("dirichlet", "powerlaw") else {}
    parts = make_partition(digits, scheme=scheme, num_clients=clients, seed=seed,
                           test_fraction=tf, **params)
    assert len(parts) == clients
    check_disjoint(parts, len(digits), nonempty_test=False)
    if scheme != "pathological" or clients * 2 >= 10:
        assert sum(len(p.train) + len(p.test) for p in parts) == len(digits)


# ------------------------------------------------------------------------------------ files
def test_partition_file_round_trip(digits, tmp_path):
    parts = make_partition(digits, scheme="dirichlet", num_clients=6, seed=4)
    path = tmp_path / "sub" / "split.json"
    save_partition(parts, path, meta={"dataset": "digits"})
    doc = json.loads(path.read_text())
    assert doc["num_clients"] == 6 and len(doc["clients"]) == 6
    assert set(doc["clients"][0]) == {"train", "test"}
    assert doc["clients"][3]["train"] == parts[3].train.tolist()
    back = load_partition(path, dataset_size=len(digits))
    assert same(parts, back)
    via_scheme = make_partition(digits, scheme=f"file:{path}", num_clients=6, seed=999)
    assert same(parts, via_scheme)
    with pytest.raises(PartitionError, match="6 clients"):
        make_partition(digits, scheme=f"file:{path}", num_clients=5, seed=0)
    # a file written by another framework (no num_clients, no meta) reads too
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"clients": [{"train": [0, 1, 2], "test": [3]},
                                             {"train": [4], "test": []}]}))
    got = load_partition(other)
    assert got[0].train.tolist() == [0, 1, 2] and got[1].test.tolist() == []


@pytest.mark.parametrize("doc,match", [
    ("not json", "not valid JSON"),
    ([1, 2], "expected an object"),
    ({"clients": []}, "no clients"),
    ({"num_clients": 3, "clients": [{"train": [1], "test": [2]}]}, "num_clients = 3"),
    ({"clients": [{"train": [1]}]}, "'train' and 'test'"),
    ({"clients": [{"train": [1.0], "test": []}]}, "integers"),
    ({"clients": [{"train": [True], "test": []}]}, "integers"),
    ({"clients": [{"train": ["3"], "test": []}]}, "integers"),
    ({"clients": [{"train": [-1], "test": []}]}, ">= 0"),
    ({"clients": [{"train": 5, "test": []}]}, "list of integer"),
    ({"clients": [{"train": [1, 1], "test": []}]}, "twice"),
    ({"clients": [{"train": [1, 2], "test": [2]}]}, "both train and test"),
    ({"clients": [{"train": [1, 2000], "test": []}]}, "out of range"),
])
def test_partition_file_validation(tmp_path, doc, match):
    path = tmp_path / "bad.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(PartitionError, match=match):
        load_partition(path, dataset_size=1797)
    with pytest.raises(PartitionError, match="not found"):
        load_partition(tmp_path / "missing.json")


# -------------------------------------------------------------------------- the command
def test_run_partition_out_and_show(tmp_path):
    from fedbus.launch.partition_cmd import run_partition

    cfg = {"dataset": "digits", "partition": "pathological", "classes_per_client": 2}
    out = tmp_path / "p.json"
    buf = io.StringIO()
    assert run_partition(cfg, 5, 1, out=str(out), stream=buf) == 0
    fd = FederatedData(cfg, 5, 1)
    assert same(load_partition(out, dataset_size=1797), fd.parts)
    buf = io.StringIO()
    png = tmp_path / "h.png"
    assert run_partition(cfg, 5, 1, show=True, png=str(png), stream=buf) == 0
    text = buf.getvalue()
    rows = [ln for ln in text.splitlines() if ln.strip().split("|")[0].strip().isdigit()]
    assert len(rows) == 5
    counts = fd.class_counts()
    for i, row in enumerate(rows):
        cells = row.split("|")[1].split()
        assert [0 if c == "." else int(c) for c in cells] == counts[i].tolist()
        assert row.split()[-1] == "2"  # classes held
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "heat-map skipped" in text
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "heat-map" in text


def test_partition_command_main(tmp_path, capsys):
    try:
        from fedbus.node.config import load_config  # noqa: F401
    except ImportError as err:
        pytest.skip(f"fedbus.node.config not importable yet ({err}); run_partition is "
                    f"tested above")
    from fedbus.launch import partition_cmd

    cfg = tmp_path / "c.toml"
    cfg.write_text('[federation]\nclients = 4\nseed = 7\n\n[data]\ndataset = "digits"\n'
                   'partition = "dirichlet"\nalpha = 0.5\n')
    parser = argparse.ArgumentParser()
    partition_cmd.add_arguments(parser)
    out = tmp_path / "p.json"
    args = parser.parse_args([str(cfg), "--set", "data.alpha=0.2", "--out", str(out)])
    assert partition_cmd.main(args) == 0
    expect = make_partition(load_dataset("digits"), scheme="dirichlet", num_clients=4, seed=7,
                            alpha=0.2, min_samples=10)
    assert same(load_partition(out), expect)
    args = parser.parse_args([str(cfg), "--show", "--png", str(tmp_path / "x.png")])
    assert partition_cmd.main(args) == 0
    assert "partition dirichlet, 4 clients, seed 7" in capsys.readouterr().out
    args = parser.parse_args([str(cfg), "--set", "data.partition=natural", "--show"])
    assert partition_cmd.main(args) == 1
    assert "natural groups" in capsys.readouterr().err
    args = parser.parse_args([str(cfg), "--set", "data.shotz=3", "--show"])
    assert partition_cmd.main(args) == 2
    with pytest.raises(SystemExit):
        parser.parse_args([str(cfg), "--show", "--out", "x.json"])
    with pytest.raises(SystemExit):
        parser.parse_args([str(cfg)])

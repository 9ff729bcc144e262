"""fedbus.node.data datasets: digits, npz (the real MNIST subset), the torchvision path
(missing / offline / served by a stand-in), FedProx synthetic statistics, MNIST-1D,
and FederatedData."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from helpers import MNIST_NPZ, needs_mnist

from fedbus.node.data import (
    DATA_DEFAULTS,
    ClientData,
    Dataset,
    DatasetUnavailable,
    FederatedData,
    clear_cache,
    load_dataset,
    save_partition,
)
from fedbus.node.data.mnist1d import make_mnist1d, templates
from fedbus.node.data.synthetic import generate_synthetic, softmax

torch.set_num_threads(1)

TV_NAMES = ["mnist", "fmnist", "emnist", "femnist", "cifar10", "cifar100"]


# --------------------------------------------------------------------------------- digits
def test_digits_normalised_and_model_ready():
    from sklearn.datasets import load_digits

    ds = load_dataset("digits")
    assert isinstance(ds, Dataset) and ds.name == "digits"
    assert ds.x.shape == (1797, 1, 8, 8) and ds.x.dtype == np.float32
    assert ds.y.dtype == np.int64 and ds.num_classes == 10 and ds.in_shape == (1, 8, 8)
    assert abs(float(ds.x.mean())) < 1e-5 and abs(float(ds.x.std()) - 1) < 1e-4
    assert np.bincount(ds.y).min() > 170 and ds.groups is None
    raw = load_digits().data.reshape(-1, 1, 8, 8) / 16.0
    m, s = ds.meta["mean"][0], ds.meta["std"][0]
    np.testing.assert_allclose(ds.x, (raw - m) / s, atol=1e-5)
    assert load_dataset("digits") is ds  # cached per process


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError) as e:
        load_dataset("imagenet")
    for name in ["digits", "npz:PATH", "mnist", "cifar100", "synthetic", "mnist1d"]:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="takes no parameter"):
        load_dataset("digits", synthetic_alpha=1.0)


# ------------------------------------------------------------------------------------ npz
@needs_mnist
def test_real_mnist_npz():
    ds = load_dataset(f"npz:{MNIST_NPZ}")
    with np.load(MNIST_NPZ) as z:
        raw_x, raw_y = z["x"], z["y"]
    assert ds.x.shape == (10000, 1, 28, 28) and ds.x.dtype == np.float32
    assert ds.num_classes == 10 and np.array_equal(ds.y, raw_y.astype(np.int64))
    assert abs(float(ds.x.mean())) < 1e-4 and abs(float(ds.x.std()) - 1) < 1e-3
    mean, std = ds.meta["mean"][0], ds.meta["std"][0]
    assert 0.10 < mean < 0.16 and 0.28 < std < 0.34  # MNIST's 0.1307 / 0.3081
    np.testing.assert_allclose(ds.x[0, 0], (raw_x[0] / 255.0 - mean) / std, atol=1e-5)


def test_npz_layouts(tmp_path):
    rng = np.random.default_rng(0)
    nhwc = rng.integers(0, 256, (50, 6, 6, 3), dtype=np.uint8)
    np.savez(tmp_path / "nhwc.npz", x=nhwc, y=np.arange(50) % 4)
    ds = load_dataset(f"npz:{tmp_path / 'nhwc.npz'}")
    assert ds.x.shape == (50, 3, 6, 6) and ds.num_classes == 4
    # per-channel standardisation
    np.testing.assert_allclose(ds.x.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(ds.x.std(axis=(0, 2, 3)), 1, atol=1e-4)
    ch1 = nhwc[..., 1] / 255.0
    np.testing.assert_allclose(ds.x[:, 1], (ch1 - ch1.mean()) / ch1.std(), atol=1e-5)

    tab = rng.normal(5, [1, 10, 100], (80, 3))
    np.savez(tmp_path / "tab.npz", x=tab, y=(np.arange(80) % 3).astype(np.uint8),
             groups=np.arange(80) // 20)
    ds = load_dataset(f"npz:{tmp_path / 'tab.npz'}")
    assert ds.x.shape == (80, 3) and ds.in_shape == (3,)
    np.testing.assert_allclose(ds.x.std(0), 1, atol=1e-4)
    assert [g.tolist() for g in ds.groups] == [list(range(i, i + 20)) for i in range(0, 80, 20)]

    # a relative path is found under data_dir too
    ds2 = load_dataset("npz:tab.npz", data_dir=str(tmp_path))
    np.testing.assert_array_equal(ds2.x, ds.x)


def test_npz_errors(tmp_path):
    np.savez(tmp_path / "noy.npz", x=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="missing y"):
        load_dataset(f"npz:{tmp_path / 'noy.npz'}")
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1))
    with pytest.raises(ValueError, match="pickle"):
        load_dataset(f"npz:{tmp_path / 'obj.npz'}")
    np.savez(tmp_path / "mism.npz", x=np.zeros((3, 4)), y=np.zeros(4))
    with pytest.raises(ValueError, match="one label per x row"):
        load_dataset(f"npz:{tmp_path / 'mism.npz'}")
    np.savez(tmp_path / "fy.npz", x=np.zeros((3, 4)), y=np.array([0.5, 1, 2]))
    with pytest.raises(ValueError, match="integers"):
        load_dataset(f"npz:{tmp_path / 'fy.npz'}")
    with pytest.raises(DatasetUnavailable, match="not found"):
        load_dataset(f"npz:{tmp_path / 'absent.npz'}")
    with pytest.raises(ValueError, match="needs a path"):
        load_dataset("npz:")


# ---------------------------------------------------------------------------- torchvision
def test_torchvision_missing_fails_naming_alternatives(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    for name in TV_NAMES:
        with pytest.raises(DatasetUnavailable) as e:
            load_dataset(name, data_dir="/nonexistent/fedbus-test")
        msg = str(e.value)
        assert "npz:" in msg and "--data-dir" in msg and "torchvision" in msg
        assert isinstance(e.value, RuntimeError)


class _FakeTV:
    """Stand-in torchvision.datasets classes: record calls; serve arrays or raise."""

    def __init__(self, present: bool, layout: str = "mnist", n: int = 12):
        self.calls: list[dict] = []
        self.present, self.layout, self.n = present, layout, n

    def make(self, cls_name):
        fake = self

        class DS:
            mirrors = ("https://fedbus-unreachable.invalid/mnist/",)
            url = "https://fedbus-unreachable.invalid/cifar.tar.gz"

            def __init__(self, root, train=True, download=False, **kw):
                fake.calls.append({"cls": cls_name, "train": train, "download": download, **kw})
                if not fake.present:
                    raise RuntimeError("Dataset not found. You can use download=True")
                rng = np.random.default_rng(1 if train else 2)
                n = fake.n if train else fake.n // 2
                if fake.layout == "cifar":
                    self.data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
                    self.targets = list(rng.integers(0, 10, n))
                else:
                    self.data = torch.from_numpy(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
                    self.targets = torch.from_numpy(rng.integers(0, 10, n))

        return DS

    def install(self, monkeypatch):
        mod = types.ModuleType("torchvision.datasets")
        for c in ["MNIST", "FashionMNIST", "EMNIST", "CIFAR10", "CIFAR100"]:
            setattr(mod, c, self.make(c))
        pkg = types.ModuleType("torchvision")
        pkg.datasets = mod
        monkeypatch.setitem(sys.modules, "torchvision", pkg)
        monkeypatch.setitem(sys.modules, "torchvision.datasets", mod)


def test_torchvision_offline_fails_without_downloading(monkeypatch, tmp_path):
    fake = _FakeTV(present=False)
    fake.install(monkeypatch)
    for name in ["mnist", "cifar10"]:
        with pytest.raises(DatasetUnavailable) as e:
            load_dataset(name, data_dir=str(tmp_path))
        assert "npz:" in str(e.value) and "--data-dir" in str(e.value)
        assert "cannot be reached" in str(e.value)
    assert fake.calls and not any(c["download"] for c in fake.calls)


def test_torchvision_loaders_pool_and_normalise(monkeypatch, tmp_path):
    fake = _FakeTV(present=True)
    fake.install(monkeypatch)
    ds = load_dataset("femnist", data_dir=str(tmp_path / "tv1"))
    assert ds.x.shape == (18, 1, 28, 28) and ds.num_classes == 62  # train 12 + test 6 pooled
    assert {c["split"] for c in fake.calls} == {"byclass"}
    assert abs(float(ds.x.mean())) < 1e-5 and abs(float(ds.x.std()) - 1) < 1e-4
    # EMNIST images are transposed back
    img = fake.make("EMNIST")(".", train=True).data.numpy()[0] / 255.0
    np.testing.assert_allclose(ds.x[0, 0], (img.T - ds.meta["mean"][0]) / ds.meta["std"][0],
                               atol=1e-5)
    cifar = _FakeTV(present=True, layout="cifar")
    cifar.install(monkeypatch)
    ds = load_dataset("cifar100", data_dir=str(tmp_path / "tv2"))
    assert ds.x.shape == (18, 3, 32, 32) and ds.num_classes == 100 and ds.in_shape == (3, 32, 32)
    np.testing.assert_allclose(ds.x.mean(axis=(0, 2, 3)), 0, atol=1e-5)


# ------------------------------------------------------------------------ FedProx synthetic
def test_synthetic_shape_and_natural_groups():
    ds = load_dataset("synthetic", seed=3, synthetic_alpha=1.0, synthetic_beta=1.0)
    assert ds.x.shape[1:] == (60,) and ds.x.dtype == np.float32 and ds.num_classes == 10
    assert len(ds.groups) == 30
    allidx = np.concatenate(ds.groups)
    assert np.array_equal(np.sort(allidx), np.arange(len(ds)))
    sizes = np.array([len(g) for g in ds.groups])
    assert sizes.min() >= 50 and sizes.tolist() == ds.meta["samples"]
    again = load_dataset("synthetic", seed=3, synthetic_alpha=1.0, synthetic_beta=1.0)
    assert again is ds
    clear_cache()
    again = load_dataset("synthetic", seed=3, synthetic_alpha=1.0, synthetic_beta=1.0)
    assert again is not ds and np.array_equal(again.x, ds.x) and np.array_equal(again.y, ds.y)
    other = load_dataset("synthetic", seed=4, synthetic_alpha=1.0, synthetic_beta=1.0)
    assert len(other) != len(ds) or not np.array_equal(other.x, ds.x)


def test_synthetic_statistics_follow_fedprox():
    seeds = range(40)
    gens = [generate_synthetic(0.5, 0.5, seed=s) for s in seeds]
    # samples per user: int(lognormal(4, 2)) + 50
    extra = np.concatenate([g.samples for g in gens]) - 50
    assert extra.min() >= 0
    logs = np.log(np.maximum(extra, 0.5))
    q25, q50, q75 = np.quantile(logs, [0.25, 0.5, 0.75])
    assert abs(q50 - 4) < 0.3                      # median e^4
    assert abs((q75 - q25) - 1.349 * 2) < 0.4      # IQR of N(4, 2) in log space
    # within a user, x ~ N(v_k, diag(j^-1.2)): pool the per-user-centred samples
    centred = np.concatenate([xx - xx.mean(0) for g in gens[:10] for xx in g.x])
    var = centred.var(0)
    expect = np.arange(1, 61) ** -1.2
    assert len(centred) > 5000
    np.testing.assert_allclose(var, expect, rtol=0.12)
    corr = np.corrcoef(centred[:, :10].T)
    assert np.abs(corr - np.eye(10)).max() < 0.08
    # labels are argmax(softmax(x W_k + b_k)) of the user's own model
    for g in gens[:5]:
        for xx, yy, W, b in zip(g.x, g.y, g.W, g.b):
            assert np.array_equal(yy, np.argmax(softmax(xx @ W + b), axis=1))
            assert np.array_equal(yy, np.argmax(xx @ W + b, axis=1))


def test_synthetic_beta_controls_feature_shift_and_alpha_model_shift():
    def user_shift_var(beta):
        # the mean over features of a user's sample mean is B_k + N(0, ~1/60)
        shifts = [xx.mean() for s in range(5) for xx in generate_synthetic(0.0, beta, seed=s).x]
        return float(np.var(shifts))

    assert user_shift_var(0.0) < 0.1
    assert 2.0 < user_shift_var(2.0) < 7.0            # ~ beta^2 = 4
    u = np.concatenate([generate_synthetic(3.0, 0.0, seed=s).mean_w for s in range(10)])
    assert abs(u.std() - 3.0) < 0.5                    # u_k ~ N(0, alpha)
    W = generate_synthetic(3.0, 0.0, seed=0)
    for k in range(3):                                 # W_k ~ N(u_k, 1)
        assert abs(W.W[k].mean() - W.mean_w[k]) < 0.3 and abs(W.W[k].std() - 1) < 0.2
    iid = generate_synthetic(1.0, 1.0, seed=0, iid=True)
    assert all(np.array_equal(iid.W[0], w) for w in iid.W)
    assert np.allclose(iid.mean_x, iid.B[:, None])


# ---------------------------------------------------------------------------------- MNIST-1D
def test_mnist1d_generator():
    t = templates()
    assert t.shape == (10, 12) and np.allclose(t[:, 0], 0)
    assert len({tuple(np.round(r, 6)) for r in t}) == 10
    ds = load_dataset("mnist1d", seed=0)
    assert ds.x.shape == (5000, 40) and ds.x.dtype == np.float32 and ds.in_shape == (40,)
    assert np.bincount(ds.y).tolist() == [500] * 10
    assert abs(float(ds.x.mean())) < 1e-5 and abs(float(ds.x.std()) - 1) < 1e-4
    x1, y1 = make_mnist1d(200, seed=5)
    x2, y2 = make_mnist1d(200, seed=5)
    x3, _ = make_mnist1d(200, seed=6)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2) and not np.array_equal(x1, x3)


def test_mnist1d_is_learnable_but_not_trivial():
    from sklearn.linear_model import LogisticRegression

    ds = load_dataset("mnist1d", seed=1)
    clf = LogisticRegression(max_iter=500).fit(ds.x[:4000], ds.y[:4000])
    acc = clf.score(ds.x[4000:], ds.y[4000:])
    # the MNIST-1D paper: logistic regression ~32% (chance 10%), CNNs ~94%
    assert 0.2 < acc < 0.5


# ------------------------------------------------------------------------------ FederatedData
def test_federated_data_clients():
    fd = FederatedData({"dataset": "digits", "partition": "iid"}, num_clients=5, seed=0)
    assert fd.num_classes == 10 and fd.in_shape == (1, 8, 8) and fd.num_clients == 5
    d = fd.client(2)
    assert isinstance(d, ClientData)
    assert d.train_x.shape[1:] == (1, 8, 8) and d.train_x.dtype == np.float32
    assert d.train_y.dtype == np.int64 and len(d.train_x) == len(d.train_y)
    assert len(d.test_y) == len(fd.parts[2].test) > 0
    np.testing.assert_array_equal(d.train_x, fd.dataset.x[fd.parts[2].train])
    counts = fd.class_counts()
    assert counts.shape == (5, 10)
    assert counts.sum(1).tolist() == [len(p.train) for p in fd.parts]
    assert fd.class_counts("test").sum() == sum(len(p.test) for p in fd.parts)
    # cached: a second FederatedData for the same config shares dataset and split
    fd2 = FederatedData({"dataset": "digits", "partition": "iid"}, num_clients=5, seed=0)
    assert fd2.parts is fd.parts and fd2.dataset is fd.dataset
    fd3 = FederatedData({"dataset": "digits", "partition": "iid"}, num_clients=5, seed=1)
    assert not np.array_equal(fd3.parts[0].train, fd.parts[0].train)
    with pytest.raises(IndexError):
        fd.client(5)
    with pytest.raises(ValueError, match="unknown \\[data\\] key 'shot'"):
        FederatedData({"shot": 3}, num_clients=2, seed=0)
    assert set(DATA_DEFAULTS) == {
        "dataset", "data_dir", "partition", "test_fraction", "test_distribution", "ways",
        "ways_std", "shots", "shots_std", "alpha", "min_samples", "classes_per_client", "powerlaw_sigma",
        "synthetic_alpha", "synthetic_beta", "image_size", "domain_samples"}


def test_federated_data_synthetic_natural_and_file(tmp_path):
    cfg = {"dataset": "synthetic", "partition": "natural", "synthetic_alpha": 1.0,
           "synthetic_beta": 1.0}
    fd = FederatedData(cfg, num_clients=30, seed=2)
    assert fd.in_shape == (60,)
    for i in (0, 17, 29):
        mine = np.sort(np.concatenate([fd.parts[i].train, fd.parts[i].test]))
        assert np.array_equal(mine, fd.dataset.groups[i])
    save_partition(fd.parts, tmp_path / "p.json")
    fd2 = FederatedData({**cfg, "partition": f"file:{tmp_path / 'p.json'}"}, 30, seed=2)
    assert all(np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
               for a, b in zip(fd.parts, fd2.parts))
    with pytest.raises(ValueError, match="federation.clients"):
        FederatedData({**cfg, "partition": f"file:{tmp_path / 'p.json'}"}, 29, seed=2)

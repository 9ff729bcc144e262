"""Feature-skew federations: the multi-domain datasets (digit5-offline built from MNIST and
scikit-learn's digits; the digit5 and office10 loaders, on small fake file layouts written
here) and the ``domains`` / ``domains-dirichlet`` partitions, plus one real federation."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import MNIST_NPZ, needs_mnist

from fedbus.node.config import ConfigError, build_config
from fedbus.node.data import (
    ClientSplit,
    Dataset,
    DatasetUnavailable,
    FederatedData,
    clear_cache,
    load_dataset,
    make_partition,
)
from fedbus.node.data import domains as dm

torch.set_num_threads(1)

OFFLINE = f"digit5-offline:{MNIST_NPZ}"


def check_disjoint(parts: list[ClientSplit], n: int) -> None:
    seen = []
    for i, p in enumerate(parts):
        assert len(p.train) > 0 and len(p.test) > 0, f"client {i} is empty"
        assert len(np.intersect1d(p.train, p.test)) == 0
        seen += [p.train, p.test]
    every = np.concatenate(seen)
    assert every.min() >= 0 and every.max() < n
    assert len(np.unique(every)) == len(every), "an index is given to two clients"


def same(a: list[ClientSplit], b: list[ClientSplit]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x.train, y.train) and
                                    np.array_equal(x.test, y.test) for x, y in zip(a, b))


def client_domain(ds: Dataset, p: ClientSplit) -> int:
    """The single domain a client's samples come from (asserts there is one)."""
    doms = np.unique(dm.domain_ids(ds)[np.concatenate([p.train, p.test])])
    assert len(doms) == 1, f"a client draws from domains {doms.tolist()}"
    return int(doms[0])


def grouped(sizes=(300, 200, 250, 150, 100), classes=10, seed=0) -> Dataset:
    """A small labelled dataset whose groups are D domains (stored out of order)."""
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    order = rng.permutation(n)
    groups = [np.sort(g) for g in np.split(order, np.cumsum(sizes)[:-1])]
    return Dataset("toy", rng.normal(size=(n, 4)).astype(np.float32),
                   rng.integers(0, classes, n).astype(np.int64), classes, groups=groups,
                   meta={"domains": [f"dom{d}" for d in range(len(sizes))]})


# ---------------------------------------------------------------------------- image ops
def test_resize_bilinear_matches_torch():
    x = np.random.default_rng(0).random((4, 2, 8, 8)).astype(np.float32)
    for size in [(28, 28), (32, 32), (5, 3)]:
        want = torch.nn.functional.interpolate(torch.from_numpy(x), size=size, mode="bilinear",
                                               align_corners=False).numpy()
        got = dm.resize_bilinear(x, *size)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_rotate_bilinear_turns_anticlockwise_about_the_centre():
    x = np.random.default_rng(1).random((3, 28, 28))
    out = dm.rotate_bilinear(x, np.array([0.0, 90.0, -90.0]))
    np.testing.assert_allclose(out[0], x[0], atol=1e-5)
    np.testing.assert_allclose(out[1], np.rot90(x[1], 1), atol=1e-5)   # anticlockwise
    np.testing.assert_allclose(out[2], np.rot90(x[2], -1), atol=1e-5)
    a = dm.rotation_angles(1000, np.random.default_rng(0))
    assert np.all((np.abs(a) >= 30) & (np.abs(a) <= 60))
    assert 0.4 < np.mean(a > 0) < 0.6


# ------------------------------------------------------------------------ digit5-offline
@pytest.fixture(scope="module")
def mnist():
    with np.load(MNIST_NPZ) as z:
        return z["x"], z["y"]


@pytest.fixture(scope="module")
def offline():
    return load_dataset(OFFLINE)


@needs_mnist
def test_digit5_offline_transforms_are_the_documented_ones(mnist):
    mx, my = mnist
    dx, dy = dm._digits_arrays()
    raw = dm.build_digit5_offline(mx, my, dx.reshape(-1, 8, 8), dy)
    x, y, dom, src = raw["x"], raw["y"], raw["domain"], raw["source"]
    assert x.dtype == np.uint8 and x.shape == (len(mx) + len(dx), 28, 28)
    sizes = np.bincount(dom).tolist()
    assert sizes == [2500, 2500, 2500, 2500, len(dx)]
    # the four MNIST-based domains split the MNIST images disjointly, all of them used
    mnist_src = [src[dom == d] for d in range(4)]
    both = np.concatenate(mnist_src)
    assert len(np.unique(both)) == len(both) == len(mx)
    for d in range(4):
        np.testing.assert_array_equal(y[dom == d], my[mnist_src[d]])
    np.testing.assert_array_equal(y[dom == 4], dy)
    # 0: as is; 1: inverted
    np.testing.assert_array_equal(x[dom == 0], mx[mnist_src[0]])
    np.testing.assert_array_equal(x[dom == 1], 255 - mx[mnist_src[1]])
    inv_mean = x[dom == 1].mean()
    assert inv_mean > 200 and abs(inv_mean - (255 - mx[mnist_src[1]].mean())) < 1e-6
    assert x[dom == 0].mean() < 60
    # 2: rotated by per-image seeded angles (rng [seed, 2])
    angles = dm.rotation_angles(2500, np.random.default_rng([dm.OFFLINE_SEED, 2]))
    want = dm._to_uint8(dm.rotate_bilinear(mx[mnist_src[2]], angles))
    np.testing.assert_array_equal(x[dom == 2], want)
    assert not np.array_equal(x[dom == 2], mx[mnist_src[2]])
    # 3: |texture - digit| with the seeded textures (rng [seed, 3])
    tex = dm.textures(2500, np.random.default_rng([dm.OFFLINE_SEED, 3]))
    assert tex.min() == 0 and abs(tex.max() - 255) < 1e-9
    np.testing.assert_array_equal(x[dom == 3], dm._to_uint8(np.abs(tex - mx[mnist_src[3]])))
    background = x[dom == 3][mx[mnist_src[3]] == 0]
    assert background.std() > 30  # textured, not flat
    # 4: the 8x8 digits scaled by 255/16 and upsampled bilinearly to 28x28
    up = torch.nn.functional.interpolate(
        torch.from_numpy(dx.reshape(-1, 1, 8, 8).astype(np.float64) * 255 / 16), size=(28, 28),
        mode="bilinear", align_corners=False)[:, 0].numpy()
    assert x[dom == 4].shape[1:] == (28, 28)
    assert np.abs(x[dom == 4].astype(np.float64) - up).max() <= 0.5 + 1e-6
    # seeded: the same seed rebuilds the same set, another seed another split
    again = dm.build_digit5_offline(mx, my, dx.reshape(-1, 8, 8), dy)
    assert all(np.array_equal(raw[k], again[k]) for k in raw)
    other = dm.build_digit5_offline(mx, my, dx.reshape(-1, 8, 8), dy, seed=1)
    assert not np.array_equal(other["source"], raw["source"])


@needs_mnist
def test_digit5_offline_dataset(offline, mnist):
    ds = offline
    assert ds.name == OFFLINE and ds.num_classes == 10
    assert ds.x.shape == (len(mnist[0]) + 1797, 1, 28, 28) and ds.x.dtype == np.float32
    assert abs(float(ds.x.mean())) < 1e-3 and abs(float(ds.x.std()) - 1) < 1e-3
    assert ds.meta["domains"] == list(dm.OFFLINE_DOMAINS)
    assert [len(g) for g in ds.groups] == [2500, 2500, 2500, 2500, 1797]
    ids = dm.domain_ids(ds)
    assert (ids >= 0).all() and np.array_equal(np.bincount(ids), [2500] * 4 + [1797])
    for d in range(5):  # same label space in every domain
        assert set(np.unique(ds.y[ids == d]).tolist()) == set(range(10))
    # the inverted domain is the bright one, after standardisation too
    means = [float(ds.x[ids == d].mean()) for d in range(5)]
    assert means[1] == max(means) and means[1] > 1.0 > means[0]
    # fixed: a fresh load is identical; federation.seed does not change it
    clear_cache()
    again = load_dataset(OFFLINE, seed=7)
    np.testing.assert_array_equal(again.x, ds.x)
    np.testing.assert_array_equal(again.y, ds.y)
    capped = load_dataset(OFFLINE, domain_samples=300)
    assert [len(g) for g in capped.groups] == [300] * 5 and len(capped) == 1500
    assert capped.meta["domain_sizes"] == [300] * 5


def test_digit5_offline_needs_the_mnist_path(tmp_path):
    with pytest.raises(ValueError, match="digit5-offline:PATH"):
        load_dataset("digit5-offline")
    with pytest.raises(DatasetUnavailable, match="MNIST npz was not found.*nope.npz"):
        load_dataset(f"digit5-offline:{tmp_path / 'nope.npz'}")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((8, 28, 28), np.uint8), y=np.full(8, 12))
    with pytest.raises(ValueError, match="one label 0-9"):
        load_dataset(f"digit5-offline:{bad}")
    with pytest.raises(ValueError, match="takes no parameter"):
        load_dataset(f"digit5-offline:{bad}", image_size=32)


def test_digit5_offline_on_a_small_fake_mnist(tmp_path):
    rng = np.random.default_rng(0)
    f = tmp_path / "m.npz"
    np.savez(f, x=rng.integers(0, 256, (40, 28, 28)).astype(np.uint8),
             y=np.arange(40) % 10)
    ds = load_dataset(f"digit5-offline:{f}")
    assert [len(g) for g in ds.groups] == [10, 10, 10, 10, 1797]
    assert ds.x.shape == (1837, 1, 28, 28)


# -------------------------------------------------------------------- domains partition
def test_domains_each_client_one_domain_all_domains_seeded():
    ds = grouped()
    for clients in (5, 7, 10, 12):
        parts = make_partition(ds, scheme="domains", num_clients=clients, seed=3)
        assert len(parts) == clients
        check_disjoint(parts, len(ds))
        doms = [client_domain(ds, p) for p in parts]
        assert doms == [i % 5 for i in range(clients)]  # round-robin
        assert set(doms) == set(range(5))
        assert [p.meta for p in parts[:5]] == [{"domain": d, "domain_name": f"dom{d}"}
                                               for d in range(5)]
        # a domain's samples are shared (near-equally) by the clients holding it, all used
        for d in range(5):
            mine = [p for p, e in zip(parts, doms) if e == d]
            got = np.sort(np.concatenate([np.concatenate([p.train, p.test]) for p in mine]))
            np.testing.assert_array_equal(got, ds.groups[d])
            sizes = [len(p.train) + len(p.test) for p in mine]
            assert max(sizes) - min(sizes) <= 1
        for p in parts:  # 75/25 within each client
            n = len(p.train) + len(p.test)
            assert len(p.test) == int(np.ceil(0.25 * n))
    a = make_partition(ds, scheme="domains", num_clients=10, seed=3)
    b = make_partition(ds, scheme="domains", num_clients=10, seed=3)
    c = make_partition(ds, scheme="domains", num_clients=10, seed=4)
    assert same(a, b) and not same(a, c)
    # with one client per domain, a client holds its whole domain (like "natural")
    one = make_partition(ds, scheme="domains", num_clients=5, seed=0, test_fraction=0.0)
    for d, p in enumerate(one):
        np.testing.assert_array_equal(p.train, ds.groups[d])


def test_domains_dirichlet_adds_label_skew_within_each_domain():
    ds = grouped(sizes=(2000,) * 5)
    parts = make_partition(ds, scheme="domains-dirichlet", num_clients=20, seed=0,
                           alpha=0.1, min_samples=5)
    check_disjoint(parts, len(ds))
    assert [client_domain(ds, p) for p in parts] == [i % 5 for i in range(20)]
    counts = np.stack([np.bincount(ds.y[p.train], minlength=10) for p in parts])
    top = counts.max(1) / counts.sum(1)
    assert np.median(top) > 0.3  # skewed: IID would give ~0.1
    iid = make_partition(ds, scheme="domains", num_clients=20, seed=0)
    iid_top = np.stack([np.bincount(ds.y[p.train], minlength=10) for p in iid])
    assert np.median(iid_top.max(1) / iid_top.sum(1)) < 0.2
    again = make_partition(ds, scheme="domains-dirichlet", num_clients=20, seed=0,
                           alpha=0.1, min_samples=5)
    assert same(parts, again)
    with pytest.raises(ValueError, match="takes no parameter"):
        make_partition(ds, scheme="domains", num_clients=5, seed=0, alpha=0.1)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        make_partition(ds, scheme="domains-dirichlet", num_clients=5, seed=0, alpha=0.0)


def test_domains_errors_and_warnings():
    plain = Dataset("plain", np.zeros((20, 2), np.float32), np.arange(20) % 2, 2)
    with pytest.raises(ValueError, match="needs a dataset with domains"):
        make_partition(plain, scheme="domains", num_clients=2, seed=0)
    ds = grouped()
    with pytest.warns(UserWarning, match="3 clients for 5 domains; domains dom3, dom4"):
        parts = make_partition(ds, scheme="domains", num_clients=3, seed=0)
    assert [client_domain(ds, p) for p in parts] == [0, 1, 2]
    small = grouped(sizes=(6, 2, 6, 6, 6))
    with pytest.raises(ValueError, match="domain 'dom1' .* 2 samples for 3 clients"):
        make_partition(small, scheme="domains", num_clients=15, seed=0)
    overlapping = grouped()
    overlapping.groups = [overlapping.groups[0], overlapping.groups[0][:5]]
    with pytest.raises(ValueError, match="overlap"):
        make_partition(overlapping, scheme="domains", num_clients=2, seed=0)


@needs_mnist
def test_domains_on_the_five_domain_set(offline):
    """The acceptance: each client one domain, same label space, seeded."""
    ds = offline
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parts = make_partition(ds, scheme="domains", num_clients=10, seed=0)
    check_disjoint(parts, len(ds))
    doms = [client_domain(ds, p) for p in parts]
    assert doms == [0, 1, 2, 3, 4] * 2
    for p in parts:  # every client sees all ten labels
        assert set(np.unique(ds.y[p.train]).tolist()) == set(range(10))
    assert same(parts, make_partition(ds, scheme="domains", num_clients=10, seed=0))
    assert not same(parts, make_partition(ds, scheme="domains", num_clients=10, seed=1))
    fd = FederatedData({"dataset": OFFLINE, "partition": "domains"}, num_clients=5, seed=0)
    assert fd.num_classes == 10 and fd.in_shape == (1, 28, 28)
    assert [client_domain(fd.dataset, p) for p in fd.parts] == [0, 1, 2, 3, 4]
    assert (fd.class_counts() > 0).all()
    nat = FederatedData({"dataset": OFFLINE, "partition": "natural"}, num_clients=5, seed=0)
    for d, p in enumerate(nat.parts):
        np.testing.assert_array_equal(np.sort(np.concatenate([p.train, p.test])),
                                      nat.dataset.groups[d])


# ------------------------------------------------------------------------ digit5 (files)
def write_digit5(folder: Path, n: int = 6) -> dict[str, np.ndarray]:
    """A tiny Digit-Five layout in the files' own formats; returns each domain's labels."""
    from scipy.io import savemat

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def onehot(y):
        return np.eye(10, dtype=np.uint8)[y]

    lab = {d: rng.integers(0, 10, 2 * n) for d in dm.DIGIT5_DOMAINS}
    # MNIST: gray 32x32 (value 10 * label) and one-hot labels
    img = (lab["mnist"] * 10).astype(np.uint8)[:, None, None] * np.ones((1, 32, 32), np.uint8)
    savemat(folder / "mnist_data.mat", {
        "train_32": img[:n], "test_32": img[n:], "label_train": onehot(lab["mnist"][:n]),
        "label_test": onehot(lab["mnist"][n:]),
        "train_28": img[:n, 2:30, 2:30, None], "test_28": img[n:, 2:30, 2:30, None]})
    # MNIST-M: colour 28x28 (resized to 32)
    img = rng.integers(0, 256, (2 * n, 28, 28, 3)).astype(np.uint8)
    savemat(folder / "mnistm_with_label.mat", {
        "train": img[:n], "test": img[n:], "label_train": onehot(lab["mnistm"][:n]),
        "label_test": onehot(lab["mnistm"][n:])})
    # SVHN: X [32, 32, 3, N], y [N, 1] with 10 for the digit 0
    svhn_y = np.where(lab["svhn"] == 0, 10, lab["svhn"])
    img = rng.integers(0, 256, (32, 32, 3, 2 * n)).astype(np.uint8)
    savemat(folder / "svhn_train_32x32.mat", {"X": img[..., :n], "y": svhn_y[:n, None]})
    savemat(folder / "svhn_test_32x32.mat", {"X": img[..., n:], "y": svhn_y[n:, None]})
    # SynthDigits
    img = rng.integers(0, 256, (2 * n, 32, 32, 3)).astype(np.uint8)
    savemat(folder / "syn_number.mat", {
        "train_data": img[:n], "test_data": img[n:], "train_label": lab["syn"][:n, None],
        "test_label": lab["syn"][n:, None]})
    # USPS: a 2x2 cell of float images [N, 1, 28, 28] in [0, 1] and labels [N, 1]
    img = np.full((2 * n, 1, 28, 28), 0.5)
    cell = np.empty((2, 2), dtype=object)
    cell[0, 0], cell[0, 1] = img[:n], lab["usps"][:n, None].astype(np.float64)
    cell[1, 0], cell[1, 1] = img[n:], lab["usps"][n:, None].astype(np.float64)
    savemat(folder / "usps_28x28.mat", {"dataset": cell})
    return lab


def raw01(ds: Dataset) -> np.ndarray:
    """Undo the per-channel standardisation: the loader's [0, 1] pixels."""
    mean = np.asarray(ds.meta["mean"], np.float32)[None, :, None, None]
    std = np.asarray(ds.meta["std"], np.float32)[None, :, None, None]
    return ds.x * std + mean


def test_digit5_loader_reads_the_digit_five_files(tmp_path):
    lab = write_digit5(tmp_path / "Digit-Five")
    ds = load_dataset("digit5", data_dir=str(tmp_path))
    assert ds.x.shape == (60, 3, 32, 32) and ds.num_classes == 10
    assert ds.meta["domains"] == ["mnist", "mnistm", "svhn", "syn", "usps"]
    assert [len(g) for g in ds.groups] == [12] * 5
    for d, dom in enumerate(dm.DIGIT5_DOMAINS):  # train then test, pooled per domain
        np.testing.assert_array_equal(ds.y[ds.groups[d]], lab[dom])
    assert (ds.y[ds.groups[2]] <= 9).all()  # SVHN's 10 became 0
    px = raw01(ds)
    mnist = px[ds.groups[0]]
    # gray MNIST repeated to three channels, values kept (10 * label / 255)
    np.testing.assert_allclose(mnist, (lab["mnist"] * 10 / 255.0)[:, None, None, None]
                               * np.ones((1, 3, 32, 32)), atol=1e-5)
    np.testing.assert_allclose(px[ds.groups[4]], 0.5, atol=1e-5)  # USPS floats in [0, 1]
    small = load_dataset("digit5", data_dir=str(tmp_path), image_size=16, domain_samples=5)
    assert small.x.shape == (25, 3, 16, 16) and [len(g) for g in small.groups] == [5] * 5
    # through the [data] table (image_size, domain_samples), files straight in data_dir
    flat = tmp_path / "flat"
    write_digit5(flat)
    fd = FederatedData({"dataset": "digit5", "data_dir": str(flat), "partition": "domains",
                        "image_size": 8, "domain_samples": 10}, num_clients=5, seed=0)
    assert fd.in_shape == (3, 8, 8) and len(fd.dataset) == 50
    assert [client_domain(fd.dataset, p) for p in fd.parts] == [0, 1, 2, 3, 4]


def test_digit5_missing_files_name_them(tmp_path):
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("digit5", data_dir=str(tmp_path))
    msg = str(err.value)
    for f in ("mnist_data.mat", "mnistm_with_label.mat", "svhn_train_32x32.mat",
              "svhn_test_32x32.mat", "syn_number.mat", "usps_28x28.mat", "Digit-Five",
              "digit5-offline:"):
        assert f in msg
    write_digit5(tmp_path / "Digit-Five")
    (tmp_path / "Digit-Five" / "syn_number.mat").unlink()
    with pytest.raises(DatasetUnavailable, match=r"Digit-Five lacks syn_number\.mat\. Offline"):
        load_dataset("digit5", data_dir=str(tmp_path))


# ---------------------------------------------------------------------- office10 (folders)
def write_office(root: Path, classes=("back_pack", "mug", "projector")) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for d, dom in enumerate(dm.OFFICE10_DOMAINS):
        for k, cls in enumerate(classes):
            sub = root / dom / cls
            sub.mkdir(parents=True)
            for j in range(2 + d):
                h, w = rng.integers(20, 60, 2)
                arr = np.full((h, w, 3), 40 * k + 10 * d, np.uint8)
                if j % 2:  # a gray PNG among the JPEGs
                    Image.fromarray(arr[..., 0], "L").save(sub / f"img{j}.png")
                else:
                    Image.fromarray(arr, "RGB").save(sub / f"img{j}.JPG", quality=95)
        (root / dom / "notes.txt").write_text("ignored")


def test_office10_loader_reads_image_folders(tmp_path):
    write_office(tmp_path / "office_caltech_10")
    ds = load_dataset("office10", data_dir=str(tmp_path), image_size=12)
    sizes = [3 * (2 + d) for d in range(4)]
    assert ds.x.shape == (sum(sizes), 3, 12, 12) and ds.num_classes == 10
    assert [len(g) for g in ds.groups] == sizes
    assert ds.meta["domains"] == ["amazon", "caltech", "dslr", "webcam"]
    assert ds.meta["classes"][8] == "mug"
    # labels by the Office-31 class order: back_pack 0, mug 8, projector 9
    for d in range(4):
        y = ds.y[ds.groups[d]]
        np.testing.assert_array_equal(np.bincount(y, minlength=10)[[0, 8, 9]], [2 + d] * 3)
    # constant images stay constant after the resize (value 40 k + 10 d, within JPEG error)
    px = raw01(ds) * 255
    for d in range(4):
        for k, label in enumerate((0, 8, 9)):
            sel = ds.groups[d][ds.y[ds.groups[d]] == label]
            assert np.abs(px[sel] - (40 * k + 10 * d)).max() < 3
    default = load_dataset("office10", data_dir=str(tmp_path))
    assert default.in_shape == (3, 32, 32)
    parts = make_partition(default, scheme="domains", num_clients=4, seed=0)
    assert [client_domain(default, p) for p in parts] == [0, 1, 2, 3]


def test_office10_errors_name_what_is_expected(tmp_path, monkeypatch):
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("office10", data_dir=str(tmp_path))
    for f in ("amazon/", "caltech/", "dslr/", "webcam/", "office_caltech_10", "back_pack",
              "laptop_computer"):
        assert f in str(err.value)
    write_office(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "webcam")
    with pytest.raises(DatasetUnavailable, match="lacks webcam/$"):
        load_dataset("office10", data_dir=str(tmp_path))
    write_office(tmp_path / "b")
    (tmp_path / "b" / "dslr" / "laptop").mkdir()
    with pytest.raises(ValueError, match="laptop is not one of the class folders"):
        load_dataset("office10", data_dir=str(tmp_path / "b"))
    write_office(tmp_path / "c")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DatasetUnavailable, match="Pillow.*pip install Pillow"):
        load_dataset("office10", data_dir=str(tmp_path / "c"))


# --------------------------------------------------------------------------------- config
def test_config_accepts_the_new_names_and_keys():
    cfg = build_config({"data": {"dataset": "digit5", "partition": "domains-dirichlet",
                                 "image_size": 64, "domain_samples": 7438}})
    assert cfg.data.image_size == 64 and cfg.data.domain_samples == 7438
    assert build_config({}).data.image_size == 0 and build_config({}).data.domain_samples == 0
    with pytest.raises(ConfigError, match="data.domain_samples"):
        build_config({"data": {"domain_samples": -1}})


# ----------------------------------------------------------------------------- federation
@needs_mnist
def test_federation_on_the_five_domain_set(tmp_path):
    from helpers import SMALL, merged, metrics, run_federation

    cfg = merged(SMALL, federation={"clients": 5, "rounds": 2},
                 data={"dataset": OFFLINE, "partition": "domains", "domain_samples": 500},
                 train={"epochs": 3, "batch_size": 16, "lr": 0.05})
    cfg["data"] = {k: v for k, v in cfg["data"].items()
                   if k in ("dataset", "partition", "domain_samples")}
    run, summary = run_federation(tmp_path, cfg, timeout=240)
    assert summary["rounds_completed"] == 2
    recs = metrics(run)
    assert [r["round"] for r in recs] == [0, 1]
    assert all(r["updates"] == 5 and r["failed"] == 0 for r in recs)
    assert len(recs[-1]["per_client"]) == 5
    assert summary["final"]["acc_mean"] > 0.25  # chance is 0.1; 0.46 when written

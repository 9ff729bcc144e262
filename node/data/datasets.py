"""Datasets: load one whole dataset, normalised and model-ready.

    ds = load_dataset("digits")                       # sklearn's bundled 8x8 digits
    ds = load_dataset("npz:../shared/data/mnist-10k.npz")
    ds = load_dataset("synthetic", seed=0, synthetic_alpha=1.0, synthetic_beta=1.0)

Every loader returns a :class:`Dataset`: ``x`` float32 (images ``[N, C, H, W]``,
tabular/1-D ``[N, D]``), ``y`` int64 ``[N]``, ``num_classes``, and ``groups``
(a natural partition, one index array per user, or None). Datasets are cached
per process (same arguments -> the same object): treat the arrays as read-only.

Names (``DATASETS``):
    digits           scikit-learn's bundled digits, 1,797 images [1, 8, 8]; x/16, then
                     standardised with the set's mean/std. Offline; the default.
    npz:PATH         any .npz with ``x`` and ``y`` (``allow_pickle=False``). uint8 x -> /255,
                     then standardised per channel (images) or per feature (tabular) with the
                     file's own statistics. [N, H, W] gets a channel dim, [N, H, W, C] (C in
                     1, 3, 4) is transposed to [N, C, H, W], [N, D] stays tabular. Optional
                     keys: ``groups`` (one int per sample: a natural partition, e.g. LEAF
                     FEMNIST writers) and ``num_classes``. A relative PATH is looked up from
                     the working directory, then under data_dir.
    mnist, fmnist,   torchvision datasets (the optional ``vision`` extra), downloaded into
    emnist, femnist, data_dir (default ~/.cache/fedbus). Train and test sets are pooled (the
    cifar10,         partitioners split per client), then standardised per channel. emnist is
    cifar100         EMNIST "balanced" (47 classes), femnist EMNIST "byclass" (62 classes,
                     LEAF FEMNIST's label set; torchvision has no writer ids: for LEAF's writer
                     partition export it to an npz with ``groups``). Without torchvision or
                     offline: DatasetUnavailable, fast, naming ``npz:PATH`` and ``--data-dir``.
    synthetic        FedProx synthetic(alpha, beta): params synthetic_alpha, synthetic_beta
                     (0.5, 0.5), synthetic_iid (False); 30 users, 60 features, 10 classes;
                     x as generated (no re-normalisation; FedProx trains on it raw);
                     ``groups`` = the users (partition "natural").
    mnist1d          MNIST-1D generated offline: 5,000 samples [40] (param num_samples),
                     standardised as in the reference code.
    digit5-offline:PATH  a Digit-5-like five-domain set built from the MNIST npz at PATH
                     and sklearn's digits (mnist, inverted, rotated, textured, digits
                     upsampled), 28x28 gray; ``groups`` = the domains. Param domain_samples.
    digit5           the Digit-5 benchmark (MNIST, MNIST-M, SVHN, SynthDigits, USPS) from the
                     Digit-Five .mat files in data_dir; [3, 32, 32]; ``groups`` = the domains.
                     Params image_size, domain_samples.
    office10         Office-Caltech-10 (amazon, caltech, dslr, webcam) from image folders in
                     data_dir (Pillow); [3, 32, 32]; ``groups`` = the domains. Params
                     image_size, domain_samples.
                     (All three: see fedbus.node.data.domains; partition "domains".)
    shapes-seg       semantic segmentation, generated offline: RGB shapes with class textures
                     on smooth backgrounds, [3, 64, 64], 6 classes (0 = background); masks in
                     ``Dataset.masks``, ``y`` = each image's dominant object class. Params
                     num_images (0 = 2000), image_size (0 = 64).
    voc2012          Pascal VOC 2012 segmentation from data_dir/VOCdevkit/VOC2012 (Pillow),
                     train + val pooled, [3, 128, 128], 21 classes, 255 = ignore. Params
                     image_size (0 = 128), num_images (0 = all).
                     (Both: see fedbus.node.data.segmentation and docs/DATA.md.)
"""
from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

TORCHVISION = {
    # name: (torchvision class, extra kwargs, classes)
    "mnist": ("MNIST", {}, 10),
    "fmnist": ("FashionMNIST", {}, 10),
    "emnist": ("EMNIST", {"split": "balanced"}, 47),
    "femnist": ("EMNIST", {"split": "byclass"}, 62),
    "cifar10": ("CIFAR10", {}, 10),
    "cifar100": ("CIFAR100", {}, 100),
}
DATASETS = ("digits", "npz:PATH", *TORCHVISION, "synthetic", "mnist1d", "digit5-offline:PATH",
            "digit5", "office10", "shapes-seg", "voc2012")
DEFAULT_DATA_DIR = "~/.cache/fedbus"


class DatasetUnavailable(RuntimeError):
    """A dataset that cannot be had here (torchvision missing, offline, file absent)."""


@dataclass
class Dataset:
    """One whole dataset, normalised and ready for the models.

    name: the name it was loaded under ("digits", "npz:/path/x.npz", ...)
    x: float32, images [N, C, H, W], tabular/1-D [N, D]
    y: int64 [N], labels 0..num_classes-1
    num_classes: number of classes (labels may not all occur)
    groups: a natural partition (FedProx synthetic: one index array per user), else None
    meta: how it was made (normalisation mean/std, source, generator params)
    masks: segmentation sets only: uint8 [N, H, W] class ids per pixel (H, W = x's), with
        meta["ignore_index"] (255) marking pixels that count nowhere; y is then one label per
        image (its dominant object class) for the partitioners. None for classification.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    groups: list[np.ndarray] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    masks: np.ndarray | None = None

    @property
    def in_shape(self) -> tuple[int, ...]:
        """One sample's shape, ``x.shape[1:]``."""
        return tuple(int(v) for v in self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.y)

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32:
            raise ValueError(f"{self.name}: x must be float32, got {self.x.dtype}")
        if self.y.dtype != np.int64 or self.y.ndim != 1 or len(self.y) != len(self.x):
            raise ValueError(f"{self.name}: y must be int64 [N] with N = len(x)")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(f"{self.name}: labels must lie in 0..{self.num_classes - 1}")
        if self.masks is not None:
            m = self.masks
            if (m.dtype != np.uint8 or m.ndim != 3 or len(m) != len(self.x)
                    or (self.x.ndim == 4 and m.shape[1:] != self.x.shape[2:])):
                raise ValueError(f"{self.name}: masks must be uint8 [N, H, W] matching x "
                                 f"{list(self.x.shape)}, got {m.dtype} {list(m.shape)}")
            ignore = int(self.meta.get("ignore_index", 255))
            bad = (m >= self.num_classes) & (m != ignore)
            if bad.any():
                raise ValueError(f"{self.name}: mask values must lie in "
                                 f"0..{self.num_classes - 1} or be {ignore} (ignore)")


def data_dir_path(data_dir: str | os.PathLike | None) -> Path:
    """The download/cache folder: data_dir, or ~/.cache/fedbus when None or empty."""
    return Path(os.path.expanduser(data_dir or DEFAULT_DATA_DIR))


def _standardise(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, list, list]:
    mean = x.mean(axis=axes, keepdims=True, dtype=np.float64)
    std = x.std(axis=axes, keepdims=True, dtype=np.float64)
    std = np.where(std < 1e-8, 1.0, std)
    out = ((x - mean) / std).astype(np.float32)
    return out, mean.ravel().tolist(), std.ravel().tolist()


def _images(name: str, x: np.ndarray, y: np.ndarray, num_classes: int, **meta) -> Dataset:
    """Scale to [0, 1] if uint8, standardise per channel, as [N, C, H, W] float32."""
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    x, mean, std = _standardise(x, (0, 2, 3))
    return Dataset(name, np.ascontiguousarray(x), y.astype(np.int64), num_classes,
                   meta={**meta, "mean": mean, "std": std})


# ---------------------------------------------------------------------------------- digits
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (pixels [1797, 64] in 0..16, labels), read from the
    file load_digits reads. Importing sklearn costs ~1.5 s, more than a whole 1-round
    federation spends on training, so the CSV is read directly when it is where
    scikit-learn keeps it, and through load_digits otherwise."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        csv = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            table = np.loadtxt(csv, delimiter=",", dtype=np.float32)
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data.astype(np.float32), d.target.astype(np.int64)


def _load_digits() -> Dataset:
    pixels, labels = _digits_arrays()
    x = (pixels / 16.0).reshape(-1, 1, 8, 8)
    x, mean, std = _standardise(x, (0, 1, 2, 3))
    return Dataset("digits", x, labels, 10,
                   meta={"source": "sklearn.datasets.load_digits", "mean": mean, "std": std})


# ------------------------------------------------------------------------------------- npz
def _resolve_npz(path: str, data_dir: str | None) -> Path:
    p = Path(os.path.expanduser(path))
    candidates = [p] if p.is_absolute() else [p, data_dir_path(data_dir) / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise DatasetUnavailable(f"npz dataset not found: {path} (looked at "
                             f"{', '.join(os.path.abspath(c) for c in candidates)})")


def _load_npz(path: str, data_dir: str | None) -> Dataset:
    if not path:
        raise ValueError("dataset 'npz:' needs a path, e.g. npz:../shared/data/mnist-10k.npz")
    file = _resolve_npz(path, data_dir)
    try:
        with np.load(file, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError) as err:
        raise ValueError(f"{file}: not a readable .npz without pickled objects ({err})") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ValueError(f"{file}: an npz dataset needs arrays 'x' and 'y'; missing "
                         f"{', '.join(missing)} (has {', '.join(arrays) or 'nothing'})")
    x, y = arrays["x"], arrays["y"]
    name = f"npz:{path}"
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"{file}: y must be 1-D with one label per x row; got x {x.shape}, "
                         f"y {y.shape}")
    if not (np.issubdtype(y.dtype, np.integer) or
            (np.issubdtype(y.dtype, np.floating) and np.all(y == np.round(y)))):
        raise ValueError(f"{file}: labels y must be integers, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if len(y) == 0 or y.min() < 0:
        raise ValueError(f"{file}: need at least one sample and labels >= 0")
    if not (np.issubdtype(x.dtype, np.number) and not np.issubdtype(x.dtype, np.complexfloating)):
        raise ValueError(f"{file}: x must be numeric, got dtype {x.dtype}")
    num_classes = int(y.max()) + 1
    if "num_classes" in arrays:
        num_classes = max(num_classes, int(arrays["num_classes"]))
    meta = {"source": str(file)}
    if x.ndim == 2:
        xf = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
        xf, mean, std = _standardise(xf, (0,))
        ds = Dataset(name, xf, y, num_classes, meta={**meta, "mean": mean, "std": std})
    elif x.ndim in (3, 4):
        if x.ndim == 3:
            x = x[:, None]
        elif x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            x = x.transpose(0, 3, 1, 2)
        ds = _images(name, x, y, num_classes, **meta)
    else:
        raise ValueError(f"{file}: x must be [N, D], [N, H, W], [N, C, H, W] or [N, H, W, C]; "
                         f"got {list(x.shape)}")
    if "groups" in arrays:
        g = arrays["groups"]
        if g.shape != y.shape or not np.issubdtype(g.dtype, np.integer):
            raise ValueError(f"{file}: groups must hold one integer per sample")
        ds.groups = [np.flatnonzero(g == v).astype(np.int64) for v in np.unique(g)]
    return ds


# ----------------------------------------------------------------------------- torchvision
def _unavailable(name: str, why: str) -> DatasetUnavailable:
    return DatasetUnavailable(
        f"dataset {name!r} is unavailable: {why}. Offline, use dataset = \"npz:PATH\" (an .npz "
        f"with x and y, e.g. npz:../shared/data/mnist-10k.npz), \"digits\", \"synthetic\" or "
        f"\"mnist1d\"; or point --data-dir (data.data_dir) at a folder that already holds the "
        f"torchvision files")


def _reachable(url: str | None, timeout: float = 3.0) -> bool:
    if not url:
        return False
    u = urlparse(url)
    if not u.hostname:
        return False
    try:
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def _load_torchvision(name: str, data_dir: str | None) -> Dataset:
    cls_name, kwargs, num_classes = TORCHVISION[name]
    try:
        import torchvision.datasets as tvd
    except ImportError:
        raise _unavailable(name, "torchvision is not installed (pip install 'fedbus[vision]')") \
            from None
    cls = getattr(tvd, cls_name)
    root = data_dir_path(data_dir)

    def both(download: bool):
        return [cls(str(root), train=t, download=download, **kwargs) for t in (True, False)]

    try:
        parts = both(False)
    except RuntimeError:
        mirrors = list(getattr(cls, "mirrors", None) or [])
        url = getattr(cls, "url", None) or (mirrors[0] if mirrors else None)
        if not _reachable(url):
            raise _unavailable(name, f"it is not in {root} and its server "
                               f"({urlparse(url).hostname if url else '?'}) cannot be reached "
                               f"(offline?)") from None
        try:
            root.mkdir(parents=True, exist_ok=True)
            parts = both(True)
        except Exception as err:  # noqa: BLE001 - any download failure reads the same
            raise _unavailable(name, f"download into {root} failed ({err})") from None
    xs, ys = [], []
    for p in parts:
        x = np.asarray(p.data.numpy() if hasattr(p.data, "numpy") else p.data)
        y = np.asarray(p.targets.numpy() if hasattr(p.targets, "numpy") else p.targets)
        if cls_name == "EMNIST":
            x = x.transpose(0, 2, 1)  # torchvision's EMNIST images are stored transposed
        xs.append(x)
        ys.append(y)
    x, y = np.concatenate(xs), np.concatenate(ys).astype(np.int64)
    x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)  # CIFAR is NHWC
    return _images(name, x, y, num_classes, source=f"torchvision.datasets.{cls_name}",
                   root=str(root), train_size=len(parts[0].targets))


# ------------------------------------------------------------------------------ generators
def _load_synthetic(seed: int, synthetic_alpha: float = 0.5, synthetic_beta: float = 0.5,
                    synthetic_iid: bool = False) -> Dataset:
    from .synthetic import generate_synthetic

    s = generate_synthetic(float(synthetic_alpha), float(synthetic_beta), seed=seed,
                           iid=bool(synthetic_iid))
    x = np.concatenate(s.x).astype(np.float32)
    y = np.concatenate(s.y).astype(np.int64)
    ends = np.cumsum(s.samples)
    groups = [np.arange(e - n, e, dtype=np.int64) for n, e in zip(s.samples, ends)]
    tag = "iid" if synthetic_iid else f"{synthetic_alpha:g},{synthetic_beta:g}"
    return Dataset("synthetic", x, y, 10, groups=groups,
                   meta={"source": f"FedProx synthetic({tag})", "seed": seed,
                         "alpha": float(synthetic_alpha), "beta": float(synthetic_beta),
                         "iid": bool(synthetic_iid), "samples": s.samples.tolist()})


def _load_mnist1d(seed: int, num_samples: int = 5000) -> Dataset:
    from .mnist1d import make_mnist1d

    x, y = make_mnist1d(int(num_samples), seed=seed)
    return Dataset("mnist1d", x, y, 10, meta={"source": "MNIST-1D generator", "seed": seed})


# -------------------------------------------------------------------------------- dispatch
_PARAMS = {"synthetic": {"synthetic_alpha", "synthetic_beta", "synthetic_iid"},
           "mnist1d": {"num_samples"},
           "digit5-offline": {"domain_samples"},
           "digit5": {"image_size", "domain_samples"},
           "office10": {"image_size", "domain_samples"},
           "shapes-seg": {"num_images", "image_size"},
           "voc2012": {"num_images", "image_size"}}
_CACHE: dict[tuple, Dataset] = {}
_LOCK = threading.Lock()


def load_dataset(name: str, *, data_dir: str | None = None, seed: int = 0,
                 **params: Any) -> Dataset:
    """Load dataset ``name`` (see the module doc for names and params).

    data_dir: download/cache folder of the torchvision datasets, the folder holding the
        digit5 / office10 files, and a second place to look for a relative npz path (None or
        "" = ~/.cache/fedbus).
    seed: seeds the generated datasets (synthetic, mnist1d, shapes-seg); the others ignore it (the
        multi-domain sets are built with a fixed seed: fedbus.node.data.domains).
    Unknown name -> ValueError listing the valid names; a dataset that cannot be had here ->
    DatasetUnavailable (a RuntimeError) naming ``npz:PATH`` and ``--data-dir``.
    Results are cached per process (same arguments -> the same object).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"dataset name must be a non-empty string; valid names: "
                         f"{', '.join(DATASETS)}")
    name = name.strip()
    if name.startswith("npz:"):
        base = "npz"
    elif name.lower().split(":", 1)[0] == "digit5-offline":
        base = "digit5-offline"
    else:
        base = name.lower()
    if base not in ("digits", "npz", "synthetic", "mnist1d", "digit5-offline", "digit5",
                    "office10", "shapes-seg", "voc2012", *TORCHVISION):
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    extra = set(params) - _PARAMS.get(base, set())
    if extra:
        raise ValueError(f"dataset {name!r} takes no parameter(s) {', '.join(sorted(extra))}"
                         + (f"; it takes {', '.join(sorted(_PARAMS[base]))}"
                            if base in _PARAMS else ""))
    seeded = base in ("synthetic", "mnist1d", "shapes-seg")
    key = (name, str(data_dir or ""), seed if seeded else None, tuple(sorted(params.items())))
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    if base == "digits":
        ds = _load_digits()
    elif base == "npz":
        ds = _load_npz(name[4:], data_dir)
    elif base == "synthetic":
        ds = _load_synthetic(int(seed), **params)
    elif base == "mnist1d":
        ds = _load_mnist1d(int(seed), **params)
    elif base == "shapes-seg":
        from .segmentation import load_shapes

        ds = load_shapes(int(seed), **params)
    elif base == "voc2012":
        from .segmentation import load_voc2012

        ds = load_voc2012(data_dir, **params)
    elif base in ("digit5-offline", "digit5", "office10"):
        from . import domains

        if base == "digit5-offline":
            ds = domains.load_digit5_offline(name.split(":", 1)[1] if ":" in name else "",
                                             data_dir, **params)
        elif base == "digit5":
            ds = domains.load_digit5(data_dir, **params)
        else:
            ds = domains.load_office10(data_dir, **params)
    else:
        ds = _load_torchvision(base, data_dir)
    with _LOCK:
        return _CACHE.setdefault(key, ds)


def clear_cache() -> None:
    """Forget every cached dataset (and partition: see fedbus.node.data.federated)."""
    with _LOCK:
        _CACHE.clear()

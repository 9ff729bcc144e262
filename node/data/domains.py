"""Multi-domain datasets for feature-skew federations (Digit-5, Office-Caltech-10).

Each dataset here has one label space shared by several *domains* (image styles), and
``Dataset.groups`` holds one index array per domain (``meta["domains"]`` their names), so
``partition = "domains"`` gives every client one domain (``"natural"`` one whole domain per
client). Samples are stored domain by domain, in the order of ``meta["domains"]``.

digit5-offline:PATH -- a Digit-5-like set built offline
    PATH is an MNIST npz (``x`` uint8 [N, 28, 28], ``y``; e.g. ../shared/data/mnist-10k.npz),
    looked up like ``npz:PATH`` (working directory, then data_dir). Five 28x28 grayscale
    domains with the labels 0-9. The MNIST images are shuffled with
    ``default_rng(seed)`` and cut into four equal disjoint parts (2,500 each of the 10,000),
    one per MNIST-based domain, so no image appears twice; domain d's own random draws come
    from ``default_rng([seed, d])``. seed is ``OFFLINE_SEED`` (0): the set is fixed, like a
    downloaded benchmark; ``federation.seed`` only changes the partition.

    0 ``mnist``          the MNIST images as they are.
    1 ``mnist-inverted`` 255 - x: white background, black strokes.
    2 ``mnist-rotated``  each image rotated about its centre by its own angle, uniform in
                         [30, 60] degrees, anticlockwise or clockwise with probability 1/2
                         (bilinear, zeros outside the source), rounded to uint8.
    3 ``mnist-texture``  MNIST-M in spirit (grayscale): per image a texture t = white noise
                         N(0, 1) [28, 28] smoothed by a Gaussian of sigma 1, 2 or 3 px
                         (uniform; periodic borders), min-max scaled to [0, 255]; the image is
                         |t - x| (MNIST-M's blend of a digit with a background patch), rounded.
    4 ``digits-28``      scikit-learn's 1,797 8x8 digits (0..16) scaled by 255/16 and
                         upsampled to 28x28 bilinearly (half-pixel centres, as
                         ``torch.nn.functional.interpolate(mode="bilinear",
                         align_corners=False)``), rounded: a second writer population,
                         thicker strokes that fill the frame (USPS-like).

    Then x/255 and standardised with the whole set's mean/std, as ``npz:PATH``.
    ``domain_samples`` = k > 0 keeps a seeded random k of each domain.

digit5 -- the Digit-5 benchmark (Peng et al., "Moment Matching for Multi-Source Domain
    Adaptation", ICCV 2019; used by FedBN and MP-FedCL) from ``data_dir``
    Files (the "Digit-Five" folder as distributed for M3SDA and read by Dassl.pytorch's
    datasets/da/digit5.py), in DATA_DIR/Digit-Five, DATA_DIR/digit5 or DATA_DIR itself:

        mnist_data.mat          train_32, test_32 [N, 32, 32] (or train_28/test_28),
                                label_train, label_test one-hot [N, 10]
        mnistm_with_label.mat   train, test [N, H, W, 3]; label_train, label_test one-hot
        svhn_train_32x32.mat    X [32, 32, 3, N], y [N, 1] (10 = digit 0)
        svhn_test_32x32.mat     the same
        syn_number.mat          train_data, test_data [N, 32, 32, 3]; train_label, test_label
        usps_28x28.mat          dataset: a 2x2 cell {train x [N, 1, 28, 28] in [0, 1],
                                train y [N, 1]; test x, test y}

    Domains ``mnist, mnistm, svhn, syn, usps``; train and test pooled per domain (the
    partitioner splits per client); a label 10 becomes 0; gray images repeated to 3 channels;
    every image resized bilinearly to ``image_size`` (0 = 32) px square; x in [0, 1] then
    standardised per channel over the whole set. The full set is ~270,000 images (~3.3 GB as
    float32 at 32 px): ``domain_samples`` = k keeps a seeded random k per domain.
    FedBN's pickled partitions are not read (fedbus loads no pickle).

office10 -- Office-Caltech-10 (Gong et al., CVPR 2012) from ``data_dir``
    DATA_DIR/office_caltech_10/ (FedBN's name) or DATA_DIR itself, holding the folders
    ``amazon, caltech, dslr, webcam``, each with one sub-folder of images per class, named
    as in Office-31: ``back_pack, bike, calculator, headphones, keyboard, laptop_computer,
    monitor, mouse, mug, projector`` (labels 0-9 in that order). Images (.jpg, .jpeg, .png,
    .bmp, any case) are read with Pillow in sorted path order, converted to RGB and resized
    (squashed, bilinear) to ``image_size`` (0 = 32) px square, as FedBN's Resize([256, 256]);
    x/255 then standardised per channel.

All three are deterministic and do not depend on ``federation.seed``; a missing file or
folder is DatasetUnavailable naming what is expected where.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .datasets import (Dataset, DatasetUnavailable, _digits_arrays, _images, _resolve_npz,
                       data_dir_path)

#: the seed of the digit5-offline construction and of every domain_samples subset
OFFLINE_SEED = 0
DEFAULT_IMAGE_SIZE = 32

OFFLINE_DOMAINS = ("mnist", "mnist-inverted", "mnist-rotated", "mnist-texture", "digits-28")
ROTATION_DEGREES = (30.0, 60.0)
TEXTURE_SIGMAS = (1, 2, 3)

DIGIT5_DOMAINS = ("mnist", "mnistm", "svhn", "syn", "usps")
DIGIT5_FOLDERS = ("Digit-Five", "digit5", ".")
DIGIT5_FILES = {
    "mnist": ("mnist_data.mat",),
    "mnistm": ("mnistm_with_label.mat",),
    "svhn": ("svhn_train_32x32.mat", "svhn_test_32x32.mat"),
    "syn": ("syn_number.mat",),
    "usps": ("usps_28x28.mat",),
}

OFFICE10_DOMAINS = ("amazon", "caltech", "dslr", "webcam")
OFFICE10_CLASSES = ("back_pack", "bike", "calculator", "headphones", "keyboard",
                    "laptop_computer", "monitor", "mouse", "mug", "projector")
OFFICE10_FOLDERS = ("office_caltech_10", ".")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


# ------------------------------------------------------------------------------ helpers
def domain_ids(ds: Dataset) -> np.ndarray:
    """int64 [N]: each sample's domain (its index in ``ds.groups``); -1 where none."""
    out = np.full(len(ds), -1, dtype=np.int64)
    for d, g in enumerate(ds.groups or []):
        out[np.asarray(g, dtype=np.int64)] = d
    return out


def _interp_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] bilinear weights, half-pixel centres, edges clamped (torch's
    align_corners=False)."""
    src = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
    src = np.clip(src, 0.0, n_in - 1)
    i0 = np.floor(src).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    w = src - i0
    m = np.zeros((n_out, n_in), dtype=np.float64)
    rows = np.arange(n_out)
    np.add.at(m, (rows, i0), 1.0 - w)
    np.add.at(m, (rows, i1), w)
    return m


def resize_bilinear(x: np.ndarray, height: int, width: int | None = None) -> np.ndarray:
    """Resize images ``[..., H, W]`` to ``[..., height, width]`` bilinearly (float32)."""
    width = height if width is None else width
    h, w = x.shape[-2:]
    x = np.asarray(x, dtype=np.float32)
    if (h, w) == (height, width):
        return x.copy()
    mh = _interp_matrix(h, height).astype(np.float32)
    mw = _interp_matrix(w, width).astype(np.float32)
    return np.ascontiguousarray(mh @ x @ mw.T)


def rotate_bilinear(x: np.ndarray, degrees: np.ndarray) -> np.ndarray:
    """Rotate each image of ``x`` [N, H, W] about its centre by ``degrees[n]`` (positive =
    anticlockwise as displayed, rows running down); bilinear, 0 outside. float32."""
    n, h, w = x.shape
    t = np.deg2rad(np.asarray(degrees, dtype=np.float64))[:, None, None]
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    r, c = np.meshgrid(np.arange(h) - cy, np.arange(w) - cx, indexing="ij")
    # inverse map: output pixel (r, c) reads the source at (r, c) turned back by t (with
    # rows pointing down, a display-anticlockwise turn by t maps (r, c) to
    # (r cos t - c sin t, r sin t + c cos t))
    sr = np.cos(t) * r + np.sin(t) * c + cy
    sc = -np.sin(t) * r + np.cos(t) * c + cx
    pad = np.zeros((n, h + 2, w + 2), dtype=np.float64)
    pad[:, 1:-1, 1:-1] = x
    r0, c0 = np.floor(sr), np.floor(sc)
    wr, wc = sr - r0, sc - c0
    k = np.arange(n)[:, None, None]

    def at(rr, cc):
        return pad[k, np.clip(rr, -1, h).astype(np.int64) + 1,
                   np.clip(cc, -1, w).astype(np.int64) + 1]

    out = ((1 - wr) * (1 - wc) * at(r0, c0) + (1 - wr) * wc * at(r0, c0 + 1)
           + wr * (1 - wc) * at(r0 + 1, c0) + wr * wc * at(r0 + 1, c0 + 1))
    return out.astype(np.float32)


def rotation_angles(n: int, rng: np.random.Generator) -> np.ndarray:
    """Domain 2's angles: |angle| ~ U(ROTATION_DEGREES), sign +/- with probability 1/2."""
    lo, hi = ROTATION_DEGREES
    mag = rng.uniform(lo, hi, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return mag * sign


def textures(n: int, rng: np.random.Generator, size: int = 28) -> np.ndarray:
    """Domain 3's backgrounds: float64 [n, size, size] in [0, 255] (see the module doc)."""
    from scipy.ndimage import gaussian_filter

    noise = rng.standard_normal((n, size, size))
    sigmas = rng.choice(np.array(TEXTURE_SIGMAS), size=n)
    out = np.empty_like(noise)
    for s in TEXTURE_SIGMAS:
        m = sigmas == s
        if m.any():
            out[m] = gaussian_filter(noise[m], sigma=(0, s, s), mode="wrap")
    lo = out.min(axis=(1, 2), keepdims=True)
    hi = out.max(axis=(1, 2), keepdims=True)
    return (out - lo) / np.maximum(hi - lo, 1e-12) * 255.0


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def _subset(n: int, limit: int, domain: int) -> np.ndarray:
    """Sorted indices of a seeded random ``limit`` of ``n`` (all when limit is 0 or >= n)."""
    limit = int(limit or 0)
    if limit < 0:
        raise ValueError(f"domain_samples must be >= 0, got {limit}")
    if limit == 0 or limit >= n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([OFFLINE_SEED, 1000 + domain])
    return np.sort(rng.choice(n, size=limit, replace=False)).astype(np.int64)


def _groups(sizes: list[int]) -> list[np.ndarray]:
    ends = np.cumsum(sizes)
    return [np.arange(e - s, e, dtype=np.int64) for s, e in zip(sizes, ends)]


def _image_size(image_size: int) -> int:
    s = int(image_size or 0) or DEFAULT_IMAGE_SIZE
    if s < 1:
        raise ValueError(f"image_size must be >= 0 (0 = {DEFAULT_IMAGE_SIZE}), got {image_size}")
    return s


# ------------------------------------------------------------------------- digit5-offline
def build_digit5_offline(mnist_x: np.ndarray, mnist_y: np.ndarray, digits_x: np.ndarray,
                         digits_y: np.ndarray, seed: int = OFFLINE_SEED) -> dict[str, np.ndarray]:
    """The five domains as uint8 images (the recipe of the module doc).

    mnist_x uint8 [N, 28, 28], mnist_y [N]; digits_x [M, 8, 8] in 0..16, digits_y [M].
    Returns x uint8 [N + M, 28, 28], y int64, domain int64 (0-4), source int64 (the index
    of each image in mnist_x for domains 0-3, in digits_x for domain 4), domain by domain.
    """
    mnist_x = np.asarray(mnist_x)
    if mnist_x.ndim != 3 or mnist_x.shape[1:] != (28, 28):
        raise ValueError(f"digit5-offline needs MNIST images [N, 28, 28]; got "
                         f"{list(mnist_x.shape)}")
    if len(mnist_x) < 4:
        raise ValueError("digit5-offline needs at least 4 MNIST images")
    if mnist_x.dtype != np.uint8:
        mx = mnist_x.astype(np.float64)
        mnist_x = _to_uint8(mx * 255.0 if mx.max() <= 1.0 else mx)
    parts = [np.sort(p) for p in np.array_split(np.random.default_rng(seed).permutation(
        len(mnist_x)), 4)]
    xs, ys, ds, srcs = [], [], [], []
    for d, src in enumerate(parts):
        img = mnist_x[src]
        rng = np.random.default_rng([seed, d])
        if d == 1:
            img = 255 - img
        elif d == 2:
            img = _to_uint8(rotate_bilinear(img, rotation_angles(len(img), rng)))
        elif d == 3:
            img = _to_uint8(np.abs(textures(len(img), rng) - img))
        xs.append(img)
        ys.append(np.asarray(mnist_y)[src])
        srcs.append(src)
    dig = np.asarray(digits_x, dtype=np.float64).reshape(-1, 8, 8) * (255.0 / 16.0)
    xs.append(_to_uint8(resize_bilinear(dig, 28)))
    ys.append(np.asarray(digits_y))
    srcs.append(np.arange(len(dig)))
    for d, x in enumerate(xs):
        ds.append(np.full(len(x), d, dtype=np.int64))
    return {"x": np.concatenate(xs), "y": np.concatenate(ys).astype(np.int64),
            "domain": np.concatenate(ds), "source": np.concatenate(srcs).astype(np.int64)}


def load_digit5_offline(path: str, data_dir: str | None, domain_samples: int = 0) -> Dataset:
    name = f"digit5-offline:{path}"
    if not path:
        raise ValueError("dataset 'digit5-offline' needs the MNIST npz it is built from: "
                         "digit5-offline:PATH, e.g. digit5-offline:../shared/data/mnist-10k.npz")
    try:
        file = _resolve_npz(path, data_dir)
    except DatasetUnavailable as err:
        raise DatasetUnavailable(f"digit5-offline: the MNIST npz was not found ({err}); give "
                                 f"an npz with x uint8 [N, 28, 28] and y, e.g. "
                                 f"digit5-offline:../shared/data/mnist-10k.npz") from None
    try:
        with np.load(file, allow_pickle=False) as z:
            if "x" not in z.files or "y" not in z.files:
                raise ValueError(f"{file}: digit5-offline needs arrays 'x' and 'y' "
                                 f"(has {', '.join(z.files) or 'nothing'})")
            mx, my = z["x"], z["y"]
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: not a readable MNIST npz ({err})") from None
    if mx.ndim == 4 and mx.shape[1] == 1:
        mx = mx[:, 0]
    elif mx.ndim == 4 and mx.shape[-1] == 1:
        mx = mx[..., 0]
    my = np.asarray(my).ravel()
    if len(my) != len(mx) or len(my) == 0 or my.min() < 0 or my.max() > 9:
        raise ValueError(f"{file}: digit5-offline needs one label 0-9 per image; got x "
                         f"{list(mx.shape)}, y {list(my.shape)}")
    dx, dy = _digits_arrays()
    raw = build_digit5_offline(mx, my, dx.reshape(-1, 8, 8), dy)
    keep = [np.flatnonzero(raw["domain"] == d) for d in range(len(OFFLINE_DOMAINS))]
    keep = [k[_subset(len(k), domain_samples, d)] for d, k in enumerate(keep)]
    idx = np.concatenate(keep)
    ds = _images(name, raw["x"][idx][:, None], raw["y"][idx], 10, source=str(file),
                 domains=list(OFFLINE_DOMAINS), seed=OFFLINE_SEED,
                 domain_sizes=[len(k) for k in keep], domain_samples=int(domain_samples or 0))
    ds.groups = _groups([len(k) for k in keep])
    return ds


# --------------------------------------------------------------------------------- digit5
def _find_folder(root: Path, folders: tuple[str, ...], needed: list[str]) -> tuple[Path, list]:
    """The first candidate folder holding every needed entry, else (best, its missing)."""
    best, best_missing = None, None
    for f in folders:
        cand = root if f == "." else root / f
        missing = [n for n in needed if not (cand / n).exists()]
        if not missing:
            return cand, []
        if best_missing is None or len(missing) < len(best_missing):
            best, best_missing = cand, missing
    return best, best_missing


def _loadmat(file: Path) -> dict:
    from scipy.io import loadmat

    try:
        return loadmat(str(file))
    except NotImplementedError:
        raise ValueError(f"{file}: a MATLAB v7.3 (HDF5) file; re-save it as v7 or older "
                         f"(scipy.io.loadmat reads those)") from None
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{file}: not a readable .mat file ({err})") from None


def _key(m: dict, file: Path, *names: str) -> np.ndarray:
    for n in names:
        if n in m:
            return np.asarray(m[n])
    have = [k for k in m if not k.startswith("__")]
    raise ValueError(f"{file}: expected {' or '.join(repr(n) for n in names)}; it has "
                     f"{', '.join(have) or 'nothing'}")


def _labels(y: np.ndarray, n: int, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[0] == n and y.shape[1] > 1:
        y = y.argmax(axis=1)  # one-hot
    y = y.ravel().astype(np.int64)
    if len(y) != n:
        raise ValueError(f"{where}: {len(y)} labels for {n} images")
    y[y == 10] = 0  # SVHN-style 10 for the digit 0
    if n and (y.min() < 0 or y.max() > 9):
        raise ValueError(f"{where}: labels must be digits 0-9 (or 10 for 0)")
    return y


def _nchw01(x: np.ndarray, where: str) -> np.ndarray:
    """Images [N, H, W], [N, H, W, C] or [N, C, H, W] (C 1 or 3) -> float32 [N, 3, H, W]
    in [0, 1]."""
    x = np.asarray(x)
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"{where}: expected images [N, H, W], [N, H, W, C] or [N, C, H, W] "
                         f"with 1 or 3 channels; got {list(x.shape)}")
    if x.dtype == np.uint8:
        out = x.astype(np.float32) / 255.0
    else:
        out = x.astype(np.float32)
        if out.size and out.max() > 1.0 + 1e-6:
            out = out / 255.0
    return np.repeat(out, 3, axis=1) if out.shape[1] == 1 else out


def _digit5_domain(folder: Path, dom: str) -> tuple[np.ndarray, np.ndarray]:
    """One domain's pooled train + test: images (any layout) and labels, per Dassl's reader."""
    if dom == "mnist":
        f = folder / "mnist_data.mat"
        m = _loadmat(f)
        xs = [_key(m, f, "train_32", "train_28"), _key(m, f, "test_32", "test_28")]
        side = {1024: 32, 784: 28}
        xs = [x.reshape(len(x), side[x.shape[1]], side[x.shape[1]])
              if x.ndim == 2 and x.shape[1] in side else x for x in xs]
        ys = [_key(m, f, "label_train"), _key(m, f, "label_test")]
    elif dom == "mnistm":
        f = folder / "mnistm_with_label.mat"
        m = _loadmat(f)
        xs = [_key(m, f, "train"), _key(m, f, "test")]
        ys = [_key(m, f, "label_train"), _key(m, f, "label_test")]
    elif dom == "svhn":
        xs, ys = [], []
        for name in DIGIT5_FILES["svhn"]:
            f = folder / name
            m = _loadmat(f)
            x = _key(m, f, "X")
            if x.ndim != 4:
                raise ValueError(f"{f}: X must be [32, 32, 3, N]; got {list(x.shape)}")
            xs.append(x.transpose(3, 0, 1, 2))
            ys.append(_key(m, f, "y"))
    elif dom == "syn":
        f = folder / "syn_number.mat"
        m = _loadmat(f)
        xs = [_key(m, f, "train_data"), _key(m, f, "test_data")]
        ys = [_key(m, f, "train_label"), _key(m, f, "test_label")]
    else:  # usps
        f = folder / "usps_28x28.mat"
        cell = _key(_loadmat(f), f, "dataset")
        if cell.dtype != object or cell.shape[:2] != (2, 2):
            raise ValueError(f"{f}: 'dataset' must be a 2x2 cell {{train x, train y; test x, "
                             f"test y}}; got {cell.dtype} {list(cell.shape)}")
        xs = [np.asarray(cell[0, 0]), np.asarray(cell[1, 0])]
        ys = [np.asarray(cell[0, 1]), np.asarray(cell[1, 1])]
    where = f"digit5 {dom} ({folder})"
    xs = [_nchw01(x, where) if x.size else x for x in xs]
    ys = [_labels(y, len(x), where) for x, y in zip(xs, ys)]
    xs = [x for x in xs if x.size]
    if not xs:
        raise ValueError(f"{where}: no images")
    h = max(x.shape[2] for x in xs)
    w = max(x.shape[3] for x in xs)
    xs = [resize_bilinear(x, h, w) for x in xs]
    return np.concatenate(xs), np.concatenate([y for y in ys if y.size])


def load_digit5(data_dir: str | None, image_size: int = 0, domain_samples: int = 0) -> Dataset:
    size = _image_size(image_size)
    root = data_dir_path(data_dir)
    files = [f for fs in DIGIT5_FILES.values() for f in fs]
    folder, missing = _find_folder(root, DIGIT5_FOLDERS, files)
    if missing:
        raise DatasetUnavailable(
            f"dataset 'digit5' needs the Digit-Five .mat files {', '.join(files)} in "
            f"{root / 'Digit-Five'}, {root / 'digit5'} or {root} (data.data_dir / --data-dir); "
            f"{folder} lacks {', '.join(missing)}. Offline, dataset = "
            f"\"digit5-offline:../shared/data/mnist-10k.npz\" builds a Digit-5-like set "
            f"(docs/DATA.md)")
    xs, ys, sizes = [], [], []
    for d, dom in enumerate(DIGIT5_DOMAINS):
        x, y = _digit5_domain(folder, dom)
        keep = _subset(len(x), domain_samples, d)
        xs.append(resize_bilinear(x[keep], size))
        ys.append(y[keep])
        sizes.append(len(keep))
    x = np.concatenate(xs)
    ds = _images("digit5", x, np.concatenate(ys), 10, source=str(folder),
                 domains=list(DIGIT5_DOMAINS), domain_sizes=sizes, image_size=size,
                 domain_samples=int(domain_samples or 0))
    ds.groups = _groups(sizes)
    return ds


# ------------------------------------------------------------------------------- office10
def load_office10(data_dir: str | None, image_size: int = 0, domain_samples: int = 0) -> Dataset:
    size = _image_size(image_size)
    root = data_dir_path(data_dir)
    folder, missing = _find_folder(root, OFFICE10_FOLDERS, list(OFFICE10_DOMAINS))
    if missing:
        raise DatasetUnavailable(
            f"dataset 'office10' needs the Office-Caltech-10 folders "
            f"{', '.join(d + '/' for d in OFFICE10_DOMAINS)} (each with one sub-folder of "
            f"images per class: {', '.join(OFFICE10_CLASSES)}) in "
            f"{root / 'office_caltech_10'} or {root} (data.data_dir / --data-dir); {folder} "
            f"lacks {', '.join(d + '/' for d in missing)}")
    try:
        from PIL import Image
    except ImportError:
        raise DatasetUnavailable("dataset 'office10' reads its images with Pillow, which is "
                                 "not installed (pip install Pillow)") from None
    xs, ys, sizes = [], [], []
    for d, dom in enumerate(OFFICE10_DOMAINS):
        files, labels = [], []
        for sub in sorted(p for p in (folder / dom).iterdir() if p.is_dir()
                          and not p.name.startswith(".")):
            if sub.name not in OFFICE10_CLASSES:
                raise ValueError(f"office10: {sub} is not one of the class folders "
                                 f"{', '.join(OFFICE10_CLASSES)}")
            imgs = sorted(p for p in sub.rglob("*") if p.is_file()
                          and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
            files += imgs
            labels += [OFFICE10_CLASSES.index(sub.name)] * len(imgs)
        if not files:
            raise DatasetUnavailable(f"office10: no images ({', '.join(IMAGE_SUFFIXES)}) in "
                                     f"the class folders of {folder / dom}")
        keep = _subset(len(files), domain_samples, d)
        arr = np.empty((len(keep), size, size, 3), dtype=np.uint8)
        for j, k in enumerate(keep):
            try:
                with Image.open(files[k]) as im:
                    arr[j] = np.asarray(im.convert("RGB").resize((size, size),
                                                                 Image.BILINEAR))
            except OSError as err:
                raise ValueError(f"office10: cannot read image {files[k]} ({err})") from None
        xs.append(arr.transpose(0, 3, 1, 2))
        ys.append(np.asarray(labels, dtype=np.int64)[keep])
        sizes.append(len(keep))
    ds = _images("office10", np.concatenate(xs), np.concatenate(ys), len(OFFICE10_CLASSES),
                 source=str(folder), domains=list(OFFICE10_DOMAINS),
                 classes=list(OFFICE10_CLASSES), domain_sizes=sizes, image_size=size,
                 domain_samples=int(domain_samples or 0))
    ds.groups = _groups(sizes)
    return ds

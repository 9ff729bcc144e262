"""Semantic-segmentation datasets: per-pixel masks beside the images.

    ds = load_dataset("shapes-seg", seed=0)              # generated offline, 2,000 64x64 images
    ds = load_dataset("voc2012", data_dir="~/data")      # Pascal VOC 2012 from its devkit folder

A segmentation :class:`~fedbus.node.data.datasets.Dataset` carries ``masks`` uint8 [N, H, W]
(class ids, ``meta["ignore_index"]`` = 255 marks pixels that count nowhere) beside ``x``
float32 [N, 3, H, W]; ``y`` int64 [N] is one label per image, the image's *dominant object
class* (the object class covering the most pixels; 0 when it shows only background), which
is what the partitioners (dirichlet, nway-kshot, pathological, ...) split by: a Dirichlet
partition over y is a partition by class presence, as Michieli & Ozay distribute Pascal VOC
("a Dirichlet distribution over the number of classes on each client", their images holding
one object class each). FederatedData.client() then hands out the masks as int64
train_y/test_y [n, H, W], with ignored pixels as -100 (torch's cross-entropy ignore_index, so
every algorithm's loss skips them unchanged).

shapes-seg (generated, seeded, offline)
    RGB images of 0..5 objects of five classes on a smooth random background (class 0):
    1 disc, 2 square, 3 triangle, 4 ring, 5 cross; 1-3 objects an image (later ones occlude
    earlier ones), random size (radius 12-28 % of the side), position and rotation, partly
    outside the frame allowed. Every class has its own texture (disc: stripes at 0 deg,
    period 6 px; square: checkerboard, 6 px cells; triangle: dots on a 6 px lattice; ring:
    stripes at 60 deg, period 4 px; cross: stripes at 120 deg, period 9 px; all with a random
    phase and +-10 deg orientation jitter) drawn between two colours: the class's base colour
    with jitter (+-0.15 per channel) and a darker copy of it. Backgrounds are a linear
    gradient between two random muted colours plus a low-frequency wave and pixel noise
    (sigma 0.03). Params: num_images (0 = 2000), image_size (0 = 64). Generated vectorised
    with numpy from ``default_rng(seed)``: the same seed gives the same images everywhere.
    x is standardised per channel over the set.
voc2012 (Pascal VOC 2012 segmentation, read from disk)
    data_dir/VOCdevkit/VOC2012/{JPEGImages/ID.jpg, SegmentationClass/ID.png,
    ImageSets/Segmentation/{train,val}.txt}; the train and val lists are pooled (the
    partitioners split per client, as for the torchvision sets). Images are resized to
    image_size x image_size (0 = 128; bilinear, aspect ratio not kept), masks by nearest
    neighbour; 21 classes (0 background, 1 aeroplane .. 20 tvmonitor), 255 = the void
    border, kept as the ignore index. Params: image_size, num_images (0 = all; else a fixed
    random subset of that many, drawn with seed 0). Needs Pillow (imported only here).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

IGNORE_INDEX = 255  # in Dataset.masks (uint8), as Pascal VOC's void label
CLIENT_IGNORE = -100  # in the int64 masks clients train on: torch's cross-entropy default

SHAPES = ("background", "disc", "square", "triangle", "ring", "cross")
SHAPES_DEFAULT_IMAGES = 2000
SHAPES_DEFAULT_SIZE = 64
VOC_DEFAULT_SIZE = 128
VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car",
               "cat", "chair", "cow", "diningtable", "dog", "horse", "motorbike", "person",
               "pottedplant", "sheep", "sofa", "train", "tvmonitor")

# texture of each object class: (kind, orientation in degrees, period in pixels at 64 px)
_TEXTURES = {1: ("stripes", 0.0, 6.0), 2: ("checker", 0.0, 6.0), 3: ("dots", 0.0, 6.0),
             4: ("stripes", 60.0, 4.0), 5: ("stripes", 120.0, 9.0)}
# base colour of each object class (RGB in [0, 1]), jittered per object
_COLOURS = np.array([[0.0, 0.0, 0.0], [0.90, 0.25, 0.20], [0.20, 0.55, 0.95],
                     [0.95, 0.80, 0.15], [0.25, 0.85, 0.35], [0.80, 0.30, 0.90]])


def dominant_class(masks: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 [N]: each mask's object class (1..C-1) with the most pixels, 0 when it has
    none; ignored pixels (>= num_classes) count nowhere. Ties go to the lower class id."""
    n = len(masks)
    flat = masks.reshape(n, -1).astype(np.int64)
    valid = flat < num_classes
    rows = np.broadcast_to(np.arange(n)[:, None], flat.shape)
    counts = np.zeros((n, num_classes), np.int64)
    np.add.at(counts, (rows[valid], flat[valid]), 1)
    obj = counts[:, 1:]
    return np.where(obj.max(axis=1) > 0, obj.argmax(axis=1) + 1, 0).astype(np.int64)


def _shape_mask(cls: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside test of one class's shape in its own frame (u, v rotated, radius 1)."""
    r2 = u * u + v * v
    if cls == 1:  # disc
        return r2 <= 1.0
    if cls == 2:  # square
        return np.maximum(np.abs(u), np.abs(v)) <= 0.8
    if cls == 3:  # equilateral triangle inscribed in the unit circle
        inside = np.ones(u.shape, bool)
        for k in range(3):
            a = np.pi / 2 + k * 2 * np.pi / 3
            inside &= (u * np.cos(a) + v * np.sin(a)) >= -0.5
        return inside
    if cls == 4:  # ring
        return (r2 <= 1.0) & (r2 >= 0.55 ** 2)
    if cls == 5:  # cross
        au, av = np.abs(u), np.abs(v)
        return ((au <= 0.32) & (av <= 1.0)) | ((av <= 0.32) & (au <= 1.0))
    raise ValueError(cls)  # pragma: no cover


def _texture(cls: int, gx: np.ndarray, gy: np.ndarray, jitter: np.ndarray,
             phase: np.ndarray, scale: float) -> np.ndarray:
    """Texture (bool: light or dark) of class `cls` on pixel coordinates [n, H, W]
    (per-object orientation jitter in radians and phase in [0, 1), [n, 1, 1])."""
    kind, angle, period = _TEXTURES[cls]
    period = period * scale
    a = np.deg2rad(angle) + jitter
    s = gx * np.cos(a) + gy * np.sin(a)
    t = gy * np.cos(a) - gx * np.sin(a)
    if kind == "stripes":
        return ((s / period + phase) % 1.0) < 0.5
    if kind == "checker":
        cs = np.floor(s / period + phase)
        ct = np.floor(t / period + phase)
        return (cs + ct) % 2 == 0
    # dots: discs of radius 0.3 period on a square lattice
    fs = (s / period + phase) % 1.0 - 0.5
    ft = (t / period + phase) % 1.0 - 0.5
    return fs * fs + ft * ft <= 0.3 ** 2


def generate_shapes(num_images: int = SHAPES_DEFAULT_IMAGES, size: int = SHAPES_DEFAULT_SIZE,
                    *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 [N, 3, size, size] in [0, 1], masks uint8 [N, size, size]) of the
    shapes-seg generator (module doc), drawn from ``default_rng(seed)``."""
    if num_images < 1 or size < 8:
        raise ValueError(f"shapes-seg: need num_images >= 1 and image_size >= 8, got "
                         f"{num_images}, {size}")
    rng = np.random.default_rng(seed)
    n, H = int(num_images), int(size)
    scale = H / 64.0
    f32 = np.float32
    gy, gx = np.mgrid[0:H, 0:H].astype(f32)
    # background: a gradient between two muted colours, a low-frequency wave, noise
    c0 = rng.uniform(0.15, 0.75, (n, 3, 1, 1)).astype(f32)
    c1 = rng.uniform(0.15, 0.75, (n, 3, 1, 1)).astype(f32)
    theta = rng.uniform(0, 2 * np.pi, (n, 1, 1)).astype(f32)
    ramp = ((gx * np.cos(theta) + gy * np.sin(theta)) / f32(H * 1.42) + f32(0.5)).clip(0, 1)
    wf = (rng.uniform(0.5, 1.5, (n, 1, 1)) * 2 * np.pi / H).astype(f32)
    wa = rng.uniform(0, 2 * np.pi, (n, 1, 1)).astype(f32)
    ramp += f32(0.06) * np.sin(wf * gx + wa) * np.cos(wf * gy - wa)
    img = c0 + (c1 - c0) * ramp[:, None]
    img += rng.standard_normal((n, 3, H, H), dtype=f32) * f32(0.03)
    masks = np.zeros((n, H, H), np.uint8)
    # objects: up to 3 slots an image; slot s is used when s < the image's count
    count = rng.integers(1, 4, n)
    slots = 3
    cls = rng.integers(1, len(SHAPES), (slots, n))
    radius = rng.uniform(0.12, 0.28, (slots, n)) * H
    cx = rng.uniform(0.1, 0.9, (slots, n)) * H
    cy = rng.uniform(0.1, 0.9, (slots, n)) * H
    rot = rng.uniform(0, 2 * np.pi, (slots, n))
    jitter = np.deg2rad(rng.uniform(-10, 10, (slots, n)))
    phase = rng.uniform(0, 1, (slots, n))
    colour = (_COLOURS[cls] + rng.uniform(-0.15, 0.15, (slots, n, 3))).clip(0, 1)
    dark = colour * rng.uniform(0.25, 0.5, (slots, n, 1))

    def col3(a: np.ndarray) -> np.ndarray:  # [k, 3] -> [k, 3, 1, 1] float32
        return a.astype(f32)[:, :, None, None]

    for s in range(slots):
        for c in range(1, len(SHAPES)):
            idx = np.flatnonzero((s < count) & (cls[s] == c))
            if not len(idx):
                continue
            # this slot's parameters of the chosen images, as [k, 1, 1] float32
            r, x0, y0, ang, jit, ph = (a[s, idx].astype(f32)[:, None, None]
                                       for a in (radius, cx, cy, rot, jitter, phase))
            dx = (gx - x0) / r
            dy = (gy - y0) / r
            cr, sr = np.cos(ang), np.sin(ang)
            inside = _shape_mask(c, dx * cr + dy * sr, dy * cr - dx * sr)
            tex = _texture(c, gx, gy, jit, ph, scale).astype(f32)
            drk = col3(dark[s, idx])
            paint = drk + (col3(colour[s, idx]) - drk) * tex[:, None]
            sub = img[idx]
            np.copyto(sub, paint, where=inside[:, None])
            img[idx] = sub
            m = masks[idx]
            m[inside] = c
            masks[idx] = m
    np.clip(img, 0, 1, out=img)
    return img, masks


def load_shapes(seed: int, num_images: int = 0, image_size: int = 0):
    from .datasets import Dataset, _standardise

    n = int(num_images) or SHAPES_DEFAULT_IMAGES
    size = int(image_size) or SHAPES_DEFAULT_SIZE
    x, masks = generate_shapes(n, size, seed=seed)
    x, mean, std = _standardise(x, (0, 2, 3))
    y = dominant_class(masks, len(SHAPES))
    return Dataset("shapes-seg", np.ascontiguousarray(x), y, len(SHAPES), masks=masks,
                   meta={"source": "fedbus shapes-seg generator", "seed": seed,
                         "ignore_index": IGNORE_INDEX, "classes": list(SHAPES),
                         "mean": mean, "std": std, "images": n, "image_size": size})


# ----------------------------------------------------------------------------------- VOC
def voc_root(data_dir) -> Path:
    from .datasets import data_dir_path

    return data_dir_path(data_dir) / "VOCdevkit" / "VOC2012"


def load_voc2012(data_dir, image_size: int = 0, num_images: int = 0):
    from .datasets import Dataset, DatasetUnavailable, _standardise

    root = voc_root(data_dir)
    lists = root / "ImageSets" / "Segmentation"
    needed = [root / "JPEGImages", root / "SegmentationClass", lists / "train.txt",
              lists / "val.txt"]
    missing = [p for p in needed if not p.exists()]
    if missing:
        raise DatasetUnavailable(
            f"dataset 'voc2012' is unavailable: expected the Pascal VOC 2012 devkit at {root} "
            f"(JPEGImages/, SegmentationClass/, ImageSets/Segmentation/train.txt and val.txt; "
            f"missing {', '.join(str(p.relative_to(root)) for p in missing)}). Unpack "
            f"VOCtrainval_11-May-2012.tar under data.data_dir (--data-dir); fedbus does not "
            f"download it. Offline, dataset = \"shapes-seg\" is a generated segmentation set")
    try:
        from PIL import Image
    except ImportError:
        raise DatasetUnavailable("dataset 'voc2012' needs Pillow to read its JPEG and PNG "
                                 "files: pip install pillow") from None
    ids: list[str] = []
    for name in ("train.txt", "val.txt"):
        ids += [s.strip() for s in (lists / name).read_text().split() if s.strip()]
    ids = list(dict.fromkeys(ids))
    if num_images and num_images < len(ids):
        pick = np.sort(np.random.default_rng(0).choice(len(ids), int(num_images),
                                                       replace=False))
        ids = [ids[i] for i in pick]
    if not ids:
        raise DatasetUnavailable(f"dataset 'voc2012': {lists} lists no image")
    size = int(image_size) or VOC_DEFAULT_SIZE
    x = np.empty((len(ids), size, size, 3), np.uint8)
    masks = np.empty((len(ids), size, size), np.uint8)
    for i, key in enumerate(ids):
        jpg, png = root / "JPEGImages" / f"{key}.jpg", root / "SegmentationClass" / f"{key}.png"
        if not jpg.is_file() or not png.is_file():
            raise DatasetUnavailable(f"dataset 'voc2012': {key} is listed but "
                                     f"{jpg if not jpg.is_file() else png} is missing")
        with Image.open(jpg) as im:
            x[i] = np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR))
        with Image.open(png) as im:
            # palette PNGs: the palette indices are the class ids (255 = void)
            m = im if im.mode in ("P", "L") else im.convert("L")
            masks[i] = np.asarray(m.resize((size, size), Image.NEAREST))
    bad = (masks >= len(VOC_CLASSES)) & (masks != IGNORE_INDEX)
    if bad.any():
        raise ValueError(f"voc2012: mask values outside 0..20 and 255 "
                         f"({sorted(np.unique(masks[bad]).tolist())[:5]})")
    xf = x.transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    xf, mean, std = _standardise(xf, (0, 2, 3))
    y = dominant_class(masks, len(VOC_CLASSES))
    return Dataset("voc2012", np.ascontiguousarray(xf), y, len(VOC_CLASSES), masks=masks,
                   meta={"source": str(root), "ignore_index": IGNORE_INDEX,
                         "classes": list(VOC_CLASSES), "mean": mean, "std": std,
                         "images": len(ids), "image_size": size})

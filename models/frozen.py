"""Frozen pre-trained backbones with a small trainable projection (FedPCL's setting).

Tan et al., "Federated Learning from Pre-Trained Models: A Contrastive Learning Approach"
(NeurIPS 2022): every client runs the same FIXED pre-trained backbones, concatenates their
representations and trains only a small projection on top (the authors' code,
exps/federated_main.py `fed_main`: backbones in eval mode; lib/models/models.py
`ProjandDeci(in_d, 256, 10)`: fc1 -> ReLU -> L2-normalise is the representation, fc2 the
decision layer). The authors' backbones (ResNet-18s pre-trained on Quick, Draw!, aircraft
and birds) are not public, so fedbus pre-trains its own, offline, on data disjoint from the
federation, or loads them from local files.

As a registry architecture (``model.arch`` or a ``model.group`` entry)::

    frozen:BACKBONE[+BACKBONE...]
    BACKBONE = ARCH@digits          ARCH (a registry arch: cnn, cnn4, mlp, resnet8, ...)
                                    pre-trained by fedbus on scikit-learn's digits
             | ARCH@PATH.npz        ... on the images of an npz (x uint8 [N, H, W] or
                                    [N, H, W, C], y): e.g. ../shared/data/mnist-10k.npz
             | ARCH@imagenet        torchvision's ImageNet weights from a local file
                                    (fedbus.models.pretrained: resnet18, resnet34,
                                    mobilenetv2)
             | PATH.pt              a backbone file written by `pretrain_backbone` (or
                                    ``python -m fedbus.models.frozen``)

e.g. ``frozen:cnn@../shared/data/mnist-10k.npz+mlp@../shared/data/mnist-10k.npz``. The
projection's width is model.feature_dim (0 = 256, the code's).

Pre-training (`pretrain_backbone`, the recipe `Recipe`): the source's images are scaled to
[0, 1], resized (bilinear, antialiased) to the federation's sample shape, gray repeated to
the federation's channels (or colour averaged to gray), standardised per channel with the
source's own statistics (as fedbus.node.data standardises every dataset), and the
architecture is trained with the cross-entropy on the source's labels (its head is then
discarded): SGD, `Recipe` defaults, seeded, on one thread, so a recipe gives the same
weights to the bit on a machine. The weights are cached in ``$FEDBUS_BACKBONE_DIR`` (default
~/.cache/fedbus/backbones) under a file named by the recipe's hash (the source file's
content hash included); a lock makes the first process that needs a recipe train it and
every other (the server, each node, replay) read its file: all get identical weights. The
config layer refuses a source that is the federation's own data (fedbus.node.config).

The network (`FrozenBackboneNet`): ``features(x) = normalize(relu(proj(cat_b f_b(x))))``,
``head(h) = fc(h)`` (a plain linear layer, fedbus's convention: the code's fc2 -> ReLU ->
normalize -> log_softmax is FedPCL's own business, and FedPCL does not use it by default).
The backbones are no sub-modules: their tensors are not in ``parameters()`` or
``state_dict()``, so no optimiser sees them, no weight delta, checkpoint or client-state
eviction carries them, and only the projection and head count as the model's trainable and
shared state. They stay in eval mode, run under no_grad, and follow ``.to(device)``; every
client of a process shares one copy (they never change).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .base import ProtoNet
from .pretrained import PretrainedUnavailable

#: the projection width of the authors' ProjandDeci(in_d, 256, 10)
NATIVE_DIM = 256
FORMAT = "fedbus-backbone/1"
SOURCES = ("digits", "PATH.npz", "imagenet")


class BackboneError(PretrainedUnavailable):
    """A backbone that cannot be used: a missing or mismatching file, a bad spec."""


@dataclass(frozen=True)
class Recipe:
    """How fedbus pre-trains one backbone. `source`: "digits" or an npz's absolute path;
    `source_sha256`: the npz's content hash ("" for digits), so a changed file is a new
    recipe. The defaults are small on purpose: a few seconds on one CPU thread."""

    arch: str
    source: str
    in_shape: tuple[int, ...]
    source_sha256: str = ""
    epochs: int = 3
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 64
    seed: int = 0

    def key(self) -> str:
        text = json.dumps({**asdict(self), "format": FORMAT}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def file_name(self) -> str:
        tag = "digits" if self.source == "digits" else Path(self.source).stem
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in f"{self.arch}-{tag}")
        return f"{safe}-{self.key()}.pt"


# --- the spec ---------------------------------------------------------------------------------

def parse_spec(option: str | None) -> list[tuple[str, str]]:
    """``"cnn@digits+/x/b.pt"`` -> ``[("cnn", "digits"), ("", "/x/b.pt")]``: (arch, source)
    per backbone; a file's arch is "" (read from the file). ValueError for a bad spec."""
    if not option or not option.strip():
        raise ValueError("frozen needs its backbones: frozen:ARCH@SOURCE[+...] with SOURCE "
                         "digits, PATH.npz or imagenet, or frozen:PATH.pt (a backbone file)")
    from .registry import ARCHS  # the registry imports this module lazily, never at load

    out = []
    for part in option.split("+"):
        part = part.strip()
        if "@" not in part:
            if not part.endswith(".pt"):
                raise ValueError(f"frozen backbone {part!r}: ARCH@SOURCE (SOURCE digits, "
                                 f"PATH.npz or imagenet) or a backbone file PATH.pt")
            out.append(("", part))
            continue
        arch, _, source = part.partition("@")
        base = arch.split(":", 1)[0]
        if base not in ARCHS or base == "frozen":
            raise ValueError(f"frozen backbone {part!r}: {arch!r} is no single-vector registry "
                             f"arch ({', '.join(a for a in ARCHS if a != 'frozen')})")
        if source not in ("digits", "imagenet") and not source.endswith(".npz"):
            raise ValueError(f"frozen backbone {part!r}: the source is digits, PATH.npz or "
                             f"imagenet")
        out.append((arch, source))
    return out


def training_sources(option: str | None) -> list[str]:
    """The data the spec's backbones are pre-trained on by fedbus: "digits" or an npz's
    absolute path (for the config layer's check that it is not the federation's own)."""
    return [src if src == "digits" else os.path.abspath(os.path.expanduser(src))
            for arch, src in parse_spec(option) if arch and src != "imagenet"]


# --- pre-training -----------------------------------------------------------------------------

def cache_dir() -> Path:
    folder = os.environ.get("FEDBUS_BACKBONE_DIR") or "~/.cache/fedbus/backbones"
    return Path(os.path.expanduser(folder))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def recipe_for(arch: str, source: str, in_shape: tuple[int, ...], **changes: Any) -> Recipe:
    """The Recipe of ARCH@SOURCE for samples of `in_shape` (recipe defaults unless changed)."""
    if source == "digits":
        return Recipe(arch, "digits", tuple(int(v) for v in in_shape), **changes)
    path = Path(os.path.expanduser(source)).resolve()
    if not path.is_file():
        raise BackboneError(f"backbone source {source}: no such file (an npz with x and y)")
    return Recipe(arch, str(path), tuple(int(v) for v in in_shape), _file_sha256(path),
                  **changes)


def source_images(recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The recipe's training images at the federation's shape, standardised: (x float32
    [N, *in_shape], y int64 [N], classes)."""
    if recipe.source == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x = (d.data / 16.0).reshape(-1, 1, 8, 8)
        y = np.asarray(d.target)
    else:
        with np.load(recipe.source, allow_pickle=False) as f:
            if "x" not in f or "y" not in f:
                raise BackboneError(f"backbone source {recipe.source}: an npz needs x and y")
            x, y = f["x"], np.asarray(f["y"])
        x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
        if x.ndim == 3:
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            x = x.transpose(0, 3, 1, 2)
        if x.ndim != 4 or len(x) != len(y):
            raise BackboneError(f"backbone source {recipe.source}: x must be images [N, H, W] "
                                f"or [N, H, W, C] with one label each, got {list(x.shape)}")
    if len(recipe.in_shape) != 3:
        raise BackboneError(f"a pre-trained backbone needs image samples [C, H, W]; the "
                            f"federation's are {list(recipe.in_shape)}")
    c, h, w = recipe.in_shape
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if tuple(t.shape[2:]) != (h, w):
        t = F.interpolate(t, size=(h, w), mode="bilinear", align_corners=False,
                          antialias=bool(h < t.shape[2] or w < t.shape[3]))
    if t.shape[1] != c:
        if t.shape[1] == 1:
            t = t.expand(-1, c, -1, -1)
        elif c == 1:
            t = t.mean(dim=1, keepdim=True)
        else:
            raise BackboneError(f"backbone source {recipe.source}: {t.shape[1]} channels, the "
                                f"federation's samples have {c}")
    mean = t.mean(dim=(0, 2, 3), keepdim=True, dtype=torch.float64)
    std = t.double().std(dim=(0, 2, 3), keepdim=True, unbiased=False).clamp(min=1e-8)
    t = ((t.double() - mean) / std).float().contiguous()
    y_t = torch.from_numpy(y.astype(np.int64))
    return t, y_t, int(y_t.max().item()) + 1


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_backbone(recipe: Recipe) -> tuple[ProtoNet, dict[str, Any]]:
    """Pre-train the recipe's network (deterministic: seeded generator, one thread, the
    caller's RNG untouched). Returns the network in eval mode and {"source_acc"} (its
    accuracy on the source's own training images)."""
    from .registry import build_model

    x, y, classes = source_images(recipe)
    with torch.random.fork_rng(devices=[]), _one_thread():
        model = build_model(recipe.arch, in_shape=recipe.in_shape, num_classes=classes,
                            seed=recipe.seed)
        torch.manual_seed(recipe.seed)  # dropout draws
        opt = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum)
        gen = torch.Generator().manual_seed(recipe.seed)
        model.train()
        for _ in range(recipe.epochs):
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), recipe.batch_size):
                idx = order[i:i + recipe.batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model(x[i:i + 1024]).argmax(1) for i in range(0, len(y), 1024)])
    return model, {"source_acc": float((pred == y).float().mean().item())}


def save_backbone(model: ProtoNet, path: Path, recipe: Recipe | None = None,
                  info: dict[str, Any] | None = None) -> Path:
    """Write a backbone file (atomically): the network's arch, shapes and weights."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "arch": model.arch, "in_shape": list(model.in_shape),
           "num_classes": int(model.num_classes), "feature_dim": int(model.feature_dim),
           "recipe": json.dumps(asdict(recipe)) if recipe else "",
           "info": json.dumps(info or {}),
           "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(doc, tmp)
    os.replace(tmp, path)
    return path


def pretrain_backbone(recipe: Recipe, folder: Path | None = None) -> Path:
    """The recipe's backbone file in `folder` (default `cache_dir()`), trained first if it
    is not there. A lock file serialises processes asking for the same recipe: the first
    trains and writes, the others wait and read the same file."""
    folder = Path(folder) if folder is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / recipe.file_name()
    if path.is_file():
        return path
    with open(folder / f".{recipe.file_name()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not path.is_file():
                model, info = train_backbone(recipe)
                save_backbone(model, path, recipe, info)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def load_backbone(path: str | os.PathLike, in_shape: tuple[int, ...] | None = None) -> ProtoNet:
    """A backbone file as a network in eval mode; BackboneError, naming the file, if it is
    missing, not a backbone file, or made for other samples than `in_shape`."""
    from .registry import build_model

    path = Path(os.path.expanduser(path))
    if not path.is_file():
        raise BackboneError(f"backbone file {path} not found (write one with "
                            f"`python -m fedbus.models.frozen`, or give ARCH@SOURCE)")
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: torch's own message
        raise BackboneError(f"backbone file {path} does not load: "
                            f"{type(err).__name__}: {' '.join(str(err).split())[:200]}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BackboneError(f"backbone file {path} is not a fedbus backbone ({FORMAT}); "
                            f"write one with `python -m fedbus.models.frozen`")
    shape = tuple(int(v) for v in doc["in_shape"])
    if in_shape is not None and shape != tuple(in_shape):
        raise BackboneError(f"backbone file {path} was trained for samples {list(shape)}, the "
                            f"federation's are {list(in_shape)}")
    with torch.random.fork_rng(devices=[]):
        model = build_model(doc["arch"], in_shape=shape, num_classes=int(doc["num_classes"]),
                            feature_dim=int(doc["feature_dim"]), seed=0)
    try:
        model.load_state_dict(doc["state_dict"])
    except RuntimeError as err:
        raise BackboneError(f"backbone file {path}: its weights do not match a "
                            f"{doc['arch']} network: {' '.join(str(err).split())[:200]}") from None
    return model.eval()


# --- the network ------------------------------------------------------------------------------

#: backbones already built in this process: (arch, source, in_shape, file stamp) -> network
_SHARED: dict[tuple, ProtoNet] = {}


def _backbone(arch: str, source: str, in_shape: tuple[int, ...]) -> ProtoNet:
    if not arch:  # a file
        p = Path(os.path.expanduser(source)).resolve()
        stamp = (p.stat().st_mtime_ns, p.stat().st_size) if p.is_file() else None
        key = ("", str(p), in_shape, stamp)
        if key not in _SHARED:
            _SHARED[key] = load_backbone(p, in_shape)
        return _SHARED[key]
    if source == "imagenet":
        key = (arch, source, in_shape, None)
        if key not in _SHARED:
            from .registry import build_model

            with torch.random.fork_rng(devices=[]):
                _SHARED[key] = build_model(arch, in_shape=in_shape, num_classes=1000,
                                           pretrained=True, seed=0).eval()
        return _SHARED[key]
    recipe = recipe_for(arch, source, in_shape)
    key = (arch, recipe.key(), in_shape, None)
    if key not in _SHARED:
        _SHARED[key] = load_backbone(pretrain_backbone(recipe), in_shape)
    return _SHARED[key]


class FrozenBackboneNet(ProtoNet):
    """Fixed backbones + a trainable projection (module doc). ``backbones``: networks with
    ``features(x) -> [B, d_b]``; they are frozen here (requires_grad off, eval mode)."""

    head_module = "fc"

    def __init__(self, backbones: list[ProtoNet], in_shape: tuple[int, ...], num_classes: int,
                 feature_dim: int | None = None, arch: str = "frozen"):
        super().__init__()
        if not backbones:
            raise ValueError("frozen needs at least one backbone")
        for b in backbones:
            b.eval()
            for p in b.parameters():
                p.requires_grad_(False)
        # a tuple, not a ModuleList: no parameters(), state_dict() or train() reaches them
        self.backbones: tuple[ProtoNet, ...] = tuple(backbones)
        self.arch = arch
        self.in_shape = tuple(int(v) for v in in_shape)
        self.feature_dim = int(feature_dim or NATIVE_DIM)
        self.num_classes = int(num_classes)
        in_d = sum(int(b.feature_dim) for b in backbones)
        self.proj = nn.Linear(in_d, self.feature_dim)
        self.fc = nn.Linear(self.feature_dim, self.num_classes)

    def representations(self, x: torch.Tensor) -> torch.Tensor:
        """The backbones' features, concatenated (the code's `reps`), without gradients."""
        with torch.no_grad():
            return torch.cat([b.features(x) for b in self.backbones], dim=1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(F.relu(self.proj(self.representations(x))), dim=1)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h)

    def _apply(self, fn, recurse=True):  # .to(device), .double(), ...: the backbones too
        super()._apply(fn, recurse)
        for b in self.backbones:
            b._apply(fn)
        return self


def build_frozen(in_shape, num_classes, feature_dim=None, option=None) -> FrozenBackboneNet:
    """The registry's constructor for ``frozen:SPEC``. The backbones are built (or read)
    with the caller's RNG untouched, then the projection and head are initialised from it
    (build_model's seed): the same seed gives the same projection, cached backbones or not."""
    in_shape = tuple(int(v) for v in in_shape)
    backbones = [_backbone(arch, source, in_shape) for arch, source in parse_spec(option)]
    return FrozenBackboneNet(backbones, in_shape, num_classes, feature_dim,
                             arch=f"frozen:{option}")


# --- command line -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``python -m fedbus.models.frozen --arch cnn --source PATH.npz --in-shape 1,8,8 --out
    FILE``: pre-train one backbone with any recipe and write it (frozen:FILE loads it)."""
    ap = argparse.ArgumentParser(prog="python -m fedbus.models.frozen",
                                 description="pre-train a frozen backbone for frozen:FILE.pt")
    ap.add_argument("--arch", required=True, help="registry arch, e.g. cnn, mlp, resnet8")
    ap.add_argument("--source", required=True, help="digits or PATH.npz (x, y images)")
    ap.add_argument("--in-shape", required=True, help="the federation's sample shape, C,H,W")
    ap.add_argument("--out", required=True, help="the backbone file to write (.pt)")
    defaults = Recipe("", "", ())
    for name in ("epochs", "batch_size", "seed"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("lr", "momentum"):
        ap.add_argument(f"--{name}", type=float, default=getattr(defaults, name))
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(v) for v in args.in_shape.split(","))
        parse_spec(f"{args.arch}@{args.source}")
        recipe = recipe_for(args.arch, args.source, shape, epochs=args.epochs, lr=args.lr,
                            momentum=args.momentum, batch_size=args.batch_size, seed=args.seed)
        model, info = train_backbone(recipe)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    path = save_backbone(model, Path(args.out), recipe, info)
    print(f"{path}: {recipe.arch} on {recipe.source}, samples {list(shape)}, "
          f"source accuracy {info['source_acc']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

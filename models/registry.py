"""The architecture registry, model groups and model summaries."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .base import ProtoNet
from .mobilenet import MobileNetV2
from .pretrained import load_pretrained
from .resnet import ResNet
from .segnet import BACKBONES as DEEPLAB_BACKBONES
from .segnet import DeepLabV3Plus
from .small import MLP, FedAvgCNN, FedCLMLP, FedProtoCNN


def _cnn(in_shape, num_classes, feature_dim=None, option=None):
    if option is None:
        return FedProtoCNN(in_shape, num_classes, feature_dim)
    try:
        out_channels = int(option)
    except ValueError:
        raise ValueError(f"cnn:{option}: the option is conv2's out-channels, an integer "
                         f"(as FedProto-mh's cnn:18, cnn:20, cnn:22)") from None
    if out_channels < 1:
        raise ValueError(f"cnn:{option}: out-channels must be >= 1")
    return FedProtoCNN(in_shape, num_classes, feature_dim, out_channels=out_channels)


def _option_int(arch: str, option: str, what: str) -> int:
    try:
        value = int(option)
    except ValueError:
        raise ValueError(f"{arch}:{option}: the option is {what}, an integer") from None
    if value < 1:
        raise ValueError(f"{arch}:{option}: {what} must be >= 1")
    return value


def _mlp(in_shape, num_classes, feature_dim=None, option=None):
    if option is None:
        return MLP(in_shape, num_classes, feature_dim)
    # mlp:128 with feature_dim 256 is Michieli & Ozay's synthetic network (appendix S1)
    return MLP(in_shape, num_classes, feature_dim,
               hidden=_option_int("mlp", option, "the first hidden layer's width"))


def _deeplab(in_shape, num_classes, feature_dim=None, option=None):
    return DeepLabV3Plus(in_shape, num_classes, feature_dim, backbone=option or "resnet8")


def _frozen(in_shape, num_classes, feature_dim=None, option=None):
    from .frozen import build_frozen  # frozen builds its backbones through this registry

    return build_frozen(in_shape, num_classes, feature_dim, option)


def _plain(cls):
    def make(in_shape, num_classes, feature_dim=None):
        return cls(in_shape, num_classes, feature_dim)
    make.__doc__ = cls.__doc__
    return make


def _resnet(depth):
    def make(in_shape, num_classes, feature_dim=None):
        return ResNet(depth, in_shape, num_classes, feature_dim)
    make.__doc__ = ResNet.__doc__
    return make


#: name -> constructor(in_shape, num_classes, feature_dim=None[, option]) -> ProtoNet
ARCHS: dict[str, Callable[..., ProtoNet]] = {
    "cnn": _cnn,
    "cnn4": _plain(FedAvgCNN),
    "mlp-fedcl": _plain(FedCLMLP),
    "resnet8": _resnet("resnet8"),
    "resnet10": _resnet("resnet10"),
    "resnet18": _resnet("resnet18"),
    "resnet34": _resnet("resnet34"),
    "mobilenetv2": _plain(MobileNetV2),
    "mlp": _mlp,
}

#: segmentation networks (features [B, D, h, w], per-pixel logits [B, C, H, W]), kept apart
#: from ARCHS, whose members all map a sample to one vector and one logit row
DENSE_ARCHS: dict[str, Callable[..., ProtoNet]] = {"deeplab": _deeplab}
#: networks composed of other networks: frozen:BACKBONES, fixed pre-trained backbones and a
#: trainable projection (fedbus.models.frozen; FedPCL's setting)
COMPOSED_ARCHS: dict[str, Callable[..., ProtoNet]] = {"frozen": _frozen}
_ALL_ARCHS = {**ARCHS, **DENSE_ARCHS, **COMPOSED_ARCHS}

#: each architecture's own feature (prototype) dimension
NATIVE_FEATURE_DIM: dict[str, int] = {
    "cnn": 50, "cnn4": 512, "mlp-fedcl": 512, "resnet8": 256, "resnet10": 512,
    "resnet18": 512, "resnet34": 512, "mobilenetv2": 1280, "mlp": 200, "deeplab": 64,
    "frozen": 256,
}

#: common prototype dimension of a model group whose members' native dims differ
#: and model.feature_dim = 0 (HtFLlib's default feature_dim)
GROUP_FEATURE_DIM = 512

MODEL_DEFAULTS: dict[str, Any] = {"arch": "cnn", "group": [], "feature_dim": 0,
                                  "pretrained": False}


def parse_arch(arch: str) -> tuple[str, str | None]:
    """``"cnn:18"`` -> ``("cnn", "18")``; checks the name. Unknown -> ValueError listing names."""
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a string, got {arch!r}")
    base, _, option = arch.strip().partition(":")
    if base not in _ALL_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known architectures: "
                         f"{', '.join(_ALL_ARCHS)} (cnn takes an out-channels option, e.g. "
                         f"cnn:18)")
    if option and base not in ("cnn", "mlp", "deeplab", "frozen"):
        raise ValueError(f"arch {arch!r}: only cnn (cnn:OUT_CHANNELS) and mlp (mlp:HIDDEN) "
                         f"take an option, deeplab its backbone (deeplab:BACKBONE) and "
                         f"frozen its backbones (frozen:ARCH@SOURCE+...)")
    if base == "frozen":
        from .frozen import parse_spec

        parse_spec(option)  # ValueError naming what is wrong with the spec
    if option and base == "deeplab" and option not in DEEPLAB_BACKBONES:
        raise ValueError(f"arch {arch!r}: deeplab's backbone is one of "
                         f"{', '.join(DEEPLAB_BACKBONES)}")
    return base, (option or None)


def build_model(arch: str, *, in_shape: tuple[int, ...], num_classes: int,
                feature_dim: int | None = None, pretrained: bool = False,
                seed: int | None = None) -> ProtoNet:
    """Build a network of the registry.

    arch: a name of ``ARCHS`` ("cnn", "cnn:18", "cnn4", "mlp-fedcl", "resnet8", "resnet10",
        "resnet18", "resnet34", "mobilenetv2", "mlp", "mlp:128" = first hidden layer 128
        wide, "deeplab" = "deeplab:resnet8" or "deeplab:mobilenetv2", a small DeepLab-V3+
        for segmentation: dense features [B, D, H/4, W/4], per-pixel logits; "frozen:SPEC"
        = fixed pre-trained backbones and a trainable projection, fedbus.models.frozen);
        unknown -> ValueError listing them.
    in_shape: one sample's shape, images ``(C, H, W)`` (any C; 8x8 and up), tabular/1-D ``(D,)``
        (mlp and mlp-fedcl flatten anything; the conv nets need images, else ValueError).
    feature_dim: None or 0 = the arch's native prototype dimension (``NATIVE_FEATURE_DIM``);
        otherwise the network's feature layer is that wide (cnn/cnn4/mlps: the last hidden
        layer; ResNets/MobileNetV2: a linear projection after global pooling), so every member
        of a model group shares one prototype space.
    pretrained: copy torchvision's ImageNet weights from a local file (see
        fedbus.models.pretrained); never downloads; PretrainedUnavailable if not possible.
    seed: when given, parameters are initialised under ``torch.manual_seed(seed)`` inside a
        forked RNG state: same seed -> identical weights (also across processes), and the
        caller's global torch RNG is left untouched.
    """
    base, option = parse_arch(arch)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if feature_dim is not None and feature_dim < 0:
        raise ValueError(f"feature_dim must be >= 0 (0 = native), got {feature_dim}")
    in_shape = tuple(int(v) for v in in_shape)
    kwargs: dict[str, Any] = {"feature_dim": feature_dim or None}
    if option is not None:
        kwargs["option"] = option

    def make() -> ProtoNet:
        return _ALL_ARCHS[base](in_shape, int(num_classes), **kwargs)

    if seed is None:
        model = make()
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = make()
    model.pretrained_info = load_pretrained(model, base) if pretrained else None
    return model


def _model_cfg(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    cfg = {**MODEL_DEFAULTS, **dict(model_cfg)}
    if not isinstance(cfg["group"], (list, tuple)):
        raise TypeError(f"model.group must be a list of arch names, got {cfg['group']!r}")
    return cfg


def arch_for_client(model_cfg: Mapping[str, Any], client: int) -> str:
    """The architecture of client ``client`` (0-based).

    model_cfg is the [model] table: arch ["cnn"], group [[]], feature_dim [0], pretrained
    [False]. A non-empty group assigns ``group[client % len(group)]`` (HtFLlib's HtFE_X
    scheme), otherwise every client runs ``arch``. The name is checked (ValueError if unknown).
    """
    cfg = _model_cfg(model_cfg)
    group = list(cfg["group"])
    arch = group[client % len(group)] if group else cfg["arch"]
    parse_arch(arch)
    return arch


def feature_dim_for(model_cfg: Mapping[str, Any]) -> int | None:
    """The prototype dimension every client shares (None = each arch's native one).

    model.feature_dim > 0 wins. Otherwise, without a group: None (native). With a group:
    its members' common native dim when they all agree (e.g. FedProto-mh's cnn:18/20/22 keep
    50), else ``GROUP_FEATURE_DIM`` (512, HtFLlib's default), so the group shares one space.
    """
    cfg = _model_cfg(model_cfg)
    if int(cfg["feature_dim"] or 0) > 0:
        return int(cfg["feature_dim"])
    group = list(cfg["group"])
    if not group:
        return None
    dims = {NATIVE_FEATURE_DIM[parse_arch(a)[0]] for a in group}
    return dims.pop() if len(dims) == 1 else GROUP_FEATURE_DIM


def build_client_model(model_cfg: Mapping[str, Any], client: int, *, in_shape: tuple[int, ...],
                       num_classes: int, seed: int | None = None) -> ProtoNet:
    """``build_model(arch_for_client(...), feature_dim=feature_dim_for(...), ...)``."""
    cfg = _model_cfg(model_cfg)
    return build_model(arch_for_client(cfg, client), in_shape=in_shape, num_classes=num_classes,
                       feature_dim=feature_dim_for(cfg), pretrained=bool(cfg["pretrained"]),
                       seed=seed)


def count_params(model: torch.nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def describe(model: ProtoNet) -> dict[str, Any]:
    """``{"arch", "params", "feature_dim"}`` of a built network."""
    return {"arch": model.arch, "params": count_params(model), "feature_dim": model.feature_dim}


def describe_group(model_cfg: Mapping[str, Any], *, num_clients: int, in_shape: tuple[int, ...],
                   num_classes: int) -> list[dict[str, Any]]:
    """One row per distinct architecture of the federation: describe() plus "clients" (how many
    clients run it). For the start-of-run printout."""
    cfg = _model_cfg(model_cfg)
    counts: dict[str, int] = {}
    for c in range(num_clients):
        a = arch_for_client(cfg, c)
        counts[a] = counts.get(a, 0) + 1
    rows = []
    for a, n in counts.items():
        m = build_model(a, in_shape=in_shape, num_classes=num_classes,
                        feature_dim=feature_dim_for(cfg), seed=0)
        rows.append({**describe(m), "arch": a, "clients": n})
    return rows


def format_group(rows: list[dict[str, Any]]) -> str:
    """A small text table of describe_group() rows."""
    lines = [f"{'arch':<14}{'clients':>8}{'params':>13}{'feature_dim':>13}"]
    for r in rows:
        lines.append(f"{r['arch']:<14}{r['clients']:>8}{r['params']:>13,}{r['feature_dim']:>13}")
    return "\n".join(lines)

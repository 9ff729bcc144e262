"""fedbus.models: networks split into ``features(x) -> h`` and ``head(h) -> logits``.

    from fedbus.models import build_model
    net = build_model("resnet10", in_shape=(1, 28, 28), num_classes=10, feature_dim=512, seed=0)
    h = net.features(x)        # [B, 512], the prototype space
    logits = net.head(h)       # == net(x)

Model groups (model-heterogeneous federations): the [model] table's ``group``
list assigns ``group[i % len(group)]`` to client i (``arch_for_client``), and
``feature_dim_for`` picks the shared prototype dimension. ``frozen:BACKBONES`` builds
fixed pre-trained backbones with a trainable projection (fedbus.models.frozen, FedPCL's
setting). This package imports
nothing of fedbus. See docs/DATA.md.
"""
from .base import ProtoNet
from .frozen import BackboneError, FrozenBackboneNet, pretrain_backbone
from .pretrained import PretrainedUnavailable
from .registry import (
    ARCHS,
    COMPOSED_ARCHS,
    DENSE_ARCHS,
    GROUP_FEATURE_DIM,
    MODEL_DEFAULTS,
    NATIVE_FEATURE_DIM,
    arch_for_client,
    build_client_model,
    build_model,
    count_params,
    describe,
    describe_group,
    feature_dim_for,
    format_group,
    parse_arch,
)
from .segnet import DeepLabV3Plus

__all__ = [
    "ARCHS",
    "COMPOSED_ARCHS",
    "DENSE_ARCHS",
    "GROUP_FEATURE_DIM",
    "MODEL_DEFAULTS",
    "NATIVE_FEATURE_DIM",
    "BackboneError",
    "DeepLabV3Plus",
    "FrozenBackboneNet",
    "PretrainedUnavailable",
    "ProtoNet",
    "arch_for_client",
    "build_client_model",
    "build_model",
    "count_params",
    "describe",
    "describe_group",
    "feature_dim_for",
    "format_group",
    "parse_arch",
    "pretrain_backbone",
]

"""The base of every fedbus network: a feature extractor and a head.

Every network is split in two, ``features(x) -> h`` (the prototype space, a
vector of ``feature_dim`` per sample) and ``head(h) -> logits``, so that
prototype-based algorithms (FedProto, FedTGP, FPL, ...) can average ``h`` per
class and model-heterogeneous federations can share one prototype space.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class ProtoNet(nn.Module):
    """Base class: ``forward(x) == head(features(x))``.

    Attributes every subclass sets:
        arch: the registry name it was built under (``"cnn:18"``, ``"resnet10"``, ...)
        in_shape: the per-sample input shape it was built for (``(1, 28, 28)``, ``(60,)``)
        feature_dim: width of ``features(x)`` (the prototype dimension)
        num_classes: width of ``head(h)``

    head_module: the attribute name of the sub-module ``head`` applies (``"fc"`` unless set)

    Subclasses implement ``features`` and ``head``. The sub-module names
    ``features`` and ``head`` are reserved for these methods.
    """

    arch: str = ""
    # The attribute holding the head's layers: weight names under "<head_module>." are
    # the head's (LG-FedAvg averages them, FedPer/FedRep keep them local, FedGH replaces them).
    head_module: str = "fc"
    feature_dim: int = 0
    num_classes: int = 0
    in_shape: tuple[int, ...] = ()

    def features(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Map a batch ``[B, *in_shape]`` to prototype-space vectors ``[B, feature_dim]``."""
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Map ``[B, feature_dim]`` to logits ``[B, num_classes]``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def affine_chain(self) -> tuple[tuple[tuple[str, bool], ...], int] | None:
        """The network as a plain chain of affine layers, where it is one: ((the layer's
        parameter prefix, whether a ReLU follows it), ...) from the flattened input to the
        logits, and the index of the layer whose output is ``features(x)``. None (the
        default): not such a chain. Cohort training runs a declared chain as batched matrix
        products with its backward written out (fedbus.algorithms.core.cohort); a subclass
        that changes ``features`` or ``head`` must declare its own chain (or None)."""
        return None

    def extra_repr(self) -> str:
        return (f"arch={self.arch!r}, in_shape={tuple(self.in_shape)}, "
                f"feature_dim={self.feature_dim}, num_classes={self.num_classes}")


def flat_dim(in_shape: tuple[int, ...]) -> int:
    """Number of values per sample (what an MLP sees after flattening)."""
    return int(math.prod(in_shape))


def image_shape(arch: str, in_shape: tuple[int, ...], min_side: int = 1) -> tuple[int, int, int]:
    """Check that ``in_shape`` is an image ``[C, H, W]`` with H, W >= ``min_side``."""
    if len(in_shape) != 3:
        raise ValueError(f"{arch} takes images [C, H, W]; got input shape {list(in_shape)} "
                         f"(for tabular or 1-D data [D] use arch 'mlp')")
    c, h, w = (int(v) for v in in_shape)
    if c < 1 or h < min_side or w < min_side:
        raise ValueError(f"{arch} needs at least 1 channel and images of at least "
                         f"{min_side}x{min_side}; got input shape {list(in_shape)}")
    return c, h, w

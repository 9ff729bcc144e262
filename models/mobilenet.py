"""MobileNetV2 (Sandler et al. 2018) for small inputs, any channel count.

The layer structure and parameter names follow torchvision's ``mobilenet_v2``
(its ``features`` Sequential is called ``body`` here, because ``features`` is
the ProtoNet method), so ImageNet weights load by name. For inputs under 64 px
the strides follow the usual CIFAR adaptation (stem stride 1, the 24-channel
stage stride 1): 32x32 ends at 4x4, 8x8 at 1x1. From 64 px up the strides are
torchvision's. The 1280-channel map is global-average-pooled; ``features(x)``
is that vector, or a linear projection of it to ``feature_dim``.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import ProtoNet, image_shape

# t (expansion), c (out channels), n (repeats), s (stride of the first), as torchvision
SETTINGS = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2],
            [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]
LAST_CHANNELS = 1280
LARGE_INPUT = 64


def _conv_bn_act(inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1):
    # torchvision's Conv2dNormActivation: [0] conv, [1] bn, [2] ReLU6
    return nn.Sequential(nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups,
                                   bias=False),
                         nn.BatchNorm2d(out), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, out: int, stride: int, expand: int):
        super().__init__()
        hidden = inp * expand
        self.use_res = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(_conv_bn_act(inp, hidden, kernel=1))
        layers += [_conv_bn_act(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, out, 1, 1, 0, bias=False), nn.BatchNorm2d(out)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(ProtoNet):
    NATIVE_DIM = LAST_CHANNELS

    def __init__(self, in_shape, num_classes, feature_dim=None):
        super().__init__()
        c, h, w = image_shape("mobilenetv2", in_shape)
        self.arch = "mobilenetv2"
        self.in_shape = (c, h, w)
        self.num_classes = int(num_classes)
        self.feature_dim = int(feature_dim or self.NATIVE_DIM)
        large = min(h, w) >= LARGE_INPUT
        layers: list[nn.Module] = [_conv_bn_act(c, 32, stride=2 if large else 1)]
        inp = 32
        for i, (t, ch, n, s) in enumerate(SETTINGS):
            if not large and i == 1:
                s = 1
            for j in range(n):
                layers.append(InvertedResidual(inp, ch, s if j == 0 else 1, t))
                inp = ch
        layers.append(_conv_bn_act(inp, LAST_CHANNELS, kernel=1))
        self.body = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.proj = (nn.Linear(LAST_CHANNELS, self.feature_dim)
                     if self.feature_dim != LAST_CHANNELS else None)
        self.fc = nn.Linear(self.feature_dim, self.num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def features(self, x):
        h = torch.flatten(self.avgpool(self.body(x)), 1)
        return h if self.proj is None else self.proj(h)

    def head(self, h):
        return self.fc(h)

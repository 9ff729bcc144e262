"""ResNet-8/10/18/34 for small inputs, any channel count.

BasicBlock ResNets with torchvision's parameter names (``conv1``, ``bn1``,
``layer1``..``layer4``, ``downsample``), so that ImageNet weights load by name.
For inputs under 64 px (8x8 digits, 28x28 MNIST, 32x32 CIFAR) the stem is the
CIFAR one (3x3 conv, stride 1, no max-pool), as in PFLlib/HtFLlib's small-image
ResNets; from 64 px up it is torchvision's (7x7 stride 2 + max-pool).

Depths (blocks per stage): resnet8 [1, 1, 1] (three stages, 256-d),
resnet10 [1, 1, 1, 1], resnet18 [2, 2, 2, 2], resnet34 [3, 4, 6, 3] (512-d).
The last stage is global-average-pooled; ``features(x)`` is that vector, or a
linear projection of it to ``feature_dim`` when one is asked for.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import ProtoNet, image_shape

DEPTHS: dict[str, list[int]] = {
    "resnet8": [1, 1, 1],
    "resnet10": [1, 1, 1, 1],
    "resnet18": [2, 2, 2, 2],
    "resnet34": [3, 4, 6, 3],
}
WIDTHS = [64, 128, 256, 512]
LARGE_INPUT = 64  # from this side length up, use the ImageNet stem


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(ProtoNet):
    def __init__(self, depth: str, in_shape, num_classes, feature_dim=None):
        super().__init__()
        if depth not in DEPTHS:  # pragma: no cover - the registry only passes known names
            raise ValueError(f"unknown ResNet {depth!r}; known: {', '.join(DEPTHS)}")
        c, h, w = image_shape(depth, in_shape)
        self.arch = depth
        self.in_shape = (c, h, w)
        self.num_classes = int(num_classes)
        blocks = DEPTHS[depth]
        native = WIDTHS[len(blocks) - 1]
        self.feature_dim = int(feature_dim or native)
        large = min(h, w) >= LARGE_INPUT
        if large:
            self.conv1 = nn.Conv2d(c, 64, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(c, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        inplanes = 64
        for i, n in enumerate(blocks):
            planes, stride = WIDTHS[i], 1 if i == 0 else 2
            layer = []
            for j in range(n):
                layer.append(BasicBlock(inplanes, planes, stride if j == 0 else 1))
                inplanes = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.num_stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.proj = nn.Linear(native, self.feature_dim) if self.feature_dim != native else None
        self.fc = nn.Linear(self.feature_dim, self.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def features(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        h = torch.flatten(self.avgpool(x), 1)
        return h if self.proj is None else self.proj(h)

    def head(self, h):
        return self.fc(h)

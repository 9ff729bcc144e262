"""A small DeepLab-V3+ for semantic segmentation, split for dense prototypes.

Chen, Zhu, Papandreou, Schroff, Adam, "Encoder-Decoder with Atrous Separable Convolution
for Semantic Image Segmentation" (ECCV 2018): the network Michieli & Ozay federate on
Pascal VOC 2012 (with a MobileNet-V2 encoder). This is a CPU-sized version of it:

    encoder    a backbone with output stride 16 and a stride-4 low-level tap:
               "resnet8" (default): fedbus's ResNet-8 (models/resnet.py) with the ImageNet
                   stem (7x7/2 conv + max-pool) at every input size; low level = layer1
                   (64 ch, H/4), high level = layer3 (256 ch, H/16);
               "mobilenetv2": fedbus's MobileNet-V2 (models/mobilenet.py, torchvision's
                   layers and names, ImageNet strides); low level = its 24-ch stage (H/4),
                   high level = the 96-ch stage (H/16; DeepLab's MobileNet variant goes on
                   to the 320-ch stage with dilation, left out here to keep it cheap).
    ASPP-lite  on the high-level map: a 1x1 branch, two 3x3 branches with dilation 2 and 4
               (DeepLab's 6/12/18 are for 33x33 maps; ours are 4x4 at 64 px), and image
               pooling (global average -> 1x1 -> broadcast), each 64 wide, concatenated and
               projected to 64 by a 1x1 conv (BN + ReLU everywhere).
    decoder    the low-level map reduced to 32 channels (1x1), concatenated with the ASPP
               output upsampled bilinearly to H/4, then a 3x3 conv to ``feature_dim``
               (BN + ReLU): the dense feature map.

Split (fedbus.models.base.ProtoNet):
    features(x) -> h  float [B, feature_dim, H/4, W/4]: the dense prototype space; a class
                      prototype is the mean of h over the pixels of that class (labels
                      downsampled to H/4 by nearest neighbour: fedbus.algorithms.core.protos).
    head(h) -> logits [B, num_classes, H, W]: ``classifier`` (a 1x1 conv, DeepLab's last
                      layer) then bilinear upsampling to the input size.
    head_module = "classifier".
feature_dim defaults to 64 whatever the backbone, so deeplab:resnet8 and deeplab:mobilenetv2
form a model group with one prototype space.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import ProtoNet, image_shape
from .mobilenet import MobileNetV2
from .resnet import LARGE_INPUT, ResNet

BACKBONES = ("resnet8", "mobilenetv2")
NATIVE_DIM = 64
ASPP_DIM = 64
LOW_DIM = 32


def _cbr(inp: int, out: int, kernel: int = 1, dilation: int = 1) -> nn.Sequential:
    pad = dilation * (kernel - 1) // 2
    return nn.Sequential(nn.Conv2d(inp, out, kernel, padding=pad, dilation=dilation,
                                   bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True))


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling, lite: 1x1, two dilated 3x3, image pooling."""

    def __init__(self, inp: int, out: int = ASPP_DIM, rates: tuple[int, ...] = (2, 4)):
        super().__init__()
        self.branches = nn.ModuleList([_cbr(inp, out, 1)]
                                      + [_cbr(inp, out, 3, r) for r in rates])
        # image pooling without BatchNorm: a 1x1 map, so per-channel BN statistics over a
        # batch of one image would be degenerate
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(inp, out, 1),
                                  nn.ReLU(inplace=True))
        self.project = _cbr(out * (len(rates) + 2), out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [b(x) for b in self.branches]
        outs.append(self.pool(x).expand(-1, -1, x.shape[2], x.shape[3]))
        return self.project(torch.cat(outs, 1))


class _ResNetEncoder(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        # the ImageNet stem (stride 4 before layer1) whatever the input size: build the
        # ResNet for a large input, the layers are size-agnostic
        net = ResNet("resnet8", (c, LARGE_INPUT, LARGE_INPUT), 1)
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        self.layer1, self.layer2, self.layer3 = net.layer1, net.layer2, net.layer3
        self.low_channels, self.high_channels = 64, 256

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        low = self.layer1(x)
        return low, self.layer3(self.layer2(low))


class _MobileNetEncoder(nn.Module):
    LOW_END, HIGH_END = 4, 14  # body[:4] ends the 24-ch stage (H/4), body[:14] the 96-ch one

    def __init__(self, c: int):
        super().__init__()
        net = MobileNetV2((c, LARGE_INPUT, LARGE_INPUT), 1)
        self.low = net.body[:self.LOW_END]
        self.high = net.body[self.LOW_END:self.HIGH_END]
        self.low_channels, self.high_channels = 24, 96

    def forward(self, x):
        low = self.low(x)
        return low, self.high(low)


class DeepLabV3Plus(ProtoNet):
    head_module = "classifier"

    def __init__(self, in_shape, num_classes, feature_dim=None, backbone: str = "resnet8"):
        super().__init__()
        if backbone not in BACKBONES:
            raise ValueError(f"deeplab:{backbone}: unknown backbone; known: "
                             f"{', '.join(BACKBONES)}")
        # over 16 px: the H/16 map (sizes round up) is then at least 2x2, so BatchNorm in
        # training mode has more than one value per channel even for a last minibatch of
        # one image
        c, h, w = image_shape(f"deeplab:{backbone}", in_shape, min_side=17)
        self.arch = f"deeplab:{backbone}"
        self.backbone_name = backbone
        self.in_shape = (c, h, w)
        self.num_classes = int(num_classes)
        self.feature_dim = int(feature_dim or NATIVE_DIM)
        self.encoder = (_ResNetEncoder(c) if backbone == "resnet8" else _MobileNetEncoder(c))
        self.aspp = ASPP(self.encoder.high_channels)
        self.reduce = _cbr(self.encoder.low_channels, LOW_DIM, 1)
        self.fuse = _cbr(ASPP_DIM + LOW_DIM, self.feature_dim, 3)
        self.classifier = nn.Conv2d(self.feature_dim, self.num_classes, 1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.classifier.weight, 0, 0.01)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> the dense feature map [B, feature_dim, H/4, W/4]."""
        low, high = self.encoder(x)
        a = F.interpolate(self.aspp(high), size=low.shape[2:], mode="bilinear",
                          align_corners=False)
        return self.fuse(torch.cat([a, self.reduce(low)], 1))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """[B, feature_dim, h, w] -> per-pixel logits [B, num_classes, H, W] at the input
        size the network was built for."""
        return F.interpolate(self.classifier(h), size=self.in_shape[1:], mode="bilinear",
                             align_corners=False)

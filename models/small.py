"""Small networks: FedProto's CNN, the FedAvg/PFLlib 4-layer CNN and two MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import ProtoNet, flat_dim, image_shape


def _conv_pad(h: int, w: int) -> int:
    """Padding of the 5x5 convolutions: the papers' 0 for inputs of 16 px and more
    (MNIST 28x28, CIFAR 32x32); 2 ("same") for smaller ones such as 8x8 digits,
    so that two conv+pool stages still leave a spatial map."""
    return 0 if min(h, w) >= 16 else 2


def _after_conv_pool(side: int, pad: int) -> int:
    """Side length after a 5x5 convolution (stride 1, padding ``pad``) and a 2x2 max-pool."""
    return (side + 2 * pad - 4) // 2


class FedProtoCNN(ProtoNet):
    """FedProto's CNN (Tan et al., AAAI 2022; ``CNNMnist`` in its code).

    conv(C->10, 5x5) -> max-pool 2 -> ReLU -> conv(10->out_channels, 5x5) ->
    Dropout2d -> max-pool 2 -> ReLU -> flatten -> fc1 (-> feature_dim, 50 by
    default) -> ReLU  ==  features(x);  dropout(0.5) -> fc2 (-> classes)  ==  head(h).

    ``out_channels`` (conv2's width, 20 by default) is what FedProto-mh varies
    across clients (18/20/22): build it as arch ``"cnn:18"``.
    """

    NATIVE_DIM = 50
    head_module = "fc2"

    def __init__(self, in_shape, num_classes, feature_dim=None, out_channels=20):
        super().__init__()
        c, h, w = image_shape("cnn", in_shape, min_side=4)
        pad = _conv_pad(h, w)
        fh = _after_conv_pool(_after_conv_pool(h, pad), pad)
        fw = _after_conv_pool(_after_conv_pool(w, pad), pad)
        if fh < 1 or fw < 1:  # pragma: no cover - guarded by min_side and _conv_pad
            raise ValueError(f"cnn: input {list(in_shape)} too small for two conv+pool stages")
        self.arch = "cnn" if out_channels == 20 else f"cnn:{out_channels}"
        self.in_shape = (c, h, w)
        self.feature_dim = int(feature_dim or self.NATIVE_DIM)
        self.num_classes = int(num_classes)
        self.out_channels = int(out_channels)
        self.conv1 = nn.Conv2d(c, 10, kernel_size=5, padding=pad)
        self.conv2 = nn.Conv2d(10, out_channels, kernel_size=5, padding=pad)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(out_channels * fh * fw, self.feature_dim)
        self.fc2 = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        return F.relu(self.fc1(torch.flatten(x, 1)))

    def head(self, h):
        return self.fc2(F.dropout(h, training=self.training))


class FedAvgCNN(ProtoNet):
    """The 4-layer CNN of FedAvg (McMahan et al. 2017) as written in PFLlib/HtFLlib
    (``FedAvgCNN``): conv(C->32, 5x5) -> ReLU -> max-pool 2 -> conv(32->64, 5x5) ->
    ReLU -> max-pool 2 -> flatten -> fc1 (-> 512) -> ReLU == features(x);
    fc (-> classes) == head(h). fc1's input is 1024 on MNIST, 1600 on CIFAR."""

    NATIVE_DIM = 512

    def __init__(self, in_shape, num_classes, feature_dim=None):
        super().__init__()
        c, h, w = image_shape("cnn4", in_shape, min_side=4)
        pad = _conv_pad(h, w)
        fh = _after_conv_pool(_after_conv_pool(h, pad), pad)
        fw = _after_conv_pool(_after_conv_pool(w, pad), pad)
        self.arch = "cnn4"
        self.in_shape = (c, h, w)
        self.feature_dim = int(feature_dim or self.NATIVE_DIM)
        self.num_classes = int(num_classes)
        self.conv1 = nn.Sequential(nn.Conv2d(c, 32, 5, padding=pad), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5, padding=pad), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(64 * fh * fw, self.feature_dim), nn.ReLU(inplace=True))
        self.fc = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x):
        return self.fc1(torch.flatten(self.conv2(self.conv1(x)), 1))

    def head(self, h):
        return self.fc(h)


class FedCLMLP(ProtoNet):
    """MP-FedCL's MLP: encoder D->512->512 (ReLU after each; D = 784 on MNIST) ==
    features(x); head 512->256->ReLU->classes. Any input shape is flattened."""

    NATIVE_DIM = 512
    head_module = "classifier"

    def __init__(self, in_shape, num_classes, feature_dim=None):
        super().__init__()
        self.arch = "mlp-fedcl"
        self.in_shape = tuple(int(v) for v in in_shape)
        self.feature_dim = int(feature_dim or self.NATIVE_DIM)
        self.num_classes = int(num_classes)
        d = flat_dim(self.in_shape)
        self.encoder = nn.Sequential(nn.Linear(d, 512), nn.ReLU(inplace=True),
                                     nn.Linear(512, self.feature_dim), nn.ReLU(inplace=True))
        self.classifier = nn.Sequential(nn.Linear(self.feature_dim, 256), nn.ReLU(inplace=True),
                                        nn.Linear(256, self.num_classes))

    def features(self, x):
        return self.encoder(torch.flatten(x, 1))

    def head(self, h):
        return self.classifier(h)

    def affine_chain(self):
        return (("encoder.0", True), ("encoder.2", True), ("classifier.0", True),
                ("classifier.2", False)), 1


class MLP(ProtoNet):
    """A plain MLP for tabular, FedProx-synthetic and MNIST-1D data (also takes
    images, flattened): D->hidden->ReLU->feature_dim->ReLU == features(x), 200 and
    200 by default; a linear layer (-> classes) == head(h)."""

    NATIVE_DIM = 200
    HIDDEN = 200

    def __init__(self, in_shape, num_classes, feature_dim=None, hidden=None):
        super().__init__()
        self.arch = "mlp"
        self.in_shape = tuple(int(v) for v in in_shape)
        if not self.in_shape or flat_dim(self.in_shape) < 1:
            raise ValueError(f"mlp needs a non-empty input shape; got {list(in_shape)}")
        self.feature_dim = int(feature_dim or self.NATIVE_DIM)
        self.num_classes = int(num_classes)
        d = flat_dim(self.in_shape)
        hidden = int(hidden or self.HIDDEN)
        if hidden != self.HIDDEN:
            self.arch = f"mlp:{hidden}"
        self.encoder = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(inplace=True),
                                     nn.Linear(hidden, self.feature_dim),
                                     nn.ReLU(inplace=True))
        self.fc = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x):
        return self.encoder(torch.flatten(x, 1))

    def head(self, h):
        return self.fc(h)

    def affine_chain(self):
        return (("encoder.0", True), ("encoder.2", True), ("fc", False)), 1

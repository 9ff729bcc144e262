"""fedbus.models: shapes, feature dims, the features/head split, seeding, model groups,
pretrained loading from local files, and a real training run on sklearn's digits."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedbus.models import (
    ARCHS,
    GROUP_FEATURE_DIM,
    NATIVE_FEATURE_DIM,
    PretrainedUnavailable,
    ProtoNet,
    arch_for_client,
    build_client_model,
    build_model,
    count_params,
    describe,
    describe_group,
    feature_dim_for,
    format_group,
)

torch.set_num_threads(1)

IMAGE_SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32), (4, 20, 24)]
FLAT_ARCHS = {"mlp", "mlp-fedcl"}
# every arch x every input shape it claims
CASES = [(a, s) for a in ARCHS for s in IMAGE_SHAPES] + \
        [(a, s) for a in sorted(FLAT_ARCHS) for s in [(40,), (60,)]]


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("arch,shape", CASES, ids=[f"{a}-{'x'.join(map(str, s))}" for a, s in CASES])
def test_forward_shapes_and_split(arch, shape):
    m = build_model(arch, in_shape=shape, num_classes=7, seed=0).eval()
    assert isinstance(m, ProtoNet) and m.arch == arch
    assert m.feature_dim == NATIVE_FEATURE_DIM[arch] and m.num_classes == 7
    x = torch.randn(3, *shape)
    with torch.no_grad():
        h = m.features(x)
        logits = m(x)
        split = m.head(h)
    assert h.shape == (3, NATIVE_FEATURE_DIM[arch])
    assert logits.shape == (3, 7)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(split, logits, rtol=0, atol=0)
    # the features depend on the input (not a constant map; an untrained net in eval mode
    # may have tiny activations, hence the relative test)
    assert (h[0] - h[1]).abs().max() > 1e-4 * h.abs().max() > 0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_common_feature_dim(arch):
    m = build_model(arch, in_shape=(1, 28, 28), num_classes=10, feature_dim=64, seed=1).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert m.features(x).shape == (2, 64)
        torch.testing.assert_close(m.head(m.features(x)), m(x))
    assert m.feature_dim == 64 and describe(m)["feature_dim"] == 64


def test_training_mode_backward_through_split():
    # gradients flow through features and head for every arch (BatchNorm in train mode: B=4)
    for arch in ARCHS:
        m = build_model(arch, in_shape=(3, 32, 32), num_classes=5, feature_dim=32, seed=0)
        m.train()
        loss = torch.nn.functional.cross_entropy(m(torch.randn(4, 3, 32, 32)),
                                                 torch.tensor([0, 1, 2, 3]))
        loss.backward()
        grads = [p.grad for p in m.parameters()]
        assert all(g is not None for g in grads), arch
        assert sum(float(g.abs().sum()) for g in grads) > 0, arch


def test_known_parameter_counts():
    # FedProto's CNNMnist on MNIST: conv1 260 + conv2 5,020 + fc1 16,050 + fc2 510
    assert count_params(build_model("cnn", in_shape=(1, 28, 28), num_classes=10)) == 21_840
    # PFLlib's FedAvgCNN on MNIST (fc1 in = 1024) and on CIFAR-10 (fc1 in = 1600)
    assert count_params(build_model("cnn4", in_shape=(1, 28, 28), num_classes=10)) == 582_026
    cifar = build_model("cnn4", in_shape=(3, 32, 32), num_classes=10)
    assert cifar.fc1[0].in_features == 1600
    # MP-FedCL: 784-512-512 encoder, 512-256-10 head
    assert count_params(build_model("mlp-fedcl", in_shape=(1, 28, 28), num_classes=10)) == \
        (784 * 512 + 512) + (512 * 512 + 512) + (512 * 256 + 256) + (256 * 10 + 10)
    # ResNet-18 trunk = torchvision's minus the 7x7 stem plus a 3x3 one (11,689,512 with
    # the 1000-class fc): 11,689,512 - 64*3*49 - 513,000 + 64*3*9 + 5,130
    assert count_params(build_model("resnet18", in_shape=(3, 32, 32), num_classes=10)) == \
        11_689_512 - 64 * 3 * 49 - 513_000 + 64 * 3 * 9 + 5_130
    # MobileNetV2: torchvision's 3,504,872 minus its 1000-class classifier (1,281,000) + 12,810
    assert count_params(build_model("mobilenetv2", in_shape=(3, 32, 32), num_classes=10)) == \
        3_504_872 - 1_281_000 + 12_810


def test_cnn_out_channels_option():
    m18 = build_model("cnn:18", in_shape=(1, 28, 28), num_classes=10)
    m22 = build_model("cnn:22", in_shape=(1, 28, 28), num_classes=10)
    assert m18.conv2.out_channels == 18 and m22.conv2.out_channels == 22
    assert m18.arch == "cnn:18" and m18.feature_dim == m22.feature_dim == 50
    assert count_params(m18) < count_params(build_model("cnn", in_shape=(1, 28, 28),
                                                        num_classes=10)) < count_params(m22)
    with pytest.raises(ValueError, match="out-channels"):
        build_model("cnn:abc", in_shape=(1, 28, 28), num_classes=10)
    with pytest.raises(ValueError, match=r"only cnn \(cnn:OUT_CHANNELS\) and mlp"):
        build_model("resnet8:3", in_shape=(1, 28, 28), num_classes=10)


def test_mlp_hidden_option_is_michieli_ozays_synthetic_network():
    # appendix S1: two dense layers of 128 and 256 units on 60 synthetic features
    m = build_model("mlp:128", in_shape=(60,), num_classes=10, feature_dim=256)
    first, second = m.encoder[0], m.encoder[2]
    assert (first.in_features, first.out_features) == (60, 128)
    assert (second.in_features, second.out_features) == (128, 256)
    assert m.feature_dim == 256 and m.arch == "mlp:128"
    assert m.features(torch.zeros(3, 60)).shape == (3, 256)
    plain = build_model("mlp", in_shape=(60,), num_classes=10)
    assert plain.encoder[0].out_features == 200 and plain.arch == "mlp"
    with pytest.raises(ValueError, match="first hidden layer"):
        build_model("mlp:wide", in_shape=(60,), num_classes=10)


def test_errors_are_clear():
    with pytest.raises(ValueError) as e:
        build_model("vgg16", in_shape=(1, 28, 28), num_classes=10)
    for name in ARCHS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="mlp"):
        build_model("cnn", in_shape=(40,), num_classes=10)
    with pytest.raises(ValueError, match="at least"):
        build_model("cnn4", in_shape=(1, 3, 3), num_classes=10)
    with pytest.raises(ValueError, match=r"\[C, H, W\]"):
        build_model("resnet10", in_shape=(60,), num_classes=10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", in_shape=(60,), num_classes=0)


def test_seeded_initialisation():
    a = build_model("resnet8", in_shape=(1, 28, 28), num_classes=10, seed=7)
    b = build_model("resnet8", in_shape=(1, 28, 28), num_classes=10, seed=7)
    c = build_model("resnet8", in_shape=(1, 28, 28), num_classes=10, seed=8)
    assert _digest(a) == _digest(b) != _digest(c)
    # the caller's global RNG is not disturbed by a seeded build
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("cnn", in_shape=(1, 28, 28), num_classes=10, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_seeded_initialisation_across_processes():
    code = ("import hashlib, torch\n"
            "from fedbus.models import build_model\n"
            "m = build_model('cnn:22', in_shape=(1, 28, 28), num_classes=10, seed=11)\n"
            "h = hashlib.sha256()\n"
            "for k, v in m.state_dict().items():\n"
            "    h.update(k.encode()); h.update(v.numpy().tobytes())\n"
            "print(h.hexdigest())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    here = build_model("cnn:22", in_shape=(1, 28, 28), num_classes=10, seed=11)
    assert out == _digest(here)


def test_model_groups():
    cfg = {"arch": "cnn", "group": ["cnn", "resnet10", "mobilenetv2"], "feature_dim": 0}
    assert [arch_for_client(cfg, i) for i in range(7)] == \
        ["cnn", "resnet10", "mobilenetv2", "cnn", "resnet10", "mobilenetv2", "cnn"]
    assert arch_for_client({"arch": "cnn4"}, 5) == "cnn4"
    assert arch_for_client({}, 0) == "cnn"
    # natives differ -> the common default; FedProto-mh's cnn:18/20/22 keep their 50
    assert feature_dim_for(cfg) == GROUP_FEATURE_DIM
    assert feature_dim_for({"group": ["cnn:18", "cnn:20", "cnn:22"]}) == 50
    assert feature_dim_for({**cfg, "feature_dim": 96}) == 96
    assert feature_dim_for({"arch": "resnet18"}) is None
    with pytest.raises(ValueError, match="unknown arch"):
        arch_for_client({"group": ["cnn", "nope"]}, 1)
    x = torch.randn(2, 1, 28, 28)
    feats = []
    for i in range(3):
        m = build_client_model(cfg, i, in_shape=(1, 28, 28), num_classes=10, seed=i).eval()
        with torch.no_grad():
            feats.append(m.features(x))
        assert m.arch == cfg["group"][i]
    assert all(f.shape == (2, GROUP_FEATURE_DIM) for f in feats)
    rows = describe_group(cfg, num_clients=7, in_shape=(1, 28, 28), num_classes=10)
    assert [(r["arch"], r["clients"]) for r in rows] == \
        [("cnn", 3), ("resnet10", 2), ("mobilenetv2", 2)]
    assert all(r["feature_dim"] == GROUP_FEATURE_DIM and r["params"] > 0 for r in rows)
    table = format_group(rows)
    assert "resnet10" in table and f"{rows[1]['params']:,}" in table


def test_describe_and_count_params():
    m = build_model("mlp", in_shape=(60,), num_classes=10)
    assert count_params(m) == (60 * 200 + 200) + (200 * 200 + 200) + (200 * 10 + 10)
    assert describe(m) == {"arch": "mlp", "params": count_params(m), "feature_dim": 200}
    m.fc.weight.requires_grad_(False)
    assert count_params(m) == (60 * 200 + 200) + (200 * 200 + 200) + 10


# ------------------------------------------------------------------------- pretrained
def _torchvision_named(model: torch.nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """A state dict laid out like torchvision's ImageNet checkpoint of ``arch``."""
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith("proj.") or k.endswith("num_batches_tracked"):
            continue
        if arch == "mobilenetv2":
            k = k.replace("body.", "features.", 1)
            if k.startswith("fc."):
                k = "classifier.1." + k[3:]
        sd[k] = v.clone()
    if arch.startswith("resnet"):
        sd["conv1.weight"] = torch.randn(64, 3, 7, 7)  # ImageNet stem: does not fit
    sd[("classifier.1.weight" if arch == "mobilenetv2" else "fc.weight")] = torch.randn(1000, 1)
    return sd


@pytest.mark.parametrize("arch,file", [("resnet18", "resnet18-f37072fd.pth"),
                                       ("mobilenetv2", "mobilenet_v2-b0353104.pth")])
def test_pretrained_from_local_file(tmp_path, monkeypatch, arch, file):
    monkeypatch.setenv("FEDBUS_WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(PretrainedUnavailable, match="never downloads"):
        build_model(arch, in_shape=(3, 32, 32), num_classes=10, pretrained=True)
    donor = build_model(arch, in_shape=(3, 32, 32), num_classes=10, seed=99)
    (tmp_path / "weights").mkdir()
    torch.save(_torchvision_named(donor, arch), tmp_path / "weights" / file)
    m = build_model(arch, in_shape=(3, 32, 32), num_classes=10, pretrained=True, seed=1)
    fresh = build_model(arch, in_shape=(3, 32, 32), num_classes=10, seed=1)
    info = m.pretrained_info
    assert info["file"].endswith(file) and len(info["loaded"]) > 20
    body = "layer1.0.conv1.weight" if arch == "resnet18" else "body.3.conv.1.0.weight"
    assert torch.equal(m.state_dict()[body], donor.state_dict()[body])
    assert not torch.equal(m.state_dict()[body], fresh.state_dict()[body])
    # the 1000-class classifier never loads; the fedbus head stays fresh
    assert torch.equal(m.fc.weight, fresh.fc.weight)
    if arch == "resnet18":
        assert "conv1.weight" in info["skipped"]
        assert torch.equal(m.conv1.weight, fresh.conv1.weight)


def test_pretrained_refused_where_no_weights_exist():
    with pytest.raises(PretrainedUnavailable, match="no ImageNet weights"):
        build_model("resnet10", in_shape=(3, 32, 32), num_classes=10, pretrained=True)
    with pytest.raises(PretrainedUnavailable, match="no ImageNet weights"):
        build_model("cnn", in_shape=(1, 28, 28), num_classes=10, pretrained=True)


# ------------------------------------------------------------------- real training run
def _train_digits(arch: str, epochs: int, lr: float, seed: int = 0) -> float:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = ((d.data / 16.0 - (d.data / 16.0).mean()) / (d.data / 16.0).std()).astype(np.float32)
    x = x.reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    tr, te = perm[: int(0.75 * len(y))], perm[int(0.75 * len(y)):]
    xt, yt = torch.from_numpy(x[tr]), torch.from_numpy(y[tr])
    m = build_model(arch, in_shape=(1, 8, 8), num_classes=10, seed=seed)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout draws from the global generator
    m.train()
    for _ in range(epochs):
        order = torch.randperm(len(yt), generator=g)
        for b in range(0, len(order), 32):
            i = order[b:b + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(xt[i]), yt[i]).backward()
            opt.step()
    m.eval()
    with torch.no_grad():
        pred = m(torch.from_numpy(x[te])).argmax(1).numpy()
    return float((pred == y[te]).mean())


def test_digits_training_learns():
    acc = _train_digits("cnn", epochs=15, lr=0.01)
    print(f"digits cnn test accuracy: {acc:.3f}")
    assert acc > 0.9  # chance is 0.1


def test_digits_training_learns_group_member():
    acc = _train_digits("resnet8", epochs=2, lr=0.05)
    print(f"digits resnet8 test accuracy: {acc:.3f}")
    assert acc > 0.8


def test_models_import_nothing_of_fedbus():
    code = ("import sys, fedbus.models\n"
            "bad = sorted(m for m in sys.modules if m.startswith('fedbus.')\n"
            "             and not m.startswith('fedbus.models'))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == ""

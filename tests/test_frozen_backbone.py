"""Frozen pre-trained backbones (fedbus.models.frozen, FedPCL's setting): pre-training is
deterministic, cached by recipe and leaves the caller's RNG alone; the config refuses a
backbone pre-trained on the federation's own data; the backbones never change, never train
and never travel (only the projection and head are parameters, state and update); backbone
files load, and a missing or mismatching file is a clear error."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import MNIST_NPZ, REPO, needs_mnist

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, LocalRun
from fedbus.models import (BackboneError, FrozenBackboneNet, build_model, count_params,
                           parse_arch)
from fedbus.models.frozen import (Recipe, load_backbone, pretrain_backbone, recipe_for,
                                  save_backbone, source_images, train_backbone)
from fedbus.node.config import ConfigError, build_config
from fedbus.node.data.datasets import load_dataset

torch.set_num_threads(1)
DIGITS = (1, 8, 8)
TRAIN = {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.0, "batch_size": 32}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "backbones"
    monkeypatch.setenv("FEDBUS_BACKBONE_DIR", str(folder))
    return folder


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- pre-training -----------------------------------------------------------------------------

def test_pretraining_is_deterministic_cached_and_leaves_the_rng_alone(cache):
    recipe = Recipe("cnn", "digits", DIGITS)
    first, info = train_backbone(recipe)
    again, _ = train_backbone(recipe)
    assert_same(state(first), state(again))  # to the bit
    assert info["source_acc"] > 0.8  # it learned its source (chance 0.1; 0.91 measured)
    other, _ = train_backbone(Recipe("cnn", "digits", DIGITS, seed=1))
    assert not torch.equal(state(other)["fc1.weight"], state(first)["fc1.weight"])

    path = pretrain_backbone(recipe, cache)
    stamp = path.stat().st_mtime_ns
    assert pretrain_backbone(recipe, cache) == path and path.stat().st_mtime_ns == stamp
    assert recipe.key() in path.name
    assert_same(state(load_backbone(path, DIGITS)), state(first))
    # a changed recipe is another file
    assert pretrain_backbone(Recipe("mlp", "digits", DIGITS, epochs=1), cache) != path

    # through the registry: the same seed gives the same projection, from the cache or not,
    # and the caller's RNG is where it was
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a = build_model("frozen:cnn@digits", in_shape=DIGITS, num_classes=10, seed=3)
    assert torch.equal(torch.rand(3), expected)
    for f in cache.glob("*.pt"):
        f.unlink()
    b = build_model("frozen:cnn@digits", in_shape=DIGITS, num_classes=10, seed=3)
    assert_same(state(a), state(b))
    x = torch.randn(5, *DIGITS)
    assert torch.equal(a.representations(x), b.representations(x))


def test_source_images_are_resized_and_standardised():
    x, y, classes = source_images(Recipe("cnn", "digits", (3, 20, 20)))
    assert x.shape == (1797, 3, 20, 20) and classes == 10 and len(y) == 1797
    assert torch.equal(x[:, 0], x[:, 1])  # gray repeated to the federation's channels
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1.0) < 1e-3


@needs_mnist
def test_backbone_data_is_disjoint_from_the_federation(cache):
    # fedbus pre-trains on its source only: MNIST for a digits federation
    recipe = recipe_for("cnn", str(MNIST_NPZ), DIGITS)
    x, _, _ = source_images(recipe)
    assert len(x) == len(np.load(MNIST_NPZ)["y"]) and x.shape[1:] == DIGITS
    build_config({"data": {"dataset": "digits"},
                  "model": {"arch": f"frozen:cnn@{MNIST_NPZ}"}})
    build_config({"data": {"dataset": f"npz:{MNIST_NPZ}"}, "model": {"arch": "frozen:cnn@digits"}})
    # ... and the config refuses the federation's own data as a source
    refused = [({"dataset": "digits"}, {"arch": "frozen:cnn@digits"}),
               ({"dataset": "digits"}, {"group": ["cnn", f"frozen:mlp@{MNIST_NPZ}+cnn@digits"]}),
               ({"dataset": f"npz:{MNIST_NPZ}"}, {"arch": f"frozen:cnn@{MNIST_NPZ}"}),
               ({"dataset": f"digit5-offline:{MNIST_NPZ}"}, {"arch": "frozen:cnn@digits"})]
    for data, model in refused:
        with pytest.raises(ConfigError, match="the federation's own data"):
            build_config({"data": data, "model": model})


# --- the network ------------------------------------------------------------------------------

def digits_client(model, params=None, algorithm="fedpcl", client=0):
    ds = load_dataset("digits")
    x, y = torch.from_numpy(ds.x), torch.from_numpy(ds.y)
    idx = np.random.default_rng(client).permutation(len(y))[:160]
    tr, te = idx[:120], idx[120:]
    ctx = ClientContext(client=client, model=model, device=torch.device("cpu"),
                        train_x=x[tr], train_y=y[tr], test_x=x[te], test_y=y[te],
                        num_classes=10, feature_dim=model.feature_dim, params=params or {},
                        train=TRAIN, seed=client)
    return get_algorithm(algorithm).client(ctx)


def backbone_state(model):
    return [state(b) for b in model.backbones]


def test_backbones_never_train_and_never_travel(cache):
    # the mechanics, not learning, are under test: backbones pre-trained on digits itself (the
    # config would refuse that for a digits federation; build_model does not check). FedAvg's
    # client uploads whatever state the network has
    model = build_model("frozen:cnn@digits+mlp@digits", in_shape=DIGITS, num_classes=10,
                        feature_dim=32, seed=0)
    assert isinstance(model, FrozenBackboneNet) and len(model.backbones) == 2
    assert set(model.state_dict()) == {"proj.weight", "proj.bias", "fc.weight", "fc.bias"}
    in_d = sum(b.feature_dim for b in model.backbones)  # 50 + 200
    assert in_d == 250 and count_params(model) == 250 * 32 + 32 + 32 * 10 + 10
    frozen = {id(p) for b in model.backbones for p in b.parameters()}
    assert frozen.isdisjoint(id(p) for p in model.parameters())
    assert all(not p.requires_grad for b in model.backbones for p in b.parameters())

    before, proj = backbone_state(model), state(model)
    for name in ("fedpcl", "fedavg"):
        h = digits_client(model, algorithm=name, params={"wait_for_all": False}
                          if name == "fedpcl" else {})
        if name == "fedpcl":  # a task with prototypes, so the contrastive term trains
            server_sets = h.local_protos()
            task = {"sets": server_sets[0][None], "sets_has": (server_sets[1] > 0)[None],
                    "avg": server_sets[0], "avg_has": server_sets[1] > 0}
        else:
            task = {"weights": {k: v.numpy() for k, v in state(model).items()}}
        model.train()
        payload = h.train(task, LocalRun(h.ctx, epochs=2, seed=1))
        assert all(not b.training for b in model.backbones)  # eval mode, whatever train() says
        if name == "fedavg":  # only the projection and head are in the update
            assert set(payload["delta"]) == {"proj.weight", "proj.bias", "fc.weight", "fc.bias"}
        else:
            assert set(payload) == {"protos", "counts"}
    for a, b in zip(backbone_state(model), before):
        assert_same(a, b)
    assert not torch.equal(state(model)["proj.weight"], proj["proj.weight"])


def test_clients_share_one_copy_of_the_backbones(cache):
    a = build_model("frozen:cnn@digits", in_shape=DIGITS, num_classes=10, seed=0)
    b = build_model("frozen:cnn@digits", in_shape=DIGITS, num_classes=10, seed=0)
    assert a.backbones[0] is b.backbones[0]
    a.double()  # .to() and dtype casts reach the backbones
    assert a.features(torch.randn(2, *DIGITS, dtype=torch.float64)).dtype == torch.float64


# --- files --------------------------------------------------------------------------------------

def test_backbone_files_load_and_bad_ones_say_why(tmp_path, cache):
    net, _ = train_backbone(Recipe("cnn", "digits", DIGITS, epochs=1))
    path = save_backbone(net, tmp_path / "cnn8.pt")
    model = build_model(f"frozen:{path}", in_shape=DIGITS, num_classes=10, seed=0)
    assert_same(state(model.backbones[0]), state(net))
    assert not list(cache.glob("*.pt"))  # a file backbone trains nothing

    with pytest.raises(BackboneError, match="not found"):
        build_model(f"frozen:{tmp_path / 'missing.pt'}", in_shape=DIGITS, num_classes=10)
    with pytest.raises(BackboneError, match=r"trained for samples \[1, 8, 8\].*\[1, 12, 12\]"):
        build_model(f"frozen:{path}", in_shape=(1, 12, 12), num_classes=10)
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    with pytest.raises(BackboneError, match="not a fedbus backbone"):
        load_backbone(tmp_path / "foreign.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(BackboneError, match="does not load"):
        load_backbone(tmp_path / "junk.pt")
    doc = torch.load(path, weights_only=True)
    doc["arch"] = "cnn4"  # weights of another network
    torch.save(doc, tmp_path / "mismatch.pt")
    with pytest.raises(BackboneError, match="do not match a cnn4 network"):
        load_backbone(tmp_path / "mismatch.pt")


def test_bad_specs_are_clear_errors(tmp_path):
    for arch, why in [("frozen", "needs its backbones"), ("frozen:vgg@digits", "no single-vector"),
                      ("frozen:cnn@somewhere", "the source is digits, PATH.npz or imagenet"),
                      ("frozen:weights.bin", "ARCH@SOURCE")]:
        with pytest.raises(ValueError, match=why):
            parse_arch(arch)
    with pytest.raises(BackboneError, match="no such file"):
        build_model(f"frozen:cnn@{tmp_path / 'none.npz'}", in_shape=DIGITS, num_classes=10)
    with pytest.raises(ConfigError, match="needs its backbones"):
        build_config({"data": {"dataset": "digits"}, "model": {"arch": "frozen:"}})


def test_missing_backbone_file_stops_the_run_before_it_starts(tmp_path):
    from fedbus.launch.preflight import PreflightError, check_inputs

    cfg = build_config({"data": {"dataset": "digits", "partition": "iid"},
                        "federation": {"clients": 2},
                        "model": {"arch": f"frozen:{tmp_path / 'gone.pt'}"},
                        "algorithm": {"name": "fedpcl"}})
    with pytest.raises(PreflightError, match=r"model.arch = .*gone.pt.* not found"):
        check_inputs(cfg)


def test_pretrain_command_writes_a_loadable_file(tmp_path):
    out = tmp_path / "mlp.pt"
    proc = subprocess.run([sys.executable, "-m", "fedbus.models.frozen", "--arch", "mlp",
                           "--source", "digits", "--in-shape", "1,8,8", "--epochs", "1",
                           "--out", str(out)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "source accuracy" in proc.stdout
    assert load_backbone(out, DIGITS).arch == "mlp"
    bad = subprocess.run([sys.executable, "-m", "fedbus.models.frozen", "--arch", "mlp",
                          "--source", str(tmp_path / "none.npz"), "--in-shape", "1,8,8",
                          "--out", str(tmp_path / "x.pt")], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr

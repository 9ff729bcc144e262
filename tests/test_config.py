"""Config: defaults, validation errors that name the key, --set overrides."""
import os

import pytest

from fedbus.node.config import ConfigError, build_config, load_config


def test_embedded_default_loads_with_every_key():
    cfg = load_config(None)
    assert cfg.data.dataset == "digits"
    assert cfg.algorithm.name == "fedproto"
    assert cfg.federation.mode == "sync"
    assert "lam" in cfg.algorithm  # the algorithm's own parameters are filled in


def test_set_overrides_any_key_and_parses_types():
    cfg = build_config({}, ["federation.rounds=7", "train.lr=0.5", "algorithm.name=fedavg",
                            "data.dataset=npz:/tmp/x.npz", "model.group=['cnn', 'cnn4']"])
    assert cfg.federation.rounds == 7 and cfg.train.lr == 0.5
    assert cfg.algorithm.name == "fedavg"
    assert cfg.data.dataset == "npz:/tmp/x.npz"
    assert cfg.model.group == ["cnn", "cnn4"]


@pytest.mark.parametrize("raw, overrides, message", [
    ({"federation": {"rouns": 3}}, [], "unknown key federation.rouns"),
    ({"federation": {"mode": "fast"}}, [], "allowed values are sync, async"),
    ({"federation": {"fraction": 1.5}}, [], "federation.fraction = 1.5: must be <= 1.0"),
    ({"federation": {"clients": "ten"}}, [], "expected int"),
    ({"train": {"lr": True}}, [], "train.lr"),
    ({"nosuch": {}}, [], "unknown section [nosuch]"),
    ({}, ["algorithm.name=fedfoo"], "unknown algorithm 'fedfoo'"),
    ({}, ["algorithm.lam=0.5", "algorithm.name=fedavg"], "unknown key algorithm.lam"),
    ({}, ["rounds=3"], "expected section.key=value"),
    ({"federation": {"clients": 2, "min_clients": 3}}, [], "min_clients = 3 exceeds"),
])
def test_bad_config_names_the_key(raw, overrides, message):
    with pytest.raises(ConfigError) as err:
        build_config(raw, overrides)
    assert message in str(err.value)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[federation\nclients = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


EXAMPLES = sorted((__import__("pathlib").Path(__file__).parent.parent / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_config_validates_and_its_models_build(path):
    """The examples are what users run first: each must pass validation as written, name a
    registered algorithm, and its model (group) must build on its data's input shape."""
    import torch

    from fedbus.algorithms import get_algorithm
    from fedbus.models import build_model

    cfg = load_config(path)
    get_algorithm(cfg.algorithm.name)
    offline = path.stem.endswith("-offline")
    assert offline == (cfg.data.dataset.startswith("npz:") or cfg.data.dataset == "digits")
    if offline:  # the path is relative to the example's folder, as its header says
        mnist = os.path.normpath(path.parent / "../../shared/data/mnist-10k.npz")
        assert cfg.data.dataset == "digits" or (
            cfg.data.dataset.endswith("shared/data/mnist-10k.npz")
            and (not os.path.exists(mnist) or cfg.data.dataset == f"npz:{mnist}")), cfg.data.dataset
    shape = {"cifar10": (3, 32, 32), "cifar100": (3, 32, 32), "digits": (1, 8, 8)}.get(
        cfg.data.dataset, (1, 28, 28))
    archs = list(cfg.model.group) or [cfg.model.arch]
    dims = set()
    for arch in dict.fromkeys(archs):
        net = build_model(arch, in_shape=shape, num_classes=10,
                          feature_dim=cfg.model.feature_dim or None, seed=0)
        with torch.no_grad():
            h = net.features(torch.zeros(2, *shape))
        dims.add(h.shape[1])
    assert len(dims) == 1, (archs, dims)  # one prototype space for the whole group


def test_the_examples_folder_holds_an_offline_twin_for_each_paper_experiment():
    names = {p.stem for p in EXAMPLES}
    assert len(names) >= 14
    for algo in ("local", "fedavg", "fedprox", "fedproto", "fedavg-proto", "mpfedcl",
                 "proto-attention", "fedtgp"):
        assert f"{algo}-mnist-offline" in names, algo


def test_paths_in_a_config_file_are_relative_to_its_folder(tmp_path, monkeypatch):
    """npz:, file: and folder keys name what sits beside the TOML from any working
    directory; a path found only from the working directory, and --set values, are left
    as they are."""
    import numpy as np

    folder = tmp_path / "exp"
    folder.mkdir()
    np.savez(folder / "data.npz", x=np.zeros((4, 1, 2, 2), np.float32), y=np.arange(4))
    (folder / "keys").mkdir()
    (folder / "c.toml").write_text('[data]\ndataset = "npz:data.npz"\n'
                                   'partition = "file:split.json"\n'
                                   '[bus]\nkeys_dir = "keys"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "split.json").write_text("{}")  # found only from the working directory
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "c.toml")
    assert cfg.data.dataset == f"npz:{folder / 'data.npz'}"
    assert cfg.bus.keys_dir == str(folder / "keys")
    assert cfg.data.partition == "file:split.json"  # the old reading still finds it
    cfg = load_config(folder / "c.toml", ["data.dataset=npz:data.npz"])
    assert cfg.data.dataset == "npz:data.npz"  # --set: relative to the shell's folder


def test_print_config_is_toml_that_loads_back_to_the_same_config(tmp_path):
    from helpers import fedbus

    out = fedbus("run", "--print-config", "--set", "federation.rounds=3",
                 "--set", "model.group=[\"cnn\",\"cnn4\"]", timeout=120).stdout
    (tmp_path / "printed.toml").write_text(out)
    printed = load_config(tmp_path / "printed.toml")
    assert printed.to_dict() == load_config(None, ["federation.rounds=3",
                                                   'model.group=["cnn","cnn4"]']).to_dict()
    assert printed.federation.rounds == 3


def test_help_config_shows_the_values_a_run_uses_and_the_schema_default_beside():
    """Without a CONFIG, `fedbus run` uses the embedded default federation, whose rounds
    (20) differ from the schema default a CONFIG that leaves the key out gets (10)."""
    from helpers import fedbus

    from fedbus.node.config import SCHEMA, load_config as load

    out = fedbus("run", "--help-config", "--set", "train.lr=0.2", timeout=120).stdout
    rounds = load(None).federation.rounds
    default = SCHEMA["federation"]["rounds"].default
    assert rounds != default
    assert any(line.startswith(f"  rounds = {rounds}  #") and
               line.endswith(f"[left out of a CONFIG: {default}]") for line in out.splitlines())
    assert any(line.startswith("  lr = 0.2  #") for line in out.splitlines())
    assert out.splitlines()[0].startswith("# the values `fedbus run` uses with the embedded")

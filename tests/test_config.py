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


@pytest.mark.parametrize("raw, overrides, suggestion", [
    ({"federation": {"round": 3}}, [], "did you mean federation.rounds?"),
    ({}, ["federation.round=3"], "did you mean federation.rounds?"),
    ({}, ["train.batchsize=8"], "did you mean train.batch_size?"),
    ({}, ["federation.lr=0.1"], "did you mean train.lr?"),  # the right key, wrong section
    ({"fedration": {}}, [], "did you mean [federation]?"),
    ({}, ["trian.lr=0.1"], "did you mean [train]?"),
])
def test_an_unknown_key_or_section_says_what_was_meant(raw, overrides, suggestion):
    with pytest.raises(ConfigError) as err:
        build_config(raw, overrides)
    assert suggestion in str(err.value)
    assert "\n" not in str(err.value)


def test_an_algorithm_key_kept_from_another_method_names_whose_it_is():
    with pytest.raises(ConfigError) as err:
        build_config({"algorithm": {"name": "fedavg", "lam": 1.0}})
    message = str(err.value)
    assert message.startswith("unknown key algorithm.lam")  # what `fedbus sweep` reads
    assert "lam is a parameter of" in message and "fedproto" in message
    assert message.endswith("not of fedavg)")


def test_nothing_is_suggested_for_a_key_like_no_other():
    with pytest.raises(ConfigError) as err:
        build_config({"federation": {"zzqx": 1}})
    assert "did you mean" not in str(err.value)


def _warnings_of(path=None, overrides=()):
    cfg = load_config(path, overrides)
    return cfg, cfg.notes


def test_keys_the_partition_does_not_read_are_warned_about_in_one_line(tmp_path):
    """An nway-kshot example switched to dirichlet keeps ways and shots: one line names
    them and the partitions they are for."""
    example = tmp_path / "mine.toml"
    example.write_text('[data]\npartition = "dirichlet"\nalpha = 0.1\nways = 4\nshots = 60\n')
    cfg, lines = _warnings_of(example)
    assert cfg.data.partition == "dirichlet"
    assert lines == [("data.shots, data.ways are set but data.partition = 'dirichlet' does "
                      "not read them (they are for nway-kshot); ignored")]
    _, lines = _warnings_of(None, ["data.partition=iid", "data.alpha=0.3"])
    assert len(lines) == 1 and "data.alpha is set" in lines[0] and "dirichlet" in lines[0]
    # the embedded default's own ways/shots are not the user's: switching partition is quiet
    assert _warnings_of(None, ["data.partition=dirichlet"])[1] == []
    # nor does a key at its default, as in a --print-config copy that lists every key
    example.write_text('[data]\npartition = "iid"\nalpha = 0.5\nmin_samples = 10\n')
    assert _warnings_of(example)[1] == []
    assert _warnings_of(example, ["data.partition=dirichlet", "data.alpha=0.1"])[1] == []


def test_the_notes_are_warned_only_once_every_input_has_passed(tmp_path):
    """The preflight warns with the config's notes after its checks, so a run that goes
    ahead says them in one line each and a bad input's error stays one line."""
    import warnings

    from fedbus.launch.preflight import PreflightError, check_inputs
    from fedbus.node.config import ConfigWarning

    config = tmp_path / "c.toml"
    config.write_text('[federation]\nclients = 4\n[data]\npartition = "iid"\nshots = 7\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_inputs(load_config(config))
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert said == ["data.shots is set but data.partition = 'iid' does not read it (it is "
                    "for nway-kshot); ignored"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(PreflightError):
            check_inputs(load_config(config, ["model.arch=nosuchnet"]))
    assert not [w for w in caught if issubclass(w.category, ConfigWarning)]


def test_the_partition_table_and_the_key_help_agree():
    """Which partition reads which key is one table, partition.PARAMS; each key's help
    names every partition that reads it, so --help-config tells the same story."""
    from fedbus.node.config import SCHEMA
    from fedbus.node.data.partition import PARAMS

    for scheme, keys in PARAMS.items():
        for key in keys:
            assert key in SCHEMA["data"], key
            if scheme != "file":
                assert scheme in SCHEMA["data"][key].help.replace(" and ", ", "), (key, scheme)


def test_a_path_not_found_says_where_it_looked_and_why(tmp_path, monkeypatch):
    """A config file's relative path is read from the file's folder; the not-found error
    prints the absolute paths tried and how the path was read; a --set path is read from
    the working directory, and says so."""
    from helpers import fedbus

    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "c.toml").write_text('[data]\ndataset = "npz:../data/mnist.npz"\n')
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = load_config(folder / "c.toml")
    assert cfg.data.dataset == "npz:../data/mnist.npz"  # also looked for under data_dir
    assert str(tmp_path / "data" / "mnist.npz") in cfg.origin("data.dataset")
    assert "relative to its folder" in cfg.origin("data.dataset")
    out = fedbus("run", str(folder / "c.toml"), "--out", str(tmp_path / "run"), check=False,
                 cwd=cwd, timeout=120)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert "not found" in line and str(tmp_path / "data" / "mnist.npz") in line
    assert "relative to its folder" in line and str(cwd / "../data/mnist.npz") not in line
    out = fedbus("run", "--set", "data.partition=file:split.json", "--out",
                 str(tmp_path / "run"), check=False, cwd=cwd, timeout=120)
    line = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and str(cwd / "split.json") in line
    assert "a --set path, read relative to the working directory" in line


def test_a_path_found_only_from_the_working_directory_gets_its_config_relative_form(
        tmp_path, monkeypatch):
    import numpy as np

    folder = tmp_path / "exp"
    folder.mkdir()
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 1, 2, 2), np.float32), y=np.arange(4))
    (folder / "c.toml").write_text('[data]\ndataset = "npz:d.npz"\n')
    monkeypatch.chdir(tmp_path)
    cfg, lines = _warnings_of(folder / "c.toml")
    assert cfg.data.dataset == "npz:d.npz"
    assert len(lines) == 1 and "write 'npz:../d.npz'" in lines[0]


def test_the_offline_examples_find_the_shared_data_beside_a_fresh_clone():
    """examples/*.toml hold npz:../../shared/data/mnist-10k.npz: relative to the example's
    folder, shared/ beside the clone (REPO/../shared), what README and docs/DATA.md say."""
    repo = EXAMPLES[0].parent.parent
    for path in EXAMPLES:
        text = path.read_text()
        if "mnist-10k.npz" in text.split("[data]", 1)[-1]:
            assert 'dataset = "npz:../../shared/data/mnist-10k.npz"' in text, path.name
            assert os.path.normpath(path.parent / "../../shared") == \
                os.path.normpath(repo.parent / "shared")

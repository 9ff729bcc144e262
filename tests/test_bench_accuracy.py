"""`fedbus bench accuracy`'s option overrides (--param) and run naming: an override reaches
the run's [algorithm] section and its run directory's name, so reused runs never mix
settings. (The benchmark itself runs real federations for minutes; it is not run here.)"""
from __future__ import annotations

import argparse

import pytest

from fedbus.bench import accuracy


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    accuracy.add_arguments(p)
    return p.parse_args(list(argv))


def _args(*argv: str) -> argparse.Namespace:
    """As main_args leaves them: with the --param overrides parsed."""
    args = _parse(*argv)
    args.params = accuracy.parse_params(args.param)
    return args


def test_param_values_are_read_as_toml_or_as_bare_words():
    assert accuracy.parse_params(["fedtgp.lam=1.25", "fedtgp.server_epochs=5",
                                  "fedproto.proto_loss=paper", "fedproto.keep_missing=true"]) == {
        "fedtgp": {"lam": 1.25, "server_epochs": 5},
        "fedproto": {"proto_loss": "paper", "keep_missing": True}}


@pytest.mark.parametrize("item, fragment", [("fedtgp.lam", "expected ALGO.KEY=VALUE"),
                                            ("lam=1", "expected ALGO.KEY=VALUE"),
                                            ("fedmagic.lam=1", "unknown algorithm 'fedmagic'")])
def test_bad_params_name_the_item(item, fragment):
    with pytest.raises(ValueError, match=fragment):
        accuracy.parse_params([item])


def test_overrides_reach_the_config_and_the_run_name_only_of_their_algorithm():
    args = _args("--param", "fedtgp.lam=1.25", "--feature-dim", "512")
    group = ["cnn", "cnn4", "resnet8"]
    cfg = accuracy.config(args, "fedtgp", 2, group)
    assert cfg["algorithm"]["name"] == "fedtgp" and cfg["algorithm"]["lam"] == 1.25
    assert cfg["model"] == {"group": group, "feature_dim": 512}
    assert cfg["federation"]["seed"] == 2
    assert accuracy.run_name(args, "fedtgp", 2, group) == "hetero-d512-fedtgp-lam1.25-s2"
    assert accuracy.config(args, "fedproto", 0, group)["algorithm"].get("lam") != 1.25
    assert accuracy.run_name(args, "fedproto", 0, group) == "hetero-d512-fedproto-s0"
    assert accuracy.run_name(_args(), "fedtgp", 0, group) == "hetero-fedtgp-s0"
    assert accuracy.run_name(_args(), "local", 1, None) == "homo-local-s1"
    # another group is part of the name too, so its runs never reuse the default group's
    assert accuracy.run_name(_args(), "fd", 0, ["cnn", "mlp"]) == "hetero-cnn.mlp-fd-s0"


def test_the_heterogeneous_block_is_read_from_the_registry():
    """Every algorithm that averages no whole model runs on a model group; the baselines of
    FedTGP's table among them, FedAvg-style ones not."""
    assert accuracy.allows_model_group("fedtgp") and accuracy.allows_model_group("local")
    assert not accuracy.allows_model_group("fedavg")
    assert not accuracy.allows_model_group("proto-attention")
    for name in ("fd", "lg-fedavg", "fml", "fedkd", "fedgh"):
        assert accuracy.allows_model_group(name), name
    for name in ("fedper", "fedrep"):
        assert not accuracy.allows_model_group(name), name


def test_a_bad_param_exits_2_before_any_run(tmp_path, capsys):
    ns = _parse("--param", "fedtgp.lam", "--data", __file__, "--out", str(tmp_path))
    assert accuracy.main_args(ns) == 2
    assert "expected ALGO.KEY=VALUE" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())

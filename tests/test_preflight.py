"""Bad input is a one-line error before anything starts (fedbus.launch.preflight).

Each bad input runs the real `fedbus run` in a subprocess: exit code 2, stderr one line naming
the key and the problem, no traceback, no run directory and no fedbus child process. Good
input passes check_inputs unchanged (in process: the same loaders the run uses)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from helpers import MNIST_NPZ, REPO, SMALL, merged, write_config

from fedbus.launch.preflight import PreflightError, check_inputs
from fedbus.node.config import ConfigError, build_config
from fedbus.node.data import load_dataset
from fedbus.node.data.partition import (
    PartitionError,
    load_partition,
    make_partition,
    save_partition,
)

DIGITS = 1797  # samples in scikit-learn's digits


def launch(tmp_path, sections: dict, *argv: str, command: str = "run") -> tuple[int, str, str]:
    """Run `fedbus COMMAND CONFIG --out RUN`; watch the launcher's children while it runs."""
    cfg = write_config(tmp_path / "bad.toml", sections)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", command, *argv, str(cfg),
                             "--out", str(run_dir)], cwd=REPO, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    launcher = psutil.Process(proc.pid)
    spawned: set[str] = set()
    end = time.time() + 120
    while proc.poll() is None and time.time() < end:
        try:
            spawned |= {" ".join(c.cmdline()) for c in launcher.children(recursive=True)}
        except psutil.Error:  # it, or a child, exited while we looked
            pass
        time.sleep(0.02)
    out, err = proc.communicate(timeout=max(1.0, end - time.time()))
    assert not [c for c in spawned if "fedbus" in c], spawned
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not left, left
    return proc.returncode, out, err


def assert_one_line(code: int, out: str, err: str, prefix: str, *words: str) -> str:
    assert code == 2, err
    assert "Traceback" not in out and "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), err
    assert lines[0].startswith(prefix), err
    for w in words:
        assert w in lines[0], (w, err)
    return lines[0]


def bad_run(tmp_path, *words: str, **changes: dict) -> str:
    return assert_one_line(*launch(tmp_path, merged(SMALL, **changes)), "fedbus run: ", *words)


# ------------------------------------------------------------------------------------ datasets
def test_missing_npz(tmp_path):
    bad_run(tmp_path, "data.dataset = 'npz:/missing.npz'", "not found",
            data={"dataset": "npz:/missing.npz"})


def test_npz_without_y(tmp_path):
    np.savez(tmp_path / "noy.npz", x=np.zeros((20, 8, 8), np.float32))
    bad_run(tmp_path, "data.dataset", "noy.npz", "'x' and 'y'", "missing y",
            data={"dataset": f"npz:{tmp_path / 'noy.npz'}"})


def test_npz_with_mismatched_x_and_y(tmp_path):
    np.savez(tmp_path / "mism.npz", x=np.zeros((20, 8, 8), np.float32),
             y=np.zeros(19, np.int64))
    bad_run(tmp_path, "data.dataset", "mism.npz", "one label per x row", "(20, 8, 8)", "(19,)",
            data={"dataset": f"npz:{tmp_path / 'mism.npz'}"})


def _mnist_reachable() -> bool:
    try:
        import torchvision.datasets as tvd
    except ImportError:
        return False
    from fedbus.node.data.datasets import _reachable

    return _reachable(tvd.MNIST.mirrors[0])


@pytest.mark.skipif(_mnist_reachable(), reason="online with torchvision: mnist would download")
def test_online_dataset_offline_names_npz(tmp_path):
    (tmp_path / "empty").mkdir()
    bad_run(tmp_path, "data.dataset = 'mnist'", "unavailable", "npz:PATH",
            data={"dataset": "mnist", "data_dir": str(tmp_path / "empty")})


# ---------------------------------------------------------------------------- partition files
@pytest.fixture
def split_doc():
    """A valid partition of digits over SMALL's 6 clients, as its JSON document."""
    parts = make_partition(load_dataset("digits"), scheme="iid", num_clients=6, seed=0)
    return {"num_clients": 6, "clients": [{"train": p.train.tolist(), "test": p.test.tolist()}
                                          for p in parts]}


def bad_partition(tmp_path, text: str, *words: str, **changes: dict) -> str:
    path = tmp_path / "p.json"
    path.write_text(text)
    return bad_run(tmp_path, f"data.partition = 'file:{path}'", *words,
                   data={"partition": f"file:{path}"}, **changes)


def test_partition_not_json(tmp_path):
    bad_partition(tmp_path, '{\n  "clients":\n}\n', "not valid JSON", "line 3")


@pytest.mark.parametrize("doc,words", [
    ([[0, 1], [2, 3]], ["expected an object"]),
    ({"clients": [{"train": [1, 2]}]}, ["client 0", "'train' and 'test'"]),
    ({"clients": [{"train": [1, "2"], "test": []}]}, ["client 0 train", "integers"]),
])
def test_partition_wrong_schema(tmp_path, doc, words):
    bad_partition(tmp_path, json.dumps(doc), *words)


def test_partition_index_out_of_range(tmp_path, split_doc):
    split_doc["clients"][4]["train"].append(1800)
    bad_partition(tmp_path, json.dumps(split_doc), "client 4 train index 1800", "out of range",
                  str(DIGITS))


def test_partition_index_given_to_two_clients(tmp_path, split_doc):
    give = split_doc["clients"][0]["train"][0]
    split_doc["clients"][3]["test"].append(give)
    bad_partition(tmp_path, json.dumps(split_doc), f"index {give} given to clients 0 and 3")


def test_partition_wrong_client_count(tmp_path, split_doc):
    bad_partition(tmp_path, json.dumps(split_doc), "holds 6 clients", "has 10",
                  "federation.clients", federation={"clients": 10})


# --------------------------------------------------------------------------------------- models
def test_unknown_model_arch(tmp_path):
    bad_run(tmp_path, "model.arch = 'cnnx'", "unknown", "resnet8", model={"arch": "cnnx"})


def test_unknown_name_in_model_group(tmp_path):
    bad_run(tmp_path, "model.group[1] = 'resnet9'", "unknown", "resnet8",
            model={"group": ["cnn", "resnet9"]}, algorithm={"name": "fedproto"})


def test_a_conv_net_on_tabular_data(tmp_path):
    bad_run(tmp_path, "model.arch = 'cnn'", "images", "mlp",
            data={"dataset": "synthetic", "partition": "natural"})


def test_weight_averaging_with_a_model_group(tmp_path):
    bad_run(tmp_path, "algorithm.name = 'fedavg'", "one architecture",
            model={"group": ["cnn", "cnn4"]})


def test_server_command_checks_too(tmp_path):
    code, out, err = launch(tmp_path, merged(SMALL, data={"dataset": "npz:/missing.npz"}),
                            "--broker", "tcp://127.0.0.1:9", command="server")
    assert_one_line(code, out, err, "fedbus server: ", "data.dataset", "not found")


# ------------------------------------------------------------------------ in process: the check
def config(**changes: dict):
    return build_config(merged(SMALL, **changes))


@pytest.mark.parametrize("changes", [
    {},
    {"model": {"group": ["cnn", "cnn4", "resnet8"]}, "algorithm": {"name": "fedproto"}},
    {"model": {"arch": "cnn:18"}},
    {"data": {"partition": "dirichlet", "alpha": 0.3}},
    {"data": {"dataset": "synthetic", "partition": "natural"}, "model": {"arch": "mlp"}},
])
def test_good_input_passes(changes):
    check_inputs(config(**changes))


def test_good_partition_file_passes(tmp_path, split_doc):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(split_doc))
    check_inputs(config(data={"partition": f"file:{path}"}))


@pytest.mark.skipif(not MNIST_NPZ.exists(), reason=f"{MNIST_NPZ} not here")
def test_good_npz_passes():
    check_inputs(config(data={"dataset": f"npz:{MNIST_NPZ}"}))


def test_preflight_error_is_one_line_config_error(tmp_path):
    with pytest.raises(PreflightError, match="data.dataset = 'npz:.*nope.npz': npz dataset not "
                       "found") as info:
        check_inputs(config(data={"dataset": f"npz:{tmp_path / 'nope.npz'}"}))
    assert isinstance(info.value, ConfigError)  # `fedbus server` reports it as config errors
    assert str(PreflightError("a\n  b")) == "a b"


def test_load_partition_rejects_an_index_shared_by_clients(tmp_path):
    path = tmp_path / "p.json"
    save_partition(make_partition(load_dataset("digits"), scheme="iid", num_clients=4, seed=0),
                   path)
    doc = json.loads(path.read_text())
    doc["clients"][2]["train"].append(doc["clients"][1]["test"][0])
    path.write_text(json.dumps(doc))
    with pytest.raises(PartitionError, match="given to clients 1 and 2"):
        load_partition(path, dataset_size=DIGITS)


def test_head_sharing_algorithm_needs_one_head_shape():
    """LG-FedAvg and FedGH share the head only: a group whose heads differ (mlp-fedcl's
    two-layer classifier against cnn's one linear layer) is refused before any process
    starts, naming the shapes; a group with one head shape passes."""
    from fedbus.node.setup import check_models

    base = merged(SMALL, model={"feature_dim": 32})
    mixed = build_config(merged(base, model={"group": ["cnn", "mlp-fedcl"]}))
    with pytest.raises(ConfigError, match=r"one head shape.*cnn: weight \[10, 32\]"):
        check_models(mixed, False, True)
    assert check_models(mixed, False, False) == 32  # FedProto etc. do not care
    same = build_config(merged(base, model={"group": ["cnn", "cnn4", "mlp"]}))
    assert check_models(same, False, True) == 32
